"""Scaled dot-product attention against a NumPy float64 reference, and positional encodings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import MultiHeadAttention, scaled_dot_product_attention, sinusoidal_positions


def reference_attention(q, k, v, mask):
  """softmax(QK^T / sqrt(d)) V in float64, with masked keys removed from each row's softmax."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  mask = np.broadcast_to(np.asarray(mask), logits.shape)
  logits = np.where(mask, logits, -np.inf)
  row_max = np.max(logits, axis=-1, keepdims=True)
  row_max = np.where(np.isfinite(row_max), row_max, 0.0)
  exp = np.where(mask, np.exp(logits - row_max), 0.0)
  total = exp.sum(-1, keepdims=True)
  weights = np.divide(exp, total, out=np.zeros_like(exp), where=total > 0)
  return np.einsum('bnts,bsnh->btnh', weights, v), weights


def reference_attention_grads(q, k, v, mask, cotangent):
  """float64 (dq, dk, dv) of sum(reference_attention(q, k, v, mask)[0] * cotangent)."""
  q, k, v, g = (np.asarray(x, np.float64) for x in (q, k, v, cotangent))
  scale = 1.0 / np.sqrt(q.shape[-1])
  _, weights = reference_attention(q, k, v, mask)  # [B, N, T, S]
  dv = np.einsum('bnts,btnh->bsnh', weights, g)
  dweights = np.einsum('btnh,bsnh->bnts', g, v)
  # Softmax backward; masked keys have weight 0, so their logits get no gradient.
  dlogits = weights * (dweights - (weights * dweights).sum(-1, keepdims=True))
  dq = np.einsum('bnts,bsnh->btnh', dlogits, k) * scale
  dk = np.einsum('bnts,btnh->bsnh', dlogits, q) * scale
  return dq, dk, dv


@pytest.fixture
def qkv_and_mask():
  rng = np.random.default_rng(0)
  q = rng.normal(size=(3, 5, 2, 8)).astype(np.float32)
  k = rng.normal(size=(3, 7, 2, 8)).astype(np.float32)
  v = rng.normal(size=(3, 7, 2, 8)).astype(np.float32)
  mask = rng.random((3, 2, 5, 7)) < 0.6
  mask[0, 1, 2, :] = False  # one fully masked row
  return q, k, v, mask


def test_matches_float64_reference(qkv_and_mask):
  q, k, v, mask = qkv_and_mask
  out, weights = scaled_dot_product_attention(q, k, v, mask)
  want_out, want_weights = reference_attention(q, k, v, mask)
  assert out.shape == (3, 5, 2, 8) and weights.shape == (3, 2, 5, 7)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-7)


def test_without_mask_matches_reference(qkv_and_mask):
  q, k, v, _ = qkv_and_mask
  out, _ = scaled_dot_product_attention(q, k, v)
  np.testing.assert_allclose(out, reference_attention(q, k, v, True)[0], rtol=1e-5, atol=1e-6)


def test_weights_sum_to_one_and_masked_keys_get_exactly_zero(qkv_and_mask):
  q, k, v, mask = qkv_and_mask
  _, weights = scaled_dot_product_attention(q, k, v, mask)
  weights = np.asarray(weights)
  assert np.all(weights[~mask] == 0.0)
  has_key = mask.any(-1)
  np.testing.assert_allclose(weights.sum(-1)[has_key], 1.0, rtol=1e-6)


@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_fully_masked_row_gives_zeros_not_nan(qkv_and_mask, dtype):
  q, k, v, mask = qkv_and_mask
  out, weights = scaled_dot_product_attention(
    q.astype(dtype), k.astype(dtype), v.astype(dtype), mask
  )
  assert out.dtype == dtype
  assert bool(jnp.all(jnp.isfinite(out.astype(jnp.float32))))
  np.testing.assert_array_equal(np.asarray(out[0, 2, 1], np.float32), 0.0)
  np.testing.assert_array_equal(weights[0, 1, 2], 0.0)


def test_bfloat16_inputs_are_scored_in_float32():
  # bfloat16 q and k: their products are exact in float32 and summed there, so the weights are
  # float32 and equal the float64 softmax of the same (bfloat16) inputs to float32 precision.
  # Head dim 16: the 1/sqrt(16) scale is exact in bfloat16 too. Logits rounded to bfloat16
  # (2^-9 relative, up to ~0.006 on these logits of up to ~3) would move the weights by ~1e-3.
  rng = np.random.default_rng(3)
  q, k, v = (
    jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    for shape in ((2, 6, 2, 16), (2, 9, 2, 16), (2, 9, 2, 16))
  )
  mask = rng.random((2, 2, 6, 9)) < 0.7
  mask[..., 0] = True
  out, weights = scaled_dot_product_attention(q, k, v, mask)
  assert out.dtype == jnp.bfloat16 and weights.dtype == jnp.float32
  want_out, want_weights = reference_attention(
    *(np.asarray(x, np.float64) for x in (q, k, v)), mask
  )
  np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-6)
  # The output rounds the weights and itself to bfloat16: a half-ulp is 0.004 on its values of
  # 1..2 (0.005 off here).
  np.testing.assert_allclose(np.asarray(out, np.float64), want_out, rtol=0, atol=1e-2)


def test_jit_vmap_grad(qkv_and_mask):
  q, k, v, mask = qkv_and_mask
  eager, _ = scaled_dot_product_attention(q, k, v, mask)
  # Compiled and eager float32 may sum in another order (XLA's CPU kernels differ with the
  # instruction set: on an AVX2-only CPU 9 of 240 outputs moved by up to 9e-8), so compare
  # to a few float32 ulps of these O(1) outputs, far below what a wrong mask or scale moves.
  np.testing.assert_allclose(
    jax.jit(scaled_dot_product_attention)(q, k, v, mask)[0], eager, rtol=1e-5, atol=1e-6
  )
  per_example = jax.vmap(lambda *a: scaled_dot_product_attention(*(x[None] for x in a))[0][0])
  np.testing.assert_allclose(per_example(q, k, v, mask), eager, rtol=1e-5, atol=1e-7)
  # A random cotangent: with sum() alone, dL/dweights would be the same for every query.
  cotangent = np.random.default_rng(1).normal(size=eager.shape)
  grads = jax.grad(
    lambda q, k, v: (
      scaled_dot_product_attention(q, k, v, mask)[0] * cotangent.astype(np.float32)
    ).sum(),
    argnums=(0, 1, 2),
  )(q, k, v)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
  # The values: the float64 gradient of softmax(QK^T / sqrt(d)) V, itself checked against a
  # central finite difference of the float64 reference. Gradients are O(1); float32 through
  # the softmax stays within ~1e-6 of float64.
  want = reference_attention_grads(q, k, v, mask, cotangent)
  for name, got, expected in zip('qkv', grads, want):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=f'd{name}')
  directions = [np.random.default_rng(2 + i).normal(size=x.shape) for i, x in enumerate((q, k, v))]
  loss = lambda e: (
    reference_attention(
      *(np.asarray(x, np.float64) + e * d for x, d in zip((q, k, v), directions)), mask
    )[0]
    * cotangent
  ).sum()
  finite_difference = (loss(1e-5) - loss(-1e-5)) / 2e-5
  np.testing.assert_allclose(
    sum((g * d).sum() for g, d in zip(want, directions)), finite_difference, rtol=1e-6
  )
  # A masked key influences nothing: its gradient is exactly zero where no query may see it.
  unseen = ~mask.any(axis=(1, 2))  # [B, S]
  np.testing.assert_array_equal(np.asarray(grads[1])[unseen], 0.0)


@pytest.mark.parametrize('length, d_model', [(50, 16), (4096, 512), (300, 7)])
def test_sinusoidal_positions_match_the_formula(length, d_model):
  table = np.asarray(sinusoidal_positions(length, d_model))
  assert table.shape == (length, d_model) and table.dtype == np.float32
  # The formula in float64, written as the annotated Transformer does (exp of a log).
  pos = np.arange(length, dtype=np.float64)[:, None]
  frequency = np.exp(np.arange(0, d_model, 2) * -(np.log(10000.0) / d_model))[None, :]
  # float32 rounding of values in [-1, 1] is at most 6e-8; float32 angles were 1.6e-5 off at
  # position 249 (d_model 512) and 2.8e-4 by position 4095.
  np.testing.assert_allclose(table[:, 0::2], np.sin(pos * frequency), rtol=0, atol=1e-6)
  np.testing.assert_allclose(
    table[:, 1::2], np.cos(pos * frequency)[:, : d_model // 2], rtol=0, atol=1e-6
  )


@pytest.mark.parametrize('d_model', [16, 7])
def test_concatenated_positions_put_every_sine_before_every_cosine(d_model):
  # Marian's layout: columns j < ceil(D/2) are sin(pos / 10000^(2j/D)), the rest the cosines.
  length, half = 50, -(-d_model // 2)
  table = np.asarray(sinusoidal_positions(length, d_model, 'concatenated'), np.float64)
  angle = np.arange(length)[:, None] / np.power(10000.0, 2 * np.arange(half)[None, :] / d_model)
  assert table.shape == (length, d_model)
  np.testing.assert_allclose(table[:, :half], np.sin(angle), atol=2e-5)
  np.testing.assert_allclose(table[:, half:], np.cos(angle[:, : d_model // 2]), atol=2e-5)


def test_self_attention_is_permutation_equivariant_without_positions_only():
  d_model, length = 16, 6
  x = jax.random.normal(jax.random.key(1), (1, length, d_model))
  perm = np.array([3, 0, 5, 1, 4, 2])
  layer = MultiHeadAttention(num_heads=4, d_model=d_model)

  def self_attend(params, inputs):
    return layer.apply(params, inputs, method=lambda m, h: m(h, m.project_kv(h), None))

  params = layer.init(jax.random.key(0), x, method=lambda m, h: m(h, m.project_kv(h), None))
  out = self_attend(params, x)
  np.testing.assert_allclose(self_attend(params, x[:, perm]), out[:, perm], rtol=1e-5, atol=1e-6)

  positions = sinusoidal_positions(length, d_model)[None]
  with_positions = self_attend(params, x + positions)
  permuted_with_positions = self_attend(params, x[:, perm] + positions)
  assert np.abs(np.asarray(permuted_with_positions - with_positions[:, perm])).max() > 1e-2


def reference_multi_head(params, x, memory, heads):
  """Self-attention of x and cross-attention of x over memory, projections as separate float64
  products (the unfused layer), through `reference_attention`."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params['params'])
  split = lambda y: y.reshape(*y.shape[:-1], heads, -1)
  project = lambda name, y: y @ p[name]['kernel'] + p[name].get('bias', 0.0)
  attend = lambda q_in, kv_in: project(
    'out',
    reference_attention(
      split(project('query', q_in)),
      split(project('key', kv_in)),
      split(project('value', kv_in)),
      True,
    )[0].reshape(q_in.shape),
  )
  x, memory = np.asarray(x, np.float64), np.asarray(memory, np.float64)
  return attend(x, x), attend(x, memory)


@pytest.mark.parametrize('fuse', [True, False])
def test_projections_match_separate_float64_products(fuse):
  # project_qkv's one [D, 3D] product (fuse) or three against three float64 products.
  d_model, heads = 32, 4
  x = jax.random.normal(jax.random.key(1), (2, 5, d_model))
  memory = jax.random.normal(jax.random.key(2), (2, 7, d_model))
  layer = MultiHeadAttention(num_heads=heads, d_model=d_model)

  def both(m, x, memory):
    q, kv = m.project_qkv(x, fuse)
    return m.attend(q, kv, None), m(x, m.project_kv(memory), None)

  params = layer.init(jax.random.key(0), x, memory, method=both)
  params['params']['value']['bias'] = jax.random.normal(jax.random.key(3), (d_model,))
  params['params']['query']['bias'] = jax.random.normal(jax.random.key(4), (d_model,))
  # The parameters stay one layer each, as checkpoints and the Marian mapping have them.
  assert set(params['params']) == {'query', 'key', 'value', 'out'}
  assert 'bias' not in params['params']['key']
  self_out, cross_out = jax.jit(lambda p, x, m: layer.apply(p, x, m, method=both))(
    params, x, memory
  )
  want_self, want_cross = reference_multi_head(params, x, memory, heads)
  np.testing.assert_allclose(self_out, want_self, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(cross_out, want_cross, rtol=1e-5, atol=1e-6)


def test_fused_projections_give_each_kernel_its_own_gradient():
  # The split of the [D, 3D] product's gradient: each kernel's equals its own float64 x^T dy.
  d_model, heads = 16, 2
  x = jax.random.normal(jax.random.key(1), (2, 3, d_model))
  layer = MultiHeadAttention(num_heads=heads, d_model=d_model)
  project = lambda m, x: m.project_qkv(x, fuse=True)
  params = layer.init(jax.random.key(0), x, method=project)
  weights = [jax.random.normal(jax.random.key(i), (2, 3, heads, d_model // heads)) for i in (5, 6)]

  def loss(params):
    q, kv = layer.apply(params, x, method=project)
    # k, v `[B, N, T, H]` back to `[B, T, N, H]`
    return (q * weights[0]).sum() + (kv.k.transpose(0, 2, 1, 3) * weights[1]).sum() + kv.v.sum()

  grads = jax.grad(loss)(params)['params']
  x64 = np.asarray(x, np.float64).reshape(-1, d_model)
  dy = {'query': weights[0], 'key': weights[1], 'value': np.ones_like(weights[1])}
  for name, dy_name in dy.items():
    want = x64.T @ np.asarray(dy_name, np.float64).reshape(-1, d_model)
    np.testing.assert_allclose(grads[name]['kernel'], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('gain', [1.0, 2**-0.5])
def test_qkv_init_gain_scales_the_xavier_uniform_limit(gain):
  # Xavier-uniform over [D, D] draws from U(-a, a), a = gain * sqrt(6 / (D + D)): fairseq's
  # gain 1/sqrt(2) is Xavier over its fused [3D, D] in-projection. The output projection keeps
  # gain 1 in both.
  d_model = 128
  layer = MultiHeadAttention(num_heads=4, d_model=d_model, qkv_init_gain=gain)
  x = jnp.zeros((1, 3, d_model))
  params = layer.init(jax.random.key(0), x, method=lambda m, h: m(h, m.project_kv(h), None))
  limit = np.sqrt(6.0 / (2 * d_model))
  for name, expected in [('query', gain), ('key', gain), ('value', gain), ('out', 1.0)]:
    kernel = np.asarray(params['params'][name]['kernel'], np.float64)  # [D, D]
    assert np.abs(kernel).max() <= expected * limit * (1 + 1e-6), name
    # U(-a, a) has standard deviation a / sqrt(3); 16,384 draws put the estimate within 1.5%.
    np.testing.assert_allclose(kernel.std(), expected * limit / np.sqrt(3), rtol=0.03, err_msg=name)
