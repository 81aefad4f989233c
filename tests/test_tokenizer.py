"""The shared subword tokenizer: special ids, exact round trips, <unk>, save/load, model compatibility."""

import json
import unicodedata

import numpy as np
import pytest

from flax_transformer import ConfigError, ModelConfig
from flax_transformer.errors import TokenizerError
from flax_transformer.tokenizer import FILE_NAME, SPECIAL_TOKENS, Tokenizer

SENTENCES = [
  'A man in an orange hat starring at something.',
  'Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.',
  'Große Hunde spielen im Schnee; zwei Jungen schauen zu!',
  'Über die Straße läuft ein älterer Herr mit weißem Bart.',
  'Two dogs (one black, one white) run across the grass?',
  'Die Mädchen essen Äpfel und trinken Öl-freien Saft: "lecker".',
  'A woman in a red coat — and a blue hat — walks by.',
  "It's 5 o'clock, and the café is full.",
]
CORPUS = SENTENCES * 20


@pytest.fixture(scope='module')
def bpe():
  return Tokenizer.train(CORPUS, vocab_size=200)


@pytest.fixture(scope='module')
def unigram():
  return Tokenizer.train(CORPUS, vocab_size=200, model='unigram')


@pytest.mark.parametrize('name', ['bpe', 'unigram'])
def test_special_ids_are_fixed(name, request):
  tokenizer = request.getfixturevalue(name)
  assert [tokenizer.id_to_token(i) for i in range(4)] == ['<pad>', '<s>', '</s>', '<unk>']
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, tokenizer.unk_id) == (0, 1, 2, 3)
  config = ModelConfig()
  assert (config.pad_id, config.bos_id, config.eos_id, config.unk_id) == (0, 1, 2, 3)


@pytest.mark.parametrize('name', ['bpe', 'unigram'])
def test_round_trip_is_exact(name, request):
  tokenizer = request.getfixturevalue(name)
  ids = tokenizer.encode(SENTENCES)
  assert all(1 <= len(row) and min(row) > 3 for row in ids)  # no specials, no <unk>
  assert tokenizer.decode(ids) == SENTENCES


def test_subwords_are_shared_and_compose_unseen_words(bpe):
  # 'Hundestraße' was never seen, but its pieces were (from 'Hunde' and 'Straße').
  ids = bpe.encode(['Hundestraße', 'Hunde'])
  assert len(ids[0]) > 1 and Tokenizer.unk_id not in ids[0]
  assert bpe.decode(ids) == ['Hundestraße', 'Hunde']


def test_vocab_size_and_nfkc_normalisation(bpe):
  assert bpe.vocab_size == 200
  # NFKC folds the ligature 'ﬁ' and the full-width 'Ａ' into plain letters.
  assert (
    bpe.decode(bpe.encode(['Ａ ﬁsh'])) == [unicodedata.normalize('NFKC', 'Ａ ﬁsh')] == ['A fish']
  )


def test_decode_stops_at_first_eos_and_drops_pad_and_bos(bpe):
  ids = bpe.encode(['Ein Mann', 'zwei Hunde'])
  rows = np.zeros((2, 12), np.int32)
  rows[0, : len(ids[0]) + 2] = [Tokenizer.bos_id, *ids[0], Tokenizer.eos_id]
  rows[0, len(ids[0]) + 3] = ids[1][0]  # after EOS: ignored
  rows[1, : len(ids[1])] = ids[1]  # no EOS: runs to the end, PAD dropped
  assert bpe.decode(rows) == ['Ein Mann', 'zwei Hunde']
  assert bpe.decode([[Tokenizer.eos_id, *ids[0]]]) == ['']


def test_unknown_characters_map_to_unk_and_decode(bpe):
  ids = bpe.encode(['Ein Hund 😀 läuft ☃'])[0]
  assert ids.count(Tokenizer.unk_id) == 2
  assert bpe.decode([ids]) == ['Ein Hund <unk> läuft <unk>']


def test_ids_outside_the_vocabulary_are_refused(bpe):
  with pytest.raises(
    TokenizerError,
    match=r'cannot decode ids \[200\]: outside the vocabulary '
    r'\[0, 200\)',
  ):
    bpe.decode([[5, 200]])


def test_encode_wants_a_sequence(bpe):
  with pytest.raises(TypeError, match=r'wrap a single one as \[text\]'):
    bpe.encode('Ein Mann')


def test_training_is_deterministic(bpe, tmp_path):
  again = Tokenizer.train(list(CORPUS), vocab_size=200)
  bpe.save(tmp_path / 'a')
  again.save(tmp_path / 'b')
  assert (tmp_path / 'a' / FILE_NAME).read_bytes() == (tmp_path / 'b' / FILE_NAME).read_bytes()


def test_save_load_identity(bpe, unigram, tmp_path):
  for name, tokenizer in (('bpe', bpe), ('unigram', unigram)):
    path = tokenizer.save(tmp_path / name)
    assert path == tmp_path / name / FILE_NAME
    loaded = Tokenizer.load(tmp_path / name)
    assert loaded.vocab_size == tokenizer.vocab_size
    vocab = range(tokenizer.vocab_size)
    assert [loaded.id_to_token(i) for i in vocab] == [tokenizer.id_to_token(i) for i in vocab]
    texts = SENTENCES + ['Ein Hund 😀', 'Hundestraße']
    assert loaded.encode(texts) == tokenizer.encode(texts)
    # Not byte-identical on a second save: serde_json may print a Unigram score's last digit
    # differently after parsing it back.


def test_load_errors(tmp_path):
  with pytest.raises(TokenizerError, match=rf'{tmp_path / FILE_NAME}: no such file'):
    Tokenizer.load(tmp_path)
  (tmp_path / FILE_NAME).write_text('{"version": "1.0", "model": ')
  with pytest.raises(TokenizerError, match='not a valid tokenizer file'):
    Tokenizer.load(tmp_path)


def test_foreign_tokenizer_with_other_special_ids_is_refused(bpe, tmp_path):
  spec = bpe.save(tmp_path).read_text().replace('"<pad>"', '"[PAD]"')
  (tmp_path / FILE_NAME).write_text(spec)
  with pytest.raises(TokenizerError, match='special token <pad> must have id 0'):
    Tokenizer.load(tmp_path)


def test_train_argument_errors():
  with pytest.raises(TokenizerError, match='vocab_size must exceed the 4 special tokens, got 4'):
    Tokenizer.train(CORPUS, vocab_size=4)
  with pytest.raises(TokenizerError, match="'bpe' or 'unigram', got 'wordpiece'"):
    Tokenizer.train(CORPUS, vocab_size=100, model='wordpiece')


def test_check_compatible(bpe):
  bpe.check_compatible(ModelConfig.tiny(vocab_size=200))
  with pytest.raises(
    ConfigError,
    match=r'model\.vocab_size=64 but the tokenizer has 200; '
    r'set model.vocab_size=200',
  ):
    bpe.check_compatible(ModelConfig.tiny())
  with pytest.raises(
    ConfigError, match=r'model\.eos_id=5 but the tokenizer has 2; set model\.eos_id=2'
  ):
    bpe.check_compatible(ModelConfig.tiny(vocab_size=200, eos_id=5))


def test_multi30k_validation_round_trips(multi30k_dir):
  def lines(name):
    return (multi30k_dir / name).read_text(encoding='utf-8').split('\n')[:-1]

  tokenizer = Tokenizer.train(lines('train.en') + lines('train.de'), vocab_size=8000)
  assert tokenizer.vocab_size == 8000
  references = lines('val.en') + lines('val.de')
  # Detokenised output is what BLEU scores, so every ordinary sentence must come back verbatim.
  ordinary = [s for s in references if s == unicodedata.normalize('NFKC', s) and '  ' not in s]
  assert len(ordinary) > 0.99 * len(references)
  decoded = tokenizer.decode(tokenizer.encode(ordinary))
  assert [d for d, s in zip(decoded, ordinary) if d != s.strip()] == []


# --- Text is text: special tokens' strings in a sentence ----------------------------------

# Training text that holds the special strings themselves, glued and apart, so that BPE
# learns merges spelling them and unigram learns them as pieces: the cases to close.
TEXT_WITH_SPECIALS = (
  CORPUS
  + [
    'Sie schrieb </s> und <pad> in den Text.',
    'a<s>b <unk> x</s>y <pad>',
    'x < y > z / s',
    'Hund</s> Mann</s> Frau</s> Kind<pad> Tier<pad> Baum<s> Haus<unk> Weg<unk>',
  ]
  * 15
)
SPECIAL_IDS = {Tokenizer.pad_id, Tokenizer.bos_id, Tokenizer.eos_id, Tokenizer.unk_id}


@pytest.fixture(scope='module', params=['bpe', 'unigram'])
def learnt_specials(request):
  return Tokenizer.train(TEXT_WITH_SPECIALS, vocab_size=300, model=request.param)


@pytest.mark.parametrize('special', SPECIAL_TOKENS)
@pytest.mark.parametrize(
  'template', ['{} Ein Hund', 'Ein {} Hund', 'Ein Hund {}', '{}', 'Ein{}Hund', '{}{}', 'x</{}']
)
def test_special_strings_in_text_are_encoded_as_text(learnt_specials, special, template):
  text = template.format(special, special)
  ids = learnt_specials.encode([text])[0]
  assert not SPECIAL_IDS & set(ids), [learnt_specials.id_to_token(i) for i in ids]
  assert learnt_specials.decode([ids]) == [text]  # every character came back: it was text


def test_training_text_with_special_strings_keeps_their_ids(learnt_specials, tmp_path):
  assert [learnt_specials.id_to_token(i) for i in range(4)] == list(SPECIAL_TOKENS)
  # What encoding must not use: BPE learnt merges that spell them; unigram holds them as
  # pieces (the copies it learnt are gone, or their names would not have these ids).
  vocabulary = json.loads(learnt_specials._backend.to_str())['model']
  if vocabulary['type'] == 'BPE':
    assert set(SPECIAL_TOKENS) & {''.join(merge) for merge in vocabulary['merges']}
  else:
    assert [piece for piece, _ in vocabulary['vocab'][:4]] == list(SPECIAL_TOKENS)
  # Saved and loaded, it encodes the same; the file keeps what was trained.
  learnt_specials.save(tmp_path)
  loaded = Tokenizer.load(tmp_path)
  texts = ['Ein </s> Hund', 'x<pad>y', *SENTENCES]
  assert loaded.encode(texts) == learnt_specials.encode(texts)
  assert json.loads((tmp_path / FILE_NAME).read_text())['model'] == vocabulary


def test_the_ids_of_other_text_are_what_tokenizers_gives(learnt_specials):
  texts = SENTENCES + ['Ein Hund 😀', 'Hundestraße', 'x < y']
  expected = [
    encoding.ids
    for encoding in learnt_specials._backend.encode_batch_fast(texts, add_special_tokens=False)
  ]
  assert learnt_specials.encode(texts) == expected


def test_a_marian_tokenizer_reads_special_strings_as_text(tmp_path):
  """sentencepiece returns a run of unknown characters as one piece, which can spell
  '</s>'; vocab.json would make that EOS."""
  pytest.importorskip('sentencepiece')
  from flax_transformer.pretrained.marian import MarianTokenizer
  from support.marian_directory import _train_spm, _vocab

  # No '<', '/', 's', '>', 'p', 'a', 'd' in the text: '</s>' and '<pad>' are unknown runs.
  text = ['Ein Hund rennt im Freien.', 'Zwei Männer fühlen tief.', 'Hunde eilen, Kühe ruhen.']
  model = _train_spm(text * 30, 60)
  for name in ('source.spm', 'target.spm'):
    (tmp_path / name).write_bytes(model)
  vocab = _vocab([model], 120)
  (tmp_path / 'vocab.json').write_text(json.dumps(vocab))
  tokenizer = MarianTokenizer(tmp_path)
  specials = {tokenizer.eos_id, tokenizer.pad_id}
  for line in ['Ein </s> Hund', '</s>', 'Hund <pad>', '<s> Ein', '<unk>', '>>de<< Hund']:
    for ids in (tokenizer.encode([line])[0], tokenizer.encode_target([line])[0]):
      assert not specials & set(ids), (line, ids)
      assert tokenizer.unk_id in ids  # the unknown characters, as unknown
  assert tokenizer.unk_id not in tokenizer.encode(['Ein Hund'])[0]


def test_one_load_reads_whichever_tokenizer_a_directory_holds_and_digests_its_files(tmp_path):
  """flax_transformer.tokenizer.load: ours, an export's or a Marian model's, told by the files
  present; digest() is the SHA-256 of the files (name and bytes), changing with any byte."""
  import hashlib

  from flax_transformer import tokenizer as room

  trained = Tokenizer.train(CORPUS, vocab_size=120)
  with pytest.raises(TokenizerError, match=r'once saved: call save\(directory\) first'):
    trained.digest()
  ours = tmp_path / 'ours'
  trained.save(ours)
  expected = hashlib.sha256(b'tokenizer.json\0' + (ours / FILE_NAME).read_bytes()).hexdigest()
  assert trained.digest() == expected
  loaded = room.load(ours)
  assert type(loaded) is Tokenizer and loaded.digest() == expected
  assert loaded.encode(SENTENCES) == trained.encode(SENTENCES)
  (ours / FILE_NAME).write_text((ours / FILE_NAME).read_text().replace('"<unk>"', '"<unk>" '))
  assert room.load(ours).digest() != expected

  # An export's files: tokenizer.json beside tokenizer_config.json.
  exported = tmp_path / 'exported'
  trained.save(exported)
  (exported / 'tokenizer_config.json').write_text('{}')
  assert room.kind_in(exported) is room.ExportedTokenizer
  with pytest.raises(TokenizerError, match='tokenizer_config.json: special tokens'):
    room.load(exported)
  # A Marian model's: its sentencepiece models and vocab.json; a damaged one is named.
  marian = tmp_path / 'marian'
  marian.mkdir()
  for name in room.TOKENIZER_FILES:
    (marian / name).write_text('not a model')
  assert room.kind_in(marian) is room.MarianTokenizer
  with pytest.raises(TokenizerError, match='source.spm: not a readable sentencepiece model'):
    room.load(marian)
  # Nothing there: ours is asked for, naming the file.
  with pytest.raises(TokenizerError, match=f'{tmp_path / "empty" / FILE_NAME}: no such file'):
    room.load(tmp_path / 'empty')
  assert room.kind_in(tmp_path / 'empty', default=room.MarianTokenizer) is room.MarianTokenizer
