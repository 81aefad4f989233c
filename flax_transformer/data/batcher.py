"""The batcher: a row plan (`plans`) and one array assembler (`assembly`) over an `EncodedCorpus`.

Axis legend: B rows of a batch, L its row length (S == T == L, as in `batching`).

    batcher = Batcher(corpus, max_tokens=4096, seed=0, plan=BestFit(64), row_multiple=2)
    batch = batcher.batch_at(step)                    # the global batch of a step
    mine = batcher.local_batch_at(step, index, count)  # only process `index`'s rows of it
    for batch in batcher.epoch(0): ...

Each pair goes to the smallest length bucket >= its padded length (`EncodedCorpus.lengths`;
a packing plan's buckets start at its row length). A bucket of length L has a fixed row count

    rows(L) = max(row_multiple, (max_tokens // L) rounded down to a multiple of row_multiple)

so every batch of the run is `[rows(L), L]` for one of the buckets and holds at most
`rows(L) * L <= max_tokens` positions per side, padding included (more only when `max_tokens <
row_multiple * L`, where one row per device is the least a batch can hold). A bucket's last
batch is topped up with all-PAD rows, which carry no loss. `row_multiple` (the number of
devices times processes) makes every batch split evenly across devices.

Epoch e is a pure function of (seed, e): within each bucket the pairs are shuffled, the plan
makes them rows (`plans.Bucketed`: one pair a row; `FirstFit`, `BestFit`: packed), the rows
are cut into batches, then all batches are shuffled across buckets. `batch_at(step)` indexes
the concatenation of epochs 0, 1, 2, ... (a packed epoch's batch count depends on its draw),
so a resumed run needs only its step to continue with identical batches. With
`shuffle=False` (evaluation) every epoch is the buckets in order, each in corpus order.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence

import numpy as np

from flax_transformer.config import NONNEGATIVE, NONNEGATIVE_INT, POSITIVE_INT, check_bounds
from flax_transformer.data.assembly import build_bucketed, build_packed
from flax_transformer.data.batching import (
  Batch,
  EncodedCorpus,
  default_buckets,
  process_rows,
  rows_per_batch,
)
from flax_transformer.data.plans import Bucketed, PackedRows, RowPlan
from flax_transformer.data.resegmenting import Resegmenting
from flax_transformer.errors import DataError

UNPACKED = Bucketed()
# One batch of an epoch's plan: (bucket, its rows: pair indices, or `PackedRows` when packed).
PlanEntry = tuple[int, 'np.ndarray | PackedRows']


class Batcher:
  """Deterministic, resumable token-budget batches over an `EncodedCorpus` (module docstring).

  plan: how pairs fill rows (`plans.Bucketed()`, the default; `FirstFit(L)`, `BestFit(L)`).
  length_buckets: the row lengths (default `batching.default_buckets(corpus.max_len)`).
  resegmenting: BPE-dropout (`resegmenting.Resegmenting`): each batch's pairs resampled for
    its epoch, bucketed by their planned resampled lengths; one pair a row only.
  """

  def __init__(
    self,
    corpus: EncodedCorpus,
    max_tokens: int,
    seed: int,
    plan: RowPlan = UNPACKED,
    length_buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    shuffle: bool = True,
    resegmenting: Resegmenting | None = None,
  ):
    check_bounds(max_tokens, POSITIVE_INT, 'max_tokens', DataError)
    check_bounds(row_multiple, POSITIVE_INT, 'row_multiple', DataError)
    check_bounds(seed, NONNEGATIVE_INT, 'seed', DataError)
    if not len(corpus):
      raise DataError(
        f'the corpus holds no pairs ({corpus.num_dropped:,} were longer than '
        f'max_len={corpus.max_len}); raise max_len'
      )
    if resegmenting is not None and plan.packs:
      raise DataError('BPE-dropout resamples one pair a row; packed rows are planned by length')
    self.corpus, self.plan, self.shuffle = corpus, plan, shuffle
    self.resegmenting = resegmenting
    self.max_tokens, self.seed = int(max_tokens), int(seed)
    self.length_buckets = plan.buckets(_checked_buckets(corpus, length_buckets))
    self.rows = tuple(rows_per_batch(max_tokens, n, row_multiple) for n in self.length_buckets)
    lengths = corpus.lengths if resegmenting is None else resegmenting.planned_lengths(corpus)
    bucket_of = np.searchsorted(self.length_buckets, lengths)  # smallest bucket >= length
    self._members = [np.flatnonzero(bucket_of == b) for b in range(len(self.length_buckets))]
    self._src_lengths = np.diff(corpus.src_offsets)
    self._tgt_lengths = np.diff(corpus.tgt_offsets)
    self._epoch_sizes: list[int] = []
    self._cached_plan: tuple[int, list[PlanEntry]] | None = None

  @property
  def shapes(self) -> tuple[tuple[int, int], ...]:
    """The `(B, L)` batch shapes this corpus produces: one per non-empty bucket."""
    return tuple(
      (rows, length)
      for rows, length, members in zip(self.rows, self.length_buckets, self._members)
      if len(members)
    )

  def epoch(self, epoch_index: int) -> EpochBatches:
    """The batches of one epoch, built on access; every pair appears exactly once."""
    return EpochBatches(self, self.plan_of(epoch_index), epoch_index)

  def batch_at(self, step: int) -> Batch:
    """The batch of global step `step` (0-based), counting across epochs."""
    epoch_index, entry = self.locate(step)
    return self.assemble(*entry, epoch=epoch_index)

  def local_batch_at(self, step: int, index: int, count: int) -> Batch:
    """`batching.shard(batch_at(step), index, count)`, building only those rows."""
    epoch_index, entry = self.locate(step)
    return self.assemble(*entry, index, count, epoch=epoch_index)

  def assemble(
    self, bucket: int, rows: np.ndarray | PackedRows, index=0, count=1, *, epoch: int
  ) -> Batch:
    """The batch of one plan entry of `epoch` (or process `index` of `count`'s rows of it);
    the epoch is what BPE-dropout's draws are keyed on."""
    size, length = self.rows[bucket], self.length_buckets[bucket]
    if self.resegmenting is not None:  # this process's pairs, resampled for the epoch
      first, size = process_rows(size, index, count)
      pairs = np.asarray(rows, np.int64)[first : first + size]
      resampled = self.resegmenting.corpus_of(self.corpus, pairs, epoch, length)
      return build_bucketed(resampled, np.arange(len(pairs)), size, length)
    build = build_packed if self.plan.packs else build_bucketed
    return build(self.corpus, rows, size, length, index, count)

  def entry(self, step: int) -> PlanEntry:
    """(bucket, rows) of global step `step`: its epoch's plan entry."""
    return self.locate(step)[1]

  def locate(self, step: int) -> tuple[int, PlanEntry]:
    """(epoch, (bucket, rows)) of global step `step`."""
    check_bounds(step, NONNEGATIVE, 'step', DataError)
    if not self.plan.packs:  # every epoch has the same batches: no plan before step's is drawn
      epoch_index, index = divmod(step, self.batches_per_epoch())
      return epoch_index, self.plan_of(epoch_index)[index]
    epoch_index = 0
    while True:
      if epoch_index == len(self._epoch_sizes):
        self._epoch_sizes.append(len(self.plan_of(epoch_index)))
      if step < self._epoch_sizes[epoch_index]:
        return epoch_index, self.plan_of(epoch_index)[step]
      step -= self._epoch_sizes[epoch_index]
      epoch_index += 1

  def batches_per_epoch(self) -> int:
    """Batches in every epoch of an unpacked plan (a packed epoch's count: `len(epoch(e))`)."""
    if self.plan.packs:
      raise DataError('a packed epoch has as many batches as its draw makes: len(epoch(e))')
    return sum(self.shape_batches().values())

  def plan_of(self, epoch_index: int) -> list[PlanEntry]:
    """[(bucket, rows)] per batch of the epoch; the last epoch's plan is memoised."""
    check_bounds(epoch_index, NONNEGATIVE, 'epoch_index', DataError)
    if self._cached_plan is not None and self._cached_plan[0] == epoch_index:
      return self._cached_plan[1]
    rng = np.random.default_rng([self.seed, epoch_index])
    plan = []
    for bucket, (members, rows) in enumerate(zip(self._members, self.rows)):
      order = self.plan.rows(
        rng.permutation(members) if self.shuffle else members,
        self._src_lengths,
        self._tgt_lengths,
        self.length_buckets[bucket],
        rng if self.shuffle else None,
      )
      plan.extend((bucket, order[start : start + rows]) for start in range(0, len(order), rows))
    if self.shuffle:
      plan = [plan[i] for i in rng.permutation(len(plan))]
    self._cached_plan = (epoch_index, plan)
    return plan

  def shape_batches(self, epoch_index: int = 0) -> dict[tuple[int, int], int]:
    """{(B, L): batches of that shape in epoch `epoch_index`}, shortest rows first: what an
    epoch's step costs on average (`flax-transformer-bench step --shape 1024x8:3,...`)."""
    if self.plan.packs:
      counts = collections.Counter(bucket for bucket, _ in self.plan_of(epoch_index))
    else:
      counts = {b: math.ceil(len(m) / self.rows[b]) for b, m in enumerate(self._members)}
    return {
      (self.rows[b], self.length_buckets[b]): counts[b]
      for b in range(len(self.length_buckets))
      if counts.get(b)
    }

  def describe(self) -> str:
    """One line for logs: batches (and rows) per epoch, shapes and the batches of each (as
    `flax-transformer-bench step --shape` takes them), and how much is padding."""
    shapes = ','.join(f'{b}x{length}:{n}' for (b, length), n in self.shape_batches().items())
    shapes = f'shapes [B x L:batches] {shapes}'
    target_tokens = int(self._tgt_lengths.sum())
    if not self.plan.packs:
      batches = self.batches_per_epoch()
      positions = sum(n * rows * length for (rows, length), n in self.shape_batches().items())
      padding = f'{1 - target_tokens / positions:.1%} of target positions are padding'
      if self.resegmenting is not None:
        padding += ' before resampling; ' + self.resegmenting.describe(
          self.corpus, self.length_buckets
        )
      return (
        f'{len(self.corpus):,} pairs in {batches:,} batches per epoch '
        f'of <= {self.max_tokens:,} tokens, {shapes}; {padding}'
      )
    plan = self.plan_of(0)
    positions = sum(self.rows[bucket] * self.length_buckets[bucket] for bucket, _ in plan)
    pairs_per_row = len(self.corpus) / sum(len(rows) for _, rows in plan)
    return (
      f'{len(self.corpus):,} pairs packed {pairs_per_row:.2f} per row in {len(plan):,} '
      f'batches (epoch 0) of <= {self.max_tokens:,} tokens, {shapes}; '
      f'{1 - target_tokens / positions:.1%} of target positions are padding'
    )


class EpochBatches(Sequence):
  """The batches of one epoch as a lazy sequence: batch i is built when indexed."""

  def __init__(self, batcher: Batcher, plan: list[PlanEntry], epoch_index: int = 0):
    self._batcher = batcher
    self._plan = plan
    self._epoch_index = epoch_index

  def __len__(self) -> int:
    return len(self._plan)

  def __getitem__(self, index: int) -> Batch:
    if isinstance(index, slice):
      raise TypeError('index one batch at a time; iterate for all of them')
    return self._batcher.assemble(*self._plan[index], epoch=self._epoch_index)


def _checked_buckets(corpus: EncodedCorpus, length_buckets: Sequence[int] | None) -> tuple:
  """`length_buckets` sorted (default: `default_buckets(corpus.max_len)`), or DataError."""
  if length_buckets is None:
    return default_buckets(corpus.max_len)
  buckets = tuple(sorted(set(length_buckets)))
  if any(not isinstance(b, (int, np.integer)) or b < 1 for b in buckets):
    raise DataError(f'length_buckets must be positive integers, got {list(length_buckets)}')
  if buckets[-1] < corpus.max_len:
    raise DataError(
      f'the largest length bucket, {buckets[-1]}, is shorter than the '
      f'corpus max_len={corpus.max_len}; add a bucket of {corpus.max_len}'
    )
  return tuple(int(b) for b in buckets)
