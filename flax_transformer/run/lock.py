"""One writer per run directory: an OS file lock on WORKDIR/run.lock, held for the whole run.

    with RunLock(workdir):       # raises RunDirectoryInUse naming the holder's pid and host
      train ...

Two training runs on one run directory would write the same checkpoints and
metrics.jsonl over each other. The lock is `fcntl.flock` on an open file: the
kernel releases it when the file is closed or the process ends in any way
(kill -9 included), so a lock is never left stale, whatever the file holds.
The file records the holder's pid, host and start time for the refusal message;
it stays behind after the run (removing it would race with a new run taking it).

flock is advisory and per host on some network filesystems: multi-host runs
take it on process 0 alone (the one that writes the run directory's files).
Readers (decode.py, distillation, averaging) take no lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from flax_transformer.errors import RunDirectoryInUse

LOCK_FILE = 'run.lock'


class RunLock:
  """Context manager: the exclusive lock on WORKDIR/run.lock (WORKDIR must exist)."""

  def __init__(self, workdir: str | Path):
    self.path = Path(workdir) / LOCK_FILE
    self._fd: int | None = None

  def acquire(self) -> RunLock:
    """Takes the lock at once, or raises RunDirectoryInUse; OSError if the file cannot be opened."""
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_holder(fd)
      os.close(fd)
      raise RunDirectoryInUse(
        f'{self.path.parent}: another training run is writing this run directory ({holder}); '
        'wait for it to end or stop it, or choose another --workdir'
      ) from None
    except BaseException:
      os.close(fd)
      raise
    os.ftruncate(fd, 0)
    os.pwrite(
      fd,
      json.dumps(
        {
          'pid': os.getpid(),
          'host': socket.gethostname(),
          'started': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
        }
      ).encode(),
      0,
    )
    self._fd = fd
    return self

  def release(self) -> None:
    if self._fd is not None:
      os.close(self._fd)  # closing the file releases the lock
      self._fd = None

  def __enter__(self) -> RunLock:
    return self.acquire()

  def __exit__(self, *exc_info) -> None:
    self.release()


def _read_holder(fd: int) -> str:
  """'pid P on host H since T' from the lock file, as far as it can be read."""
  try:
    holder = json.loads(os.pread(fd, 4096, 0).decode())
    return f'pid {holder["pid"]} on host {holder["host"]} since {holder["started"]}'
  except (OSError, ValueError, KeyError, TypeError):
    # The holder has the lock but has not written its name yet.
    return 'a process that has just started'
