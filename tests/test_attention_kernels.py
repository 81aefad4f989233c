"""model.attention_kernel: `jax.nn.dot_product_attention` ('xla', 'cudnn') computes what our
einsum computes.

The einsum is the reference (itself checked against NumPy float64 in test_attention.py). On
this CPU, 'xla' runs beside it in float32: outputs and gradients agree to 1e-5 of the
largest, for padding, the look-ahead mask, cross-attention, a cached decoding step, remat,
and a shard_map training step. 'cudnn' needs a GPU: its test runs only where one is.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attention import reference_attention, reference_attention_grads

from flax_transformer import ModelConfig
from flax_transformer.config import ConfigError
from flax_transformer.nn import attention, masks
from flax_transformer.nn.backend import resolve_attention_kernel
from flax_transformer.nn.build import build_model
from support.device_workers import assert_runs_match, run_worker

SRC = jnp.array([[5, 9, 12, 7, 2, 0, 0], [4, 4, 8, 2, 0, 0, 0], [6, 2, 0, 0, 0, 0, 0]])
TGT = jnp.array([[1, 8, 13, 6, 2], [1, 7, 2, 0, 0], [1, 9, 10, 11, 2]])
CONFIG = ModelConfig.tiny(dropout_rate=0.0)


def assert_close_to_largest(got, expected, tolerance=1e-5):
  """Each leaf of `got` within `tolerance` times the largest magnitude of all of `expected`."""
  scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(expected))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=tolerance * scale), got, expected
  )


@pytest.fixture
def fused_calls(monkeypatch):
  """The masks each call of `attention.fused_attention` got, in order."""
  calls = []
  original = attention.fused_attention

  def spy(q, k, v, mask, implementation='xla'):
    calls.append((q.shape[1], k.shape[1], mask.causal, implementation))
    return original(q, k, v, mask, implementation)

  monkeypatch.setattr(attention, 'fused_attention', spy)
  return calls


# --- the pure function ------------------------------------------------------------------------


@pytest.mark.parametrize('causal, query_len', [(False, 5), (True, 7)], ids=['cross', 'causal'])
def test_fused_attention_matches_float64_and_einsum_with_its_gradients(causal, query_len):
  rng = np.random.default_rng(0)
  q = rng.normal(size=(3, query_len, 2, 8)).astype(np.float32)
  k, v = (rng.normal(size=(3, 7, 2, 8)).astype(np.float32) for _ in range(2))
  mask = masks.KeyLengths(jnp.array([7, 4, 1], jnp.int32), causal=causal)
  dense = np.asarray(mask.dense(query_len, 7))
  cotangent = rng.normal(size=q.shape).astype(np.float32)
  want = reference_attention(q, k, v, dense)[0]
  want_grads = reference_attention_grads(q, k, v, dense, cotangent)

  def fused(q, k, v):
    return attention.fused_attention(q, k, v, mask, 'xla')

  def einsum(q, k, v):
    return attention.scaled_dot_product_attention(q, k, v, mask.dense(query_len, 7))[0]

  for fn in (fused, einsum):
    out, pullback = jax.vjp(fn, q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(pullback(jnp.asarray(cotangent)), want_grads):
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_key_lengths_are_the_visible_prefix_and_an_empty_row_counts_one():
  visible = jnp.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], bool)
  lengths = masks.KeyLengths.of_visible(visible)
  np.testing.assert_array_equal(lengths.lengths, [3, 1, 1])
  np.testing.assert_array_equal(
    masks.KeyLengths.of_visible(visible[:, None, None, :]).lengths, [3, 1, 1]
  )
  dense = masks.KeyLengths(jnp.array([3, 1, 4]), causal=True).dense(4)
  assert dense.shape == (3, 1, 4, 4)
  np.testing.assert_array_equal(dense[0, 0], np.tril(np.ones((4, 4), bool)) & [1, 1, 1, 0])
  np.testing.assert_array_equal(dense[2, 0], np.tril(np.ones((4, 4), bool)))


# --- the model --------------------------------------------------------------------------------


def model_config(kind: str, bos_is_pad: bool) -> ModelConfig:
  return CONFIG.replace(kind=kind, **({'bos_id': 0} if bos_is_pad else {}))


@functools.cache
def initial_params(kind: str, bos_is_pad: bool):
  """The kernel does not change the parameters: one init serves both."""
  model = build_model(model_config(kind, bos_is_pad))
  return jax.jit(model.init)(jax.random.key(0), SRC, TGT)['params']


def logits_and_gradients(kernel: str, kind='autoregressive', remat='none', bos_is_pad=False):
  model = build_model(model_config(kind, bos_is_pad).replace(attention_kernel=kernel, remat=remat))
  tgt = TGT.at[:, 0].set(0) if bos_is_pad else TGT
  params = initial_params(kind, bos_is_pad)

  def loss(params):
    out = model.apply({'params': params}, SRC, tgt, train=True, rngs={'dropout': jax.random.key(1)})
    logits = out[0] if kind == 'cmlm' else out
    return jnp.sum(jnp.tanh(logits) * jnp.cos(jnp.arange(logits.size).reshape(logits.shape))), out

  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return out, grads


@pytest.mark.parametrize(
  'kind, remat, bos_is_pad',
  [
    ('autoregressive', 'none', False),
    ('autoregressive', 'layer', False),
    ('autoregressive', 'none', True),
    ('cmlm', 'none', False),
  ],
  ids=['post_ln', 'remat', 'bos_is_pad', 'cmlm'],
)
def test_xla_gives_the_outputs_and_gradients_of_einsum(kind, remat, bos_is_pad, fused_calls):
  initial_params(kind, bos_is_pad)
  fused_calls.clear()
  got = logits_and_gradients('xla', kind, remat, bos_is_pad)
  layers = CONFIG.num_encoder_layers + 2 * CONFIG.num_decoder_layers
  # Every attention of the pass took the fused kernel (the scan traces one layer per stack).
  assert len(fused_calls) == (3 if remat != 'none' else layers)
  assert {c[2] for c in fused_calls} == {False, kind == 'autoregressive'}
  expected = logits_and_gradients('einsum', kind, remat, bos_is_pad)
  assert_close_to_largest(got[0], expected[0])  # logits (and cmlm's length logits)
  assert_close_to_largest(got[1], expected[1])  # every parameter's gradient


def cached_step_logits(kernel: str, steps=4):
  """decode_step's logits `[B, steps, V]`, fed the teacher tokens TGT one at a time."""
  model = build_model(CONFIG.replace(attention_kernel=kernel))
  variables = {'params': initial_params('autoregressive', False)}
  cache = model.apply(variables, SRC, 8, method=model.start_decoding)
  step = jax.jit(functools.partial(model.apply, method=model.decode_step))
  logits = []
  for position in range(steps):
    step_logits, cache = step(variables, TGT[:, position : position + 1], cache, position)
    logits.append(step_logits[:, 0])
  return jnp.stack(logits, axis=1)


def test_a_cached_step_takes_the_kernel_asked_for_and_agrees(fused_calls):
  got = cached_step_logits('xla')
  # traced once: each decoder layer's self- and cross-attention, one query, no look-ahead mask
  assert [c[:3] for c in fused_calls[-4:]] == [(1, 8, False), (1, 7, False)] * 2
  assert_close_to_largest(got, cached_step_logits('einsum'))
  teacher_forced = build_model(CONFIG).apply(
    {'params': initial_params('autoregressive', False)}, SRC, TGT[:, :4]
  )
  # Where the fed token is not PAD: a cached step hides no token it was given.
  fed = np.asarray(TGT[:, :4] != 0)
  assert_close_to_largest(got[fed], teacher_forced[fed])


def test_auto_keeps_einsum_for_cached_steps_and_beams(monkeypatch, fused_calls):
  from flax_transformer.nn import layers
  from flax_transformer.nn import model as model_module

  # auto as it resolves on a GPU, with xla standing in for cuDNN on this CPU
  for module in (layers, model_module):
    monkeypatch.setattr(module, 'resolve_attention_kernel', lambda config: 'xla')
  model = build_model(CONFIG)
  variables = {'params': initial_params('autoregressive', False)}
  counts = []

  def passes():  # traced only (eval_shape): the spy counts what each pass would run
    model.apply(variables, SRC, TGT)
    counts.append(len(fused_calls))
    cache = model.apply(variables, SRC, 8, method=model.start_decoding)
    counts.append(len(fused_calls))
    model.apply(variables, TGT[:, :1], cache, 0, method=model.decode_step)
    beams = model.apply(variables, SRC, 8, 2, method=model.start_beam_decoding)
    model.apply(variables, jnp.ones((3, 2), jnp.int32), beams, 0, method=model.decode_beam_step)
    counts.append(len(fused_calls))

  fused_calls.clear()
  jax.eval_shape(passes)
  assert counts == [6, 8, 10]  # a whole sequence: the kernel, every attention
  # after the whole pass, only the encoders of the two starts: the steps keep einsum
  assert {c[:3] for c in fused_calls[6:]} == {(7, 7, False)}


def test_packed_rows_banded_attention_and_weights_keep_einsum(fused_calls):
  from flax_transformer.nn.model import attention_weights

  packing = masks.Packing(
    src_segments=(SRC != 0).astype(jnp.int32),
    tgt_segments=(TGT != 0).astype(jnp.int32),
    src_positions=jnp.broadcast_to(jnp.arange(7), SRC.shape) * (SRC != 0),
    tgt_positions=jnp.broadcast_to(jnp.arange(5), TGT.shape) * (TGT != 0),
  )
  model = build_model(CONFIG.replace(attention_kernel='xla'))
  variables = {'params': initial_params('autoregressive', False)}
  fused_calls.clear()
  jax.eval_shape(lambda: model.apply(variables, SRC, TGT, packing=packing))
  assert fused_calls == []
  weights_of = lambda model: jax.jit(functools.partial(attention_weights, model))(
    variables, SRC, TGT
  )
  weights = weights_of(model)  # the weights are asked for
  assert fused_calls == [] and len(weights) == 6
  assert_close_to_largest(weights, weights_of(build_model(CONFIG)))
  banded = build_model(CONFIG.replace(attention_kernel='xla', attention_radius=2))
  jax.eval_shape(lambda: banded.apply(variables, SRC, TGT))
  assert [c[2] for c in fused_calls] == [False, False]  # cross-attention only


# --- the setting ------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'settings, backend, expected',
  [
    ({}, 'cpu', 'einsum'),
    ({}, 'tpu', 'einsum'),
    ({}, 'gpu', 'cudnn'),
    ({'dtype': 'float32'}, 'gpu', 'einsum'),
    ({'d_model': 48}, 'gpu', 'einsum'),
    ({'attention_dropout_rate': 0.1}, 'gpu', 'einsum'),
    ({'attention_kernel': 'xla'}, 'cpu', 'xla'),
    ({'attention_kernel': 'einsum'}, 'gpu', 'einsum'),
    ({'attention_kernel': 'cudnn'}, 'gpu', 'cudnn'),
    ({'d_model': 1024, 'num_heads': 4}, 'gpu', 'einsum'),  # head_dim 256: Hopper only
    (
      {'d_model': 1024, 'num_heads': 4, 'attention_kernel': 'cudnn', 'dtype': 'bfloat16'},
      'gpu',
      'cudnn',
    ),
  ],
)
def test_auto_takes_cudnn_on_a_gpu_where_it_applies(settings, backend, expected):
  assert resolve_attention_kernel(ModelConfig.tiny(**settings), backend) == expected


@pytest.mark.parametrize(
  'capability, expected', [('9.0', 'cudnn'), ('8.0', 'cudnn'), ('7.5', 'einsum')]
)
def test_auto_takes_cudnn_on_ampere_and_later_only(monkeypatch, capability, expected):
  import types

  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  monkeypatch.setattr(
    jax, 'devices', lambda: [types.SimpleNamespace(compute_capability=capability)]
  )
  assert resolve_attention_kernel(ModelConfig.tiny()) == expected


@pytest.mark.parametrize(
  'settings, message',
  [
    ({'attention_kernel': 'cudnn', 'dtype': 'float32'}, 'not model.dtype=float32'),
    ({'attention_kernel': 'cudnn', 'd_model': 48}, 'a multiple of 8, got 12'),
    (
      {'attention_kernel': 'cudnn', 'd_model': 1056, 'num_heads': 4},
      'at most 256 and a multiple of 8, got 264',
    ),
    ({'attention_kernel': 'xla', 'attention_dropout_rate': 0.1}, 'has no attention dropout'),
  ],
)
def test_an_explicit_kernel_the_model_rules_out_is_refused(settings, message):
  with pytest.raises(ConfigError, match=message):
    ModelConfig.tiny(**settings)


def test_cudnn_without_a_gpu_is_refused_to_train_and_decodes_with_auto():
  from flax_transformer.decode.methods import Greedy
  from flax_transformer.decode.translator import Translator
  from flax_transformer.tokenizer import Tokenizer

  config = CONFIG.replace(attention_kernel='cudnn', dtype='bfloat16')
  with pytest.raises(ConfigError, match='cudnn needs a GPU'):
    build_model(config)
  if jax.default_backend() == 'gpu':
    pytest.skip('this host has a GPU: cudnn runs here')
  tokenizer = Tokenizer.train(['a b c d'] * 4, vocab_size=100)
  config = config.replace(vocab_size=tokenizer.vocab_size)
  tokens = jnp.ones((1, 4), jnp.int32)
  params = build_model(config.replace(attention_kernel='auto')).init(
    jax.random.key(0), tokens, tokens
  )['params']
  translator = Translator(config, params, tokenizer)
  assert translator.config.attention_kernel == 'auto'
  assert translator.config.dtype == 'bfloat16'
  assert isinstance(translator.translate(['a b'], Greedy())[0], str)


# --- data parallel ----------------------------------------------------------------------------

WORKER = r"""
import sys
import numpy as np
from support.device_workers import train_runs, uneven_batch
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.model import Transformer

out = sys.argv[1]
config = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
train_config = TrainConfig(steps=3, warmup_steps=4, lr_scale=4.0, adam_eps=1.0)

batch_at = lambda step: uneven_batch(config.vocab_size, step, length=10)

results = train_runs(Transformer(config), train_config, ['shard_map-1'], 3, batch_at)
fused = train_runs(Transformer(config.replace(attention_kernel='xla')), train_config,
                   ['shard_map-2'], 3, batch_at)
results.update({f'xla-{name}': value for name, value in fused.items()})
np.savez(out, **results)
"""


def test_a_shard_map_step_with_xla_trains_as_einsum_on_one_device(tmp_path):
  results = run_worker(WORKER, tmp_path / 'runs.npz', [], device_count=2)
  assert_runs_match(results, 'xla-shard_map-2', reference='shard_map-1')


# --- cuDNN, where a GPU is --------------------------------------------------------------------


@pytest.mark.skipif(
  jax.default_backend() != 'gpu',
  reason=f'cuDNN flash attention runs only on an NVIDIA GPU; this host has {jax.default_backend()}',
)
def test_cudnn_gives_the_bfloat16_outputs_and_gradients_of_einsum():
  config = ModelConfig.tiny(d_model=64, num_heads=4, dropout_rate=0.0, dtype='bfloat16')
  results = {}
  for kernel in ('einsum', 'cudnn'):
    model = build_model(config.replace(attention_kernel=kernel))
    params = model.init(jax.random.key(0), SRC, TGT)['params']
    loss = lambda p: jnp.mean(model.apply({'params': p}, SRC, TGT, train=True) ** 2)
    results[kernel] = jax.jit(jax.value_and_grad(loss))(params)
  # bfloat16 keeps 8 bits: the two kernels round their products differently
  assert_close_to_largest(results['cudnn'], results['einsum'], tolerance=2e-2)
