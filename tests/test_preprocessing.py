"""The literature's preprocessing as data settings, and its tokenized BLEU (issue #50, item 1-2)."""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig, run_preset
from flax_transformer.data import preprocessing
from flax_transformer.data.preprocessing import (
  PreprocessingTokenizer,
  TextPreprocessing,
  moses_tokenized,
)
from flax_transformer.files import files_digest
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train.evaluation import corpus_scores, tokenized_bleu
from flax_transformer.train.loop import check_settings
from flax_transformer.train.optimizer import make_schedule

STANDARD = TextPreprocessing(normalize_punctuation=True, lowercase=True, pretokenize='moses')


def test_standard_preprocessing_normalises_lowercases_and_splits_punctuation():
  # Moses' normaliser turns typographic quotes into ASCII and collapses spaces; the tokenizer
  # splits punctuation and clitics (English "'s"), keeps abbreviations whole ("z.B.").
  assert STANDARD.prepare(['A man\u2019s  "blue" shirt, at 5 p.m.'], 'en') == [
    'a man \'s " blue " shirt , at 5 p.m.'
  ]
  assert STANDARD.prepare(['Ein Hund, z.B. ein Pudel, springt.'], 'de') == [
    'ein hund , z.b. ein pudel , springt .'
  ]
  # Each step alone does only its own part.
  assert TextPreprocessing(lowercase=True).prepare(['Ein Hund, springt.'], 'de') == [
    'ein hund, springt.'
  ]
  assert TextPreprocessing(pretokenize='moses').prepare(['Ein Hund, springt.'], 'de') == [
    'Ein Hund , springt .'
  ]
  assert TextPreprocessing().prepare(['Ein  Hund,'], 'de') == ['Ein  Hund,']


def test_outputs_are_detokenized_unless_asked_to_stay_tokenized():
  tokenized = ['ein hund , z.B. ein pudel , springt .']
  assert STANDARD.finish(tokenized, 'de') == ['ein hund, z.B. ein pudel, springt.']
  kept = TextPreprocessing(lowercase=True, pretokenize='moses', detokenize=False)
  assert kept.finish(tokenized, 'de') == tokenized
  assert TextPreprocessing(lowercase=True).finish(tokenized, 'de') == tokenized


def _bleu_by_hand(hypothesis: list[str], reference: list[str]) -> float:
  """BLEU-4 of one segment in float64 from its n-gram counts (no zero count: no smoothing)."""
  log_precisions = []
  for n in range(1, 5):
    grams = lambda words: [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    hyp, ref = grams(hypothesis), grams(reference)
    matches = sum(min(hyp.count(g), ref.count(g)) for g in set(hyp))
    log_precisions.append(np.log(np.float64(matches) / len(hyp)))
  brevity = min(0.0, 1 - len(reference) / len(hypothesis))
  return 100 * float(np.exp(brevity + np.mean(log_precisions)))


def test_tokenized_bleu_matches_a_hand_count_on_moses_tokens():
  hypotheses, references = ['Ein Mann, der geht.'], ['ein Mann, der läuft.']
  score, signature = tokenized_bleu(hypotheses, references, 'de')
  # 'ein mann , der geht .' against 'ein mann , der läuft .': 5/6, 3/5, 2/4, 1/3.
  expected = _bleu_by_hand('ein mann , der geht .'.split(), 'ein mann , der läuft .'.split())
  assert expected == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, rel=1e-12)
  assert score.score == pytest.approx(expected, rel=1e-6)
  assert score.sys_len == score.ref_len == 6
  assert 'tok:none' in signature and 'moses-norm+lc+tok-de' in signature
  # Cased 13a BLEU sees 'Ein' against 'ein' and the punctuation glued: lower.
  values, _ = corpus_scores(hypotheses, references, 'de')
  assert values['bleu_tok'] == pytest.approx(expected, rel=1e-6)
  assert values['bleu'] < values['bleu_lc'] <= values['bleu_tok'] + 1e-9
  assert 'bleu_tok' not in corpus_scores(hypotheses, references)[0]
  # The output's length against the reference's, in the same tokens: 'ein mann .' is 3 of 6.
  assert values['length_ratio'] == pytest.approx(1.0)
  short, _ = corpus_scores(['Ein Mann.'], references, 'de')
  assert short['length_ratio'] == pytest.approx(3 / 6)
  assert 'length_ratio' not in corpus_scores(hypotheses, references)[0]


def test_tokenized_reference_length_of_test_2016_is_the_published_one(multi30k_dir):
  """Wu et al.'s fairseq run reports reflen=12103 on test_2016: the token count of the German
  test references after normalisation, lowercasing and Moses tokenization."""
  references = (multi30k_dir / 'test_2016_flickr.de').read_text(encoding='utf-8').splitlines()
  assert len(references) == 1000
  assert sum(len(line.split()) for line in moses_tokenized(references, 'de')) == 12_103
  score, _ = tokenized_bleu(references, references, 'de')
  assert score.ref_len == 12_103 and score.score == pytest.approx(100.0)


@pytest.fixture(scope='module')
def cased_tokenizer() -> Tokenizer:
  texts = [
    'Ein Hund läuft , ein Mann geht .',
    'A dog runs , a man walks .',
    'ein hund läuft',
    'a dog runs',
  ] * 20
  return Tokenizer.train(texts, 120)


def test_the_wrapped_tokenizer_prepares_each_side_in_its_language_and_finishes_outputs(
  cased_tokenizer,
):
  wrapped = preprocessing.wrap(
    cased_tokenizer, DataConfig(src_lang='en', tgt_lang='de', lowercase=True, pretokenize='moses')
  )
  assert isinstance(wrapped, PreprocessingTokenizer)
  assert wrapped.encode(['A dog runs, a man walks.']) == cased_tokenizer.encode(
    ['a dog runs , a man walks .']
  )
  assert wrapped.encode_target(['Ein Hund läuft.']) == cased_tokenizer.encode(['ein hund läuft .'])
  # Each side in its own language: Moses splits an apostrophe's 's' as English ("'s") only.
  assert wrapped.encode(["Peter's dog."]) == cased_tokenizer.encode(["peter 's dog ."])
  assert wrapped.encode_target(["Peter's Hund."]) == cased_tokenizer.encode(["peter ' s hund ."])
  assert cased_tokenizer.encode(["peter 's"]) != cased_tokenizer.encode(["peter ' s"])
  ids, lengths = wrapped.encode_flat(['A dog runs.'])
  assert ids.tolist() == cased_tokenizer.encode(['a dog runs .'])[0] and lengths.tolist() == [
    len(ids)
  ]
  row = cased_tokenizer.encode(['ein hund läuft , ein mann geht .'])[0] + [wrapped.eos_id]
  assert wrapped.decode([row]) == ['ein hund läuft, ein mann geht.']
  # Sent to a pool's workers whole; the vocabulary and files are the wrapped tokenizer's.
  copy = pickle.loads(pickle.dumps(wrapped))
  assert copy.encode(['A dog runs.']) == wrapped.encode(['A dog runs.'])
  assert (wrapped.vocab_size, wrapped.FILES) == (cased_tokenizer.vocab_size, Tokenizer.FILES)
  assert preprocessing.unwrap(wrapped) is cased_tokenizer
  # Without preprocessing there is nothing to wrap.
  assert preprocessing.wrap(cased_tokenizer, DataConfig()) is cased_tokenizer


def test_the_corpus_cache_key_changes_with_the_preprocessing(cased_tokenizer, tmp_path):
  cased_tokenizer.save(tmp_path)
  lowered = preprocessing.wrap(cased_tokenizer, DataConfig(lowercase=True))
  tokenized = preprocessing.wrap(cased_tokenizer, DataConfig(lowercase=True, pretokenize='moses'))
  swapped = preprocessing.wrap(
    cased_tokenizer, DataConfig(lowercase=True, src_lang='de', tgt_lang='en')
  )
  keys = {t.digest() for t in (cased_tokenizer, lowered, tokenized, swapped)}
  # Unwrapped, the digest is the files' own: a run without preprocessing keeps its cache.
  assert len(keys) == 4 and cased_tokenizer.digest() == files_digest([tmp_path / 'tokenizer.json'])


def test_peak_lr_is_fairseqs_inverse_sqrt_schedule():
  """train.peak_lr P with W warm-up updates: P * n / W up to n = W, then P * sqrt(W / n)
  (fairseq's inverse_sqrt from a zero start), n the 1-based update."""
  model, peak, warmup = ModelConfig.tiny(d_model=128), 0.005, 2000
  schedule = make_schedule(TrainConfig(peak_lr=peak, warmup_steps=warmup), model)
  n = np.array([1, 500, 1999, 2000, 2001, 4000, 8000, 32_000], np.float64)
  expected = np.where(n <= warmup, peak * n / warmup, peak * np.sqrt(warmup / n))
  actual = np.array([float(schedule(int(k) - 1)) for k in n])
  np.testing.assert_allclose(actual, expected, rtol=1e-5)
  # Without it, the paper's: its peak (d_model * W)^-0.5.
  paper = make_schedule(TrainConfig(warmup_steps=warmup), model)
  assert float(paper(warmup - 1)) == pytest.approx((128 * warmup) ** -0.5, rel=1e-5)


@pytest.mark.parametrize(
  'build, message',
  [
    (lambda: TrainConfig(peak_lr=0.005, lr_scale=2.0), 'set one of them'),
    (lambda: TrainConfig(best_metric='bleu'), 'train.best_metric=bleu needs validation BLEU'),
    (lambda: TrainConfig(patience=-1), 'train.patience must be a non-negative integer'),
    (lambda: DataConfig(detokenize=False), 'data.detokenize=false is read only with'),
    (lambda: DataConfig(pretokenize='spacy'), 'data.pretokenize must be one of none, moses'),
  ],
)
def test_bad_settings_are_refused_in_one_line(build, message):
  with pytest.raises(ConfigError, match=message) as error:
    build()
  assert '\n' not in str(error.value)


def test_a_pretrained_cased_tokenizer_is_not_fed_lowercased_text():
  model, train, data = run_preset('multi30k_fairseq')
  with pytest.raises(
    ConfigError, match='--init-from brings a tokenizer trained on text as written'
  ) as error:
    check_settings(model.replace(vocab_size=10_000), train, data, pretrained=True)
  assert 'lowercased' in str(error.value) and '\n' not in str(error.value)


def test_the_fairseq_preset_is_the_anchors_recipe():
  model, train, data = run_preset('multi30k_fairseq')
  assert (
    model.d_model,
    model.num_heads,
    model.num_encoder_layers,
    model.num_decoder_layers,
    model.d_ff,
    model.dropout_rate,
    model.norm_placement,
  ) == (128, 4, 4, 4, 256, 0.3, 'post')
  assert (
    train.peak_lr,
    train.warmup_steps,
    train.max_tokens,
    train.patience,
    train.label_smoothing,
    train.adam_eps,
    train.max_grad_norm,
  ) == (0.005, 2000, 8192, 10, 0.1, 1e-8, 25.0)
  assert train.checkpoint_every == train.eval_every and train.keep_checkpoints == 10
  assert (data.normalize_punctuation, data.lowercase, data.pretokenize) == (True, True, 'moses')
  assert not math.isnan(train.steps) and train.steps == 8000


def test_a_sentence_prepared_again_is_looked_up_not_tokenized_again():
  """The training text is prepared for the tokenizer's sample and again for encoding: the
  second pass reads the memo, and gives what Moses gives."""
  steps = TextPreprocessing(normalize_punctuation=True, lowercase=True, pretokenize='moses')
  texts = [f'A dog, number {index}, runs fast.' for index in range(50)]
  first = steps.prepare(texts, 'en')
  before = preprocessing._prepared.cache_info()
  again = steps.prepare(texts, 'en')
  after = preprocessing._prepared.cache_info()
  assert again == first == [steps.prepare_one(text, 'en') for text in texts]
  assert first[0] == 'a dog , number 0 , runs fast .'
  assert (after.hits - before.hits, after.misses - before.misses) == (50, 0)
  # Another language or other steps are other entries, never a stale answer.
  assert steps.prepare(texts[:1], 'de') == [steps.prepare_one(texts[0], 'de')]
  lowered_only = TextPreprocessing(lowercase=True)
  assert lowered_only.prepare(texts[:1], 'en') == [texts[0].lower()]
