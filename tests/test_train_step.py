"""The objective, the schedule, the optimizer options and the single-device training step.

References are independent: the schedule's closed form and label-smoothed
cross-entropy written out in NumPy float64 from the target distribution.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util

from flax_transformer.config import ConfigError, ModelConfig, TrainConfig, parse_overrides
from flax_transformer.data.batching import Batch
from flax_transformer.nn.backend import AUTO_FUSED_LOSS_BYTES, AUTO_LOSS_CHUNK, resolve_loss_chunk
from flax_transformer.nn.model import Transformer
from flax_transformer.train import (
  DataParallel,
  TrainState,
  create_train_state,
  ending_schedule,
  label_smoothed_cross_entropy,
  make_optimizer,
  make_parallel_step,
  make_schedule,
  token_metrics,
  transformer_schedule,
)
from flax_transformer.train.losses import chunked_loss_sums, fused_loss_sums, loss_sums
from flax_transformer.train.optimizer import ema_params, with_parameter_ema
from support.copy_task import random_copy_batch

PAD, BOS, EOS = 0, 1, 2
# One layer each side: the step's behaviour does not depend on depth, and compiles halve.
CONFIG = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)


def reference_smoothed_ce(logits, targets, eps, pad_id):
  """sum over non-PAD positions of -sum_v q_v log p_v, q = (1 - eps) onehot + eps / V, float64."""
  logits = np.asarray(logits, np.float64)
  log_p = logits - logits.max(-1, keepdims=True)
  log_p -= np.log(np.exp(log_p).sum(-1, keepdims=True))
  vocab = logits.shape[-1]
  q = np.full(logits.shape, eps / vocab)
  np.put_along_axis(q, targets[..., None], 1 - eps + eps / vocab, axis=-1)
  per_token = -(q * log_p).sum(-1)
  weights = targets != pad_id
  return (per_token * weights).sum(), weights.sum()


def concat(a: Batch, b: Batch) -> Batch:
  return jax.tree.map(lambda x, y: np.concatenate([x, y]), a, b)


def flat(params):
  return traverse_util.flatten_dict(jax.device_get(params), sep='/')


# --- schedule ------------------------------------------------------------------


@pytest.mark.parametrize('d_model,warmup,scale', [(512, 4000, 1.0), (128, 300, 2.0)])
def test_schedule_matches_closed_form(d_model, warmup, scale):
  schedule = transformer_schedule(d_model, warmup, scale)
  counts = np.array([0, 1, 10, warmup // 2, warmup - 2, warmup - 1, warmup, 3 * warmup, 100_000])
  n = counts.astype(np.float64) + 1
  want = scale * d_model**-0.5 * np.minimum(n**-0.5, n * warmup**-1.5)
  got = np.array([float(schedule(c)) for c in counts])
  np.testing.assert_allclose(got, want, rtol=1e-6)
  # Peak at update warmup - 1 (n = warmup): scale / sqrt(d_model * warmup).
  assert np.argmax(got) == list(counts).index(warmup - 1)
  np.testing.assert_allclose(got.max(), scale / np.sqrt(d_model * warmup), rtol=1e-6)


def test_schedule_is_jittable_and_rejects_zero_warmup():
  schedule = transformer_schedule(64, 10)
  np.testing.assert_allclose(jax.jit(schedule)(jnp.int32(4)), float(schedule(4)), rtol=1e-7)
  with pytest.raises(ValueError, match='warmup_steps must be positive'):
    transformer_schedule(64, 0)


# Hand-computed: peak 0.01, warm-up 4 updates, 12 updates in all. n = count + 1.
# linear: 0.01 * (12 - n) / 8 after the warm-up; wsd, cooldown 0.5: held to n = 6, then
# 0.01 * (1 - sqrt((n - 6) / 6)), e.g. n = 7.5: 1 - sqrt(1/4) = 0.5.
HAND_SCHEDULES = {
  'linear': {0: 0.0025, 3: 0.01, 4: 0.01 * 7 / 8, 7: 0.005, 10: 0.01 / 8, 11: 0.0, 20: 0.0},
  'wsd': {0: 0.0025, 3: 0.01, 5: 0.01, 6: 0.01 * (1 - 6**-0.5), 8: 0.01 * (1 - 0.5**0.5), 11: 0.0},
}


@pytest.mark.parametrize('shape', sorted(HAND_SCHEDULES))
def test_ending_schedules_equal_hand_computed_values(shape):
  schedule = ending_schedule(0.01, 4, 12, shape, cooldown_fraction=0.5)
  for count, want in HAND_SCHEDULES[shape].items():
    np.testing.assert_allclose(float(schedule(count)), want, rtol=1e-6, atol=1e-9, err_msg=count)
  # Through the settings: the same function, the peak from peak_lr, the end from train.steps.
  config = TrainConfig(
    steps=12, warmup_steps=4, peak_lr=0.01, schedule=shape, cooldown_fraction=0.5
  )
  from_settings = make_schedule(config, CONFIG)
  np.testing.assert_allclose(
    [float(from_settings(c)) for c in range(14)], [float(schedule(c)) for c in range(14)], rtol=1e-7
  )


def test_an_ending_schedule_counts_updates_not_steps_and_wsd_cooldown_shape():
  # 24 steps of 2 accumulated batches are 12 updates: the same schedule as above.
  config = TrainConfig(
    steps=24, grad_accum_steps=2, warmup_steps=4, peak_lr=0.01, schedule='linear'
  )
  np.testing.assert_allclose(float(make_schedule(config, CONFIG)(7)), 0.005, rtol=1e-6)
  # The wsd cooldown falls fast at first: its first half removes 1 - sqrt(1/2) = 71% of the peak.
  schedule = ending_schedule(1.0, 10, 1000, 'wsd', cooldown_fraction=0.2)
  np.testing.assert_allclose(float(schedule(899)), 1 - 0.5**0.5, rtol=1e-5)
  assert float(schedule(799)) == pytest.approx(1.0)
  assert float(schedule(800)) < 1.0


@pytest.mark.parametrize(
  'overrides,message',
  [
    ({'schedule': 'cosine'}, 'train.schedule must be one of inverse_sqrt, linear, wsd'),
    ({'schedule': 'wsd', 'cooldown_fraction': 0.0}, r'train.cooldown_fraction must be in \(0, 1\]'),
    ({'schedule': 'wsd', 'cooldown_fraction': 1.5}, r'train.cooldown_fraction must be in \(0, 1\]'),
    ({'schedule': 'linear', 'steps': 100, 'warmup_steps': 100}, 'leaves no update after'),
  ],
)
def test_schedule_settings_are_refused_out_of_range(overrides, message):
  with pytest.raises(ConfigError, match=message):
    TrainConfig(**overrides)


def test_parameter_ema_equals_a_float64_reference_and_skips_withheld_updates():
  # SGD on 0.5 * |w - 3|^2 from w = 0: the average after each update, recomputed in float64.
  decay = 0.8
  optimizer = with_parameter_ema(optax.sgd(0.3), decay)
  params = {'w': jnp.zeros(2, jnp.float32)}
  state = optimizer.init(params)
  w, average = np.zeros(2), np.zeros(2)
  for n in range(12):
    grads = jax.tree.map(lambda p: p - 3.0, params)
    updates, state = optimizer.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    w = w - 0.3 * (w - 3.0)
    d = min(decay, (1 + n) / (10 + n))
    average = d * average + (1 - d) * w
    np.testing.assert_allclose(ema_params(state)['w'], average, rtol=1e-6)
  # The average lags the parameters climbing towards 3.
  assert np.all(np.asarray(ema_params(state)['w']) < np.asarray(params['w']))
  # make_optimizer keeps one only when asked, inside gradient accumulation.
  assert ema_params(make_optimizer(TrainConfig(), CONFIG).init(params)) is None
  accumulating = make_optimizer(TrainConfig(ema_decay=0.99, grad_accum_steps=2), CONFIG)
  np.testing.assert_array_equal(ema_params(accumulating.init(params))['w'], params['w'])


def test_ema_decay_outside_zero_to_one_is_refused():
  with pytest.raises(ConfigError, match=r'train.ema_decay must be in \[0, 1\), got 1.0'):
    TrainConfig(ema_decay=1.0)


# --- loss ----------------------------------------------------------------------


@pytest.mark.parametrize('eps', [0.0, 0.1, 0.3])
def test_label_smoothed_cross_entropy_matches_float64_reference(eps):
  rng = np.random.default_rng(0)
  logits = (3 * rng.normal(size=(3, 6, 17))).astype(np.float32)
  targets = rng.integers(1, 17, (3, 6)).astype(np.int32)
  targets[0, 4:] = PAD
  targets[2, 1:] = PAD
  loss_sum, weight_sum = label_smoothed_cross_entropy(logits, targets, eps, PAD)
  want_loss, want_weight = reference_smoothed_ce(logits, targets, eps, PAD)
  assert float(weight_sum) == want_weight == 3 * 6 - 2 - 5
  np.testing.assert_allclose(float(loss_sum), want_loss, rtol=2e-6)


def test_pad_positions_carry_no_loss():
  rng = np.random.default_rng(1)
  logits = rng.normal(size=(2, 5, 11)).astype(np.float32)
  targets = np.array([[4, 5, 2, PAD, PAD], [6, 2, PAD, PAD, PAD]], np.int32)
  changed = logits.copy()
  changed[targets == PAD] = 100 * rng.normal(size=((targets == PAD).sum(), 11))
  np.testing.assert_array_equal(
    label_smoothed_cross_entropy(logits, targets, 0.1, PAD),
    label_smoothed_cross_entropy(changed, targets, 0.1, PAD),
  )


@pytest.mark.parametrize('chunk', [1, 5, 7, 18, 64], ids=lambda c: f'chunk{c}')
def test_chunked_loss_sums_equal_the_whole_batchs(chunk):
  """A chunk at a time (chunks that do and do not divide the 18 tokens) against float64."""
  rng = np.random.default_rng(2)
  states = rng.normal(size=(3, 6, 8)).astype(np.float32)
  projection = (2 * rng.normal(size=(8, 17))).astype(np.float32)
  targets = rng.integers(1, 17, (3, 6)).astype(np.int32)
  targets[0, 4:] = PAD
  logits_fn = lambda h: h @ projection
  sums = jax.jit(lambda s: chunked_loss_sums(logits_fn, s, targets, 0.1, PAD, chunk))(states)
  logits = np.asarray(states, np.float64) @ projection
  want_loss, want_tokens = reference_smoothed_ce(logits, targets, 0.1, PAD)
  assert float(sums['tokens']) == want_tokens == 16
  np.testing.assert_allclose(float(sums['loss_sum']), want_loss, rtol=2e-6)
  whole = loss_sums(jnp.asarray(states) @ projection, targets, 0.1, PAD)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6), sums, whole)


def test_token_metrics():
  metrics = token_metrics({'loss_sum': 30.0, 'nll_sum': 20.0, 'correct': 6.0, 'tokens': 10.0})
  assert metrics['loss'] == 3.0 and metrics['accuracy'] == 0.6
  np.testing.assert_allclose(metrics['ppl'], np.exp(2.0), rtol=1e-12)


# --- configuration -------------------------------------------------------------


@pytest.mark.parametrize(
  'field,value,message',
  [
    ('steps', 0, 'train.steps must be a positive integer'),
    ('warmup_steps', -5, 'train.warmup_steps must be a positive integer'),
    ('label_smoothing', 1.0, r'train.label_smoothing must be in \[0, 1\)'),
    ('max_grad_norm', 0.0, 'train.max_grad_norm must be a positive number'),
    ('weight_decay', -0.1, 'train.weight_decay must be >= 0'),
    ('grad_accum_steps', 1.5, 'train.grad_accum_steps must be a positive integer'),
  ],
)
def test_train_config_rejects_invalid_values(field, value, message):
  with pytest.raises(ConfigError, match=message):
    TrainConfig(**{field: value})


def test_parse_overrides_by_annotation():
  config = parse_overrides(
    TrainConfig(), 'train', {'steps': '7', 'max_grad_norm': 'none', 'lr_scale': '0.5'}
  )
  assert (config.steps, config.max_grad_norm, config.lr_scale) == (7, None, 0.5)
  model = parse_overrides(
    CONFIG, 'model', {'share_embeddings': 'false', 'activation': 'gelu', 'attention_radius': '3'}
  )
  assert (model.share_embeddings, model.activation, model.attention_radius) == (False, 'gelu', 3)
  with pytest.raises(ConfigError, match="train.steps must be an integer, got 'ten'"):
    parse_overrides(TrainConfig(), 'train', {'steps': 'ten'})
  with pytest.raises(ConfigError, match='model.activation must be one of relu, gelu'):
    parse_overrides(CONFIG, 'model', {'activation': 'tanh'})
  with pytest.raises(ConfigError, match='unknown option train.stpes'):
    parse_overrides(TrainConfig(), 'train', {'stpes': '1'})
  # A number's setting that also takes a name: model.loss_chunk, a count of tokens or auto.
  assert parse_overrides(CONFIG, 'model', {'loss_chunk': '256'}).loss_chunk == 256
  assert parse_overrides(CONFIG, 'model', {'loss_chunk': 'auto'}).loss_chunk == 'auto'
  with pytest.raises(ConfigError, match="model.loss_chunk must be an integer or auto, got 'fast'"):
    parse_overrides(CONFIG, 'model', {'loss_chunk': 'fast'})
  with pytest.raises(ConfigError, match='model.loss_chunk must be a non-negative integer or auto'):
    parse_overrides(CONFIG, 'model', {'loss_chunk': '-1'})


# --- the step, on one device -----------------------------------------------------

# Copy task over 16 word ids: learnable by the tiny model in a few hundred steps.
WORDS, LENGTH, ROWS = 20, 8, 32
TRAIN_CONFIG = TrainConfig(steps=300, warmup_steps=100, lr_scale=0.5)


@pytest.fixture(scope='module')
def single():
  return DataParallel(jax.devices()[:1])


@pytest.fixture(scope='module')
def setup(single):
  """(model, optimizer, the mapped step, the initial state on the host), compiled once."""
  model = Transformer(CONFIG)
  optimizer = make_optimizer(TRAIN_CONFIG, CONFIG)
  initial = jax.device_get(create_train_state(model, optimizer, seed=0))
  return model, optimizer, make_parallel_step(model, optimizer, TRAIN_CONFIG, single), initial


def fresh_state(optimizer, params):
  """A step-0 state for another optimizer over the same parameters (no model compile)."""
  return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))


@pytest.fixture(scope='module')
def copy_run(single, setup):
  """The tiny model trained TRAIN_CONFIG.steps on the copy task: (per-step metrics, final state)."""
  _, _, step, initial = setup
  state = single.replicate(initial)
  rng = np.random.default_rng(0)
  history = []
  for _ in range(TRAIN_CONFIG.steps):
    state, metrics = step(state, single.shard_batch(random_copy_batch(rng, ROWS, LENGTH, WORDS)))
    history.append(metrics)
  return single.unreplicate(history), single.unreplicate(state)


def test_loss_falls_well_below_its_start_on_a_copy_task(copy_run):
  history, _ = copy_run
  losses = [float(m['loss_sum'] / m['tokens']) for m in history]
  start, end = np.mean(losses[:10]), np.mean(losses[-10:])
  assert start > 0.9 * np.log(CONFIG.vocab_size)  # about uniform over the vocabulary
  assert end < 0.3 * start, (start, end)
  accuracy = np.mean([float(m['correct'] / m['tokens']) for m in history[-10:]])
  assert accuracy > 0.9


def test_step_metrics_and_counter(copy_run, setup):
  history, state = copy_run
  model, _, _, initial = setup
  first = history[0]
  batch = random_copy_batch(np.random.default_rng(0), ROWS, LENGTH, WORDS)  # the first batch again
  assert float(first['tokens']) == float(batch.num_tokens)
  # correct: the target tokens the initial model ranks first, counted here in NumPy.
  logits = np.asarray(model.apply({'params': initial.params}, batch.src, batch.tgt_in))
  real = batch.tgt_out != PAD
  assert float(first['correct']) == np.sum((logits.argmax(-1) == batch.tgt_out) & real)
  # ... and the trained model's counts go from chance to nearly all.
  last = history[-1]
  assert float(last['correct']) > 0.9 * float(last['tokens']) > 10 * float(first['correct'])
  schedule = transformer_schedule(CONFIG.d_model, TRAIN_CONFIG.warmup_steps, TRAIN_CONFIG.lr_scale)
  for index in (0, 99, 299):
    np.testing.assert_allclose(
      float(history[index]['learning_rate']), float(schedule(index)), rtol=1e-6
    )
  assert float(first['grad_norm']) > 0
  assert int(state.step) == TRAIN_CONFIG.steps


def test_step_loss_equals_float64_reference(single, setup):
  """With dropout 0 the step's summed loss is the reference loss of the model it starts from."""
  model, _, step, initial = setup
  batch = random_copy_batch(np.random.default_rng(5), ROWS, LENGTH, WORDS)
  logits = model.apply({'params': initial.params}, batch.src, batch.tgt_in)
  want_loss, want_tokens = reference_smoothed_ce(logits, batch.tgt_out, 0.1, PAD)
  _, metrics = step(single.replicate(initial), single.shard_batch(batch))
  metrics = single.unreplicate(metrics)
  assert float(metrics['tokens']) == want_tokens
  np.testing.assert_allclose(float(metrics['loss_sum']), want_loss, rtol=1e-5)


def test_step_gradient_is_that_of_the_per_token_mean_loss(single, setup):
  """grad_norm is the norm of d(loss_sum / target tokens)/d(params), computed here with jax.grad
  of the label-smoothed loss outside the step: a step that forgot to divide by the tokens (Adam
  alone would not notice the scale) reports a norm that many times larger."""
  model, _, step, initial = setup
  batch = random_copy_batch(np.random.default_rng(6), ROWS, LENGTH, WORDS)

  def mean_loss(params):
    logits = model.apply({'params': params}, batch.src, batch.tgt_in)
    total, tokens = label_smoothed_cross_entropy(logits, batch.tgt_out, 0.1, PAD)
    return total / tokens

  grads = jax.grad(mean_loss)(initial.params)
  want = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.tree.leaves(grads)))
  _, metrics = step(single.replicate(initial), single.shard_batch(batch))
  np.testing.assert_allclose(float(single.unreplicate(metrics)['grad_norm']), want, rtol=1e-4)


def test_a_remat_step_with_its_chunked_loss_equals_the_plain_step(single, setup):
  """remat (and so the loss a chunk of logits at a time): the same sums and gradient norm."""
  model, optimizer, step, initial = setup
  remat = Transformer(CONFIG.replace(remat='layer'))
  remat_step = make_parallel_step(remat, optimizer, TRAIN_CONFIG, single)
  batch = single.shard_batch(random_copy_batch(np.random.default_rng(7), ROWS, LENGTH, WORDS))
  _, want = step(single.replicate(initial), batch)
  _, got = remat_step(single.replicate(initial), batch)
  want, got = single.unreplicate(want), single.unreplicate(got)
  for name in ('loss_sum', 'nll_sum', 'correct', 'tokens', 'grad_norm'):
    np.testing.assert_allclose(float(got[name]), float(want[name]), rtol=1e-5, err_msg=name)


def test_a_fused_loss_step_equals_the_plain_step(single, setup):
  """model.loss_chunk: the projection, loss and gradient a chunk at a time, fused: the same
  sums, and the same parameters after the update."""
  model, optimizer, step, initial = setup
  fused = Transformer(CONFIG.replace(loss_chunk=24))  # not a divisor of the batch's tokens
  fused_step = make_parallel_step(fused, optimizer, TRAIN_CONFIG, single)
  batch = single.shard_batch(random_copy_batch(np.random.default_rng(8), ROWS, LENGTH, WORDS))
  want_state, want = step(single.replicate(initial), batch)
  got_state, got = fused_step(single.replicate(initial), batch)
  want, got = single.unreplicate(want), single.unreplicate(got)
  for name in ('loss_sum', 'nll_sum', 'correct', 'tokens', 'grad_norm'):
    np.testing.assert_allclose(float(got[name]), float(want[name]), rtol=1e-5, err_msg=name)
  want_params, got_params = (flat(single.unreplicate(s).params) for s in (want_state, got_state))
  for name in want_params:
    np.testing.assert_allclose(got_params[name], want_params[name], rtol=1e-5, atol=1e-6)


def test_loss_chunk_auto_fuses_on_a_cpu_in_float32_once_the_logits_are_large():
  # The Multi30k anchor's shape: vocabulary 10,000, 8,192 target tokens, float32 on a CPU.
  config = ModelConfig.tiny(vocab_size=10_000)
  assert config.loss_chunk == 'auto' and config.dtype == 'auto'
  assert resolve_loss_chunk(config, 8192, 'cpu') == AUTO_LOSS_CHUNK
  # Not on a GPU or TPU, not in bfloat16, not below the logits' size, never over a number.
  assert resolve_loss_chunk(config, 8192, 'gpu') == resolve_loss_chunk(config, 8192, 'tpu') == 0
  assert resolve_loss_chunk(config.replace(dtype='bfloat16'), 8192, 'cpu') == 0
  below = AUTO_FUSED_LOSS_BYTES // (4 * config.vocab_size)  # the most tokens whose logits are under
  assert resolve_loss_chunk(config, below, 'cpu') == 0
  assert resolve_loss_chunk(config, below + 1, 'cpu') == AUTO_LOSS_CHUNK
  assert resolve_loss_chunk(config.replace(loss_chunk=256), 8192, 'gpu') == 256
  assert resolve_loss_chunk(config.replace(loss_chunk=0), 8192, 'cpu') == 0
  # One chunk's worth of tokens gains nothing from a loop of one.
  wide = config.replace(vocab_size=10**6)
  assert resolve_loss_chunk(wide, AUTO_LOSS_CHUNK, 'cpu') == 0


def test_the_step_fuses_its_loss_over_the_chunk_auto_resolves_to(monkeypatch, single, setup):
  """train_step asks `resolve_loss_chunk` with its batch's tokens, and fuses over what it says."""
  from flax_transformer.nn import backend
  from flax_transformer.train import step as step_module

  chunks = []

  def recording(*args):
    chunks.append(args[-1])
    return fused_loss_sums(*args)

  monkeypatch.setattr(step_module, 'fused_loss_sums', recording)
  _, optimizer, _, initial = setup
  batch = single.shard_batch(random_copy_batch(np.random.default_rng(9), ROWS, LENGTH, WORDS))
  auto_step = make_parallel_step(Transformer(CONFIG), optimizer, TRAIN_CONFIG, single)
  jax.eval_shape(auto_step, single.replicate(initial), batch)
  assert chunks == []  # the tiny model's logits are far below the size auto fuses at
  monkeypatch.setattr(backend, 'AUTO_FUSED_LOSS_BYTES', 1)
  monkeypatch.setattr(backend, 'AUTO_LOSS_CHUNK', 24)
  auto_step = make_parallel_step(Transformer(CONFIG), optimizer, TRAIN_CONFIG, single)
  jax.eval_shape(auto_step, single.replicate(initial), batch)
  assert chunks == ([24] if jax.default_backend() == 'cpu' and ROWS * LENGTH > 24 else [])


@pytest.mark.parametrize('chunk', [4, 7, 64])
def test_fused_loss_sums_and_gradients_equal_a_float64_reference(chunk):
  rng = np.random.default_rng(chunk)
  rows, length, width, vocab, eps, scale = 3, 5, 8, 11, 0.1, 0.7
  embedding = rng.normal(size=(vocab, width)).astype(np.float32)
  states = rng.normal(size=(rows, length, width)).astype(np.float32)
  targets = rng.integers(1, vocab, size=(rows, length))
  targets[0, -2:] = PAD
  project = lambda params, h: h @ params['embedding'].T * scale

  def loss(params, h):
    return fused_loss_sums(project, params, h, targets, eps, PAD, chunk)['loss_sum']

  sums = fused_loss_sums(project, {'embedding': embedding}, states, targets, eps, PAD, chunk)
  d_params, d_states = jax.grad(loss, argnums=(0, 1))({'embedding': embedding}, states)
  # float64: logits, the smoothed target's loss, and d loss / d logits = softmax - q at non-PAD.
  h, e = states.astype(np.float64), embedding.astype(np.float64)
  logits = h @ e.T * scale
  want_loss, count = reference_smoothed_ce(logits, targets, eps, PAD)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  q = np.full(logits.shape, eps / vocab)
  np.put_along_axis(q, targets[..., None], 1 - eps + eps / vocab, axis=-1)
  d_logits = (p - q) * (targets != PAD)[..., None]
  np.testing.assert_allclose(float(sums['loss_sum']), want_loss, rtol=1e-6)
  assert float(sums['tokens']) == count
  np.testing.assert_allclose(d_states, d_logits @ e * scale, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    d_params['embedding'], np.einsum('btv,btd->vd', d_logits, h) * scale, rtol=1e-5, atol=1e-6
  )


def test_gradient_accumulation_equals_one_large_batch(single, setup):
  """K=2 micro-batches with equal token counts update like one step on both at once.

  MultiSteps averages per-micro-batch mean gradients; with equal token counts
  that is the per-token mean over both, so the updates agree to float32 rounding.
  """
  model, optimizer, step, initial = setup
  rng = np.random.default_rng(7)
  first, second = (random_copy_batch(rng, ROWS // 2, LENGTH, WORDS) for _ in range(2))
  second = second.replace(tgt_in=first.tgt_in, tgt_out=first.tgt_out)  # same token count
  state, _ = step(single.replicate(initial), single.shard_batch(concat(first, second)))
  one_batch = flat(single.unreplicate(state).params)

  config = TRAIN_CONFIG.replace(grad_accum_steps=2)
  accumulating = make_optimizer(config, CONFIG)
  accumulate_step = make_parallel_step(model, accumulating, config, single)
  state = single.replicate(fresh_state(accumulating, initial.params))
  state, _ = accumulate_step(state, single.shard_batch(first))
  middle = flat(single.unreplicate(state).params)
  before = flat(initial.params)
  assert all(np.array_equal(middle[name], before[name]) for name in before)  # only accumulated
  state, _ = accumulate_step(state, single.shard_batch(second))
  two_batches = flat(single.unreplicate(state).params)
  assert one_batch.keys() == two_batches.keys()
  for name in one_batch:
    np.testing.assert_allclose(
      two_batches[name], one_batch[name], rtol=1e-5, atol=1e-6, err_msg=name
    )


def test_clipping_and_weight_decay_options():
  """Clipping caps the update's input; decoupled decay shrinks matrices but not biases."""
  params = {'dense': {'kernel': jnp.ones((3, 3)), 'bias': jnp.ones((3,))}}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  config = TrainConfig(warmup_steps=1, weight_decay=0.5)
  optimizer = make_optimizer(config, CONFIG)
  updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
  lr = float(transformer_schedule(CONFIG.d_model, 1)(0))
  np.testing.assert_allclose(updates['dense']['kernel'], -lr * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(updates['dense']['bias'], 0.0)

  clipped = make_optimizer(TrainConfig(warmup_steps=1, max_grad_norm=1e-3, adam_eps=1.0), CONFIG)
  plain = make_optimizer(TrainConfig(warmup_steps=1, adam_eps=1.0), CONFIG)
  big = jax.tree.map(lambda p: 10 * jnp.ones_like(p), params)
  norm = float(optax.tree.norm(big))
  step_clipped, _ = clipped.update(big, clipped.init(params), params)
  step_plain, _ = plain.update(big, plain.init(params), params)
  # With eps = 1 Adam's first update is -lr * g / (|g| + 1): tiny for a clipped g.
  scale = 1e-3 / norm
  np.testing.assert_allclose(
    step_clipped['dense']['kernel'], -lr * 10 * scale / (10 * scale + 1), rtol=1e-5
  )
  np.testing.assert_allclose(step_plain['dense']['kernel'], -lr * 10 / 11, rtol=1e-5)


def test_bfloat16_compute_keeps_float32_parameters_and_loss(single, setup):
  _, optimizer, _, initial = setup
  config = CONFIG.replace(dtype='bfloat16')
  step = make_parallel_step(Transformer(config), optimizer, TRAIN_CONFIG, single)
  batch = random_copy_batch(np.random.default_rng(2), ROWS, LENGTH, WORDS)
  state, metrics = step(single.replicate(initial), single.shard_batch(batch))
  state, metrics = single.unreplicate(state), single.unreplicate(metrics)
  assert all(x.dtype == np.float32 for x in jax.tree.leaves(state.params))
  assert metrics['loss_sum'].dtype == np.float32
  # The same parameters in float32 compute: the bf16 loss agrees to bf16 precision.
  f32_logits = Transformer(CONFIG).apply({'params': initial.params}, batch.src, batch.tgt_in)
  want, _ = reference_smoothed_ce(f32_logits, batch.tgt_out, 0.1, PAD)
  np.testing.assert_allclose(float(metrics['loss_sum']), want, rtol=2e-2)
