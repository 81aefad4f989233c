"""Scheduled sampling: the decay schedules, the mixing of gold and predicted decoder inputs, and
the training step with it on: p = 0 is teacher forcing, p = 1 feeds the first pass's argmax, and
1 device trains like 2 (shard_map and pmap).

References are independent: Bengio et al.'s schedules in NumPy float64, the first pass's argmax
from a plain forward pass, binomial bounds for the mixing rate.
"""

import functools

import jax
import numpy as np
import pytest
from flax import traverse_util

from flax_transformer.config import (
  ConfigError,
  DataConfig,
  ModelConfig,
  TrainConfig,
  parse_overrides,
)
from flax_transformer.nn.model import Transformer
from flax_transformer.train import (
  DataParallel,
  create_train_state,
  make_optimizer,
  make_parallel_step,
)
from flax_transformer.train import scheduled_sampling as ss
from flax_transformer.train.loop import check_settings
from support.copy_task import random_copy_batch
from support.device_workers import assert_runs_match, run_worker

PAD, BOS, EOS = 0, 1, 2
CONFIG = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.1)
STEPS = np.array([0, 1, 7, 100, 999, 1000, 2000, 5000, 20_000, 1_000_000])


def schedule(name, **values):
  return TrainConfig(
    scheduled_sampling=name, **{f'scheduled_sampling_{key}': value for key, value in values.items()}
  )


def reference_gold_probability(name, i, k=1.0, c=1e-4, eps=0.0):
  """Bengio et al. (2015), section 2.4, in float64 (linear clipped to 1 from above)."""
  i = np.asarray(i, np.float64)
  if name == 'linear':
    return np.minimum(1.0, np.maximum(eps, k - c * i))
  if name == 'exponential':
    return k**i
  return k / (k + np.exp(np.minimum(i / k, 700.0)))


@pytest.mark.parametrize(
  'name, values',
  [
    ('linear', dict(k=1.0, c=1e-4, eps=0.0)),
    ('linear', dict(k=1.25, c=2.5e-4, eps=0.75)),
    ('exponential', dict(k=0.9999)),
    ('exponential', dict(k=0.99)),
    ('inverse_sigmoid', dict(k=300.0)),
    ('inverse_sigmoid', dict(k=1.0)),
  ],
)
def test_gold_probability_matches_bengio_formulas(name, values):
  config = schedule(name, **values)
  got = np.array([float(ss.gold_probability(step, config)) for step in STEPS])
  want = reference_gold_probability(name, STEPS, **values)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
  assert want.max() - want.min() > 0.2  # the schedule decays over STEPS: a real comparison


def test_off_feeds_gold_at_every_step():
  assert [float(ss.gold_probability(step, TrainConfig())) for step in STEPS] == [1.0] * len(STEPS)


def distinct_rows(rows, length, pad_from=None):
  """gold_in `<s> 10 11 ..`, PAD from column pad_from[r] on; predictions 1000 + t, never gold."""
  gold = np.tile(np.arange(length, dtype=np.int32) + 9, (rows, 1))
  gold[:, 0] = BOS
  if pad_from is not None:
    gold[np.arange(length) >= np.asarray(pad_from)[:, None]] = PAD
  predictions = np.tile(np.arange(length, dtype=np.int32) + 1000, (rows, 1))
  return gold, predictions


@pytest.mark.parametrize('p', [0.0, 0.1, 0.5, 0.9, 1.0])
def test_mixing_rate_matches_p_and_mixed_tokens_are_shifted_predictions(p):
  rows, length = 64, 257
  gold, predictions = distinct_rows(rows, length)
  keys = ss.row_keys(jax.random.key(3), 0, rows)
  mixed = np.asarray(ss.mix_decoder_inputs(gold, predictions, p, keys, PAD))
  assert (mixed[:, 0] == BOS).all()
  took = mixed[:, 1:] != gold[:, 1:]  # [B, T - 1]
  # A replaced position t holds the prediction made at t - 1; the rest stay gold.
  np.testing.assert_array_equal(mixed[:, 1:][took], predictions[:, :-1][took])
  n = took.size
  sigma = np.sqrt(n * p * (1 - p))
  assert abs(took.sum() - n * p) <= 5 * sigma  # exact when p is 0 or 1
  # Each row draws its own coins: rows are not copies of one another.
  if 0 < p < 1:
    assert len({row.tobytes() for row in took}) == rows


def test_bos_and_pad_inputs_are_never_replaced():
  pad_from = np.array([1, 2, 5, 8])
  gold, predictions = distinct_rows(4, 8, pad_from)
  keys = ss.row_keys(jax.random.key(0), 0, 4)
  mixed = np.asarray(ss.mix_decoder_inputs(gold, predictions, 1.0, keys, PAD))
  expected = np.where(gold == PAD, PAD, np.concatenate([gold[:, :1], predictions[:, :-1]], axis=1))
  np.testing.assert_array_equal(mixed, expected)


def test_a_rows_choices_depend_on_its_global_index_not_its_batch():
  """What makes 1 device equal N devices: rows 4..7 mix alike as part of 8 rows or on their own."""
  gold, predictions = distinct_rows(8, 33)
  key = jax.random.key(5)
  whole = ss.mix_decoder_inputs(gold, predictions, 0.5, ss.row_keys(key, 0, 8), PAD)
  half = ss.mix_decoder_inputs(gold[4:], predictions[4:], 0.5, ss.row_keys(key, 4, 4), PAD)
  np.testing.assert_array_equal(np.asarray(whole)[4:], np.asarray(half))


def test_sampled_predictions_follow_the_softmax():
  probs = np.array([0.1, 0.2, 0.3, 0.4])
  rows, length = 50, 200
  logits = np.broadcast_to(np.log(probs), (rows, length, 4)).astype(np.float32)
  tokens = np.asarray(ss.predict(logits, ss.row_keys(jax.random.key(1), 0, rows), 'sample'))
  counts = np.bincount(tokens.ravel(), minlength=4)
  n = tokens.size
  assert (np.abs(counts - n * probs) <= 5 * np.sqrt(n * probs * (1 - probs))).all()
  np.testing.assert_array_equal(ss.predict(logits, None, 'argmax'), np.full((rows, length), 3))


@pytest.mark.parametrize(
  'overrides, message',
  [
    (dict(scheduled_sampling='cosine'), 'train.scheduled_sampling must be one of'),
    (
      dict(scheduled_sampling_k=0.5),
      "train.scheduled_sampling_k=0.5 is not read with train.scheduled_sampling='off'",
    ),
    (
      dict(scheduled_sampling='exponential', scheduled_sampling_eps=0.5),
      'train.scheduled_sampling_eps=0.5 is not read',
    ),
    (dict(scheduled_sampling='linear', scheduled_sampling_eps=1.5), 'needs k >= 0, c >= 0'),
    (dict(scheduled_sampling='linear', scheduled_sampling_c=-1.0), 'needs k >= 0, c >= 0'),
    (dict(scheduled_sampling='exponential', scheduled_sampling_k=1.5), 'needs 0 < k <= 1'),
    (dict(scheduled_sampling='exponential', scheduled_sampling_k=0.0), 'needs 0 < k <= 1'),
    (dict(scheduled_sampling='inverse_sigmoid', scheduled_sampling_k=0.5), 'needs k >= 1'),
    (
      dict(scheduled_sampling='linear', scheduled_sampling_k='1'),
      'scheduled_sampling_k must be a number',
    ),
    (
      dict(scheduled_sampling='linear', scheduled_sampling_choice='top_k'),
      'train.scheduled_sampling_choice must be one of',
    ),
  ],
)
def test_config_rejects_bad_settings(overrides, message):
  with pytest.raises(ConfigError, match=message):
    TrainConfig(**overrides)


def test_command_line_settings_and_cmlm_refusal():
  config = parse_overrides(
    TrainConfig(),
    'train',
    {
      'scheduled_sampling': 'inverse_sigmoid',
      'scheduled_sampling_k': '300',
      'scheduled_sampling_choice': 'sample',
    },
  )
  assert (
    config.scheduled_sampling,
    config.scheduled_sampling_k,
    config.scheduled_sampling_choice,
  ) == ('inverse_sigmoid', 300.0, 'sample')
  cmlm = ModelConfig.tiny(kind='cmlm')
  with pytest.raises(ConfigError, match="needs model.kind='autoregressive'"):
    check_settings(cmlm, config, DataConfig())
  check_settings(CONFIG, config, DataConfig())  # an autoregressive model may


# --- the training step --------------------------------------------------------------------


def copy_batch(seed, rows=8, length=12):
  """Copy-task rows of 2 to `length` - 1 words, PAD after."""
  return random_copy_batch(
    np.random.default_rng(seed), rows, length, CONFIG.vocab_size, min_words=2
  )


# Gold probability 1 - i clipped to [0, 1]: step 0 is teacher forcing (p = 0), step 1 feeds only
# predictions (p = 1), with one compile.
P0_THEN_P1 = schedule('linear', k=1.0, c=1.0)


@pytest.fixture(scope='module')
def one_step():
  """(config, batch, step) -> (metrics, flat new params) of one step on one device, from the
  same parameters and optimizer state with the step counter at `step`."""
  model = Transformer(CONFIG)
  parallel = DataParallel(jax.devices()[:1])
  initial = jax.device_get(create_train_state(model, make_optimizer(TrainConfig(), CONFIG), 0))

  @functools.cache  # one compile per configuration
  def compiled(train_config):
    return make_parallel_step(model, make_optimizer(train_config, CONFIG), train_config, parallel)

  def run(train_config, batch, step):
    state = initial.replace(step=np.asarray(step, np.int32))
    state, metrics = compiled(train_config)(parallel.replicate(state), parallel.shard_batch(batch))
    return (
      parallel.unreplicate(metrics),
      traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/'),
    )

  return model, initial, run


def test_p0_is_teacher_forcing_losses_and_gradients_alike(one_step):
  """Gold probability 1: the same loss, gradient norm and update, bit for bit."""
  _, _, run = one_step
  batch = copy_batch(0)
  plain_metrics, plain_params = run(TrainConfig(), batch, 0)
  metrics, params = run(P0_THEN_P1, batch, 0)
  for name in ('loss_sum', 'nll_sum', 'correct', 'tokens', 'grad_norm'):
    np.testing.assert_array_equal(metrics[name], plain_metrics[name], err_msg=name)
  for name, value in plain_params.items():
    np.testing.assert_array_equal(params[name], value, err_msg=name)


def test_p1_feeds_the_teacher_forced_argmax(one_step):
  """Gold probability 0: the step equals teacher forcing on `<s>` + the first pass's argmax
  (made with the step's own parameters, without dropout), PAD kept, targets gold."""
  model, initial, run = one_step
  batch = copy_batch(1)
  logits = model.apply({'params': initial.params}, batch.src, batch.tgt_in)  # [B, T, V]
  own = np.concatenate([batch.tgt_in[:, :1], np.argmax(logits, -1)[:, :-1]], axis=1)
  own = np.where(batch.tgt_in == PAD, PAD, own).astype(np.int32)
  changed = (own != batch.tgt_in).mean()
  assert changed > 0.3, changed  # an untrained model's guesses differ from the reference
  metrics, _ = run(P0_THEN_P1, batch, 1)
  plain_metrics, _ = run(TrainConfig(), batch.replace(tgt_in=own), 1)
  np.testing.assert_allclose(metrics['loss_sum'], plain_metrics['loss_sum'], rtol=1e-6)
  np.testing.assert_allclose(metrics['grad_norm'], plain_metrics['grad_norm'], rtol=1e-5)
  gold_metrics, _ = run(TrainConfig(), batch, 1)
  assert abs(metrics['loss_sum'] - gold_metrics['loss_sum']) > 1e-3 * gold_metrics['loss_sum']


WORKER = r"""
import sys
import numpy as np
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.model import Transformer
from support.device_workers import train_runs
from test_scheduled_sampling import copy_batch

out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
# Dropout 0: each device draws its own dropout masks, so only then can the runs agree.
config = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
# Sampled predictions, half the inputs replaced, two batches per update; adam_eps=1 as in
# test_multidevice (rounding noise in near-zero gradients would otherwise become +-lr steps).
train_config = TrainConfig(steps=steps, warmup_steps=2, lr_scale=4.0, adam_eps=1.0,
                           grad_accum_steps=2, scheduled_sampling='linear',
                           scheduled_sampling_k=0.5, scheduled_sampling_c=0.0,
                           scheduled_sampling_choice='sample')
np.savez(out, **train_runs(Transformer(config), train_config, runs, steps,
                           lambda index: copy_batch(10 + index)))
"""
RUNS = ('shard_map-1', 'shard_map-2', 'pmap-2')


@pytest.fixture(scope='module')
def device_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp('scheduled_sampling') / 'runs.npz'
  return run_worker(WORKER, out, [4, *RUNS], device_count=2, backend_optimization=False)


@pytest.mark.parametrize('run', RUNS[1:])
def test_two_devices_train_like_one(device_runs, run):
  """Tolerances as tests/test_multidevice.py's: float32 sums taken in another order."""
  assert_runs_match(device_runs, run)


def test_free_running_accuracy_counts_reference_positions():
  """benchmarks/scheduled_sampling.py's mismatch measure: position-wise matches over the
  reference's positions; a short output loses the positions it does not reach, a long one gains
  nothing from its extra tokens."""
  from benchmarks.scheduled_sampling import positionwise_correct

  reference = np.array([5, 6, 7, EOS])
  assert positionwise_correct(np.array([5, 6, 7, EOS, PAD, PAD]), reference) == 4
  assert positionwise_correct(np.array([5, 7, 7, EOS]), reference) == 3
  assert positionwise_correct(np.array([5, EOS]), reference) == 1
  assert positionwise_correct(np.array([6, 7, EOS, PAD]), reference) == 0  # shifted: all wrong
  assert positionwise_correct(np.array([5, 6, 7, 8, 9, EOS]), reference) == 3


def test_every_sentence_of_a_packed_row_keeps_its_gold_bos():
  """With probability 1 every real position but a sentence's first takes the prediction; in a
  packed row each sentence's BOS (its position 0) stays gold, as a row's first position does."""
  gold = np.array([[BOS, 5, 6, BOS, 7, PAD]])
  positions = np.array([[0, 1, 2, 0, 1, 0]])
  predictions = np.array([[11, 12, 13, 14, 15, 16]])
  keys = ss.row_keys(jax.random.key(0), 0, 1)
  mixed = np.asarray(ss.mix_decoder_inputs(gold, predictions, 1.0, keys, PAD, positions))
  np.testing.assert_array_equal(mixed, [[BOS, 11, 12, BOS, 14, PAD]])
