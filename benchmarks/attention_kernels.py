"""What each `model.attention_kernel` costs: one attention call, forward and backward, by length.

    python -m benchmarks.attention_kernels                 # this backend's kernels, ~1 minute
    python -m benchmarks.attention_kernels --lengths 64,256 --tokens 16384

For each sequence length L (a fixed number of tokens per batch, so rows = tokens / L), the
gradient of one causal self-attention over right-padded rows (random lengths, as a batch
bucket holds), `[rows, L, 8 heads, 64]`, through our einsum (`scaled_dot_product_attention`
on the dense mask), JAX's `xla` implementation and, on a GPU, cuDNN's fused kernel
(`fused_attention` on `masks.KeyLengths`); compute dtype float32 on a CPU, bfloat16 on a GPU,
as `model.dtype auto` picks. Medians of interleaved rounds after warm-up, and XLA's compiled
temporary memory. This is the measurement behind `auto`'s choice per backend (docs in
benchmarks/README.md). Writes benchmarks/results/attention_kernels_<backend>.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.common import RESULTS, accelerator_info, machine_info, write_json

HEADS, HEAD_DIM = 8, 64


def kernels_here() -> tuple[str, ...]:
  import jax

  return ('einsum', 'xla', 'cudnn') if jax.default_backend() == 'gpu' else ('einsum', 'xla')


def attention_gradient(kernel: str, rows: int, length: int, dtype: str):
  """(jitted d(sum(out * cotangent))/d(q, k, v), its arguments)."""
  import jax
  import jax.numpy as jnp

  from flax_transformer.nn import attention, masks

  keys = jax.random.split(jax.random.key(0), 4)
  q, k, v, cotangent = (
    jax.random.normal(key, (rows, length, HEADS, HEAD_DIM), dtype) for key in keys
  )
  lengths = jax.random.randint(jax.random.key(1), (rows,), length // 2, length + 1)
  mask = masks.KeyLengths(lengths.astype(jnp.int32), causal=True)

  def out(q, k, v):
    if kernel == 'einsum':
      return attention.scaled_dot_product_attention(q, k, v, mask.dense(length))[0]
    return attention.fused_attention(q, k, v, mask, kernel)

  def loss(q, k, v):
    return jnp.sum(out(q, k, v).astype(jnp.float32) * cotangent.astype(jnp.float32))

  return jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v)


def measure(lengths: list[int], tokens: int, rounds: int) -> list[dict]:
  import jax

  from flax_transformer import bench
  from flax_transformer.bench.compiled import compile_programs, memory_of

  dtype = 'bfloat16' if jax.default_backend() == 'gpu' else 'float32'
  rows_out = []
  for length in lengths:
    rows = max(tokens // length, 1)
    calls, temp = {}, {}
    for kernel in kernels_here():
      fn, args = attention_gradient(kernel, rows, length, dtype)
      (compiled,), _ = compile_programs(lambda: [fn.lower(*args)])
      temp[kernel] = memory_of([compiled]).temporaries
      calls[kernel] = lambda compiled=compiled, args=args: jax.block_until_ready(compiled(*args))
    times = bench.alternating_rounds(calls, rounds, warmup=2)
    row = {'length': length, 'rows': rows, 'dtype': dtype}
    for kernel in calls:
      row[f'{kernel}_ms'] = round(times[kernel].median_s * 1e3, 3)
      row[f'{kernel}_temp_mib'] = round(temp[kernel] / 2**20, 1)
    for kernel in calls:
      row[f'{kernel}_over_einsum'] = round(row[f'{kernel}_ms'] / row['einsum_ms'], 3)
    print(json.dumps(row), flush=True)
    rows_out.append(row)
  return rows_out


def main(argv=None) -> None:
  import jax

  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--lengths', default='32,64,128,256,512')
  parser.add_argument('--tokens', type=int, default=8192, help='tokens per batch (rows x L)')
  parser.add_argument('--rounds', type=int, default=7)
  parser.add_argument('--output', type=Path)
  args = parser.parse_args(argv)
  output = args.output or RESULTS / f'attention_kernels_{jax.default_backend()}.json'
  rows = measure([int(x) for x in args.lengths.split(',')], args.tokens, args.rounds)
  payload = {
    'machine': machine_info(os.cpu_count()),
    'accelerator': accelerator_info(),
    'heads': HEADS,
    'head_dim': HEAD_DIM,
    'tokens': args.tokens,
    'rows': rows,
  }
  print(f'wrote {write_json(output, payload)}')


if __name__ == '__main__':
  main()
