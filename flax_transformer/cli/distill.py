"""Sequence-level knowledge distillation: a copy of the parallel text whose training targets are
an autoregressive checkpoint's beam-search translations, to train a cmlm student on.

    python distill.py --checkpoint runs/m30k/average-last5 --data ../shared/data/multi30k \\
        --output data/m30k-distilled

Exit status: 0; 2 for a bad option, checkpoint, data or output (one line); 1 when writing fails.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from flax_transformer.decode.methods import BeamSearch


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='distill.py', allow_abbrev=False,
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--checkpoint', required=True, type=Path,
                      help='the teacher: an autoregressive run directory written by train.py '
                           '(or its average-lastK)')
  parser.add_argument('--data', metavar='SOURCE',
                      help="the parallel text, as train.py's --data (default: the checkpoint's "
                           'data.source)')
  parser.add_argument('--output', required=True, type=Path,
                      help='directory to write <split>.<lang> files into (must be new or empty)')
  parser.add_argument('--overwrite', action='store_true', help='replace --output if it exists')
  parser.add_argument('--beam-size', type=int, default=BeamSearch.beam_size,
                      help=f'beams (default {BeamSearch.beam_size})')
  parser.add_argument('--alpha', type=float, default=BeamSearch.alpha,
                      help=f'length penalty ((5 + |Y|) / 6)^alpha (default {BeamSearch.alpha})')
  parser.add_argument('--batch-size', type=int, default=64, help='sentences per batch')
  args = parser.parse_args(argv)
  for option in ('beam_size', 'batch_size'):
    if getattr(args, option) < 1:
      parser.error(f'argument --{option.replace("_", "-")}: must be >= 1, '
                   f'got {getattr(args, option)}')
  return args


def main(argv: Sequence[str] | None = None, print_fn: Callable[[str], None] = print) -> int:
  args = parse_args(argv)
  from flax_transformer.config import ConfigError
  from flax_transformer.data.corpus import DataError
  from flax_transformer.data.tokenizer import TokenizerError
  from flax_transformer.run.checkpoints import CheckpointError
  from flax_transformer.train.distill import DistillError, distill
  try:
    method = BeamSearch(beam_size=args.beam_size, alpha=args.alpha)
    result = distill(args.checkpoint, args.output, data=args.data, method=method,
                     batch_size=args.batch_size, overwrite=args.overwrite)
  except (DistillError, CheckpointError, ConfigError, DataError, TokenizerError) as error:
    print(f'distill.py: error: {error}', file=sys.stderr)
    return 2
  except OSError as error:
    print(f'distill.py: error: writing {args.output} failed ({error.strerror or error})',
          file=sys.stderr)
    return 1
  notes = [f'{result.empty:,} empty (their pairs are dropped when loaded)'] if result.empty else []
  if result.truncated:
    notes.append(f'{result.truncated:,} sources longer than the teacher\'s max_len translated '
                 'from their beginning')
  print_fn(f'wrote {result.output}: {result.sentences:,} training sources with the '
           f'{method.describe()} translations of {args.checkpoint}'
           + (f'; {"; ".join(notes)}' if notes else '') + '; the other splits keep their '
           'references.')
  print_fn(f'Train a non-autoregressive student on it:\n  {result.command}')
  return 0
