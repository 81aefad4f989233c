"""Worker scripts run on simulated CPU devices, as the multi-device tests run them.

XLA_FLAGS must be set before jax is imported, so each worker is a fresh
process; it saves its results to an .npz file whose keys are `RUN/KIND/INDEX`.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from support.environment import xla_flags

ROOT = Path(__file__).resolve().parents[2]


def run_worker(
  source: str, out: Path, args, device_count: int, backend_optimization: bool = True
) -> dict[str, np.ndarray]:
  """`python -c source out *args` on `device_count` CPU devices -> the arrays it saved to `out`.

  `backend_optimization=False` turns XLA's backend optimisation off (as
  tests/test_multihost.py does): a third less compiling, where only equality
  between runs is tested.
  """
  flags = [f'--xla_force_host_platform_device_count={device_count}']
  if not backend_optimization:
    flags.append('--xla_backend_optimization_level=0')
  # tests/ on the path too: workers import the helpers of tests/support/.
  env = {
    **os.environ,
    'XLA_FLAGS': xla_flags(*flags),
    'JAX_PLATFORMS': 'cpu',
    'PYTHONPATH': f'{ROOT}{os.pathsep}{ROOT / "tests"}',
  }
  done = subprocess.run(
    [sys.executable, '-c', source, str(out), *map(str, args)],
    env=env,
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  with np.load(out) as data:
    return dict(data)


def uneven_batch(vocab_size: int, step: int, rows: int = 8, length: int = 12):
  """Inside a worker: step's `Batch` of reversal pairs, row r holding length - 1 - r words, so
  that the long rows come first and device 0 gets many more tokens than the last device."""
  import numpy as np

  from flax_transformer.data.batching import Batch

  rng = np.random.default_rng(step)
  src, tgt_in, tgt_out = (np.zeros((rows, length), np.int32) for _ in range(3))
  for row in range(rows):
    words = rng.integers(4, vocab_size, length - 1 - row)
    src[row, : len(words) + 1] = [*words, 2]
    tgt_in[row, : len(words) + 1] = [1, *words[::-1]]
    tgt_out[row, : len(words) + 1] = [*words[::-1], 2]
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=np.arange(rows, dtype=np.int32))


def train_runs(model, train_config, runs, steps: int, batch_at) -> dict[str, np.ndarray]:
  """Inside a worker: each run ('shard_map-2', 'pmap-4', ...) trains `steps` steps from the same
  initial state on `batch_at(step)`; -> {'RUN/loss/STEP': loss per token, 'RUN/params/NAME': ...}."""
  import jax
  from flax import traverse_util

  from flax_transformer.train import (
    DataParallel,
    create_train_state,
    make_optimizer,
    make_parallel_step,
  )

  optimizer = make_optimizer(train_config, model.config)
  initial = jax.device_get(create_train_state(model, optimizer, seed=0))
  results = {}
  for run in runs:
    mode, count = run.split('-')
    parallel = DataParallel(jax.devices()[: int(count)], mode=mode)
    step = make_parallel_step(model, optimizer, train_config, parallel)
    state = parallel.replicate(initial)
    for index in range(steps):
      state, metrics = step(state, parallel.shard_batch(batch_at(index)))
      metrics = parallel.unreplicate(metrics)
      results[f'{run}/loss/{index}'] = metrics['loss_sum'] / metrics['tokens']
    params = traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/')
    results.update({f'{run}/params/{name}': value for name, value in params.items()})
  return results


def run_values(results: dict[str, np.ndarray], run: str, kind: str) -> dict[str, np.ndarray]:
  """The arrays of one run and kind, keyed by what follows `RUN/KIND/`."""
  prefix = f'{run}/{kind}/'
  return {name[len(prefix) :]: value for name, value in results.items() if name.startswith(prefix)}


def assert_runs_match(results: dict[str, np.ndarray], run: str, reference: str = 'shard_map-1'):
  """`run`'s losses to 1e-6 and parameters to 1e-5 relative (+ 1e-6) of `reference`'s: the
  rounding of float32 sums taken in another order, nothing more."""
  for kind, rtol, atol in (('loss', 1e-6, 0.0), ('params', 1e-5, 1e-6)):
    expected = run_values(results, reference, kind)
    values = run_values(results, run, kind)
    assert values.keys() == expected.keys() and expected
    for name, value in expected.items():
      np.testing.assert_allclose(
        values[name], value, rtol=rtol, atol=atol, err_msg=f'{kind} {name}'
      )
