"""Sequence-level knowledge distillation: a copy of the parallel text whose training targets are
an autoregressive checkpoint's beam-search translations, to train a cmlm student on.

    python distill.py --checkpoint runs/m30k/average-last5 --data ../shared/data/multi30k \\
        --output data/m30k-distilled

A failure is one line on standard error (--debug adds the traceback) and an exit status, as
the table in flax_transformer/cli/failures.py lists them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

from flax_transformer import errors
from flax_transformer.cli.failures import REFUSED, Failure, add_debug_option, run_program
from flax_transformer.cli.options import (
  add_method_options,
  add_unverified_option,
  method_settings,
  unverified_reporter,
)
from flax_transformer.decode.methods import BeamSearch

# How the teacher decodes; its fields are the method options (--beam-size, --alpha, ...).
TEACHER_METHOD = BeamSearch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='distill.py', allow_abbrev=False, description=__doc__.split('\n\n')[0]
  )
  parser.add_argument(
    '--checkpoint',
    required=True,
    type=Path,
    help='the teacher: an autoregressive run directory written by train.py (or its average-lastK)',
  )
  parser.add_argument(
    '--data',
    metavar='SOURCE',
    help="the parallel text, as train.py's --data (default: the checkpoint's data.source)",
  )
  parser.add_argument(
    '--output',
    required=True,
    type=Path,
    help='directory to write <split>.<lang> files into (must be new or empty)',
  )
  parser.add_argument(
    '--overwrite', action='store_true', help='replace --output if an earlier distill.py wrote it'
  )
  parser.add_argument('--batch-size', type=int, default=64, help='sentences per batch')
  add_method_options(parser, [TEACHER_METHOD], title="the teacher's decoding")
  add_unverified_option(parser)
  add_debug_option(parser)
  args = parser.parse_args(argv)
  if args.batch_size < 1:
    parser.error(f'argument --batch-size: must be >= 1, got {args.batch_size}')
  args.method_settings = method_settings(parser, args, [TEACHER_METHOD])
  return args


def main(argv: Sequence[str] | None = None, print_fn: Callable[[str], None] = print) -> int:
  """The program; failures: one line and a status (cli/failures.py)."""
  return run_program('distill.py', lambda: _main(argv, print_fn), argv, lambda error: None)


def _main(argv: Sequence[str] | None, print_fn: Callable[[str], None]) -> int:
  args = parse_args(argv)
  from flax_transformer.train.distill import distill

  try:
    method = TEACHER_METHOD(**args.method_settings)
    result = distill(
      args.checkpoint,
      args.output,
      data=args.data,
      method=method,
      batch_size=args.batch_size,
      overwrite=args.overwrite,
      on_unverified=unverified_reporter(args, 'distill.py'),
    )
  except errors.Error as error:
    raise Failure(str(error), REFUSED) from error  # one line; its traceback with --debug
  except OSError as error:
    raise Failure(f'writing {args.output} failed ({error.strerror or error})', 1) from error
  notes = [f'{result.empty:,} empty (their pairs are dropped when loaded)'] if result.empty else []
  if result.truncated:
    notes.append(
      f"{result.truncated:,} sources longer than the teacher's max_len translated "
      'from their beginning'
    )
  print_fn(
    f'wrote {result.output}: {result.sentences:,} training sources with the '
    f'{method.describe()} translations of {args.checkpoint}'
    + (f'; {"; ".join(notes)}' if notes else '')
    + '; the other splits keep their '
    'references.'
  )
  print_fn(f'Train a non-autoregressive student on it:\n  {result.command}')
  return 0
