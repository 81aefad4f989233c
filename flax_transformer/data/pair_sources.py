"""Pair sources: a split's sentence pairs as the corpus cache reads them, with a content key.

    source = TextPairFiles('data/train.en', 'data/train.de')   # two text files, read as a stream
    source = DatasetPairs(ds['train'], content=files_fingerprint([...]))  # a `datasets` split
    source.fingerprint()          # what the encoded ids depend on: part of `cache.cache_key`
    source.blocks(20_000)         # the text in blocks of lines, for `encoding.encoded_blocks`
    source.sample_pairs(100_000)  # a seeded random sample, for training a tokenizer

The fingerprint of text files (`files_fingerprint`) is each file's size and the SHA-256 of
its bytes, not paths and mtimes: the content is what the ids depend on, so a moved, copied
or touched corpus keeps its cache, and an edit that keeps the size and mtime (`cp -p`, a
restore, a clock skew) still changes the key. Hashing is ~1-2 s per GB on one core
(SHA-NI), seconds at WMT14's size, and the same pass counts the lines for the progress bar.

They live beside `corpus` (which reads whole splits into tables, and chooses the files:
`corpus.text_pair_files`) rather than in it, which would pass its 500 lines.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import datasets
import numpy as np

from flax_transformer.data.corpus import invalid_utf8
from flax_transformer.errors import DataError

_HASH_BLOCK = 8 << 20


def files_fingerprint(paths: Sequence[str | Path]) -> dict:
  """{'files': [{'name', 'size', 'sha256', 'lines'}]} for each path, in order: the content key.

  `lines` counts '\\n'-separated lines as `corpus.split_lines` does (a last line without a
  newline counts), from the same read that hashes the bytes.
  """
  entries = []
  for path in paths:
    path = Path(path)
    digest, size, newlines, last = hashlib.sha256(), 0, 0, b'\n'
    try:
      with open(path, 'rb') as file:
        while block := file.read(_HASH_BLOCK):
          digest.update(block)
          size += len(block)
          newlines += block.count(b'\n')
          last = block[-1:]
    except OSError as error:
      raise DataError(f'{path}: cannot read it ({error.strerror or error})') from error
    entries.append(
      {
        'name': path.name,
        'size': size,
        'sha256': digest.hexdigest(),
        'lines': newlines + (last != b'\n'),
      }
    )
  return {'files': entries}


@dataclasses.dataclass(frozen=True)
class TextPairFiles:
  """One split as two UTF-8 text files, line N of `target` translating line N of `source`.

  Read and cleaned exactly as `corpus.load_parallel` reads a text directory: lines split on
  '\\n' only, both sides stripped, pairs with an empty side dropped; `example_ids` count
  the pairs kept by that cleaning, as the rows of `load_parallel(...)[split]` do.
  """

  source: str | Path
  target: str | Path

  @functools.cached_property
  def _fingerprint(self) -> dict:
    return {
      'kind': 'text-pair-files',
      'clean': 'strip-drop-empty',
      **files_fingerprint([self.source, self.target]),
    }

  def fingerprint(self) -> dict:
    """The content key (read once: every byte is hashed)."""
    return self._fingerprint

  @property
  def num_lines(self) -> int:
    """Lines of the source file (the target's must match; `blocks` checks)."""
    return self._fingerprint['files'][0]['lines']

  def describe(self) -> str:
    return f'{self.source} + {self.target}'

  def sample_pairs(self, count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(sources, targets) of `count` lines drawn at random (seed), in file order and cleaned;
    every line when count is 0 or the files hold no more. For training a tokenizer: memory
    grows with the sample, not with the files."""
    chosen = sample_rows(self.num_lines, count, seed)
    wanted = None if chosen is None else set(chosen.tolist())
    sources, targets = [], []
    with open(self.source, 'rb') as src_file, open(self.target, 'rb') as tgt_file:
      for number, (src_line, tgt_line) in enumerate(zip(src_file, tgt_file)):
        if wanted is not None and number not in wanted:
          continue  # not decoded: only the sample's lines cost more than a read
        src_text = _decode_line(src_line, self.source, number)
        tgt_text = _decode_line(tgt_line, self.target, number)
        if src_text and tgt_text:
          sources.append(src_text)
          targets.append(tgt_text)
    return sources, targets

  def blocks(self, lines: int) -> Iterator[tuple]:
    """('text', src bytes, tgt bytes, first line number (0-based), file names) per `lines` lines."""
    with open(self.source, 'rb') as src_file, open(self.target, 'rb') as tgt_file:
      for first in itertools.count(0, lines):
        src_lines = list(itertools.islice(src_file, lines))
        tgt_lines = list(itertools.islice(tgt_file, lines))
        if len(src_lines) != len(tgt_lines):
          src_total = first + len(src_lines) + sum(1 for _ in src_file)
          tgt_total = first + len(tgt_lines) + sum(1 for _ in tgt_file)
          raise DataError(
            f'{self.source} has {src_total:,} lines but {self.target} has '
            f'{tgt_total:,}; line N of one must translate line N of the other'
          )
        if not src_lines:
          return
        yield (
          'text',
          b''.join(src_lines),
          b''.join(tgt_lines),
          first,
          (str(self.source), str(self.target)),
        )


def sample_rows(total: int, count: int, seed: int = 0) -> np.ndarray | None:
  """`count` of the rows 0..total-1 drawn without replacement (seeded), sorted; None for all
  of them (count 0, or no fewer rows than asked for)."""
  if count == 0 or count >= total:
    return None
  return np.sort(np.random.default_rng(seed).choice(total, count, replace=False))


def _decode_line(line: bytes, path: str | Path, number: int) -> str:
  try:
    return line.decode('utf-8').strip()
  except UnicodeDecodeError as error:
    raise invalid_utf8(str(path), line, error, number) from None


@dataclasses.dataclass(frozen=True)
class DatasetPairs:
  """A `datasets.Dataset` split with 'source' and 'target' columns, taken as it is (as
  `encode_corpus` takes it), with a `content` fingerprint the caller vouches for: e.g.
  `files_fingerprint` of the files it was read from plus how they were read. (A
  `datasets` fingerprint of an in-memory table is random per process, so it cannot be
  the key.)"""

  dataset: datasets.Dataset
  content: str | dict

  def fingerprint(self) -> dict:
    return {'kind': 'dataset', 'rows': len(self.dataset), 'content': self.content}

  def describe(self) -> str:
    return f'a dataset of {len(self.dataset):,} pairs'

  def sample_pairs(self, count: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """As `TextPairFiles.sample_pairs`, over the dataset's rows (taken as they are)."""
    chosen = sample_rows(len(self.dataset), count, seed)
    rows = self.dataset if chosen is None else self.dataset.select(chosen)
    return list(rows['source']), list(rows['target'])

  def blocks(self, lines: int) -> Iterator[tuple]:
    columns = self.dataset.select_columns(['source', 'target'])
    for first in range(0, len(columns), lines):
      chunk = columns[first : first + lines]
      yield ('list', chunk['source'], chunk['target'], first, None)


PairSource = TextPairFiles | DatasetPairs
