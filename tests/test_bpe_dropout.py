"""BPE-dropout (`tokenizer.bpe_dropout`, `data.resegmenting`, `data.bpe_dropout`): plain BPE
at rate 0, subword-nmt's merge rule above it, the text never changed, and batches that are a
pure function of (seed, epoch, pair)."""

import collections
import json
import random

import datasets
import numpy as np
import pytest
import tokenizers
from subword_nmt import apply_bpe

from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.data import resegmenting
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import EncodedCorpus, encode_corpus, shard
from flax_transformer.data.plans import FirstFit
from flax_transformer.data.resegmenting import Resegmenting, resegmenting_of
from flax_transformer.data.toy_task import number_translation
from flax_transformer.errors import DataError, TokenizerError
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.tokenizer.bpe_dropout import METASPACE, BpeDropout, draws, mix
from flax_transformer.train.loop import train

RATE = 0.1


@pytest.fixture(scope='module')
def toy():
  """The toy task's pairs and a 300-piece BPE of both sides (German number words are long
  compounds: many merges a word)."""
  data = number_translation()
  texts = data['train']['source'][:] + data['train']['target'][:]
  return data, Tokenizer.train(texts, 300)


def flat(rows):
  return np.concatenate([np.asarray(r, np.int64) for r in rows]), np.array([len(r) for r in rows])


def split(ids, lengths):
  ends = np.cumsum(lengths)
  return [ids[end - n : end].tolist() for end, n in zip(ends, lengths)]


def keys(n, salt=0):
  return np.arange(n, dtype=np.uint64) + np.uint64(1_000_003 * salt)


def test_at_rate_zero_the_ids_are_the_tokenizers(toy):
  data, tokenizer = toy
  lines = data['validation']['target'][:] + data['validation']['source'][:] + ['', 'ä ö ü ß é']
  rows = tokenizer.encode(lines)
  ids, lengths = tokenizer.bpe_dropout(0.0).resegment(*flat(rows), keys(len(rows)))
  assert split(ids, lengths) == rows


def test_at_rate_zero_every_multi30k_word_keeps_the_tokenizers_ids(multi30k_dir):
  lines = [
    line.rstrip('\n').lower()
    for lang in ('en', 'de')
    for line in (multi30k_dir / f'train.{lang}').open(encoding='utf-8')
  ]
  tokenizer = Tokenizer.train(lines, 4000)
  rows = tokenizer.encode(lines)
  ids, lengths = tokenizer.bpe_dropout(0.0).resegment(*flat(rows), keys(len(rows)))
  assert np.array_equal(ids, np.concatenate([np.asarray(r) for r in rows]))
  assert np.array_equal(lengths, [len(r) for r in rows])


def subword_nmt_codes(tokenizer: Tokenizer) -> dict:
  """The tokenizer's merges as subword-nmt's codes: (left, right) -> rank."""
  merges = json.loads(tokenizer._backend.to_str())['model']['merges']  # noqa: SLF001
  return {tuple(m.split(' ') if isinstance(m, str) else m): rank for rank, m in enumerate(merges)}


def subword_nmt_pieces(codes: dict, word: str, rate: float) -> tuple[str, ...]:
  """One draw of subword-nmt's own `apply_bpe.encode` (with Python's `random`) on `word`'s
  characters; a final sentinel character that never merges stands in for its end-of-word
  marker, which our merges do not have."""
  pieces = apply_bpe.encode(word + '\ue000', codes, {}, None, '@@', (0, 2), {}, dropout=rate)
  assert pieces[-1] == '\ue000'
  return tuple(pieces[:-1])


def draw_ours(tokenizer: Tokenizer, words: list[str], rate: float, draws: int, salt: int = 1):
  """A Counter of (word, pieces) over `draws` draws of each word."""
  rows = [tokenizer.encode([word[1:]])[0] for word in words] * draws
  ids, lengths = tokenizer.bpe_dropout(rate).resegment(*flat(rows), keys(len(rows), salt))
  return collections.Counter(
    (word, tuple(tokenizer.id_to_token(i) for i in pieces))
    for word, pieces in zip(words * draws, split(ids, lengths))
  )


def draw_both(tokenizer: Tokenizer, words: list[str], rate: float, draws: int):
  """(ours, subword-nmt's): Counters of (word, pieces) over `draws` draws of each word."""
  ours = draw_ours(tokenizer, words, rate, draws)
  codes = subword_nmt_codes(tokenizer)
  random.seed(0)
  theirs = collections.Counter(
    (word, subword_nmt_pieces(codes, word, rate)) for word in words * draws
  )
  return ours, theirs


def test_the_merge_rule_is_subword_nmts(toy):
  """The segmentations drawn here and by subword-nmt's `apply_bpe.encode` (the rule the
  paper's authors name) come from one distribution: over every word of the validation split
  the same mean pieces a word (`tokenizers`' own dropout, which revives skipped merges, gives
  14% fewer on Multi30k), and for short words each segmentation equally often."""
  data, tokenizer = toy
  rate = 0.3
  lines = data['validation']['target'][:100] + data['validation']['source'][:100]
  words = sorted({METASPACE + w for line in lines for w in line.split()})
  ours, theirs = draw_both(tokenizer, words, rate, draws=60)

  def mean_pieces(counts):
    return sum(len(pieces) * n for (_, pieces), n in counts.items()) / counts.total()

  # About 10,000 draws each: the means' sampling error is about 0.5% of them.
  assert mean_pieces(ours) == pytest.approx(mean_pieces(theirs), rel=0.02)
  plain = np.mean([len(tokenizer.encode([word[1:]])[0]) for word in words])
  assert mean_pieces(ours) > 1.2 * plain  # the rate splits words
  # Short words have a few segmentations each: their two samples are as far apart as two
  # samples of ours alone (the sampling noise), not further.
  short = [word for word in words if 3 <= len(word) <= 6]
  assert len(short) >= 8
  ours, theirs = draw_both(tokenizer, short, rate, draws=2000)
  again = draw_ours(tokenizer, short, rate, draws=2000, salt=2)

  def distance(a, b):
    return 0.5 * sum(abs(a[k] - b[k]) for k in a.keys() | b.keys()) / a.total()

  assert distance(ours, theirs) < 1.5 * distance(ours, again) + 0.01
  assert distance(ours, again) < 0.05


def test_a_repeated_pair_merges_from_the_left_as_tokenizers_and_subword_nmt_do():
  vocab = {
    piece: i for i, piece in enumerate(['<pad>', '<s>', '</s>', '<unk>', METASPACE, 'a', 'aa'])
  }
  merges = [('a', 'a')]
  backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges, unk_token='<unk>'))
  words = [METASPACE + 'a' * n for n in range(1, 8)]
  plain = [backend.encode(word, add_special_tokens=False).ids for word in words]
  assert [len(ids) for ids in plain] == [2, 2, 3, 3, 4, 4, 5]  # ▁ aa a, ▁ aa aa, ...
  ids, lengths = BpeDropout(vocab, merges, 0.0).resegment(*flat(plain), keys(len(words)))
  assert split(ids, lengths) == plain
  codes = {pair: rank for rank, pair in enumerate(merges)}
  assert [[vocab[p] for p in subword_nmt_pieces(codes, w, 0)] for w in words] == plain


def scalar_merges(symbols: list[int], merges: dict, rate: float, key: int) -> list[int]:
  """subword-nmt's loop, one word at a time in Python, on `bpe_dropout.draws`'s draws for
  `key` (the word's key): the oracle of the vectorised rounds."""
  for round_index in range(len(symbols)):
    if len(symbols) < 2:
      break
    uniform = draws(np.array([key], np.uint64), round_index, len(symbols) - 1)[0]
    kept = [
      (merges[pair][0], i, pair)
      for i, pair in enumerate(zip(symbols, symbols[1:]))
      if pair in merges and uniform[i] >= rate
    ]
    if not kept:
      break
    best = min(kept)[2]
    merged, start = [], 0
    for _, i, pair in kept:
      if pair != best or i < start:
        continue
      merged += symbols[start:i] + [merges[pair][1]]
      start = i + 2
    symbols = merged + symbols[start:]
  return symbols


def test_the_vectorised_rounds_equal_a_scalar_loop_on_the_same_draws(toy):
  """At rate 0.5 (runs of a repeated pair broken by skipped places included), every word drawn
  as arrays equals subword-nmt's loop run on the same draws, one word at a time."""
  data, tokenizer = toy
  config = json.loads(tokenizer._encoder.to_str())['model']  # noqa: SLF001 -- its merges
  vocab = config['vocab']
  merges = {}
  for rank, merge in enumerate(config['merges']):
    left, right = merge.split(' ') if isinstance(merge, str) else merge
    merges.setdefault((vocab[left], vocab[right]), (rank, vocab[left + right]))
  words = sorted({w for line in data['validation']['target'][:150] for w in line.split()})
  words += ['e' * n for n in range(2, 12)] + ['ee' * n + 'n' for n in range(1, 6)]
  rows = [tokenizer.encode([word])[0] for word in words]  # one word a sentence: its place is 0
  sentence_keys = keys(len(rows), salt=3)
  ids, lengths = tokenizer.bpe_dropout(0.5).resegment(*flat(rows), sentence_keys)
  word_keys = mix(sentence_keys ^ mix(np.uint64(1)))
  expected = [
    scalar_merges([vocab[c] for c in METASPACE + word], merges, 0.5, key)
    for word, key in zip(words, word_keys)
  ]
  assert split(ids, lengths) == expected
  assert sum(e != r for e, r in zip(expected, rows)) > len(rows) // 2


def test_text_that_spells_a_special_token_never_becomes_one():
  """A corpus whose words end in '</s>' teaches BPE to merge '</s' + '>'; the tokenizer encodes
  without such merges (special_tokens_as_text), and so does its dropout: no draw puts a
  special id inside a sentence, and a word with an unknown character keeps its ids."""
  lines = [f'{word}</s> {word}<pad> plain' for word in ('xa', 'yb', 'zc', 'wd', 've') * 20]
  tokenizer = Tokenizer.train(lines, 60)
  text = ['xa</s> d</s> yb<pad>', 've☃d</s> plain']
  rows = tokenizer.encode(text)
  assert tokenizer.unk_id in rows[1]
  ids, lengths = tokenizer.bpe_dropout(0.0).resegment(*flat(rows), keys(2))
  assert split(ids, lengths) == rows
  for salt in range(50):
    ids, lengths = tokenizer.bpe_dropout(0.5).resegment(*flat(rows), keys(2, salt))
    assert not np.isin(ids, [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id]).any()
    assert tokenizer.decode([r + [tokenizer.eos_id] for r in split(ids, lengths)])[0] == text[0]
    unknown_word = split(ids, lengths)[1][: rows[1].index(tokenizer.unk_id) + 1]
    assert unknown_word == rows[1][: len(unknown_word)]


def test_a_pair_is_never_planned_shorter_than_its_plain_ids():
  """Skipping a merge can make a word shorter ('▁ab' where plain BPE gives '▁ ab': (a, b) is
  merged before (▁, a), and (▁a, b) exists): its bucket is still planned by its plain length."""
  vocab = {
    p: i
    for i, p in enumerate(['<pad>', '<s>', '</s>', '<unk>', METASPACE, 'a', 'b', 'ab', '▁a', '▁ab'])
  }
  # '▁ab' is drawn with probability p (1 - p)^2, most often at p = 1/3: 15% of draws.
  dropout = BpeDropout(vocab, [('a', 'b'), (METASPACE, 'a'), ('▁a', 'b')], 1 / 3)
  ids, lengths = dropout.resegment(*flat([[vocab[METASPACE], vocab['ab']]] * 64), keys(64))
  assert min(lengths) == 1 and set(lengths) <= {1, 2, 3}  # the shorter one is drawn too
  n = 640  # about 14 pairs whose two planning draws are both the shorter one
  corpus = EncodedCorpus(
    src_ids=np.tile(np.int32([4, 7, 2]), n),
    src_offsets=np.arange(n + 1) * 3,
    tgt_ids=np.tile(np.int32([5, 2]), n),  # 'a': a pair's length is its source's
    tgt_offsets=np.arange(n + 1) * 2,
    example_ids=np.arange(n),
    max_len=8,
    num_dropped=0,
  )
  planned = Resegmenting(dropout, 0).planned_lengths(corpus)
  assert (planned >= corpus.lengths).all()
  batcher = Batcher(corpus, 24, 0, length_buckets=(3, 8), resegmenting=Resegmenting(dropout, 0))
  for batch in batcher.epoch(0):
    rows = batch.src[batch.example_ids >= 0]
    ends = (rows != 0).sum(axis=1) - 1  # each row's last token: its EOS, never cut off
    assert (rows[np.arange(len(rows)), ends] == 2).all()
  with pytest.raises(ValueError, match='sentence 0 has 2 ids, more than its limit 1'):
    dropout.resegment(*flat([[vocab[METASPACE], vocab['ab']]]), keys(1, salt=5), np.array([1]))
  with pytest.raises(TokenizerError, match="merge 0 \\('▁' \\+ 'ab'\\) comes before merge 1"):
    BpeDropout(vocab, [(METASPACE, 'ab'), ('a', 'b')], 0.1)


def test_resampling_changes_the_pieces_never_the_text(toy):
  data, tokenizer = toy
  lines = data['validation']['target'][:300]
  rows = tokenizer.encode(lines)
  ids, lengths = tokenizer.bpe_dropout(RATE).resegment(*flat(rows), keys(len(rows)))
  resampled = split(ids, lengths)
  assert tokenizer.decode([r + [tokenizer.eos_id] for r in resampled]) == lines
  assert sum(a != b for a, b in zip(resampled, rows)) > len(rows) // 10
  # At rate 1 every merge is skipped: each word is spelt out.
  ids, lengths = tokenizer.bpe_dropout(1.0).resegment(*flat(rows), keys(len(rows)))
  assert [len(r) for r in split(ids, lengths)] == [
    len(line.replace(' ', '')) + line.count(' ') + 1 for line in lines
  ]


def test_a_sentence_is_drawn_by_its_key_alone(toy):
  data, tokenizer = toy
  rows = tokenizer.encode(data['validation']['target'][:64])
  dropout = tokenizer.bpe_dropout(RATE)
  together = split(*dropout.resegment(*flat(rows), keys(64)))
  alone = [
    split(*dropout.resegment(*flat([row]), keys(64)[i : i + 1]))[0] for i, row in enumerate(rows)
  ]
  assert together == alone
  reversed_order = split(*dropout.resegment(*flat(rows[::-1]), keys(64)[::-1]))
  assert reversed_order == together[::-1]
  other = split(*dropout.resegment(*flat(rows), keys(64, salt=7)))
  assert sum(a != b for a, b in zip(other, together)) > 16


def test_limits_give_the_last_words_their_ids_back(toy):
  data, tokenizer = toy
  rows = tokenizer.encode(data['validation']['target'][:200])
  dropout = tokenizer.bpe_dropout(0.5)
  free = split(*dropout.resegment(*flat(rows), keys(200)))
  limits = np.array([len(r) + 1 for r in rows])
  limited = split(*dropout.resegment(*flat(rows), keys(200), limits))
  assert all(len(r) <= limit for r, limit in zip(limited, limits))
  assert tokenizer.decode(limited) == tokenizer.decode(rows)
  for plain, drawn, cut, limit in zip(rows, free, limited, limits):
    if len(drawn) <= limit:
      assert cut == drawn
    else:  # a prefix of the free draw, then a suffix of the plain ids
      common = next(k for k in range(len(cut) + 1) if k == len(cut) or cut[k] != drawn[k])
      assert cut[common:] == plain[len(plain) - (len(cut) - common) :]


@pytest.fixture(scope='module')
def corpus(toy):
  data, tokenizer = toy
  return encode_corpus(data['train'].select(range(2000)), tokenizer, 32)


def test_batches_are_a_pure_function_of_seed_epoch_and_pair(toy, corpus):
  _, tokenizer = toy

  def batcher():
    return Batcher(
      corpus, 512, 3, row_multiple=2, resegmenting=Resegmenting(tokenizer.bpe_dropout(RATE), 3)
    )

  first, second, plain = batcher(), batcher(), Batcher(corpus, 512, 3, row_multiple=2)
  per_epoch = first.batches_per_epoch()
  assert per_epoch > plain.batches_per_epoch()  # longer pairs, bucketed by it
  for step in (0, 5, per_epoch + 5):
    batch = first.batch_at(step)
    again = second.batch_at(step)  # a resumed run's batcher
    for name in ('src', 'tgt_in', 'tgt_out', 'example_ids'):
      assert np.array_equal(getattr(batch, name), getattr(again, name))
      assert np.array_equal(
        getattr(first.local_batch_at(step, 1, 2), name), getattr(shard(batch, 1, 2), name)
      )
    assert batch.src.shape in first.shapes
    rows = batch.example_ids >= 0
    # tgt_in is BOS then tgt_out shifted; the text is the pair's own.
    assert np.array_equal(
      batch.tgt_in[rows, 1:],
      np.where(batch.tgt_out[rows, :-1] == tokenizer.eos_id, 0, batch.tgt_out[rows, :-1]),
    )
    texts = tokenizer.decode(batch.tgt_out[rows].tolist())
    plain_rows = [
      corpus.target(int(np.flatnonzero(corpus.example_ids == e)[0])).tolist()
      for e in batch.example_ids[rows]
    ]
    assert texts == tokenizer.decode(plain_rows)
  # The same pairs in epochs 0 and 1, drawn differently.
  epoch0 = {
    int(e): row
    for b in first.epoch(0)
    for e, row in zip(b.example_ids, b.tgt_out.tolist())
    if e >= 0
  }
  epoch1 = {
    int(e): row
    for b in first.epoch(1)
    for e, row in zip(b.example_ids, b.tgt_out.tolist())
    if e >= 0
  }
  assert sorted(epoch0) == sorted(epoch1) == sorted(corpus.example_ids.tolist())
  assert sum(epoch0[e] != epoch1[e] for e in epoch0) > len(epoch0) // 4
  assert 'BPE-dropout 0.1 (data.bpe_dropout)' in first.describe()


def test_a_large_corpus_is_planned_on_a_sample(toy, corpus, monkeypatch):
  _, tokenizer = toy
  whole = Resegmenting(tokenizer.bpe_dropout(RATE), 3).planned_lengths(corpus)
  monkeypatch.setattr(resegmenting, 'PLANNING_PAIRS', 300)
  sampled = Resegmenting(tokenizer.bpe_dropout(RATE), 3)
  planned = sampled.planned_lengths(corpus)
  drawn = sampled._plan(corpus)[2]  # noqa: SLF001 -- which pairs were drawn
  assert len(drawn) == 300 and np.array_equal(planned[drawn], whole[drawn])
  assert (planned >= corpus.lengths).all() and (planned <= corpus.max_len).all()
  # The others planned by the sample's growth at their plain length: about as long in all.
  assert planned.sum() == pytest.approx(whole.sum(), rel=0.03)
  assert planned.sum() > 1.05 * corpus.lengths.sum()


def test_what_bpe_dropout_refuses(toy, corpus):
  data, tokenizer = toy
  with pytest.raises(DataError, match='one pair a row'):
    Batcher(corpus, 512, 0, FirstFit(32), resegmenting=Resegmenting(tokenizer.bpe_dropout(RATE), 0))
  unigram = Tokenizer.train(data['train']['target'][:500], 120, model='unigram')
  with pytest.raises(TokenizerError, match='this tokenizer is Unigram'):
    unigram.bpe_dropout(RATE)
  other_words = tokenizers.Tokenizer(tokenizers.models.BPE({'a': 0}, []))
  other_words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  with pytest.raises(TokenizerError, match="leading '▁'.* pre-tokenizes with Whitespace"):
    BpeDropout.of(other_words, RATE)
  with pytest.raises(TokenizerError, match='a str has none'):
    resegmenting_of('not a tokenizer', RATE, 0)
  assert resegmenting_of(tokenizer, 0.0, 0) is None
  with pytest.raises(ConfigError, match=r'data.bpe_dropout must be in \[0, 1\), got 1.0'):
    DataConfig(bpe_dropout=1.0)


@pytest.mark.parametrize(
  'settings, message',
  [
    (
      {'train': {'packing': 16}},
      r'data.bpe_dropout=0.1 resamples one pair a row; packed rows \(train.packing=16\)',
    ),
    (
      {'data': {'tokenizer': 'unigram'}},
      r'data.bpe_dropout=0.1: BPE-dropout resamples the merges of a BPE model; this tokenizer '
      'is Unigram',
    ),
  ],
)
def test_train_refuses_bpe_dropout_it_cannot_do_before_compiling(tmp_path, settings, message):
  pairs = datasets.DatasetDict(
    {'train': datasets.Dataset.from_dict({'source': ['one two'] * 8, 'target': ['eins zwei'] * 8})}
  )
  with pytest.raises(ConfigError, match=message):
    train(
      ModelConfig.tiny(),
      TrainConfig(steps=2, max_tokens=64, **settings.get('train', {})),
      DataConfig(vocab_size=40, bpe_dropout=RATE, **settings.get('data', {})),
      tmp_path,
      dataset=pairs,
    )
