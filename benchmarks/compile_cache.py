"""What JAX's persistent compilation cache saves a restart: compiling our training step
with an empty cache, then in a new process with the cache the first one wrote.

    python -m benchmarks.compile_cache [--model base] [--rows 85 --length 96] [--rounds 3]

Each round, in processes of their own (as train.py and its restart would be):

  cold  an empty cache directory (`cli.compilation_cache.enable`, as train.py sets it):
        trace, lower and compile train.py's step (`flax_transformer.bench.TrainingStep`) for one batch shape, then run one step;
  warm  a new process on the directory `cold` wrote: the same, so XLA's compilation is
        read from the cache (tracing and lowering still happen, as in any process).

Reported: seconds to a compiled step and the step itself, medians over rounds, and the
cache's counts of programs read and compiled. The default shape is the largest of the
base preset's buckets at 8,192 tokens (85 rows of 96 tokens), the batch the data-pipeline
benchmark trains with. Writes benchmarks/results/compile_cache.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS, machine_info, python_worker, write_json

WORKER = """
import json, sys
from flax_transformer.cli import compilation_cache
cache = compilation_cache.enable(sys.argv[1])
from benchmarks import workloads
from flax_transformer import bench
from flax_transformer.config import TrainConfig
step = bench.TrainingStep(workloads.model_config(sys.argv[2]), TrainConfig(),
                          bench.BatchShape(int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[4])),
                          devices=1)
report = step.report(bench.time_rounds(step.run, 1, warmup=0))
read, compiled = cache.counts()
print(json.dumps({'compile_s': report.compilation.seconds, 'step_s': report.timing.median_s,
                  'cache': report.compilation.cache, 'programs_read': read,
                  'programs_compiled': compiled}))
"""


def run_worker(cache_dir: str, args: argparse.Namespace) -> dict:
  return python_worker(WORKER, [cache_dir, args.model, args.rows, args.length])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--model', default='base')
  parser.add_argument('--rows', type=int, default=85)
  parser.add_argument('--length', type=int, default=96)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--output', type=Path, default=RESULTS / 'compile_cache.json')
  args = parser.parse_args(argv)
  runs = {'cold': [], 'warm': []}
  for round_index in range(args.rounds):
    with tempfile.TemporaryDirectory(prefix='compile-cache-') as cache_dir:
      for kind in ('cold', 'warm'):
        runs[kind].append(run_worker(cache_dir, args))
        print(f'round {round_index + 1} {kind}: {json.dumps(runs[kind][-1])}', flush=True)
  summary = {
    kind: {
      name: round(statistics.median(run[name] for run in rounds), 2)
      for name in ('compile_s', 'step_s')
    }
    | {
      'programs_read': rounds[-1]['programs_read'],
      'programs_compiled': rounds[-1]['programs_compiled'],
    }
    for kind, rounds in runs.items()
  }
  payload = {
    'benchmark': 'compile_cache',
    'machine': machine_info(os.cpu_count()),
    'model': args.model,
    'rows': args.rows,
    'length': args.length,
    'rounds': args.rounds,
    'summary': summary,
    'runs': runs,
    'compile_saved_s': round(summary['cold']['compile_s'] - summary['warm']['compile_s'], 2),
    'load_average_at_end': list(os.getloadavg()),
  }
  print(json.dumps(summary, indent=1))
  print(f'wrote {write_json(args.output, payload)}')


if __name__ == '__main__':
  main()
