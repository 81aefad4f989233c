"""The assembler: a batch from one plan entry with array operations, never a loop per pair.

Axis legend: B rows of a batch, L the row length (S == T == L, as in `batching`);
P pairs placed in the rows built, K their tokens on one side.

`build_bucketed(corpus, pairs, rows, length)` (one pair a row) and `build_packed(corpus,
rows_of_pairs, rows, length)` (`plans.PackedRows`, with segments and positions) fill a
`Batch`: every token's (row, column) and its place in the flat id arrays come from
`np.repeat` and `np.cumsum` over the pairs' lengths; one fancy-indexed gather from the
corpus and one scatter per array fill it, a dozen NumPy calls per batch whatever its
number of pairs. With `index`/`count` they build only rows `[index * B / count, (index + 1)
* B / count)` of the global batch, equal to `batching.shard(global batch, index, count)`:
a process of a multi-host job gathers only its own rows, 1/count of the work.
tests/support/loop_batches.py keeps the Python-loop builders these replaced, as oracles.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flax_transformer.data.batching import Batch, EncodedCorpus, process_rows
from flax_transformer.data.plans import PackedRows, token_spans


def _side(ids: np.ndarray, offsets: np.ndarray, pairs: np.ndarray):
  """(lengths [P], token -> pair [K], token position [K], index into ids [K], token ids [K])
  of one side. `np.asarray` views a memmap as a plain array (its `__getitem__` is Python)."""
  ids, offsets = np.asarray(ids), np.asarray(offsets)
  starts = offsets[pairs]
  lengths = offsets[pairs + 1] - starts
  items, positions = token_spans(lengths)
  flat = starts[items] + positions
  return lengths, items, positions, flat, ids[flat]


def _shifted(ids: np.ndarray, flat: np.ndarray, positions: np.ndarray, bos: int) -> np.ndarray:
  """tgt_in's tokens: BOS at each pair's first position, else the previous target id."""
  previous = np.asarray(ids)[np.maximum(flat - 1, 0)]
  return np.where(positions == 0, np.int32(bos), previous)


def build_bucketed(
  corpus: EncodedCorpus, pairs: np.ndarray, rows: int, length: int, index: int = 0, count: int = 1
) -> Batch:
  """The batch of one pair a row, for a bucket of `rows` x `length`, or with `count` > 1
  only rows `[index * rows / count, (index + 1) * rows / count)` of it (`shard`'s part)."""
  first, size = process_rows(rows, index, count)
  pairs = np.asarray(pairs, np.int64)[first : first + size]
  pad = corpus.pad_id
  src = np.full((size, length), pad, np.int32)
  tgt_in = np.full((size, length), pad, np.int32)
  tgt_out = np.full((size, length), pad, np.int32)
  example_ids = np.full((size,), -1, np.int32)
  _, row, column, _, tokens = _side(corpus.src_ids, corpus.src_offsets, pairs)
  src.ravel()[row * length + column] = tokens
  _, row, column, flat, tokens = _side(corpus.tgt_ids, corpus.tgt_offsets, pairs)
  at = row * length + column
  tgt_out.ravel()[at] = tokens
  tgt_in.ravel()[at] = _shifted(corpus.tgt_ids, flat, column, corpus.bos_id)
  example_ids[: len(pairs)] = np.asarray(corpus.example_ids)[pairs]
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=example_ids, pad_id=pad)


def build_packed(
  corpus: EncodedCorpus,
  rows_of_pairs: PackedRows | Sequence[np.ndarray],
  rows: int,
  length: int,
  index: int = 0,
  count: int = 1,
) -> Batch:
  """The batch of packed rows, for a bucket of `rows` x `length`, or
  with `count` > 1 only this process's rows of it (`shard`'s part)."""
  if not isinstance(rows_of_pairs, PackedRows):
    rows_of_pairs = PackedRows.from_rows(rows_of_pairs)
  first, size = process_rows(rows, index, count)
  mine = rows_of_pairs[first : first + size]
  pairs = mine.pairs
  counts = np.diff(mine.splits)
  row_of_pair = np.repeat(np.arange(len(mine)), counts)
  segment = np.arange(len(pairs)) - mine.splits[row_of_pair]  # 0-based, within its row
  pad = corpus.pad_id
  arrays = {
    name: np.full((size, length), pad if name in ('src', 'tgt_in', 'tgt_out') else 0, np.int32)
    for name in (
      'src',
      'tgt_in',
      'tgt_out',
      'src_segments',
      'tgt_segments',
      'src_positions',
      'tgt_positions',
    )
  }
  for side in ('src', 'tgt'):
    ids, offsets = getattr(corpus, f'{side}_ids'), getattr(corpus, f'{side}_offsets')
    lengths, item, position, flat, tokens = _side(ids, offsets, pairs)
    before = np.zeros(len(pairs) + 1, np.int64)  # tokens of the pairs before each
    np.cumsum(lengths, out=before[1:])
    at = before[:-1] - before[mine.splits[row_of_pair]]  # each pair's first column in its row
    cell = row_of_pair[item] * length + at[item] + position  # index into the [B * L] arrays
    if side == 'src':
      arrays['src'].ravel()[cell] = tokens
    else:
      arrays['tgt_out'].ravel()[cell] = tokens
      arrays['tgt_in'].ravel()[cell] = _shifted(ids, flat, position, corpus.bos_id)
    arrays[f'{side}_segments'].ravel()[cell] = segment[item] + 1
    arrays[f'{side}_positions'].ravel()[cell] = position
  example_ids = np.full((size, length), -1, np.int32)
  example_ids[row_of_pair, segment] = np.asarray(corpus.example_ids)[pairs]
  return Batch(example_ids=example_ids, pad_id=pad, **arrays)


def plan_padding(
  plan: Sequence[tuple[int, Sequence]],
  rows: Sequence[int],
  length_buckets: Sequence[int],
  corpus: EncodedCorpus,
) -> dict[str, float]:
  """Padding of a whole epoch's plan ([(bucket, rows or pairs)] per batch) without building
  it: {'target', 'source'} shares of PAD positions, 'rows' filled, 'positions' per side."""
  positions = sum(rows[bucket] * length_buckets[bucket] for bucket, _ in plan)
  filled = sum(len(entry) for _, entry in plan)
  src = int(np.diff(corpus.src_offsets).sum())
  tgt = int(np.diff(corpus.tgt_offsets).sum())
  return {
    'target': 1 - tgt / positions,
    'source': 1 - src / positions,
    'rows': filled,
    'positions': positions,
  }
