"""Translate with a trained checkpoint: sentences as arguments, a file, or standard input.

    python decode.py --checkpoint runs/multi30k "Ein Mann fährt Fahrrad."
    python decode.py --checkpoint runs/multi30k --average-last 5 \\
        --input test.de --output test.hyp.en --reference test.en
    cat test.de | python decode.py --checkpoint runs/multi30k --method greedy
    python decode.py --checkpoint runs/cmlm --method mask_predict --iterations 10 --length-beam 3
    python decode.py --checkpoint opus-mt-en-de "The cat sat on the mat."   # a Marian model

One sentence per line in (UTF-8, split at '\\n' only, as training reads its data),
one translation per line out, in input order, written block by block; a progress
bar on standard error counts the sentences of a file or standard input. Empty
lines give empty lines; a line longer than the model's max_len is truncated with
a warning naming it. --reference prints BLEU (cased, lowercased, tokenized) and chrF,
signatures included. A failure part way keeps the translations already written and says how
many; it is one line on standard error (--debug adds the traceback) and an exit status, as
the table in flax_transformer/cli/failures.py lists them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from flax_transformer import errors
from flax_transformer.cli.failures import REFUSED, Failure, add_debug_option, run_program
from flax_transformer.cli.options import (
  add_method_options,
  add_unverified_option,
  method_settings,
  unverified_reporter,
)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='decode.py',
    description=__doc__.split('\n\n')[0],
    allow_abbrev=False,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  add = parser.add_argument
  add('sentences', nargs='*', help='sentences to translate (else --input or stdin)')
  add(
    '--checkpoint',
    required=True,
    type=Path,
    help='run directory of train.py (config.json, tokenizer.json, checkpoints/), its RUN/best '
    'or RUN/average-lastK, or a Hugging Face Marian directory (config.json, model.safetensors)',
  )
  add('--step', type=int, help='checkpoint step to load (default: the latest)')
  add(
    '--average-last',
    type=int,
    default=0,
    metavar='K',
    help='average the parameters of the last K checkpoints (paper: 5)',
  )
  add('--input', type=Path, help='file with one sentence per line ("-": stdin)')
  add('--output', type=Path, help='write translations here (default: stdout)')
  add(
    '--reference',
    type=Path,
    help='reference translations, one per line: print BLEU (cased, '
    'lowercased, tokenized as the literature reports it) and chrF',
  )
  add('--target-lang', metavar='LANG', help="--reference's tokenized BLEU: the output language")
  add('--batch-size', type=int, default=64, help='sentences per batch')
  add(
    '--dtype',
    choices=('float32', 'bfloat16'),
    help="compute dtype to decode in (default: the model's): bfloat16 runs the matmuls in "
    'bfloat16 with float32 accumulation, the search in float32',
  )
  add_method_options(parser)
  add_unverified_option(parser)
  add_debug_option(parser)
  args = parser.parse_args(argv)
  # Refused here, naming the option, not deep in loading or decoding (method settings: parsed).
  for option, low in (('step', 0), ('average_last', 0), ('batch_size', 1)):
    value = getattr(args, option)
    if value is not None and value < low:
      parser.error(f'argument --{option.replace("_", "-")}: must be >= {low}, got {value}')
  args.method_settings = method_settings(parser, args)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  """The program; failures: one line and a status (cli/failures.py)."""
  return run_program('decode.py', lambda: _main(argv), argv, lambda error: None)


def _main(argv: Sequence[str] | None) -> int:
  args = parse_args(argv)
  # Imported here so that --help and argument errors answer at once.
  from flax_transformer.cli import text_io
  from flax_transformer.decode.methods import default_method, method_from_name
  from flax_transformer.decode.translator import Translator

  settings = args.method_settings
  try:
    text_io.check_output(args.output, args.checkpoint, args.input, args.reference)
    text_io.check_target_lang(args.target_lang, args.reference)
    sentences, show_progress = text_io.read_input(args.sentences, args.input)
    references = (
      text_io.read_references(args.reference, len(sentences))
      if args.reference is not None
      else None
    )
    # A named method's settings are refused before the checkpoint loads.
    method = method_from_name(args.method, **settings) if args.method else None
    translator = Translator.from_directory(
      args.checkpoint,
      args.step,
      args.average_last,
      args.dtype,
      unverified_reporter(args, 'decode.py'),
    )
    method = method or default_method(translator.config, **settings)
    args.target_lang = args.target_lang or text_io.target_language(args.checkpoint)
    translator.check_method(method, len(sentences), args.batch_size)
    output = text_io.open_output(args.output)
  except errors.Error as error:
    raise Failure(str(error), REFUSED) from error  # one line; its traceback with --debug
  status, translations = text_io.translate_into(
    output,
    args.output or 'standard output',
    translator,
    method,
    sentences,
    args.batch_size,
    show_progress,
  )
  if status == 0 and references is not None:  # BLEU cased, lowercased, tokenized; chrF
    print(
      *text_io.score_lines(translations, references, args.target_lang),
      sep='\n',
      file=sys.stdout if args.output else sys.stderr,
    )
  return status
