"""Table 1's complexity per layer, measured: self-attention against restricted self-attention.

  python -m benchmarks.complexity [--quick] [--radius 64] [--lengths 128,256,...,16384]

One attention layer's core, softmax(Q K^T / sqrt(d)) V on given Q, K, V `[1, n, N, H]`
(the Q, K, V and output projections, O(n d^2) in every variant, are left out),
forward only, float32, batch 1, for n = 128 .. 16,384. Three contenders:
  full         `scaled_dot_product_attention`, no mask: the paper's self-attention
  full_masked  the same with the |i - j| <= r mask: what `attention_radius` cost before the band
  banded       `banded_attention(radius=r)`: only blocks of r against their neighbours
Time: median of 5 timed calls after one warm-up call (compilation excluded); the two
full forms in interleaved rounds, 3 of them at n >= 8,192, the banded one apart; wall
seconds and the process's CPU seconds.
Memory: XLA's own account of the compiled function (`memory_analysis()`): temporaries
+ arguments + outputs, the most it holds at once, not measured resident memory.
The default is one head of d = 256: at n = 16,384 the full scores `[n, n]` are 1 GiB
per head, and several heads would not fit beside the other jobs on a 23 GB machine.
Growth exponents are least-squares slopes of log(time) and log(memory) against log(n)
over n >= --fit-from, beside the paper's O(n^2 d) (exponent 2) and O(r n d) (1).
Results: benchmarks/results/complexity.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from flax_transformer.nn import masks
from flax_transformer.nn.attention import banded_attention, scaled_dot_product_attention

RESULTS = Path(__file__).resolve().parent / 'results'
LENGTHS = tuple(2**p for p in range(7, 15))  # 128 .. 16,384
PAPER_EXPONENTS = {'full': 2.0, 'full_masked': 2.0, 'banded': 1.0}


def contenders(length: int, radius: int) -> dict:
  """{name: attention function of (q, k, v) `[1, n, N, H]` -> `[1, n, N, H]`}."""
  window = masks.local_mask(length, radius)  # [1, 1, n, n]
  return {
    'full': lambda q, k, v: scaled_dot_product_attention(q, k, v)[0],
    'full_masked': lambda q, k, v: scaled_dot_product_attention(q, k, v, window)[0],
    'banded': lambda q, k, v: banded_attention(q, k, v, radius),
  }


def compiled_bytes(compiled) -> int:
  """Temporaries + arguments + outputs of a compiled function, as XLA accounts for them."""
  m = compiled.memory_analysis()
  return int(m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes)


def measure_length(length: int, radius: int, heads: int, head_dim: int, rounds: int) -> dict:
  """{name: {'median_s', 'min_s', 'times_s', 'bytes'}} for one sequence length.

  The two full forms are timed in interleaved rounds (`rounds_for`), the banded one apart
  with all `rounds`: it is cheap, and a few seconds' wait between its calls only let
  other jobs' load land on them.
  """
  q, k, v = (
    jax.random.normal(jax.random.key(i), (1, length, heads, head_dim), jnp.float32)
    for i in range(3)
  )
  compiled = {
    name: jax.jit(fn).lower(q, k, v).compile() for name, fn in contenders(length, radius).items()
  }
  run = {name: (lambda c=c: c(q, k, v).block_until_ready()) for name, c in compiled.items()}
  times = timed_rounds(
    {name: run[name] for name in ('full', 'full_masked')}, rounds_for(length, rounds)
  )
  times.update(timed_rounds({'banded': run['banded']}, rounds))
  return {name: {**times[name], 'bytes': compiled_bytes(c)} for name, c in compiled.items()}


def timed_rounds(contenders: dict, rounds: int) -> dict:
  """`common.interleaved_medians` (one warm-up call each), with the process's CPU seconds too.

  CPU seconds (all of XLA's threads) count the work done and not the time spent
  waiting for cores that other jobs hold: on a loaded machine they follow the
  complexity more closely than wall time does.
  """
  cpu = {name: [] for name in contenders}

  def counted(name, fn):
    def call():
      start = time.process_time()
      fn()
      cpu[name].append(time.process_time() - start)

    return call

  times = common.interleaved_medians(
    {name: counted(name, fn) for name, fn in contenders.items()}, rounds=rounds
  )
  return {
    name: {
      **times[name],
      'cpu_median_s': statistics.median(cpu[name][1:]),
      'cpu_s': [round(t, 6) for t in cpu[name][1:]],
    }
    for name in contenders
  }


def fit_exponent(lengths, values) -> float:
  """The slope p of log(value) = p log(n) + c, by least squares."""
  return float(np.polyfit(np.log(lengths), np.log(values), 1)[0])


def exponents(rows: list[dict], fit_from: int) -> dict:
  """{name: {'time', 'time_of_min', 'cpu_time', 'memory', 'paper': p}} over rows with n >= fit_from.

  'time' fits the wall-time medians, 'time_of_min' the fastest calls (the least disturbed
  by other jobs), 'cpu_time' the medians of the CPU seconds (`timed_rounds`).
  """
  fitted = [row for row in rows if row['length'] >= fit_from]
  lengths = [row['length'] for row in fitted]
  return {
    name: {
      'time': fit_exponent(lengths, [row[name]['median_s'] for row in fitted]),
      'time_of_min': fit_exponent(lengths, [row[name]['min_s'] for row in fitted]),
      'cpu_time': fit_exponent(lengths, [row[name]['cpu_median_s'] for row in fitted]),
      'memory': fit_exponent(lengths, [row[name]['bytes'] for row in fitted]),
      'paper': paper,
    }
    for name, paper in PAPER_EXPONENTS.items()
  }


def rounds_for(length: int, rounds: int) -> int:
  """Fewer rounds where a full call takes seconds (n >= 8,192 on two CPU cores)."""
  return rounds if length < 8192 else max(1, min(rounds, 3))


def print_table(rows: list[dict], fitted: dict) -> None:
  names = list(PAPER_EXPONENTS)
  print(f'{"n":>6} ' + ' '.join(f'{name + " ms":>15} {name + " MiB":>16}' for name in names))
  for row in rows:
    print(
      f'{row["length"]:>6} '
      + ' '.join(
        f'{row[n]["median_s"] * 1e3:>15.2f} {row[n]["bytes"] / 2**20:>16.1f}' for n in names
      )
    )
  for name, fit in fitted.items():
    print(
      f'{name}: time ~ n^{fit["time"]:.2f} (fastest calls: n^{fit["time_of_min"]:.2f}, CPU '
      f'seconds: n^{fit["cpu_time"]:.2f}), memory ~ n^{fit["memory"]:.2f} '
      f'(paper: n^{fit["paper"]:.0f})'
    )


def parse_args() -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.complexity',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--quick', action='store_true', help='n up to 2,048, 2 rounds')
  parser.add_argument(
    '--lengths', default=','.join(map(str, LENGTHS)), help='comma-separated sequence lengths n'
  )
  parser.add_argument('--radius', type=int, default=64, help='r of the restricted attention')
  parser.add_argument('--heads', type=int, default=1)
  parser.add_argument('--d-model', type=int, default=256, help='d = heads * head dim')
  parser.add_argument(
    '--rounds', type=int, default=5, help='timed rounds (at most 3 at n >= 8,192)'
  )
  parser.add_argument('--fit-from', type=int, default=1024, help='smallest n in the fits')
  parser.add_argument('--threads', type=int, help='cores to pin to (default all)')
  parser.add_argument(
    '--output', help='JSON file (default benchmarks/results/complexity[_quick].json)'
  )
  return parser.parse_args()


def main() -> None:
  args = parse_args()
  cores = common.pin_threads(args.threads)
  lengths = [int(n) for n in args.lengths.split(',')]
  if args.quick:
    lengths, args.rounds = [n for n in lengths if n <= 2048], 2
  if args.d_model % args.heads:
    raise SystemExit(f'--d-model={args.d_model} is not divisible by --heads={args.heads}')
  rows = []
  for length in lengths:
    rows.append(
      {
        'length': length,
        **measure_length(length, args.radius, args.heads, args.d_model // args.heads, args.rounds),
      }
    )
    print(
      f'n={length}: '
      + ', '.join(
        f'{name} {row["median_s"] * 1e3:.2f} ms'
        for name, row in rows[-1].items()
        if name != 'length'
      ),
      flush=True,
    )
  fit_from = args.fit_from if any(n >= args.fit_from for n in lengths) else min(lengths)
  fitted = exponents(rows, fit_from) if len({n for n in lengths if n >= fit_from}) > 1 else {}
  print_table(rows, fitted)
  output = (
    Path(args.output)
    if args.output
    else RESULTS / ('complexity_quick.json' if args.quick else 'complexity.json')
  )
  common.write_json(
    output,
    {
      'machine': common.machine_info(len(cores)),
      'accelerator': common.accelerator_info(),
      'settings': {
        'radius': args.radius,
        'heads': args.heads,
        'd_model': args.d_model,
        'batch': 1,
        'dtype': 'float32',
        'rounds': args.rounds,
        'fit_from': fit_from,
        'what': 'attention core (no projections), forward; bytes: XLA temp + arguments + outputs',
      },
      'rows': rows,
      'exponents': fitted,
    },
  )
  print(f'wrote {output}')


if __name__ == '__main__':
  main()
