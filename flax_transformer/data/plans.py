"""Row plans: which pairs share a row of a batch, as values a `Batcher` is given.

Axis legend: L the row length of a bucket; P pairs, R rows.

A plan turns one length bucket's pairs, in the epoch's shuffled order, into rows:

  * `Bucketed()`: one pair per row (the paper's batching by approximate length);
  * `FirstFit(row_length)`: pairs packed online, each into the oldest of at most 16 open rows
    where both sides fit (`pack_rows`); runs begun before best fit existed resume with it;
  * `BestFit(row_length)`: best-fit decreasing on the length histogram (`pack_plan`), with
    array operations and a loop over pair *types* (distinct (source length, target length)),
    never over pairs, so its cost is bounded by L² whatever the corpus size:

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
    possible (plus one); the online first fit cannot look ahead, so it leaves more padding
    (benchmarks/results/data_pipeline_dev.json; tests/test_assembly.py checks that best
    fit's padding is no larger).

A packing plan sends pairs no longer than `row_length` to rows of that length and longer
ones to the larger length buckets, packed there too (`buckets`). Packed rows are
`PackedRows`, flat arrays; `assembly.build_packed` fills a batch from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal, Protocol

import numpy as np

from flax_transformer.config import check_bounds
from flax_transformer.data.batching import SEQUENCE_LENGTH
from flax_transformer.errors import DataError

# Rows kept open for the next pairs while first fit packs; more fill rows a little better and
# cost time per pair (a pair tries each open row in turn).
_OPEN_ROWS = 16
PackingPlan = Literal['best_fit', 'first_fit']


class RowPlan(Protocol):
  """How a `Batcher` fills its rows: a frozen value, so a plan is part of what a run is."""

  packs: bool  # several pairs per row (the batches carry segments and positions)

  def buckets(self, length_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """The row lengths of the batches, from the corpus's length buckets."""
    ...

  def rows(
    self,
    pairs: np.ndarray,
    src_lengths: np.ndarray,
    tgt_lengths: np.ndarray,
    length: int,
    rng: np.random.Generator | None,
  ) -> np.ndarray | PackedRows:
    """One bucket's pairs, in order -> its rows (rng: the epoch's generator, None when not
    shuffling). Unpacked: the pairs themselves, one a row."""
    ...


@dataclasses.dataclass(frozen=True)
class Bucketed:
  """One pair per row, in the bucket of the smallest length >= the pair's."""

  packs = False

  def buckets(self, length_buckets: tuple[int, ...]) -> tuple[int, ...]:
    return length_buckets

  def rows(self, pairs, src_lengths, tgt_lengths, length, rng) -> np.ndarray:
    del src_lengths, tgt_lengths, length, rng  # one pair per row, in the given order
    return pairs

  def describe(self) -> str:
    return 'one pair per row'


@dataclasses.dataclass(frozen=True)
class _Packing:
  row_length: int

  packs = True

  def __post_init__(self):
    check_bounds(
      self.row_length, SEQUENCE_LENGTH, 'train.packing (the packed row length)', DataError
    )

  def buckets(self, length_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """`row_length`, then the longer buckets (for the pairs longer than a packed row)."""
    return (self.row_length,) + tuple(b for b in length_buckets if b > self.row_length)


@dataclasses.dataclass(frozen=True)
class FirstFit(_Packing):
  """Pairs packed online in their shuffled order (`pack_rows`); draws nothing more."""

  def rows(self, pairs, src_lengths, tgt_lengths, length, rng) -> PackedRows:
    del rng
    return PackedRows.from_rows(pack_rows(pairs, src_lengths, tgt_lengths, length))

  def describe(self) -> str:
    return f'first fit into rows of {self.row_length}'


@dataclasses.dataclass(frozen=True)
class BestFit(_Packing):
  """Best-fit decreasing on the length histogram (`pack_plan`), rows shuffled by the epoch's
  generator."""

  def rows(self, pairs, src_lengths, tgt_lengths, length, rng) -> PackedRows:
    return pack_plan(pairs, src_lengths, tgt_lengths, length, rng)

  def describe(self) -> str:
    return f'best fit into rows of {self.row_length}'


def row_plan(packing: int, kind: PackingPlan = 'best_fit') -> RowPlan:
  """The plan of `train.packing` (0: `Bucketed`) and a run's recorded packing plan."""
  if kind not in ('best_fit', 'first_fit'):
    raise DataError(f"the packing plan must be 'best_fit' or 'first_fit', got {kind!r}")
  if not packing:
    return Bucketed()
  return BestFit(packing) if kind == 'best_fit' else FirstFit(packing)


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


def token_spans(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For K = sum(lengths) tokens: the item each belongs to and its position within it."""
  items = np.repeat(np.arange(len(lengths)), lengths)
  starts = np.cumsum(lengths) - lengths
  return items, np.arange(int(lengths.sum()), dtype=np.int64) - starts[items]


def pack_rows(
  order: np.ndarray, src_lengths: np.ndarray, tgt_lengths: np.ndarray, length: int
) -> list[np.ndarray]:
  """Pairs `order` (indices into the length arrays, each pair <= `length` a side) -> rows.

  Each pair, in order, goes to the first of the open rows (at most `_OPEN_ROWS`,
  oldest first) with room for its source and its target; else to a new row,
  closing the fullest open row when too many are open. Returns every row's pair
  indices, in the order the rows were opened; every pair is in exactly one row.
  """
  rows: list[list[int]] = []
  open_rows: list[int] = []  # indices into rows
  src_free: dict[int, int] = {}
  tgt_free: dict[int, int] = {}
  for pair in order.tolist():
    need_src, need_tgt = int(src_lengths[pair]), int(tgt_lengths[pair])
    home = next((r for r in open_rows if src_free[r] >= need_src and tgt_free[r] >= need_tgt), None)
    if home is None:
      if len(open_rows) == _OPEN_ROWS:
        open_rows.remove(min(open_rows, key=lambda r: max(src_free[r], tgt_free[r])))
      home = len(rows)
      rows.append([])
      open_rows.append(home)
      src_free[home], tgt_free[home] = length, length
    rows[home].append(pair)
    src_free[home] -= need_src
    tgt_free[home] -= need_tgt
  return [np.asarray(row, np.int64) for row in rows]


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
  rows, positions = token_spans(counts)
  return pairs[splits[order][rows] + positions], new_splits
