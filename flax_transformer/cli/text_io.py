"""Lines in and out for the decoding program: arguments, files or standard input, UTF-8."""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from flax_transformer.cli.failures import Failure, one_line
from flax_transformer.data.corpus import split_lines
from flax_transformer.errors import ConfigError, DataError, InputError
from flax_transformer.signals import Stopped

# Sentences read, sorted and decoded together; their translations are written before the next
# block is read. Large enough for length-sorted batches, small enough to see output soon.
BATCHES_PER_BLOCK = 8


def lines_of(data: bytes, where: str) -> list[str]:
  """UTF-8 lines split as training splits its files; a Windows line end's '\\r' is dropped."""
  try:
    return [line.removesuffix('\r') for line in split_lines(data, where)]
  except DataError as error:
    raise InputError(str(error)) from None


def read_input(sentences: Sequence[str], path: Path | None) -> tuple[list[str], bool]:
  """The sentences, and whether they came from a file or stdin (then a progress bar shows)."""
  if sentences and path:
    raise InputError('give sentences as arguments or --input FILE, not both')
  if sentences:
    return list(sentences), False
  if path is not None and str(path) != '-':
    if not path.is_file():
      raise InputError(f'--input {path}: no such file')
    lines, source = lines_of(path.read_bytes(), str(path)), str(path)
  elif sys.stdin.isatty():
    raise InputError(
      'nothing to translate: give sentences as arguments, --input FILE, or pipe '
      'text into standard input'
    )
  else:
    lines, source = lines_of(sys.stdin.buffer.read(), 'standard input'), 'standard input'
  if not lines:
    raise InputError(f'{source} is empty: nothing to translate')
  return lines, True


def read_references(path: Path, count: int) -> list[str]:
  if not path.is_file():
    raise InputError(f'--reference {path}: no such file')
  references = lines_of(path.read_bytes(), str(path))
  if len(references) != count:
    raise InputError(f'--reference {path} has {len(references)} lines, the input has {count}')
  return references


def check_output(output: Path | None, checkpoint: Path, *inputs: Path | None) -> None:
  """Refuses, before anything is written, an --output that would overwrite an input file (the
  sentences, the references) or anything of the checkpoint directory it translates with (and of
  the run an averaged checkpoint comes from)."""
  if output is None:
    return
  from flax_transformer.run.directory import averaged_run
  from flax_transformer.run.outputs import Protected
  from flax_transformer.run.outputs import check_output as check

  protected = [Protected(checkpoint, f'the checkpoint directory {checkpoint}')]
  run = averaged_run(checkpoint)  # an average-lastK's run is an input too
  protected += [Protected(run, f'the run {run}, averaged in {checkpoint}')] if run else []
  protected += [
    Protected(path, f'the {what} {path}')
    for what, path in zip(('input', 'references'), inputs)
    if path is not None and str(path) != '-'
  ]
  check(
    output,
    protected,
    '--output',
    InputError,
    advice='write the translations elsewhere',
    is_file=True,
  )


def open_output(path: Path | None):
  """The --output file opened for writing, or standard output."""
  if path is None:
    return sys.stdout
  try:
    return open(path, 'w', encoding='utf-8')
  except OSError as error:
    raise InputError(f'--output {path}: cannot write it ({error.strerror or error})') from None


def blocks(items: Sequence[str], size: int) -> Iterator[tuple[int, Sequence[str]]]:
  """(first index, items) of consecutive blocks of `size` items."""
  for start in range(0, len(items), size):
    yield start, items[start : start + size]


def check_target_lang(lang: str | None, reference: Path | None) -> None:
  """--target-lang: a language sacremoses tokenizes (ConfigError otherwise), and said to be
  unused, on standard error, without --reference (it only tokenizes the BLEU of one)."""
  if lang is None:
    return
  from sacremoses.corpus import NonbreakingPrefixes

  known = [code for code in NonbreakingPrefixes().available_langs if len(code) <= 3]
  if lang not in known:
    raise ConfigError(
      f'--target-lang {lang!r} is not a language code sacremoses knows (it tokenizes '
      f'tokenized BLEU); known: {", ".join(sorted(known))}'
    )
  if reference is None:
    print(
      f'decode.py: --target-lang {lang} is unused: it tokenizes the BLEU of --reference, '
      'and none is given',
      file=sys.stderr,
    )


def target_language(checkpoint: Path) -> str | None:
  """A run directory's data.tgt_lang (also an average's or best's), else None (a Marian model)."""
  from flax_transformer.errors import CheckpointError
  from flax_transformer.run.config_file import read_config

  try:
    return read_config(checkpoint)[2].tgt_lang
  except CheckpointError:
    return None


def score_lines(translations, references, lang: str | None) -> list[str]:
  """--reference's report (`evaluation.score_lines`), imported only when asked for."""
  from flax_transformer.train.evaluation import score_lines as lines

  return lines(translations, references, lang)


def translate_into(
  output: TextIO,
  destination: str,
  translator,
  method,
  sentences: list[str],
  batch_size: int,
  show_progress: bool,
) -> tuple[int, list[str]]:
  """Decodes block by block, writing each block's translations before reading the next.

  Returns the exit status and the translations written. A failure to write, a signal between
  batches and an error part way each say how many lines `destination` holds.
  """
  translations = []
  try:
    _write_blocks(output, translator, method, sentences, batch_size, show_progress, translations)
    if output is not sys.stdout:
      output.close()  # a failure to write the last bytes is reported like any other
  except OSError as error:
    print(
      f'decode.py: error: writing {destination} failed ({error.strerror or error}); it holds '
      f'the translations of the first {len(translations)} lines at most',
      file=sys.stderr,
    )
    return 1, translations
  except Stopped as stop:  # between batches: the block under way is not written
    print(
      f'decode.py: {stop}; {destination} holds the translations of the first '
      f'{len(translations)} lines',
      file=sys.stderr,
    )
    return stop.exit_code, translations
  except Exception as error:
    raise Failure(
      f'failed after {len(translations)} lines, whose translations are in '
      f'{destination}: {one_line(error)}',
      1,
    ) from error
  finally:
    if output is not sys.stdout and not output.closed:
      with contextlib.suppress(OSError):  # after an error: what failed is reported already
        output.close()
  return 0, translations


def _write_blocks(
  output: TextIO,
  translator,
  method,
  sentences: list[str],
  batch_size: int,
  show_progress: bool,
  translations: list[str],
) -> None:
  """Translates and writes each block, appending to `translations` as each is written."""
  max_len = translator.config.max_len
  with (
    tqdm(
      total=len(sentences),
      unit='sent',
      desc='decode',
      disable=not show_progress,
      file=sys.stderr,
      dynamic_ncols=True,
    ) as progress,
    warnings.catch_warnings(),
  ):
    # Library warnings (e.g. an output budget capped at max_len) as one plain line each.
    warnings.showwarning = lambda message, *_, **__: progress.write(
      f'decode.py: warning: {message}', file=sys.stderr
    )
    for start, block in blocks(sentences, batch_size * BATCHES_PER_BLOCK):
      done = translator.translate(
        block,
        method,
        batch_size=batch_size,
        on_batch=progress.update,
        on_truncated=lambda index, count, start=start: progress.write(
          f'decode.py: warning: line {start + index + 1} has {count} subword tokens; the '
          f'model reads at most {max_len - 1} + EOS: truncated',
          file=sys.stderr,
        ),
      )
      output.write(''.join(text + '\n' for text in done))
      output.flush()
      translations.extend(done)
