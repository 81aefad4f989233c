"""Write a run as a Hugging Face Marian model, which transformers and CTranslate2 load.

    python export.py runs/m30k --to export/m30k --average-last 5
    ct2-transformers-converter --model export/m30k --output_dir export/m30k-ct2
    # transformers: MarianMTModel.from_pretrained('export/m30k').generate(...), greedy;
    # README.md's Marian section shows both ways of loading it

The directory holds config.json, model.safetensors, tokenizer.json,
tokenizer_config.json, generation_config.json and a README.md saying how each of
decode.py's searches reads there (flax_transformer/pretrained/export.py says how
the network maps). Greedy decoding gives decode.py's strings. A failure is one line
on standard error (--debug adds the traceback) and an exit status, as the table in
flax_transformer/cli/failures.py lists them; a refused export writes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from flax_transformer import errors
from flax_transformer.cli.failures import REFUSED, Failure, add_debug_option, run_program
from flax_transformer.cli.options import add_unverified_option, unverified_reporter


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='export.py', description=__doc__.split('\n\n')[0], allow_abbrev=False
  )
  add = parser.add_argument
  add(
    'run',
    type=Path,
    help='run directory written by train.py (or its average-lastK, or its '
    'best: RUN/best, the best validation checkpoint)',
  )
  add(
    '--to',
    required=True,
    type=Path,
    metavar='DIR',
    help='directory to write (new, empty, or an earlier export, which is replaced)',
  )
  add('--step', type=int, help='checkpoint step to export (default: the latest)')
  add(
    '--average-last',
    type=int,
    default=0,
    metavar='K',
    help='export the mean of the last K checkpoints (paper: 5)',
  )
  add_unverified_option(parser)
  add_debug_option(parser)
  args = parser.parse_args(argv)
  for option in ('step', 'average_last'):
    value = getattr(args, option)
    if value is not None and value < 0:
      parser.error(f'argument --{option.replace("_", "-")}: must be >= 0, got {value}')
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """The program; failures: one line and a status (cli/failures.py)."""
  return run_program('export.py', lambda: _main(argv), argv, lambda error: None)


def _main(argv: Sequence[str] | None) -> int:
  args = parse_args(argv)
  # Imported here so that --help and argument errors answer at once.
  from flax_transformer.run.export import export_run

  try:
    output = export_run(
      args.run,
      args.to,
      step=args.step,
      average_last=args.average_last,
      on_unverified=unverified_reporter(args, 'export.py'),
    )
  except ModuleNotFoundError as error:
    raise Failure(f'export needs {error.name}: pip install -e .[pretrained]', 2) from error
  except errors.Error as error:
    raise Failure(str(error), REFUSED) from error
  print(
    f'export.py: wrote {output} (transformers: MarianMTModel.from_pretrained({str(output)!r});'
    f' CTranslate2: ct2-transformers-converter --model {output} --output_dir ...)'
  )
  return 0
