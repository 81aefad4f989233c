"""Sequence packing: several sentence pairs in each row of a batch, as large-scale trainers do.

Axis legend: B rows in a batch, L the row length (S == T == L, as in `batching`).

A Multi30k sentence is ~15 subwords, so one pair per row of a length bucket
leaves about a quarter of the positions PAD. A packed row holds pairs one after
another until the next does not fit; segment ids keep them apart
(`masks.segment_mask`: attention stays within a pair, cross-attention goes
from target pair k to source pair k) and positions restart in each pair, so a
pair's losses and gradient are those it would have alone in a row:

    src           x1 x2 </s> u1 </s> <pad>       tgt_in   <s> y1 y2 <s> v1 <pad>
    src_segments  1  1  1    2  2    0           tgt_out  y1  y2 </s> v1 </s> <pad>
    src_positions 0  1  2    0  1    0           tgt_segments 1 1 1 2 2 0

    batcher = PackingBatcher(corpus, max_tokens=4096, seed=0, row_length=32)
    batch = batcher.batch_at(step)          # a batching.Batch with its packing fields set

Pairs no longer than `row_length` are packed into rows of that length; longer
ones go to the larger length buckets and are packed there too, so every batch
still has one of a few fixed shapes (one compiled program each).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from flax_transformer.config import NONNEGATIVE, ConfigError, ModelConfig, TrainConfig, check_bounds
from flax_transformer.data.batching import (
  SEQUENCE_LENGTH,
  Batch,
  Batcher,
  EncodedCorpus,
  rows_per_batch,
)
from flax_transformer.data.corpus import DataError

# Rows kept open for the next pairs while packing; more fill rows a little better and cost
# time per pair (a pair tries each open row in turn).
_OPEN_ROWS = 16


class PackingBatcher(Batcher):
  """`Batcher` whose rows each hold as many pairs as fit: batches are still a pure function
  of (seed, step), so a resumed run packs exactly as the uninterrupted one did.

  Epoch e: the pairs are shuffled (seed, e), each goes to the smallest bucket >=
  max(its length, row_length), and within each bucket is placed, in that order, in
  the oldest of at most `_OPEN_ROWS` open rows where both its source and its target
  fit (else in a new row; the fullest open row is then closed). Rows are cut into
  batches of `rows(L)` rows (`Batcher`), and the batches shuffled across buckets.
  The number of batches can differ by an epoch's draw; `batch_at` counts them.
  """

  def __init__(
    self,
    corpus: EncodedCorpus,
    max_tokens: int,
    seed: int,
    row_length: int,
    length_buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    shuffle: bool = True,
  ):
    super().__init__(corpus, max_tokens, seed, length_buckets, row_multiple, shuffle)
    check_bounds(row_length, SEQUENCE_LENGTH, 'train.packing (the packed row length)', DataError)
    self.row_length = int(row_length)
    buckets = (self.row_length,) + tuple(b for b in self.length_buckets if b > self.row_length)
    self.rows = tuple(rows_per_batch(max_tokens, length, row_multiple) for length in buckets)
    self.length_buckets = buckets
    bucket_of = np.searchsorted(buckets, corpus.lengths)
    self._members = [np.flatnonzero(bucket_of == b) for b in range(len(buckets))]
    self._src_lengths = np.diff(corpus.src_offsets)
    self._tgt_lengths = np.diff(corpus.tgt_offsets)
    self._epoch_sizes: list[int] = []
    del self.num_batches_per_epoch  # differs by epoch: `epoch(e)` has len()

  def batch_at(self, step: int) -> Batch:
    """The batch of global step `step` (0-based), counting across epochs of any length."""
    return self._build(*self._entry(step))

  def _entry(self, step: int):
    """(bucket, rows of pairs) of global step `step`: its epoch's plan entry."""
    check_bounds(step, NONNEGATIVE, 'step', DataError)
    epoch_index = 0
    while True:
      if epoch_index == len(self._epoch_sizes):
        self._epoch_sizes.append(len(self._plan(epoch_index)))
      if step < self._epoch_sizes[epoch_index]:
        return self._plan(epoch_index)[step]
      step -= self._epoch_sizes[epoch_index]
      epoch_index += 1

  def describe(self) -> str:
    """One line for logs: epoch 0's batches and rows, shapes, and how much is padding."""
    plan = self._plan(0)
    target_tokens = int(self._tgt_lengths.sum())
    positions = sum(self.rows[bucket] * self.length_buckets[bucket] for bucket, _ in plan)
    pairs_per_row = len(self.corpus) / sum(len(rows) for _, rows in plan)
    shapes = ' '.join(f'{rows}x{length}' for rows, length in self.shapes)
    return (
      f'{len(self.corpus):,} pairs packed {pairs_per_row:.2f} per row in {len(plan):,} '
      f'batches (epoch 0) of <= {self.max_tokens:,} tokens, shapes [B x L]: {shapes}; '
      f'{1 - target_tokens / positions:.1%} of target positions are padding'
    )

  def _fill_rows(
    self, bucket: int, pairs: np.ndarray, rng: np.random.Generator | None
  ) -> list[np.ndarray]:
    """A bucket's pairs, in order -> its rows, each the pair indices it holds (`pack_rows`)."""
    del rng  # first fit places the pairs in their shuffled order and draws nothing more
    return pack_rows(pairs, self._src_lengths, self._tgt_lengths, self.length_buckets[bucket])

  def _build(self, bucket: int, rows_of_pairs: list[np.ndarray]) -> Batch:
    rows, length = self.rows[bucket], self.length_buckets[bucket]
    pad, corpus = self.corpus.pad_id, self.corpus
    arrays = {
      name: np.full((rows, length), pad if name in ('src', 'tgt_in', 'tgt_out') else 0, np.int32)
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
    example_ids = np.full((rows, length), -1, np.int32)
    for row, pairs in enumerate(rows_of_pairs):
      src_at = tgt_at = 0
      for segment, pair in enumerate(pairs, start=1):
        source, target = corpus.source(pair), corpus.target(pair)
        for side, at, ids in (('src', src_at, source), ('tgt', tgt_at, target)):
          span = slice(at, at + len(ids))
          arrays[f'{side}_segments'][row, span] = segment
          arrays[f'{side}_positions'][row, span] = np.arange(len(ids))
        arrays['src'][row, src_at : src_at + len(source)] = source
        arrays['tgt_out'][row, tgt_at : tgt_at + len(target)] = target
        arrays['tgt_in'][row, tgt_at] = corpus.bos_id
        arrays['tgt_in'][row, tgt_at + 1 : tgt_at + len(target)] = target[:-1]  # without its EOS
        example_ids[row, segment - 1] = corpus.example_ids[pair]
        src_at, tgt_at = src_at + len(source), tgt_at + len(target)
    return Batch(example_ids=example_ids, pad_id=pad, **arrays)


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


def padding_share(batches: Sequence[Batch], pad_id: int) -> dict[str, float]:
  """The fraction of source and of target positions that are PAD over `batches`."""
  positions = max(sum(b.src.size for b in batches), 1)
  return {
    'source': 1 - sum(int((b.src != pad_id).sum()) for b in batches) / positions,
    'target': 1 - sum(int(b.num_tokens) for b in batches) / positions,
  }


def check_settings(model_config: ModelConfig, train_config: TrainConfig) -> None:
  """Raises ConfigError, in one line naming the options, for what packing does not support."""
  if not train_config.packing:
    return
  # Refused here, before the data loads, rather than by PackingBatcher after.
  check_bounds(
    train_config.packing, SEQUENCE_LENGTH, 'train.packing (the packed row length; 0: no packing)'
  )
  if train_config.packing > model_config.max_len:
    raise ConfigError(
      f'train.packing={train_config.packing} is longer than model.max_len='
      f'{model_config.max_len}, the longest row the model takes; lower it'
    )
  if model_config.attention_radius is not None:
    raise ConfigError(
      f'train.packing={train_config.packing} cannot be combined with '
      f'model.attention_radius={model_config.attention_radius}: the banded '
      'attention has no segment mask; set one of them off'
    )
  if model_config.kind == 'cmlm' and train_config.eos_fill_rate:
    raise ConfigError(
      f'train.packing={train_config.packing} cannot be combined with '
      f'train.eos_fill_rate={train_config.eos_fill_rate} (cmlm): it fills the PAD '
      "after a sentence, and a packed row's PAD belongs to none; set "
      'train.eos_fill_rate=0, or train.packing=0 to train unpacked'
    )
