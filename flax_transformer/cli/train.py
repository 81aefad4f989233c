"""Train a Transformer translation model; a command line over `flax_transformer.train.loop.train`.

    python train.py                                   # the offline default: the toy task
    python train.py --preset multi30k --data ../shared/data/multi30k --workdir runs/multi30k
    python train.py --objective cmlm                  # a non-autoregressive model (mask-predict)
    python train.py --init-from opus-mt-en-de --data DIR  # fine-tune a Marian model
    python train.py --coordinator HOST:PORT --num-processes N --process-id I ...  # multi-host

Every setting of ModelConfig, TrainConfig and DataConfig is an option `--model.NAME=VALUE`,
`--train.NAME=VALUE`, `--data.NAME=VALUE` over the preset's values (`--help` lists them). A
run directory that holds checkpoints is resumed exactly, unless `--no-resume` is given.

A failure is one line on standard error (--debug adds the traceback) and an exit status, as
the table in flax_transformer/cli/failures.py lists them (SIGTERM or Ctrl-C: the step reached
is saved first; after a second Ctrl-C, or before training started, nothing new is saved).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flax_transformer.cli import compilation_cache, hosts, options
from flax_transformer.cli.failures import add_debug_option, run_program, train_failure
from flax_transformer.config import RUN_PRESETS, ConfigError


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog='train.py',
    allow_abbrev=False,
    formatter_class=argparse.RawDescriptionHelpFormatter,
    description=__doc__.split('\n\n')[0],
    epilog='model.vocab_size and the special token ids come from the tokenizer trained on the '
    'data (its size is at most --data.vocab_size).\nMixed precision: --bf16 computes in '
    'bfloat16 with float32 parameters, logits and loss.',
  )
  run = _add_run_options(parser.add_argument_group('run'))
  hosts.add_host_options(parser)
  options.add_unverified_option(run)
  add_debug_option(run)
  options.add_setting_options(parser)
  return parser


def _add_run_options(run: argparse._ArgumentGroup) -> argparse._ArgumentGroup:
  """Where the run lives, how it maps over devices, and what it does at the end."""
  run.add_argument(
    '--preset',
    choices=RUN_PRESETS,
    help='named settings to start from (default: toy, offline); a resumed run starts from its '
    "own config.json's instead, and only the options given change it",
  )
  run.add_argument(
    '--workdir',
    help='run directory: config.json, tokenizer.json, '
    'checkpoints/, metrics.jsonl (default: runs/PRESET)',
  )
  run.add_argument(
    '--resume',
    action=argparse.BooleanOptionalAction,
    default=True,
    help='continue from the latest checkpoint in --workdir if there is one; '
    '--no-resume deletes the previous run there and starts afresh',
  )
  run.add_argument(
    '--devices',
    type=options.positive_int,
    metavar='N',
    help='use the first N local devices (default: all devices of all processes)',
  )
  run.add_argument(
    '--parallel',
    choices=('shard_map', 'pmap'),
    default='shard_map',
    help='how the step is mapped over devices (identical results)',
  )
  run.add_argument(
    '--average-last',
    type=options.positive_int,
    default=0,
    metavar='K',
    help='at the end, write WORKDIR/average-lastK, the mean of the last K '
    'checkpoints (the paper averages 5), and report its scores',
  )
  run.add_argument('--compilation-cache', metavar='DIR', help=compilation_cache.HELP)
  run.add_argument(
    '--skip-nonfinite',
    type=options.nonnegative_int,
    default=0,
    metavar='N',
    help='skip up to N steps whose loss or gradient is not finite (their '
    'updates are not applied) before stopping; default 0: stop at the first',
  )
  return run


def main(argv: list[str] | None = None) -> int:
  """The program; argv None reads sys.argv. Failures: one line and a status (cli/failures.py)."""
  return run_program('train.py', lambda: _main(argv), argv, train_failure)


def _main(argv: list[str] | None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    options.configs_from_args(args)  # option errors answer at once, before JAX loads
  except ConfigError as error:
    parser.error(str(error))
  hosts.start_hosts(parser, args)
  # Imported after argument checks, so --help and option errors answer at once (and after
  # jax.distributed.initialize, which must come before anything touches the devices).
  from flax_transformer.errors import NotARun
  from flax_transformer.run.directory import saved_steps
  from flax_transformer.train.loop import train
  from flax_transformer.train.setup import check_settings

  try:
    cache = compilation_cache.enable(args.compilation_cache)
  except ConfigError as error:
    parser.error(str(error))
  if args.workdir == '':  # Path('') would be '.', and quoted so
    raise NotARun("--workdir '' names no directory; name a new one (default: runs/PRESET)")
  workdir = Path(args.workdir or Path('runs') / (args.preset or 'toy'))
  try:
    configs = options.run_configs(args, workdir)  # a run to resume: its own, as given
    check_settings(
      *configs,
      args.average_last,
      args.skip_nonfinite,
      pretrained=args.init_from is not None,
      saved=saved_steps(workdir) if args.resume else (),
    )
  except ConfigError as error:
    parser.error(str(error))
  train(
    *configs,
    workdir,
    devices=args.devices,
    parallel=args.parallel,
    resume=args.resume,
    average_last=args.average_last,
    skip_nonfinite=args.skip_nonfinite,
    init_from=args.init_from,
    allow_unverified=args.allow_unverified,
  )
  cache.report()
  return 0
