"""The input side at the paper's scale: raw text -> first training step, resume -> first step,
encoding rate, host batches per second and peak memory, on a WMT14-sized stand-in.

    python -m benchmarks.make_standin --pairs 4500000 --output /tmp/standin   # once, offline
    python -m benchmarks.data_pipeline --data /tmp/standin --workdir /tmp/dp-run

Stages, each in a process of its own (the programs are what a user runs):

  first_run  `train.py --preset base --data DATA --train.max_tokens 8192` in a fresh WORKDIR
             (the base model and its 37k vocabulary; a smaller batch than the paper's, which
             a 24 GB CPU host cannot hold), until its first training step is logged: the times at which the tokenizer, the encoded cache and the model
             were ready, and the peak RSS (VmHWM) when the training loop starts. Then SIGTERM:
             the run saves the step reached and exits, as a user's Ctrl-C would.
  resume     the same command again: it reads WORKDIR's tokenizer and cache and resumes from the
             saved step; time to its first step, peak RSS.
  batches    (in this process) host batches from the cache the first run wrote: real target
             tokens per second of `local_batch_at`, bucketed and packed (rows of 64, best
             fit), for one process (all rows) and per process of two (half the rows each), and
             the Python-loop builders of before (tests/support/loop_batches.py, the tests'
             oracles, on the same plans) beside them;
             medians of several rounds, after the epoch's plan is built.

Writes benchmarks/results/data_pipeline.json (or --output). The run directory stays for
inspection; delete it yourself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import RESULTS, machine_info, write_json

ROOT = Path(__file__).resolve().parent.parent
# Lines of train.py's log that mark a stage, and the name each gets.
MARKS = {
  'tokenizer: trained': 'tokenizer_ready_s',
  'cache: encoded': 'cache_written_s',
  'cache: hit': 'cache_read_s',
  'model:': 'training_loop_s',
}


def peak_rss_gb(pid: int) -> float | None:
  """VmHWM of a running process (Linux), in GB."""
  try:
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
      if line.startswith('VmHWM:'):
        return int(line.split()[1]) / 1e6
  except OSError:
    return None
  return None


def first_step(command: list[str], workdir: Path, timeout_s: float) -> dict:
  """Runs train.py until it logs a training step past the one it started from; then SIGTERM."""
  metrics = workdir / 'metrics.jsonl'
  logged_before = len(metrics.read_text().splitlines()) if metrics.exists() else 0
  started = time.perf_counter()
  # JAX's persistent compilation cache, which train.py keeps by default, in a directory of
  # the benchmark's own: the first run starts with it empty, the resumed run reads what the
  # first one compiled. Its new entries are the programs a run compiled.
  jax_cache = workdir.parent / f'{workdir.name}.jax-cache'
  entries_before = len(list(jax_cache.glob('*-cache')))
  environment = {**os.environ, 'PYTHONUNBUFFERED': '1', 'JAX_COMPILATION_CACHE_DIR': str(jax_cache)}
  process = subprocess.Popen(
    command,
    cwd=ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    text=True,
    bufsize=1,
    env=environment,
  )
  result: dict = {'command': ' '.join(command[1:])}
  lines: list[str] = []

  def read() -> None:  # the stage marks, timed as they are printed
    for line in process.stdout:
      lines.append(line.rstrip('\n'))
      for mark, name in MARKS.items():
        if line.startswith(mark) and name not in result:
          result[name] = round(time.perf_counter() - started, 2)
          if name == 'training_loop_s':
            result['peak_rss_before_first_step_gb'] = peak_rss_gb(process.pid)

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  try:
    while True:
      if time.perf_counter() - started > timeout_s:
        raise TimeoutError(f'no training step within {timeout_s:.0f} s:\n' + '\n'.join(lines))
      if metrics.exists() and len(metrics.read_text().splitlines()) > logged_before:
        result['first_step_s'] = round(time.perf_counter() - started, 2)
        result['peak_rss_at_first_step_gb'] = peak_rss_gb(process.pid)
        break
      if process.poll() is not None:
        raise RuntimeError(f'train.py exited with {process.returncode}:\n' + '\n'.join(lines))
      time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=600)
    reader.join(timeout=10)
  finally:
    if process.poll() is None:
      process.kill()
  result['programs_compiled'] = len(list(jax_cache.glob('*-cache'))) - entries_before
  result['log'] = [line for line in lines if not line.startswith('  ')][:12]
  return result


def median_rate(build, steps: range, rounds: int) -> float:
  """Median over rounds of real target tokens per second of `build(step)` over `steps`."""
  rates = []
  for _ in range(rounds):
    tokens, begin = 0, time.perf_counter()
    for step in steps:
      batch = build(step)
      tokens += int((batch.tgt_out != batch.pad_id).sum())
    rates.append(tokens / (time.perf_counter() - begin))
  return statistics.median(rates)


def load_only_cache(cache_dir: Path):
  """The one encoded corpus a run wrote into CACHE_DIR (`data.cache.load`, unverified)."""
  from flax_transformer.data.cache import load

  [key] = [
    json.loads((path / 'manifest.json').read_text())['key']
    for path in cache_dir.iterdir()
    if not path.name.startswith('.')
  ]
  return load(cache_dir, key, verify=False)


def batch_rates(cache_dir: Path, max_tokens: int, packing: int, rounds: int, steps: int) -> dict:
  from flax_transformer.data.batcher import Batcher
  from flax_transformer.data.plans import BestFit, FirstFit
  from tests.support.loop_batches import LoopBatcher

  begin = time.perf_counter()
  corpus = load_only_cache(cache_dir)
  results = {
    'pairs': len(corpus),
    'cache_load_s': round(time.perf_counter() - begin, 2),
    'max_tokens': max_tokens,
    'packed_row_length': packing,
  }
  kinds = {
    'bucketed': (
      LoopBatcher(corpus, max_tokens, 0, row_multiple=2),
      Batcher(corpus, max_tokens, 0, row_multiple=2),
    ),
    'packed': (
      LoopBatcher(corpus, max_tokens, 0, FirstFit(packing), row_multiple=2),
      Batcher(corpus, max_tokens, 0, BestFit(packing), row_multiple=2),
    ),
  }
  window = range(1, steps + 1)
  for kind, (before, ours) in kinds.items():
    for batcher in (before, ours):
      begin = time.perf_counter()
      batcher.batch_at(0)  # the epoch's plan, built once per epoch
      plan_s = time.perf_counter() - begin
      name = 'before' if batcher is before else 'ours'
      results[f'{kind}_{name}_plan_epoch_s'] = round(plan_s, 2)
    results[f'{kind}_before_tokens_per_s'] = round(median_rate(before.batch_at, window, rounds))
    results[f'{kind}_ours_tokens_per_s'] = round(
      median_rate(lambda step: ours.local_batch_at(step, 0, 1), window, rounds)
    )
    results[f'{kind}_ours_per_process_of_2_tokens_per_s'] = round(
      min(
        median_rate(lambda step, index=index: ours.local_batch_at(step, index, 2), window, rounds)
        for index in range(2)
      )
    )
    results[f'{kind}_ours_over_before'] = round(
      results[f'{kind}_ours_tokens_per_s'] / results[f'{kind}_before_tokens_per_s'], 2
    )
  return results


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--data', type=Path, required=True, help='the stand-in (make_standin)')
  parser.add_argument('--workdir', type=Path, required=True, help='a new run directory')
  parser.add_argument('--output', type=Path, default=RESULTS / 'data_pipeline.json')
  parser.add_argument('--stages', default='first_run,resume,batches')
  parser.add_argument('--timeout', type=float, default=3600, help='seconds per train.py run')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--steps', type=int, default=200, help='batches per round')
  parser.add_argument(
    '--max-tokens',
    type=int,
    default=8192,
    help="train.py's batch size (tokens per side) for the two runs",
  )
  args = parser.parse_args(argv)
  stages = args.stages.split(',')
  # Every step is saved, so that the SIGTERM after the first logged step leaves a checkpoint
  # to resume from; --max-tokens: the base preset's 25,000 needs more than a 24 GB CPU host
  # (its second step's shape asks XLA for 30 GB), and the input side does not depend on it.
  command = [
    sys.executable,
    'train.py',
    '--preset',
    'base',
    '--data',
    str(args.data),
    '--workdir',
    str(args.workdir),
    '--steps',
    '100000',
    '--train.log_every',
    '1',
    '--train.eval_every',
    '100000',
    '--train.checkpoint_every',
    '1',
    '--train.max_tokens',
    str(args.max_tokens),
  ]
  payload = {
    'benchmark': 'data_pipeline',
    'machine': machine_info(os.cpu_count()),
    'data': str(args.data),
  }
  if 'first_run' in stages:
    if args.workdir.exists():
      parser.error(f'{args.workdir} exists: the first run needs a new run directory')
    payload['first_run'] = first_step(command, args.workdir, args.timeout)
    print(json.dumps(payload['first_run'], indent=1))
  if 'resume' in stages:
    payload['resume'] = first_step(command, args.workdir, args.timeout)
    print(json.dumps(payload['resume'], indent=1))
  if 'batches' in stages:
    payload['batches'] = batch_rates(args.workdir / 'encoded', 25_000, 64, args.rounds, args.steps)
    print(json.dumps(payload['batches'], indent=1))
  payload['load_average_at_end'] = list(os.getloadavg())
  print(f'wrote {write_json(args.output, payload)}')


if __name__ == '__main__':
  main()
