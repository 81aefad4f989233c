"""Restricted self-attention computed as a band: equal to the masked full form and to a NumPy
float64 reference, forward and gradient; in the model's encoder, decoder and cached decoding;
and from the command line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ModelConfig, Transformer
from flax_transformer.cli import decode as decode_cli
from flax_transformer.cli import train as train_cli
from flax_transformer.nn import attention, masks
from flax_transformer.nn.attention import banded_attention, scaled_dot_product_attention
from support.script_calls import call

# (length, radius, causal): lengths not a multiple of r, r = 0, and r beyond the length.
CASES = [(13, 3, False), (11, 3, True), (9, 0, False), (7, 5, True)]


def reference_band_mask(length, radius, causal, key_padding):
  """bool [B, 1, T, T] from the definition, |i - j| <= r, j <= i if causal, keys not PAD."""
  i, j = np.arange(length)[:, None], np.arange(length)[None, :]
  visible = (np.abs(i - j) <= radius) & ((j <= i) | (not causal))
  return visible[None, None] & key_padding[:, None, None, :]


def reference_forward_and_grad(q, k, v, mask, cotangent):
  """Attention and the gradients of sum(out * cotangent) w.r.t. q, k, v, in float64 by hand."""
  q, k, v, g = (np.asarray(x, np.float64).transpose(0, 2, 1, 3) for x in (q, k, v, cotangent))
  scale = q.shape[-1] ** -0.5
  logits = np.where(mask, q @ k.swapaxes(-1, -2) * scale, -np.inf)  # [B, N, T, S]
  row_max = np.max(logits, axis=-1, keepdims=True)
  exp = np.where(mask, np.exp(logits - np.where(np.isfinite(row_max), row_max, 0.0)), 0.0)
  total = exp.sum(-1, keepdims=True)
  weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
  d_weights = g @ v.swapaxes(-1, -2)
  d_logits = weights * (d_weights - np.sum(d_weights * weights, -1, keepdims=True))
  back = lambda x: x.transpose(0, 2, 1, 3)
  return back(weights @ v), (
    back(d_logits @ k * scale),
    back(d_logits.swapaxes(-1, -2) @ q * scale),
    back(weights.swapaxes(-1, -2) @ g),
  )


def random_inputs(length, seed=0):
  rng = np.random.default_rng(seed)
  q, k, v, cotangent = (rng.normal(size=(3, length, 2, 8)).astype(np.float32) for _ in range(4))
  key_padding = np.ones((3, length), bool)
  key_padding[1, length - 4 :] = False  # a padded sentence
  key_padding[2, :] = False  # an all-PAD row: every query sees nothing
  return q, k, v, cotangent, key_padding


def test_band_as_a_dense_mask():
  """Radius 1, causal, the last key PAD; and one cached query at position 2 of 5 slots."""
  band = masks.Band(key_padding=jnp.array([[True, True, True, False]]), radius=1, causal=True)
  np.testing.assert_array_equal(
    band.dense(4)[0, 0], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 0]]
  )
  step = masks.Band(offset=2, radius=1, causal=True)
  np.testing.assert_array_equal(step.dense(1, 5)[0, 0], [[0, 1, 1, 0, 0]])


@pytest.mark.parametrize('length,radius,causal', CASES)
def test_band_equals_masked_attention_and_float64_reference(length, radius, causal):
  q, k, v, cotangent, key_padding = random_inputs(length)
  mask = reference_band_mask(length, radius, causal, key_padding)

  def loss(attend):
    return lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent)

  banded = lambda q, k, v: banded_attention(q, k, v, radius, causal=causal, key_padding=key_padding)
  masked = lambda q, k, v: scaled_dot_product_attention(q, k, v, mask)[0]
  grads = {
    name: jax.jit(jax.grad(loss(f), argnums=(0, 1, 2)))
    for name, f in [('banded', banded), ('masked', masked)]
  }
  want_out, want_grads = reference_forward_and_grad(q, k, v, mask, cotangent)

  out = jax.jit(banded)(q, k, v)
  np.testing.assert_allclose(out, jax.jit(masked)(q, k, v), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(out)[2] == 0.0)  # the all-PAD row: zeros, not NaN
  for got, masked_grad, want in zip(grads['banded'](q, k, v), grads['masked'](q, k, v), want_grads):
    np.testing.assert_allclose(got, masked_grad, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_band_scores_only_the_neighbour_blocks():
  """The point of the band: a length-64 sequence at r = 4 scores 16 blocks x 4 x 12 keys, not 64^2."""
  q, k, v, _, key_padding = random_inputs(64)
  band = masks.Band(key_padding=key_padding, radius=4)
  jaxpr = jax.make_jaxpr(
    lambda q, k, v: attention._band_attention(
      q, attention._heads_first(k), attention._heads_first(v), band
    )
  )(q, k, v)
  shapes = {tuple(var.aval.shape) for eqn in jaxpr.eqns for var in eqn.outvars}
  assert (3, 2, 16, 4, 12) in shapes
  assert not any(len(s) == 4 and s[-2:] == (64, 64) for s in shapes)


def test_attention_dropout_acts_on_the_band_weights():
  """A weights_fn (attention dropout) sees the band weights and changes the output as on the full form."""
  q, k, v, _, key_padding = random_inputs(13)
  band = masks.Band(key_padding=key_padding, radius=2)
  heads_first = attention._heads_first
  doubled = attention._banded_attention(q, heads_first(k), heads_first(v), band, lambda w: 2 * w)
  full = scaled_dot_product_attention(q, k, v, reference_band_mask(13, 2, False, key_padding))[0]
  np.testing.assert_allclose(doubled, 2 * np.asarray(full), atol=1e-5, rtol=1e-5)


# --- in the model ----------------------------------------------------------------------------

CONFIG = ModelConfig.tiny(
  dropout_rate=0.0,
  attention_radius=2,
  d_model=32,
  d_ff=64,
  num_encoder_layers=2,
  num_decoder_layers=1,
)
SRC = jnp.array([[5, 9, 12, 7, 8, 10, 11, 4, 6, 13, 14, 2], [5, 9, 12, 7, 2, 0, 0, 0, 0, 0, 0, 0]])
TGT = jnp.array([[1, 8, 13, 6, 9, 10, 15, 16, 17, 18, 19], [1, 8, 13, 6, 9, 0, 0, 0, 0, 0, 0]])


@pytest.fixture(scope='module')
def restricted():
  model = Transformer(CONFIG)
  return model, jax.jit(model.init)(jax.random.key(0), SRC, TGT)


def test_model_band_equals_its_masked_form(restricted):
  """Asked for the attention weights, the model materializes the mask: the two paths agree."""
  model, variables = restricted
  banded = jax.jit(model.apply)(variables, SRC, TGT)
  masked, _ = jax.jit(lambda src, tgt: model.apply(variables, src, tgt, mutable=['intermediates']))(
    SRC, TGT
  )
  np.testing.assert_allclose(banded, masked, atol=1e-5, rtol=1e-5)


def test_restricted_encoder_reaches_exactly_layers_times_radius(restricted):
  """With L = 2 layers of radius 2, encoder position 0 depends on positions 0..4 and no further."""
  model, variables = restricted
  assert CONFIG.num_encoder_layers * CONFIG.attention_radius == 4
  encode = jax.jit(lambda src: model.apply(variables, src, method=Transformer.encode))
  base = encode(SRC)
  for position, reaches in [(4, True), (5, False), (9, False)]:
    altered = encode(SRC.at[0, position].set(20))
    change = np.abs(np.asarray(altered - base))[0, 0].max()
    assert (change > 1e-4) if reaches else (change == 0.0), (position, change)


@pytest.mark.parametrize('chunk', [1, 3])
def test_cached_band_decoding_equals_the_full_pass(restricted, chunk):
  """Steps of 1 and of 3 tokens on a 16-slot cache read only r + T slots; logits as the full pass."""
  model, variables = restricted
  full = model.apply(variables, SRC, TGT)
  cache = model.apply(variables, SRC, 16, method=Transformer.start_decoding)
  step = jax.jit(
    lambda tokens, cache, position: model.apply(
      variables, tokens, cache, position, method=Transformer.decode_step
    )
  )
  for position in range(0, 9, chunk):
    logits, cache = step(TGT[:, position : position + chunk], cache, position)
    np.testing.assert_allclose(
      logits[0], full[0, position : position + chunk], atol=1e-5, rtol=1e-5
    )


# --- from the command line -------------------------------------------------------------------

TINY = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--model.max_len=16',
  '--data.vocab_size=256',
  '--train.max_tokens=256',
  '--train.warmup_steps=4',
]


# A random model's translations run to the output budget, which max_len caps.
@pytest.mark.filterwarnings('ignore:source length .* output capped')
def test_cli_trains_and_decodes_with_attention_radius(numbers_corpus, tmp_path, monkeypatch):
  workdir = tmp_path / 'run'
  status, _, err = call(
    train_cli.main,
    [
      *TINY,
      '--model.attention_radius',
      '2',
      '--data',
      numbers_corpus,
      '--steps=2',
      '--workdir',
      workdir,
    ],
  )
  assert status == 0, err
  assert json.loads((workdir / 'config.json').read_text())['model']['attention_radius'] == 2
  traced = []
  band_attention = attention._band_attention
  monkeypatch.setattr(
    attention,
    '_band_attention',
    lambda q, k, v, band, *rest: traced.append(band.radius) or band_attention(q, k, v, band, *rest),
  )
  status, out, err = call(
    decode_cli.main, ['--checkpoint', workdir, '--method', 'greedy', 'twenty-two']
  )
  assert status == 0 and out.count('\n') == 1, err  # one translation line (a 2-step model's)
  assert traced and set(traced) == {2}
