"""What every benchmark here needs: pinned threads, medians, machine facts (the library's
`bench.environment`), JSON.

Nothing in here knows about a model. Numbers are medians of timed calls after
warm-up calls; when several contenders are compared they are timed in
interleaved rounds (`interleaved_medians`), so that a burst of load from
elsewhere on the machine hits all of them alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / 'results'
ROOT = RESULTS.parent.parent


def python_worker(
  code: str, args, checkout: Path = ROOT, failed: str = 'the worker failed'
) -> dict:
  """Runs `code` in a fresh `python -c` with `args`, importing from `checkout`, and returns the
  JSON object its last line of standard output prints; a failure ends the benchmark with
  `failed` and the end of the worker's standard error."""
  done = subprocess.run(
    [sys.executable, '-c', code, *map(str, args)],
    cwd=checkout,
    capture_output=True,
    text=True,
    env={**os.environ, 'PYTHONPATH': str(checkout)},
    check=False,
  )
  if done.returncode:
    raise SystemExit(f'{failed}:\n{done.stderr[-3000:]}')
  return json.loads(done.stdout.strip().splitlines()[-1])


def pin_threads(threads: int | None) -> list[int]:
  """Pins this process to its first `threads` cores (all when None); returns them.

  Call before JAX or PyTorch start: XLA sizes its CPU thread pool from the
  affinity mask, and PyTorch then gets `torch.set_num_threads(len(cores))`
  from `torch_threads`, so both frameworks compute on the same cores.
  """
  cores = sorted(os.sched_getaffinity(0))
  if threads is not None:
    if not 1 <= threads <= len(cores):
      raise ValueError(
        f'--threads must be between 1 and {len(cores)} (the cores this process '
        f'may use), got {threads}'
      )
    cores = cores[:threads]
    os.sched_setaffinity(0, cores)
  return cores


def torch_threads(count: int):
  """Gives PyTorch `count` intra-op threads (the same number XLA got from `pin_threads`).

  Its OpenMP threads wait passively between parallel regions unless
  OMP_WAIT_POLICY says otherwise: spinning threads on a machine shared with
  other work made PyTorch several times slower, and XLA's threads block too.
  Takes effect only before PyTorch's first import.
  """
  os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
  import torch

  torch.set_num_threads(count)
  torch.set_num_interop_threads(1)


def time_calls(fn: Callable[[], object], repeats: int) -> list[float]:
  """Wall seconds of `repeats` calls of `fn`, which must return only once its work is done."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return times


def interleaved_medians(
  contenders: Mapping[str, Callable[[], object]],
  rounds: int,
  warmup: int = 1,
  progress: Callable[[], None] | None = None,
) -> dict[str, dict]:
  """`flax_transformer.bench.alternating_rounds` (round r times every contender in turn, after
  `warmup` untimed calls each; `progress()` after every timed call) as
  {name: {'median_s', 'min_s', 'times_s'}}. Imported here, not above: a peer's worker
  imports this module under a python of its own and calls only `time_calls`."""
  from flax_transformer.bench.timing import alternating_rounds

  timings = alternating_rounds(contenders, rounds, warmup, progress)
  return {name: summarize_times(list(timing.times_s)) for name, timing in timings.items()}


def summarize_times(times: list[float]) -> dict:
  return {
    'median_s': statistics.median(times),
    'min_s': min(times),
    'times_s': [round(t, 6) for t in times],
  }


# Peers' versions too, where installed (read from their metadata, not imported).
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'torch', 'transformers', 'ctranslate2')


def machine_info(threads: int) -> dict:
  """Where and with what a result was measured (`flax_transformer.bench.environment`: CPU,
  cores, load, versions, flags, date), and the threads it computed on. Imported here, not
  above, as `interleaved_medians`'s timing is."""
  from flax_transformer.bench.environment import environment

  return {**environment(PACKAGES, accelerator=False), 'threads': threads}


def accelerator_info() -> dict:
  """JAX's default backend and its first device (`flax_transformer.bench.environment`)."""
  from flax_transformer.bench.environment import device_info

  return device_info()


def write_json(path: Path, payload: dict) -> Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(payload, indent=2, sort_keys=False) + '\n')
  return path


def read_json(path: Path, what: str = 'JSON') -> dict | list:
  """`path`'s JSON, or SystemExit in one line naming the file: missing, or half-written."""
  try:
    return json.loads(Path(path).read_text())
  except FileNotFoundError:
    raise SystemExit(f'{path}: no such file ({what})') from None
  except (json.JSONDecodeError, UnicodeDecodeError) as error:
    raise SystemExit(f'{path}: not complete JSON, half-written? ({what}: {error})') from None


def read_run_config(workdir: Path) -> dict:
  """A training run directory's config.json, or SystemExit in one line: no directory, not a
  run of train.py, a half-written config.json."""
  workdir = Path(workdir)
  if not workdir.is_dir():
    raise SystemExit(f'{workdir}: no such run directory')
  if not (workdir / 'config.json').is_file():
    raise SystemExit(f'{workdir}: not a run of train.py (no config.json there)')
  config = read_json(workdir / 'config.json', "the run's settings")
  sections = ('model', 'train', 'data')
  if not isinstance(config, dict) or not any(isinstance(config.get(s), dict) for s in sections):
    raise SystemExit(f'{workdir / "config.json"}: not the settings of a train.py run')
  return config
