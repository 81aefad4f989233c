"""Dropout whose random mask is drawn once, from 16 random bits per element.

`nn.Dropout` draws 32 threefry bits per element and leaves the mask to XLA,
which on CPU fuses the whole random-number computation into every consumer of
the mask: the forward select and each backward use recompute it, so each
dropout site runs threefry several times a step. Here the mask is materialised once (`lax.optimization_barrier`) and kept
for the backward pass, from half as many random bits: each 32-bit word that
threefry makes gives two elements their 16 bits. (Asked for uint16 directly,
JAX draws a whole 32-bit word per element and drops half of it; on CPU, where
threefry runs as a rolled loop over the whole counter array, that doubles the
mask's cost.)

The keep probability is rounded to a multiple of 2^-16 (rate 0.1 keeps with
probability 58982 / 65536 = 0.899994), and kept values are scaled by the
inverse of that rounded probability, so E[dropout(x)] = x exactly.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

_BITS = 16


def keep_threshold(rate: float) -> int:
  """Elements whose 16 random bits are below this are kept: round((1 - rate) * 2^16)."""
  threshold = round((1.0 - rate) * 2**_BITS)
  if not 0.0 <= rate < 1.0 or threshold == 0:
    raise ValueError(f'dropout rate must be in [0, 1 - 2^-17), got {rate!r}')
  return threshold


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
  """Zeros each element of `x` with probability `rate` (to 2^-16), scales the rest by 1 / keep.

  Same shape and dtype as `x`. The mask is computed once and reused by the backward pass.
  """
  threshold = keep_threshold(rate)
  keep = _keep_mask(key, x.shape, threshold)
  keep = lax.optimization_barrier(keep)  # one mask, not threefry fused into every consumer
  scale = jnp.asarray(2**_BITS / threshold, x.dtype)
  return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


def _keep_mask(key: jax.Array, shape: tuple[int, ...], threshold: int) -> jax.Array:
  """bool `shape`: True where an element's 16 random bits are below `threshold`.

  Word i of ceil(size / 2) random 32-bit words gives its low 16 bits to element
  i of the flattened array and its high 16 bits to element ceil(size / 2) + i.
  """
  size = math.prod(shape)
  words = jax.random.bits(key, ((size + 1) // 2,), jnp.uint32)  # [ceil(size / 2)]
  halves = jnp.concatenate([words & 0xFFFF, words >> 16])[:size]  # [2 * ceil(size / 2)] -> [size]
  return (halves < threshold).reshape(shape)


class Dropout(nn.Module):
  """`nn.Dropout`'s interface (rate; deterministic at call time; 'dropout' rngs) on `dropout`."""

  rate: float

  @nn.compact
  def __call__(self, x: jax.Array, deterministic: bool) -> jax.Array:
    if deterministic or self.rate == 0.0:
      return x
    return dropout(x, self.rate, self.make_rng('dropout'))
