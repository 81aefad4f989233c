"""train.py's multi-host options, and joining the processes before anything touches a device."""

from __future__ import annotations

import argparse

from flax_transformer.cli.failures import deadline
from flax_transformer.cli.options import positive_int

# How long a multi-host start waits for every process to join the coordinator (JAX's default).
COORDINATOR_TIMEOUT_S = 300
# JAX's own deadline comes this much later: its expiry aborts the process with a C++ stack trace,
# so the program's `deadline` ends it first, with one line.
_JAX_TIMEOUT_MARGIN_S = 5


def add_host_options(parser: argparse.ArgumentParser) -> None:
  """--distributed, --coordinator, --num-processes, --process-id, --coordinator-timeout."""
  hosts = parser.add_argument_group(
    'multi-host',
    'run the same command on every process; with --distributed alone, JAX '
    'detects the cluster (SLURM, TPU pods, Open MPI)',
  )
  hosts.add_argument(
    '--distributed',
    action='store_true',
    help='call jax.distributed.initialize() before anything else',
  )
  hosts.add_argument(
    '--coordinator', metavar='HOST:PORT', help='address of process 0 (implies --distributed)'
  )
  hosts.add_argument(
    '--num-processes',
    type=positive_int,
    metavar='N',
    help='how many processes take part (with --coordinator)',
  )
  hosts.add_argument(
    '--process-id',
    type=int,
    metavar='I',
    help="this process's index, 0 .. N-1 (with --coordinator)",
  )
  hosts.add_argument(
    '--coordinator-timeout',
    type=positive_int,
    metavar='SECONDS',
    default=COORDINATOR_TIMEOUT_S,
    help='give up when the processes have not all joined the coordinator '
    'within this time (default: %(default)s)',
  )


def start_hosts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """jax.distributed.initialize when asked; flag mistakes are answered at once."""
  from flax_transformer.train import distributed

  if not (args.coordinator or args.distributed):
    if (
      args.num_processes is not None
      or args.process_id is not None
      or args.coordinator_timeout != COORDINATOR_TIMEOUT_S
    ):
      parser.error(
        '--num-processes, --process-id and --coordinator-timeout need --coordinator '
        '(or --distributed)'
      )
    return
  problem = distributed.check_coordinator(args.coordinator, args.num_processes, args.process_id)
  if problem:
    parser.error(problem)
  try:
    waiting, failed = distributed.join_lines(
      args.coordinator, args.num_processes, args.process_id, args.coordinator_timeout
    )
    with deadline(args.coordinator_timeout, 'train.py', failed, 1, waiting=waiting):
      distributed.start(
        args.coordinator,
        args.num_processes,
        args.process_id,
        timeout_s=args.coordinator_timeout + _JAX_TIMEOUT_MARGIN_S,
      )
  except ValueError as error:  # JAX names the first setting it could neither read nor detect
    parser.error(
      f'jax.distributed.initialize: {error} JAX detects the cluster on TPU pods and '
      'under SLURM or Open MPI; elsewhere give --coordinator HOST:PORT, '
      '--num-processes N and --process-id I'
    )
