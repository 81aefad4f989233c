"""Encoding by words: each distinct word goes through `tokenizers` once, a line's ids are its
words' ids joined, gathered with NumPy.

    memo = WordMemo(backend)                 # backend: a `tokenizers.Tokenizer` (see `applies_to`)
    ids, lengths = memo.encode(['Ein Hund läuft.', 'Zwei Hunde'])
    # ids int32 [total tokens], lengths int64 [2]: the same ids as
    # backend.encode_batch_fast(texts, add_special_tokens=False), row after row

Why this is faster: `tokenizers` runs its whole pipeline per line (NFKC with an alignment
table, the Metaspace pass, an `Encoding` object turned into Python ints), and a corpus's
words repeat: a corpus of millions of lines holds some hundred thousand distinct words.
Here Arrow splits a batch of lines at its spaces and groups equal words (in C++), each
distinct word of the batch is looked up once, and the ids are NumPy gathers.

Why the ids are the same: our tokenizers (`Tokenizer.train`) normalise with NFKC, then
Metaspace turns every ' ' into '▁' and starts a word at each '▁' (prepending one to the
line), and the subword model (BPE or unigram) encodes each word on its own. Cut a line at
its spaces into chunks. NFKC never acts across a space (U+0020 is a starter that composes
with nothing and stops canonical reordering), so the line normalises chunk by chunk; each
chunk is preceded by a '▁' in the line (the prepended one, or its space) and followed by
the next chunk's '▁'; so the line's words are the chunks' words, provided a chunk encoded
alone gets the same leading '▁' as in the line. That fails only when a chunk is empty
(two spaces in a row, a leading or trailing space) or when its normalised text already
starts with ' ' or '▁' (a chunk starting with '▁', U+00A0, U+3000, '´', ...): then
Metaspace prepends nothing to the chunk alone, while in the line the '▁' before it stays a
word of its own. Such chunks are marked unsafe, and a line holding one is encoded whole by
`tokenizers`, as is every line once the memo is full (`capacity` distinct words). Special
tokens' strings are text (`tokenizer.special_tokens_as_text`), so '</s>' in a line is a
word like any other. `applies_to` checks that a backend is built this way (its
normaliser, pre-tokenizer, model, added tokens); the memo is used for no other.

tests/test_word_memo.py checks the ids against `tokenizers` on generated lines of the
awkward characters above, and benchmarks/encoding_gate.py the SHA-256 of whole corpora.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import tokenizers

# Distinct words remembered (with their ids): a few hundred MB of Python strings and
# dictionary at most. A line with a word first seen after that goes to `tokenizers` whole.
MEMO_WORDS = 2_000_000
METASPACE = '▁'
_UNSAFE = -2  # a word whose ids alone differ from its ids in a line (module docstring)
_MISSING = -1
_NORMALIZER = {'type': 'NFKC'}
_PRE_TOKENIZER = {
  'type': 'Metaspace',
  'replacement': METASPACE,
  'prepend_scheme': 'always',
  'split': True,
}


def applies_to(backend: tokenizers.Tokenizer, config: dict | None = None) -> bool:
  """Whether a line's ids under `backend` are its space-separated chunks' ids joined (module
  docstring): NFKC, Metaspace('▁', always, split), BPE without dropout or unigram, only
  special added tokens and those encoded as text, no truncation or padding.

  config: `backend`'s tokenizer.json, parsed, when the caller has it (parsing a vocabulary
    of tens of thousands of pieces takes a tenth of a second).
  """
  config = config if config is not None else json.loads(backend.to_str())
  model = config.get('model') or {}
  return (
    config.get('normalizer') == _NORMALIZER
    and config.get('pre_tokenizer') == _PRE_TOKENIZER
    and (
      model.get('type') == 'Unigram'
      or (model.get('type') == 'BPE' and model.get('dropout') is None)
    )
    and all(token.get('special') for token in config.get('added_tokens') or [])
    and backend.encode_special_tokens
    and config.get('truncation') is None
    and config.get('padding') is None
  )


class WordMemo:
  """Ids of distinct words, and lines encoded from them (module docstring)."""

  def __init__(
    self, backend: tokenizers.Tokenizer, capacity: int = MEMO_WORDS, config: dict | None = None
  ):
    """config: `backend`'s tokenizer.json, parsed, if at hand (`applies_to`)."""
    if not applies_to(backend, config):
      raise ValueError(
        'WordMemo needs a tokenizer built as Tokenizer.train builds one (word_memo.applies_to)'
      )
    self._backend = backend
    self.capacity = capacity
    self._row = {'': _UNSAFE}  # word -> row of the tables below, or _UNSAFE
    self._starts = np.zeros(1024, np.int64)  # [rows] first id in _ids
    self._lengths = np.zeros(1024, np.int64)  # [rows] ids per word
    self._ids = np.zeros(8192, np.int32)  # [ids of every remembered word]
    self._rows = self._used = 0

  def __len__(self) -> int:
    """Distinct words remembered (with their ids)."""
    return self._rows

  def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [sum of lengths], lengths int64 [len(texts)]): each text's ids without
    specials, row after row; equal to the backend's `encode_batch_fast`."""
    texts = list(texts)
    if not texts:
      return np.zeros(0, np.int32), np.zeros(0, np.int64)
    try:
      # Arrow splits and groups the words in C++ (exact string equality), so Python sees
      # each distinct word of the batch once rather than every word.
      chunks = pc.split_pattern(pa.array(texts, pa.large_string()), ' ')
    except (pa.ArrowException, UnicodeError):  # e.g. a lone surrogate: not UTF-8 text
      return encode_lines(self._backend, texts)
    counts = pc.list_value_length(chunks).to_numpy().astype(np.int64)  # [texts] chunks each
    grouped = pc.dictionary_encode(chunks.flatten())
    rows = self._rows_of(grouped.dictionary.to_pylist())[grouped.indices.to_numpy()]
    line_starts = np.cumsum(counts) - counts
    plain = np.logical_or.reduceat(rows < 0, line_starts)  # [texts] a chunk not in the memo
    lengths = np.add.reduceat(self._lengths[np.maximum(rows, 0)], line_starts)
    plain_rows = np.flatnonzero(plain)
    if len(plain_rows):
      plain_ids, lengths[plain_rows] = encode_lines(self._backend, [texts[i] for i in plain_rows])
    ids = np.empty(int(lengths.sum()), np.int32)
    from_memo = np.repeat(~plain, lengths)  # [ids] which ids the memo gives
    ids[from_memo] = self._gather(rows[~np.repeat(plain, counts)])
    if len(plain_rows):
      ids[~from_memo] = plain_ids
    return ids, lengths

  def _rows_of(self, words: list[str]) -> np.ndarray:
    """[words] each distinct word's row, remembering new ones while there is room; _UNSAFE,
    or _MISSING once the memo is full, for words the memo cannot give."""
    rows = np.fromiter(map(self._row.get, words, itertools.repeat(_MISSING)), np.int64, len(words))
    missing = np.flatnonzero(rows == _MISSING)
    if len(missing) and self._rows < self.capacity:
      self._remember([words[i] for i in missing[: self.capacity - self._rows]])
      rows[missing] = [self._row.get(words[i], _MISSING) for i in missing]
    return rows

  def _remember(self, words: list[str]) -> None:
    encodings = self._backend.encode_batch_fast(words, add_special_tokens=False)
    normalize = self._backend.normalizer.normalize_str
    safe = []
    for word, encoding in zip(words, encodings):
      if normalize(word).startswith((' ', METASPACE)):
        self._row[word] = _UNSAFE
      else:
        safe.append((word, encoding.ids))
    lengths = np.fromiter((len(ids) for _, ids in safe), np.int64, len(safe))
    self._grow(len(safe), int(lengths.sum()))
    first, used = self._rows, self._used
    self._lengths[first : first + len(safe)] = lengths
    self._starts[first : first + len(safe)] = used + np.cumsum(lengths) - lengths
    self._ids[used : used + int(lengths.sum())] = np.fromiter(
      itertools.chain.from_iterable(ids for _, ids in safe), np.int32, int(lengths.sum())
    )
    for row, (word, _) in enumerate(safe, first):
      self._row[word] = row
    self._rows, self._used = first + len(safe), used + int(lengths.sum())

  def _grow(self, rows: int, ids: int) -> None:
    """Doubles the tables until `rows` more words and `ids` more ids fit."""
    while self._rows + rows > len(self._starts):
      self._starts = np.resize(self._starts, 2 * len(self._starts))
      self._lengths = np.resize(self._lengths, 2 * len(self._lengths))
    while self._used + ids > len(self._ids):
      self._ids = np.resize(self._ids, 2 * len(self._ids))

  def _gather(self, rows: np.ndarray) -> np.ndarray:
    """[sum of the words' lengths] the ids of the words in `rows` ([words], all >= 0), joined."""
    lengths = self._lengths[rows]
    starts = self._starts[rows]
    # Position k of the output is id (k - where its word begins in the output) of its word.
    shift = np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)
    return self._ids[shift + np.arange(len(shift))]


def encode_lines(backend: tokenizers.Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """`WordMemo.encode`'s result through `tokenizers` alone, line by line (no special ids
  added)."""
  encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
  return flat_rows([encoding.ids for encoding in encodings])


def flat_rows(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [sum of lengths], lengths int64 [rows]): rows of ids joined."""
  lengths = np.fromiter(map(len, rows), np.int64, count=len(rows))
  ids = np.fromiter(itertools.chain.from_iterable(rows), np.int32, count=int(lengths.sum()))
  return ids, lengths
