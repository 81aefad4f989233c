"""A step's matmul bound: its matrix products, each compiled and timed alone on this host, summed.

A training step cannot run faster than its matrix multiplications do on their own, so the sum
of their times is a floor for the step, and the step's time as a multiple of it says how much
of the step is everything else (the softmax over the vocabulary, layer norms, dropout masks,
the optimizer, layout changes, the host's dispatch):

    bound = matmul_bound(step.run_fn, step.args)       # traced, not run
    bound.seconds, bound.table()                       # the floor, and the products by time
    report.time_s / bound.seconds                      # the step as a multiple of it

The products are read from the step's jaxpr (forward and backward, per device inside
`shard_map`), every `dot_general` with its operands' shapes and dtypes, its dimension numbers,
precision and output dtype, counted (a `scan` body as many times as it runs). Each distinct
product is compiled alone on random operands and timed (the median of `rounds` calls after a
warm-up, less the dispatch of a call that does nearly nothing, which the step pays once); products that XLA would fuse with their neighbours are timed unfused, so the floor is
the products' own cost, not a promise of what fusion achieves.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jax_core

from flax_transformer.bench.timing import time_rounds


@dataclasses.dataclass(frozen=True)
class Product:
  """One matrix product of a step: `lax.dot_general(lhs, rhs, dimension_numbers, ...)`."""

  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  dtype: str  # the operands' (the lhs's; a mixed product is timed with each as given)
  rhs_dtype: str
  dimension_numbers: tuple
  precision: object
  out_dtype: str | None

  @property
  def flops(self) -> int:
    """2 x the output's size x the contracted size."""
    (lhs_contract, _), (lhs_batch, _) = self.dimension_numbers
    contracted = int(np.prod([self.lhs[d] for d in lhs_contract], dtype=np.int64))
    return 2 * self.output_size() * contracted

  def output_size(self) -> int:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = self.dimension_numbers
    free_lhs = [n for d, n in enumerate(self.lhs) if d not in (*lhs_contract, *lhs_batch)]
    free_rhs = [n for d, n in enumerate(self.rhs) if d not in (*rhs_contract, *rhs_batch)]
    batch = [self.lhs[d] for d in lhs_batch]
    return int(np.prod([*batch, *free_lhs, *free_rhs], dtype=np.int64))

  def describe(self) -> str:
    """'[B,T,D] . [D,F] float32 (contract 2/0)', with the batch dimensions when there are any."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = self.dimension_numbers
    shape = lambda dims: 'x'.join(map(str, dims))
    dims = lambda ds: ','.join(map(str, ds))
    batch = f', batch {dims(lhs_batch)}/{dims(rhs_batch)}' if lhs_batch else ''
    return (
      f'[{shape(self.lhs)}] . [{shape(self.rhs)}] {self.dtype} '
      f'(contract {dims(lhs_contract)}/{dims(rhs_contract)}{batch})'
    )


@dataclasses.dataclass(frozen=True)
class MatmulBound:
  """The step's products, each with its count and the seconds of one call alone."""

  products: tuple[tuple[Product, int, float], ...]

  @property
  def seconds(self) -> float:
    return sum(count * seconds for _, count, seconds in self.products)

  @property
  def flops(self) -> int:
    return sum(count * product.flops for product, count, _ in self.products)

  def top(self, n: int = 8) -> list[tuple[Product, int, float]]:
    """The `n` products that take the most of the bound (count x time)."""
    return sorted(self.products, key=lambda p: -p[1] * p[2])[:n]

  def to_dict(self) -> dict:
    return {
      'seconds': self.seconds,
      'flops': self.flops,
      'products': [
        {
          'lhs': list(product.lhs),
          'rhs': list(product.rhs),
          'dtype': product.dtype,
          'count': count,
          'seconds_each': seconds,
          'flops_each': product.flops,
        }
        for product, count, seconds in self.top(len(self.products))
      ],
    }

  def table(self, n: int = 8) -> str:
    total = self.seconds or 1.0
    rate = lambda p, s: f'{p.flops / s / 1e9:7.1f} GFLOP/s' if s else '  within dispatch'
    rows = [
      f'{count:>4d} x {product.describe():<56s} {seconds * 1e3:9.3f} ms each, '
      f'{100 * count * seconds / total:5.1f}% of the bound, {rate(product, seconds)}'
      for product, count, seconds in self.top(n)
    ]
    return '\n'.join(rows)


def step_products(fn: Callable, *args) -> collections.Counter[Product]:
  """The matrix products `fn(*args)` computes, counted, from its jaxpr (nothing runs)."""
  counts: collections.Counter[Product] = collections.Counter()
  _collect(jax.make_jaxpr(fn)(*args).jaxpr, 1, counts)
  return counts


def _collect(jaxpr, times: int, counts: collections.Counter) -> None:
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      lhs, rhs = (v.aval for v in eqn.invars)
      (lc, rc), (lb, rb) = eqn.params['dimension_numbers']
      product = Product(
        lhs=tuple(lhs.shape),
        rhs=tuple(rhs.shape),
        dtype=str(lhs.dtype),
        rhs_dtype=str(rhs.dtype),
        dimension_numbers=((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))),
        precision=eqn.params.get('precision'),
        out_dtype=None
        if eqn.params.get('preferred_element_type') is None
        else str(np.dtype(eqn.params['preferred_element_type'])),
      )
      counts[product] += times
    repeat = eqn.params.get('length', 1) if eqn.primitive.name == 'scan' else 1
    for sub in jax_core.jaxprs_in_params(eqn.params):
      _collect(sub, times * repeat, counts)


def dispatch_seconds(rounds: int = 20) -> float:
  """The median seconds of calling a compiled program that does nearly nothing: what each
  product's time alone carries beyond its arithmetic (the step pays it once, not per product)."""
  nothing = jax.jit(lambda x: x + 1).lower(jnp.zeros((1,))).compile()
  x = jnp.zeros((1,))
  return time_rounds(lambda: nothing(x).block_until_ready(), rounds, 3).median_s


def time_product(product: Product, rounds: int = 5, warmup: int = 2) -> float:
  """The median seconds of one call of `product`, compiled alone, on random operands (the
  call's own dispatch included; `matmul_bound` takes it out)."""
  keys = jax.random.split(jax.random.key(0))
  lhs = jax.random.normal(keys[0], product.lhs).astype(product.dtype)
  rhs = jax.random.normal(keys[1], product.rhs).astype(product.rhs_dtype)
  dot = jax.jit(
    lambda a, b: lax.dot_general(
      a,
      b,
      product.dimension_numbers,
      precision=product.precision,
      preferred_element_type=None if product.out_dtype is None else jnp.dtype(product.out_dtype),
    )
  )
  compiled = dot.lower(lhs, rhs).compile()
  return time_rounds(lambda: compiled(lhs, rhs).block_until_ready(), rounds, warmup).median_s


def matmul_bound(fn: Callable, *args, rounds: int = 5) -> MatmulBound:
  """`fn(*args)`'s products (`step_products`), each timed alone (`time_product`)."""
  counts = step_products(fn, *args)
  dispatch = dispatch_seconds()
  return MatmulBound(
    tuple(
      (product, count, max(time_product(product, rounds) - dispatch, 0.0))
      for product, count in counts.items()
    )
  )
