"""What `model.remat` saves: the compiled training step's memory for each setting.

    python -m benchmarks.remat_memory [--model base] [--rows 390 --length 64] [--step]

For each of none, layer and dots, in a process of its own: trace, lower and compile the
training step (`flax_transformer.bench.TrainingStep`: train.py's step on one device) for one batch shape and
read XLA's `memory_analysis()`: temporaries (activations kept for the backward pass and
scratch), arguments, outputs. The default shape is the paper's batch: 390 rows of 64
tokens, 24,960 tokens per side (about 25,000), and its 37,000-piece vocabulary. `--step` also runs two steps and reports
the second's time and the process's peak RSS.

Beside it, `--minimal` measures the same question on a stack of 8 two-matmul layers
(4,096 x 512, hidden 2,048) written two ways, unrolled (as our layers are) and as a
`lax.scan`, with and without `jax.checkpoint`: what XLA's CPU compiler does with
rematerialisation, independent of this library. Writes
benchmarks/results/remat_memory.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from benchmarks.common import RESULTS, machine_info, python_worker, write_json

SETTINGS = ('none', 'layer', 'dots')

WORKER = """
import json, resource, sys
from benchmarks import workloads
from flax_transformer import bench
from flax_transformer.config import TrainConfig
config = workloads.model_config(sys.argv[1]).replace(remat=sys.argv[2], vocab_size=int(sys.argv[6]))
step = bench.TrainingStep(config, TrainConfig(),
                          bench.BatchShape(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[4])),
                          devices=1)
stepping = sys.argv[5] == 'step'
report = step.report(bench.time_rounds(step.run, 1, warmup=1) if stepping else bench.Timing((0.0,)))
memory = report.memory
result = {'compile_s': report.compilation.seconds, 'temp_bytes': memory.temporaries,
          'argument_bytes': memory.arguments, 'output_bytes': memory.outputs,
          'alias_bytes': memory.aliased}
if stepping:
  result['step_s'] = report.timing.median_s
  result['peak_rss_bytes'] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(result))
"""

MINIMAL = """
import json
import jax, jax.numpy as jnp
def layer(x, w):
  w1, w2 = w
  return x + jnp.tanh(jnp.tanh(x @ w1) @ w2)
x = jnp.ones((4096, 512))
weights = (jnp.ones((8, 512, 2048)), jnp.ones((8, 2048, 512)))
def unrolled(weights, fn):
  y = x
  for i in range(8):
    y = fn(y, (weights[0][i], weights[1][i]))
  return y.sum()
def scanned(weights, fn):
  return jax.lax.scan(lambda y, w: (fn(y, w), None), x, weights)[0].sum()
result = {}
for form, run in (('unrolled', unrolled), ('scan', scanned)):
  for remat, fn in (('none', layer), ('checkpoint', jax.checkpoint(layer))):
    compiled = jax.jit(jax.grad(lambda w: run(w, fn))).lower(weights).compile()
    result[f'{form}/{remat}'] = compiled.memory_analysis().temp_size_in_bytes
print(json.dumps(result))
"""


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='base')
  parser.add_argument('--rows', type=int, default=390)
  parser.add_argument('--length', type=int, default=64)
  parser.add_argument('--vocab', type=int, default=37_000, help="the base preset's")
  parser.add_argument('--settings', default=','.join(SETTINGS))
  parser.add_argument('--step', action='store_true', help='also time a step (second of two)')
  parser.add_argument('--minimal', action='store_true', help='also the 8-layer stack')
  parser.add_argument('--output', type=Path, default=RESULTS / 'remat_memory.json')
  args = parser.parse_args(argv)
  rows = {}
  for setting in args.settings.split(','):
    rows[setting] = python_worker(
      WORKER,
      [args.model, setting, args.rows, args.length, 'step' if args.step else 'compile', args.vocab],
    )
    print(setting, json.dumps(rows[setting]), flush=True)
  payload = {
    'machine': machine_info(os.cpu_count()),
    'model': args.model,
    'vocab': args.vocab,
    'shape': {'rows': args.rows, 'length': args.length, 'tokens_per_side': args.rows * args.length},
    'settings': rows,
  }
  if args.minimal:
    payload['minimal'] = python_worker(MINIMAL, [])
    print('minimal', json.dumps(payload['minimal']), flush=True)
  write_json(args.output, payload)
  print(f'wrote {args.output}')


if __name__ == '__main__':
  main()
