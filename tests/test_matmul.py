"""dense_dot: float32-accumulated products whose gradients are float64-exact in float32 and
whose backward matmuls really run in bfloat16 when the compute dtype is bfloat16."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer.nn.matmul import Dense, dense_dot

RNG = np.random.default_rng(0)
X = RNG.normal(size=(3, 5, 8)).astype(np.float32)  # [B, L, K]
KERNEL = RNG.normal(size=(8, 6)).astype(np.float32)  # [K, N]
COTANGENT = RNG.normal(size=(3, 5, 6)).astype(np.float32)


def reference(x, kernel, cotangent):
  """float64 y = x kernel and the gradients of sum(y * cotangent)."""
  x, kernel, cotangent = (np.asarray(a, np.float64) for a in (x, kernel, cotangent))
  return (x @ kernel, cotangent @ kernel.T, np.einsum('blk,bln->kn', x, cotangent))


def gradients(x, kernel, kernel_axis=0):
  def objective(x, kernel):
    return jnp.sum(dense_dot(x, kernel, kernel_axis) * COTANGENT)

  return jax.grad(objective, argnums=(0, 1))(x, kernel)


@pytest.mark.parametrize('kernel_axis', [0, 1])
def test_float32_matches_float64_reference(kernel_axis):
  kernel = KERNEL if kernel_axis == 0 else KERNEL.T.copy()  # [K, N] or [N, K]
  want_y, want_dx, want_dkernel = reference(X, KERNEL, COTANGENT)
  y = dense_dot(jnp.asarray(X), jnp.asarray(kernel), kernel_axis)
  dx, dkernel = gradients(jnp.asarray(X), jnp.asarray(kernel), kernel_axis)
  np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
    dkernel, want_dkernel if kernel_axis == 0 else want_dkernel.T, rtol=1e-5, atol=1e-5
  )


def test_bfloat16_results_and_gradient_dtypes():
  x = jnp.asarray(X, jnp.bfloat16)
  y = dense_dot(x, jnp.asarray(KERNEL))
  dx, dkernel = gradients(x, jnp.asarray(KERNEL))
  assert (y.dtype, dx.dtype, dkernel.dtype) == (jnp.float32, jnp.bfloat16, jnp.float32)
  # Operands rounded to bfloat16 (8 significant bits): relative error a few 2^-8.
  want_y, want_dx, want_dkernel = reference(X, KERNEL, COTANGENT)
  for got, want in ((y, want_y), (dx, want_dx), (dkernel, want_dkernel)):
    got = np.asarray(got, np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2


def test_bfloat16_backward_multiplies_in_bfloat16():
  """Every dot of forward + backward takes bf16 operands and accumulates in f32."""
  forward_and_backward = lambda x, kernel: (dense_dot(x, kernel), gradients(x, kernel))
  hlo = (
    jax.jit(forward_and_backward)
    .lower(jnp.asarray(X, jnp.bfloat16), jnp.asarray(KERNEL))
    .as_text(dialect='hlo')
  )
  shapes = dict(re.findall(r'^\s*(?:ROOT )?([\w.\-]+) = (\w+)\[', hlo, re.M))
  dots = re.findall(
    r'^\s*(?:ROOT )?[\w.\-]+ = (\w+)\[[\d,]*\]\S* dot\(([\w.\-]+), ([\w.\-]+)\)', hlo, re.M
  )
  assert len(dots) == 3  # y, dx, dkernel
  assert all((out, shapes[lhs], shapes[rhs]) == ('f32', 'bf16', 'bf16') for out, lhs, rhs in dots)


def test_dense_has_flax_dense_parameters_and_outputs():
  ours, theirs = (
    Dense(6, kernel_init=nn.initializers.xavier_uniform()),
    nn.Dense(6, kernel_init=nn.initializers.xavier_uniform()),
  )
  params = theirs.init(jax.random.key(0), X)
  assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), X)) == jax.tree.map(jnp.shape, params)
  np.testing.assert_allclose(ours.apply(params, X), theirs.apply(params, X), rtol=1e-6, atol=1e-6)
  assert Dense(6, dtype=jnp.bfloat16).apply(params, X).dtype == jnp.bfloat16


@pytest.mark.parametrize('kernel_axis', [0, 1])
def test_weight_gradient_contracts_flattened_rows(kernel_axis):
  """In float32 the kernel's gradient is one 2-D product over the flattened leading axes:
  contracting [B, L] of 3-D operands, XLA's CPU backend first copies the activations
  transposed. (bfloat16 keeps the 3-D contraction, which runs faster there.)"""
  kernel = KERNEL if kernel_axis == 0 else KERNEL.T.copy()
  hlo = jax.jit(lambda x, k: gradients(x, k, kernel_axis)).lower(X, kernel).as_text(dialect='hlo')
  dots = re.findall(r'= f32\[([\d,]*)\]\S* dot\(.*?lhs_contracting_dims=\{([\d,]*)\}', hlo)
  kernel_shape = ','.join(map(str, kernel.shape))
  assert [contracting for shape, contracting in dots if shape == kernel_shape] == ['0']
