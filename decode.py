"""Translate with a trained checkpoint: sentences as arguments, a file, or standard input.

    python decode.py --checkpoint runs/multi30k "Ein Mann fährt Fahrrad."
    python decode.py --checkpoint runs/multi30k --average-last 5 \
        --input test.de --output test.hyp.en --reference test.en
    cat test.de | python decode.py --checkpoint runs/multi30k --method greedy
    python decode.py --checkpoint runs/cmlm --method nat --iterations 10 --length-beam 3 \
        --input test.de                          # a model trained with train.py --objective cmlm

One sentence per line in, one translation per line out, in input order: the
output is written block by block as decoding goes (a progress bar on standard
error counts sentences for --input and standard input). Empty lines give empty
lines. A line longer than the model's max_len (in subword tokens, EOS included)
is truncated to fit, with a warning on standard error naming the line.

With --reference, sacreBLEU's BLEU and chrF of the translations are printed with
their signatures: on standard output when translations go to --output, on
standard error otherwise.

Input is UTF-8 (invalid bytes are refused, naming the line), split at '\\n'
only, as training reads its data, so the output lines match the input lines one
to one. Characters the vocabulary lacks become <unk> tokens and decode like any
other. A failure part way (a full disk, Ctrl-C, an accelerator error) keeps the
translations already written, which are all the lines before a given one, and
says how many there are.

Exit status: 0 on success, 2 for bad arguments, input or checkpoint (with a
one-line message, before any translation), 1 when writing the output fails or
anything unexpected happens part way, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

from tqdm import tqdm

# Sentences read, sorted and decoded together; their translations are written before the next
# block is read. Large enough for length-sorted batches, small enough to see output soon.
BATCHES_PER_BLOCK = 8


class InputError(Exception):
  """Bad command-line input: the message is shown as is."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='decode.py', description=__doc__.split('\n\n')[0],
                                   allow_abbrev=False,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('sentences', nargs='*', help='sentences to translate (else --input or stdin)')
  parser.add_argument('--checkpoint', required=True, type=Path,
                      help='run directory written by train.py (config.json, tokenizer.json, '
                           'checkpoints/)')
  parser.add_argument('--step', type=int,
                      help='checkpoint step to load (default: the latest)')
  parser.add_argument('--average-last', type=int, default=0, metavar='K',
                      help='average the parameters of the last K checkpoints (paper: 5)')
  parser.add_argument('--input', type=Path, help='file with one sentence per line ("-": stdin)')
  parser.add_argument('--output', type=Path, help='write translations here (default: stdout)')
  parser.add_argument('--reference', type=Path,
                      help='reference translations, one per line: print BLEU and chrF')
  search = parser.add_argument_group(
      'search', 'beam, greedy and sample decode an autoregressive checkpoint (the default kind), '
      'nat a non-autoregressive one (train.py --objective cmlm)')
  search.add_argument('--method', choices=('beam', 'greedy', 'sample', 'nat'),
                      help='beam search (the default for an autoregressive checkpoint), greedy, '
                           'sampling, or nat: mask-predict (the default for a cmlm checkpoint), '
                           'which predicts the output length and fills all positions at once, '
                           'then re-predicts the least confident ones')
  search.add_argument('--beam-size', type=int, default=4,
                      help='beam search: beams (paper: 4)')
  search.add_argument('--alpha', type=float, default=0.6,
                      help='beam search: length penalty ((5 + |Y|) / 6)^alpha (paper: 0.6)')
  search.add_argument('--temperature', type=float, default=1.0, help='sampling: temperature')
  search.add_argument('--top-k', type=int, default=0,
                      help='sampling: keep the k best (0: all)')
  search.add_argument('--top-p', type=float, default=1.0, help='sampling: nucleus mass (1: all)')
  search.add_argument('--seed', type=int, default=0, help='sampling: random seed')
  search.add_argument('--iterations', type=int, default=10,
                      help='nat: decoding passes; each after the first re-masks and re-predicts '
                           'the least confident tokens (1: one pass; default 10)')
  search.add_argument('--length-beam', type=int,
                      help='nat: the most probable output lengths decoded per sentence, the '
                           'best-scoring kept (default 3; 1 with --nat-length fixed)')
  search.add_argument('--nat-length', choices=('predict', 'fixed'), default='predict',
                      help='nat: predict the length (default), or decode source length + '
                           "the model's max_length_offset positions and cut at the first EOS")
  search.add_argument('--max-len', type=int,
                      help='output tokens per sentence (default: source length + 50, at most '
                           "the model's max_len); not for nat")
  search.add_argument('--batch-size', type=int, default=64,
                      help='sentences per batch')
  args = parser.parse_args(argv)
  # Refused here, naming the option, rather than deep in loading or decoding.
  for option, low in (('step', 0), ('average_last', 0), ('beam_size', 1), ('top_k', 0),
                      ('iterations', 1), ('length_beam', 1), ('max_len', 1), ('batch_size', 1)):
    value = getattr(args, option)
    if value is not None and value < low:
      parser.error(f'argument --{option.replace("_", "-")}: must be >= {low}, got {value}')
  return args


def _lines(data: bytes, where: str) -> list[str]:
  """UTF-8 lines split as training splits its files; a Windows line end's '\\r' is dropped."""
  from flax_transformer.data import DataError, split_lines
  try:
    return [line.removesuffix('\r') for line in split_lines(data, where)]
  except DataError as error:
    raise InputError(str(error)) from None


def read_input(args: argparse.Namespace) -> tuple[list[str], bool]:
  """The sentences, and whether they came from a file or stdin (then a progress bar shows)."""
  if args.sentences and args.input:
    raise InputError('give sentences as arguments or --input FILE, not both')
  if args.sentences:
    return list(args.sentences), False
  if args.input is not None and str(args.input) != '-':
    if not args.input.is_file():
      raise InputError(f'--input {args.input}: no such file')
    lines, source = _lines(args.input.read_bytes(), str(args.input)), str(args.input)
  elif sys.stdin.isatty():
    raise InputError('nothing to translate: give sentences as arguments, --input FILE, or pipe '
                     'text into standard input')
  else:
    lines, source = _lines(sys.stdin.buffer.read(), 'standard input'), 'standard input'
  if not lines:
    raise InputError(f'{source} is empty: nothing to translate')
  return lines, True


def read_references(path: Path, count: int) -> list[str]:
  if not path.is_file():
    raise InputError(f'--reference {path}: no such file')
  references = _lines(path.read_bytes(), str(path))
  if len(references) != count:
    raise InputError(f'--reference {path} has {len(references)} lines, the input has {count}')
  return references


def _open_output(path: Path | None):
  """The --output file opened for writing (after the checkpoint loaded), or standard output."""
  if path is None:
    return sys.stdout
  try:
    return open(path, 'w', encoding='utf-8')
  except OSError as error:
    raise InputError(f'--output {path}: cannot write it ({error.strerror or error})') from None


def blocks(items: Sequence[str], size: int) -> Iterator[tuple[int, Sequence[str]]]:
  for start in range(0, len(items), size):
    yield start, items[start:start + size]


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  # Imported here so that --help and argument errors answer at once.
  from flax_transformer.checkpoint import CheckpointError
  from flax_transformer.config import ConfigError
  from flax_transformer.tokenizer import TokenizerError
  from flax_transformer.translate import Search, Translator

  try:
    sentences, show_progress = read_input(args)
    references = (read_references(args.reference, len(sentences))
                  if args.reference is not None else None)
    def make_search(method: str) -> Search:
      # A fixed length is one candidate per sentence; predicted lengths keep the 3 best.
      length_beam = args.length_beam or (1 if args.nat_length == 'fixed' else 3)
      return Search(method=method, beam_size=args.beam_size, alpha=args.alpha,
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, iterations=args.iterations, length_beam=length_beam,
                    nat_length=args.nat_length, max_len=args.max_len)

    # A named method's settings are refused before the checkpoint loads.
    search = make_search(args.method) if args.method else None
    translator = Translator.from_checkpoint(args.checkpoint, step=args.step,
                                            average_last=args.average_last)
    if search is None:
      # The checkpoint's kind picks the default: beam search (the paper) or mask-predict.
      search = make_search('nat' if translator.config.kind == 'cmlm' else 'beam')
    search.check_model(translator.config)
    max_len = translator.config.max_len
    if args.max_len is not None and not 1 <= args.max_len <= max_len:
      raise InputError(f'--max-len must be in [1, {max_len}] (the model\'s max_len, the length '
                       f'of its positional table), got {args.max_len}')
    output = _open_output(args.output)
  except (InputError, CheckpointError, ConfigError, TokenizerError) as error:
    print(f'decode.py: error: {error}', file=sys.stderr)
    return 2

  destination = args.output or 'standard output'
  translations = []
  try:
    with tqdm(total=len(sentences), unit='sent', desc='decode', disable=not show_progress,
              file=sys.stderr, dynamic_ncols=True) as progress, warnings.catch_warnings():
      # Library warnings (e.g. an output budget capped at max_len) as one plain line each.
      warnings.showwarning = lambda message, *_, **__: progress.write(
          f'decode.py: warning: {message}', file=sys.stderr)
      for start, block in blocks(sentences, args.batch_size * BATCHES_PER_BLOCK):
        sources = translator.encode(block)
        for index, count in sources.truncated:
          progress.write(f'decode.py: warning: line {start + index + 1} has {count} subword '
                         f'tokens; the model reads at most {max_len - 1} + EOS: truncated',
                         file=sys.stderr)
        done = translator.translate_sources(sources, search, args.batch_size,
                                            on_batch=progress.update)
        progress.update(sum(ids is None for ids in sources.ids))
        output.write(''.join(text + '\n' for text in done))
        output.flush()
        translations.extend(done)
    if output is not sys.stdout:
      output.close()  # a failure to write the last bytes is reported like any other
  except OSError as error:
    print(f'decode.py: error: writing {destination} failed ({error.strerror or error}); it holds '
          f'the translations of the first {len(translations)} lines at most', file=sys.stderr)
    return 1
  except KeyboardInterrupt:
    print(f'decode.py: interrupted; {destination} holds the translations of the first '
          f'{len(translations)} lines', file=sys.stderr)
    return 128 + signal.SIGINT
  except BaseException:
    print(f'decode.py: failed after {len(translations)} lines, whose translations are in '
          f'{destination}:', file=sys.stderr)
    raise
  finally:
    if output is not sys.stdout and not output.closed:
      # After an error: what could not be written is reported already.
      with contextlib.suppress(OSError):
        output.close()

  if references is not None:
    from sacrebleu.metrics import BLEU, CHRF
    stream = sys.stdout if args.output else sys.stderr
    for metric in (BLEU(), CHRF()):
      score = metric.corpus_score(translations, [references])
      print(f'{score}  signature: {metric.get_signature()}', file=stream)
  return 0


if __name__ == '__main__':
  sys.exit(main())
