"""A process that holds a run directory's lock (run.lock.RunLock) until it is killed:
tests/test_run_directory.py and tests/test_faults.py."""

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Imports run/lock.py alone (not the package, which imports JAX): the holder starts at once.
HOLD = (
  'import importlib.util, sys, time\n'
  'spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])\n'
  'run_lock = importlib.util.module_from_spec(spec)\n'
  'spec.loader.exec_module(run_lock)\n'
  'run_lock.RunLock(sys.argv[2]).acquire()\n'
  'print("held", flush=True)\n'
  'time.sleep(600)\n'
)


@contextlib.contextmanager
def lock_holder(workdir: Path) -> Iterator[subprocess.Popen]:
  """A process holding WORKDIR's lock for the block (WORKDIR created); killed after it."""
  workdir.mkdir(parents=True, exist_ok=True)
  lock_module = ROOT / 'flax_transformer' / 'run' / 'lock.py'
  process = subprocess.Popen(
    [sys.executable, '-c', HOLD, str(lock_module), str(workdir)],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, 'PYTHONPATH': str(ROOT)},
  )
  try:
    assert process.stdout.readline() == 'held\n'
    yield process
  finally:
    process.kill()
    process.wait()
    process.stdout.close()
