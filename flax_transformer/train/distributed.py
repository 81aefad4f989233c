"""Multi-host start-up: `jax.distributed.initialize` with the choices a training run needs.

    start('10.0.0.1:1234', num_processes=2, process_id=0)   # or start() under SLURM, MPI, TPU pods

Call it before anything touches the devices. What is None, JAX detects.
"""

from __future__ import annotations

import datetime
import ipaddress
import os

import jax


def check_coordinator(
  coordinator: str | None, num_processes: int | None, process_id: int | None
) -> str | None:
  """An error message for flags a coordinator would never answer, else None."""
  if coordinator is not None:
    host, _, port = coordinator.rpartition(':')
    if not host or not port.isdigit():
      return f'--coordinator must be HOST:PORT (the address of process 0), got {coordinator!r}'
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    return (
      f'--process-id={process_id} is outside 0 .. {num_processes - 1} '
      f'(--num-processes={num_processes})'
    )
  return None


def start(
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  timeout_s: int | None = None,
) -> None:
  """`jax.distributed.initialize`; what is None, JAX detects (TPU pods, SLURM, Open MPI).

  timeout_s: how long to wait for every process to join (None: JAX's default). When it
  passes, JAX aborts the process (a C++ check failure, which Python cannot catch).
  Raises ValueError when JAX can neither read nor detect a setting.
  """
  # Collectives between CPU processes need an implementation: gloo (TCP, built into
  # jaxlib) unless one is chosen in the environment (e.g. mpi). Only the CPU backend
  # reads this; GPU and TPU collectives are unaffected.
  if 'JAX_CPU_COLLECTIVES_IMPLEMENTATION' not in os.environ:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  timeout = {} if timeout_s is None else {'initialization_timeout': int(timeout_s)}
  jax.distributed.initialize(
    coordinator,
    num_processes,
    process_id,
    coordinator_bind_address=loopback_bind_address(coordinator),
    **timeout,
  )
  if jax.process_index() != 0:
    # Process 0 reports for all. Set before anything imports tqdm, which reads it once:
    # this also silences the data loading bars of `datasets` and of encode_corpus.
    os.environ['TQDM_DISABLE'] = '1'


def join_lines(
  coordinator: str | None, num_processes: int | None, process_id: int | None, timeout_s: int
) -> tuple[str, str]:
  """(the line while the processes join the coordinator, the line if they have not all
  joined within `timeout_s`), worded for this process's part."""
  where = coordinator or 'the address JAX detected'
  until = (datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=timeout_s)).strftime(
    '%H:%M:%S UTC'
  )
  if process_id == 0:
    waiting = (
      f'coordinator at {where}: waiting for all {num_processes} processes to join, '
      f'until {until} (--coordinator-timeout={timeout_s} s)'
    )
    return waiting, (
      f'error: not every process joined the coordinator (process 0, at {where}) within '
      f'--coordinator-timeout={timeout_s} s; check that all {num_processes} were started, '
      'with this --coordinator and --num-processes'
    )
  waiting = (
    f'process {"?" if process_id is None else process_id}: joining the coordinator at '
    f'{where}, until {until} (--coordinator-timeout={timeout_s} s)'
  )
  return waiting, (
    f'error: no coordinator answered at {where} with all the processes joined within '
    f'--coordinator-timeout={timeout_s} s; check that process 0 runs there and that every '
    'process was started with the same --num-processes'
  )


def loopback_bind_address(coordinator: str | None) -> str | None:
  """The coordinator address itself when it is a loopback one, else None.

  JAX's coordinator listens on every interface by default; one reached at
  127.0.0.1 or localhost serves this machine only, so it listens there alone and
  a rehearsal on one machine opens no port to the network. Any other address is
  left to the default, as process 0 may be reached by a name or NAT address that
  is not one of its own interfaces.
  """
  if coordinator is None:
    return None
  host = coordinator.rpartition(':')[0].strip('[]')
  try:
    return coordinator if ipaddress.ip_address(host).is_loopback else None
  except ValueError:
    return coordinator if host == 'localhost' else None
