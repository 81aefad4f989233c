"""Batches assembled with array operations: gathers and scatters instead of a Python loop per pair.

Axis legend: B rows of a batch, L the row length (S == T == L, as in `batching`);
P pairs placed in the rows built, K their tokens on one side.

Three parts, each a drop-in for a loop of `batching`/`packing`:

  * `build_bucketed(corpus, pairs, rows, length)` and `build_packed(corpus, rows_of_pairs,
    rows, length)` fill a `Batch` bit for bit as `Batcher._build` and
    `PackingBatcher._build` do, from the same plan entry. Every token's (row, column) and
    its place in the flat id arrays come from `np.repeat` and `np.cumsum` over the pairs'
    lengths; one fancy-indexed gather from the corpus and one scatter per array fill it.
    The work is a dozen NumPy calls per batch whatever its number of pairs.
  * `index`/`count` build only rows `[index * B / count, (index + 1) * B / count)` of the
    global batch, equal to `batching.shard(global batch, index, count)`: a process of a
    multi-host job gathers only its own rows, 1/count of the work.
  * `pack_plan`: which pairs share a row, with array operations and a loop over pair
    *types* (distinct (source length, target length)), never over pairs, so its cost is
    bounded by L² whatever the corpus size. The algorithm, best-fit decreasing on the
    length histogram:

      1. group the pairs by type (a, b) (`np.unique`); the pairs of a type are
         interchangeable for packing, and keep their shuffled order;
      2. take the types largest first (by max(a, b), then a + b); bins (rows) are kept as
         *groups* of identical content (how many rows, the room left on each side, the
         types they hold);
      3. place a type's c pairs into the group with the least room left (source plus
         target) that still fits (a, b), one pair per row of that group, splitting the
         group when c is smaller; repeat until the c pairs are placed or no group fits;
         then open new rows, each with as many pairs of the type as fit;
      4. expand the groups into rows and give each row slot of a type the next pair of
         that type (a stable sort by type: slots and pairs meet in order), then shuffle
         the rows (seeded), so that a batch, cut from consecutive rows, is a random draw.

    In one dimension first- and best-fit decreasing need at most 11/9 of the fewest rows
    possible (plus one); the online
    first fit of `packing.pack_rows` (at most 16 open rows, pairs in shuffled order)
    cannot look ahead, so it leaves more padding (both are measured in
    benchmarks/results/data_pipeline_dev.json and tests/test_assembly.py checks this
    one's padding is no larger).

`ArrayBatcher` and `ArrayPackingBatcher` are `Batcher` and `PackingBatcher` with these
builders (and, for packing, `pack_plan` instead of `pack_rows`; `plan='first_fit'` keeps
today's rows), plus `local_batch_at(step, index, count)`. Batches stay a pure function of
(seed, step): a resumed run builds exactly what the uninterrupted one did.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import numpy as np

from flax_transformer.config import NONNEGATIVE, check_bounds
from flax_transformer.data.batching import Batch, Batcher, EncodedCorpus, process_rows
from flax_transformer.data.corpus import DataError
from flax_transformer.data.packing import PackingBatcher, pack_rows

# ------------------------------------------------------------------------------------------------
# Rows of pairs, flat.


@dataclasses.dataclass(frozen=True)
class PackedRows:
  """Rows of pairs in one flat array: row r holds `pairs[splits[r]:splits[r + 1]]`.

  Behaves as the list of per-row arrays `pack_rows` returns where `Batcher._plan` uses
  it: `len()` is the number of rows, a slice is the rows it selects, an int a row.
  """

  pairs: np.ndarray  # int64 [P]
  splits: np.ndarray  # int64 [R + 1], splits[0] == 0

  @classmethod
  def from_rows(cls, rows: Sequence[Sequence[int]]) -> PackedRows:
    counts = np.fromiter(map(len, rows), np.int64, count=len(rows))
    splits = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(counts, out=splits[1:])
    pairs = (
      np.concatenate([np.asarray(row, np.int64) for row in rows])
      if len(rows)
      else np.zeros(0, np.int64)
    )
    return cls(pairs=pairs.astype(np.int64, copy=False), splits=splits)

  def __len__(self) -> int:
    return len(self.splits) - 1

  def __getitem__(self, index):
    if isinstance(index, slice):
      start, stop, step = index.indices(len(self))
      if step != 1:
        raise ValueError('PackedRows slices take consecutive rows')
      stop = max(start, stop)
      return PackedRows(
        pairs=self.pairs[self.splits[start] : self.splits[stop]],
        splits=self.splits[start : stop + 1] - self.splits[start],
      )
    return self.pairs[self.splits[index] : self.splits[index + 1]]

  def rows(self) -> list[np.ndarray]:
    """As `pack_rows` returns them: one int64 array per row."""
    return [self[r] for r in range(len(self))]


# ------------------------------------------------------------------------------------------------
# Builders.


def _spans(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For K = sum(lengths) tokens: the item each belongs to and its position within it."""
  items = np.repeat(np.arange(len(lengths)), lengths)
  starts = np.cumsum(lengths) - lengths
  return items, np.arange(int(lengths.sum()), dtype=np.int64) - starts[items]


def _side(ids: np.ndarray, offsets: np.ndarray, pairs: np.ndarray):
  """(lengths [P], token -> pair [K], token position [K], index into ids [K], token ids [K])
  of one side. `np.asarray` views a memmap as a plain array (its `__getitem__` is Python)."""
  ids, offsets = np.asarray(ids), np.asarray(offsets)
  starts = offsets[pairs]
  lengths = offsets[pairs + 1] - starts
  items, positions = _spans(lengths)
  flat = starts[items] + positions
  return lengths, items, positions, flat, ids[flat]


def _shifted(ids: np.ndarray, flat: np.ndarray, positions: np.ndarray, bos: int) -> np.ndarray:
  """tgt_in's tokens: BOS at each pair's first position, else the previous target id."""
  previous = np.asarray(ids)[np.maximum(flat - 1, 0)]
  return np.where(positions == 0, np.int32(bos), previous)


def build_bucketed(
  corpus: EncodedCorpus, pairs: np.ndarray, rows: int, length: int, index: int = 0, count: int = 1
) -> Batch:
  """`Batcher._build(bucket, pairs)` for a bucket of `rows` x `length`, or with `count` > 1
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
  """`PackingBatcher._build(bucket, rows_of_pairs)` for a bucket of `rows` x `length`, or
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


# ------------------------------------------------------------------------------------------------
# The packing plan.


def pack_plan(
  order: np.ndarray,
  src_lengths: np.ndarray,
  tgt_lengths: np.ndarray,
  length: int,
  rng: np.random.Generator | None = None,
) -> PackedRows:
  """Pairs `order` (indices into the length arrays, each <= `length` a side) -> rows, by
  best-fit decreasing on the length histogram (the module docstring); every pair lands in
  exactly one row. `rng` shuffles the rows (None: the order the groups made them).
  """
  order = np.asarray(order, np.int64)
  if not len(order):
    return PackedRows(pairs=np.zeros(0, np.int64), splits=np.zeros(1, np.int64))
  need_src = np.asarray(src_lengths[order], np.int64)
  need_tgt = np.asarray(tgt_lengths[order], np.int64)
  if need_src.max() > length or need_tgt.max() > length or min(need_src.min(), need_tgt.min()) < 1:
    raise DataError(f'pack_plan: every pair needs 1..{length} positions a side')
  types, pair_type, type_count = np.unique(
    need_src * (length + 1) + need_tgt, return_inverse=True, return_counts=True
  )
  type_src, type_tgt = types // (length + 1), types % (length + 1)
  largest_first = np.lexsort((-(type_src + type_tgt), -np.maximum(type_src, type_tgt)))
  groups = _Groups(length)
  for kind in largest_first.tolist():
    a, b, left = int(type_src[kind]), int(type_tgt[kind]), int(type_count[kind])
    while left:
      group = groups.best_fit(a, b)
      if group < 0:
        per_row = min(length // a, length // b)
        full, rest = divmod(left, per_row)
        if full:
          groups.add(full, (kind,) * per_row, length - per_row * a, length - per_row * b)
        if rest:
          groups.add(1, (kind,) * rest, length - rest * a, length - rest * b)
        break
      left -= groups.place(group, kind, a, b, left)
  # Expand: each group's rows, each row its slots (one type each); rows in group order.
  live = [g for g in range(groups.size) if groups.count[g]]
  contents = [groups.contents[g] for g in live]
  row_counts = np.repeat([len(c) for c in contents], groups.count[live])
  slot_type = np.concatenate(
    [np.tile(np.asarray(c, np.int64), int(groups.count[g])) for g, c in zip(live, contents)]
  )
  pairs = np.empty(len(order), np.int64)
  pairs[np.argsort(slot_type, kind='stable')] = order[np.argsort(pair_type, kind='stable')]
  splits = np.zeros(len(row_counts) + 1, np.int64)
  np.cumsum(row_counts, out=splits[1:])
  if rng is not None:
    pairs, splits = _reorder_rows(pairs, splits, rng.permutation(len(row_counts)))
  return PackedRows(pairs=pairs, splits=splits)


class _Groups:
  """Rows of identical content, as arrays: count, room left per side, and the types held."""

  def __init__(self, length: int, capacity: int = 256):
    self.length = length
    self.count = np.zeros(capacity, np.int64)
    self.src_free = np.zeros(capacity, np.int64)
    self.tgt_free = np.zeros(capacity, np.int64)
    self.contents: list[tuple[int, ...]] = []
    self.index: dict[tuple[int, ...], int] = {}
    self.size = 0

  def add(self, count: int, content: tuple[int, ...], src_free: int, tgt_free: int) -> None:
    group = self.index.get(content)
    if group is None:
      if self.size == len(self.count):
        for name in ('count', 'src_free', 'tgt_free'):
          setattr(
            self, name, np.concatenate([getattr(self, name), np.zeros_like(getattr(self, name))])
          )
      group = self.index[content] = self.size
      self.contents.append(content)
      self.src_free[group], self.tgt_free[group] = src_free, tgt_free
      self.size += 1
    self.count[group] += count

  def best_fit(self, a: int, b: int) -> int:
    """The group with the least room (both sides together) that fits (a, b); -1 if none."""
    n = self.size
    src_free, tgt_free = self.src_free[:n], self.tgt_free[:n]
    fits = (self.count[:n] > 0) & (src_free >= a) & (tgt_free >= b)
    if not fits.any():
      return -1
    room = np.where(fits, src_free + tgt_free, np.iinfo(np.int64).max)
    return int(np.argmin(room))

  def place(self, group: int, kind: int, a: int, b: int, left: int) -> int:
    """One pair of `kind` into each of up to `left` rows of `group`; returns how many."""
    moved = int(min(left, self.count[group]))
    self.count[group] -= moved
    self.add(
      moved,
      self.contents[group] + (kind,),
      int(self.src_free[group]) - a,
      int(self.tgt_free[group]) - b,
    )
    return moved


def _reorder_rows(
  pairs: np.ndarray, splits: np.ndarray, order: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  counts = np.diff(splits)[order]
  new_splits = np.zeros(len(order) + 1, np.int64)
  np.cumsum(counts, out=new_splits[1:])
  rows, positions = _spans(counts)
  return pairs[splits[order][rows] + positions], new_splits


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


# ------------------------------------------------------------------------------------------------
# The batchers.


class ArrayBatcher(Batcher):
  """`Batcher` (same plan, same batches, bit for bit) built by `build_bucketed`; with
  `local_batch_at` building one process's rows only."""

  def _build(self, bucket: int, pairs: np.ndarray) -> Batch:
    return build_bucketed(self.corpus, pairs, self.rows[bucket], self.length_buckets[bucket])

  def _entry(self, step: int) -> tuple[int, np.ndarray]:
    check_bounds(step, NONNEGATIVE, 'step', DataError)
    epoch_index, index = divmod(step, self.num_batches_per_epoch)
    return self._plan(epoch_index)[index]

  def local_batch_at(self, step: int, index: int, count: int) -> Batch:
    """`shard(batch_at(step), index, count)`, building only those rows."""
    bucket, pairs = self._entry(step)
    return build_bucketed(
      self.corpus, pairs, self.rows[bucket], self.length_buckets[bucket], index, count
    )


class ArrayPackingBatcher(PackingBatcher):
  """`PackingBatcher` built by `build_packed`, its rows planned by `pack_plan` (best-fit
  decreasing; rows shuffled by the epoch's generator) or, with `plan='first_fit'`, by
  `pack_rows` exactly as `PackingBatcher` plans them (then its batches are bit for bit
  `PackingBatcher`'s); with `local_batch_at` building one process's rows only."""

  def __init__(
    self,
    corpus: EncodedCorpus,
    max_tokens: int,
    seed: int,
    row_length: int,
    length_buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    shuffle: bool = True,
    plan: Literal['best_fit', 'first_fit'] = 'best_fit',
  ):
    if plan not in ('best_fit', 'first_fit'):
      raise DataError(f"plan must be 'best_fit' or 'first_fit', got {plan!r}")
    self.plan_kind = plan
    super().__init__(corpus, max_tokens, seed, row_length, length_buckets, row_multiple, shuffle)

  def _fill_rows(
    self, bucket: int, pairs: np.ndarray, rng: np.random.Generator | None
  ) -> PackedRows:
    """A bucket's shuffled pairs -> its rows: `pack_plan` (which shuffles the rows it makes
    with the epoch's generator), or `pack_rows` with plan='first_fit'."""
    length = self.length_buckets[bucket]
    if self.plan_kind == 'first_fit':
      return PackedRows.from_rows(pack_rows(pairs, self._src_lengths, self._tgt_lengths, length))
    return pack_plan(pairs, self._src_lengths, self._tgt_lengths, length, rng)

  def _build(self, bucket: int, rows_of_pairs) -> Batch:
    return build_packed(self.corpus, rows_of_pairs, self.rows[bucket], self.length_buckets[bucket])

  def local_batch_at(self, step: int, index: int, count: int) -> Batch:
    """`shard(batch_at(step), index, count)`, building only those rows."""
    bucket, rows_of_pairs = self._entry(step)
    return build_packed(
      self.corpus, rows_of_pairs, self.rows[bucket], self.length_buckets[bucket], index, count
    )
