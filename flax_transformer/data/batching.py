"""Token ids -> batches of a few fixed shapes, each filled up to a token budget.

Axis legend: B rows (sentence pairs) in a batch, S source length, T target length.
Here S == T == the batch's length bucket: both sides are padded to one length.

Two steps, so that tokenisation runs once per run and batching once per epoch:

    corpus = encode_corpus(ds['train'], tokenizer, max_len=128)   # drops over-long pairs
    batcher = Batcher(corpus, max_tokens=4096, seed=0, row_multiple=jax.device_count())
    for batch in batcher.epoch(0): ...                           # or batcher.batch_at(step)

Sequence conventions (y1..yn is the tokenised target, x1..xm the source):

    src      x1 .. xm </s> <pad> ..
    tgt_in   <s> y1 .. yn  <pad> ..     decoder input (teacher forcing)
    tgt_out  y1 .. yn </s> <pad> ..     what the decoder must predict at each position

The source gets EOS too, so the encoder sees where the sentence ends even in a
row with no padding. The paper batches "by approximate sequence length" with
about 25,000 source and 25,000 target tokens per batch (§5.1); here a batch holds
at most `max_tokens` positions per side, padding included, and every batch has
one of `len(length_buckets)` shapes, so `jax.jit` compiles at most that often.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import datasets
import flax
import jax
import numpy as np
from tqdm.auto import tqdm

from flax_transformer import signals
from flax_transformer.config import NONNEGATIVE, NONNEGATIVE_INT, POSITIVE_INT, Bounds, check_bounds
from flax_transformer.data.corpus import DataError
from flax_transformer.nn import masks
from flax_transformer.tokenizer import Tokenizer

PAD_ID, BOS_ID, EOS_ID = Tokenizer.pad_id, Tokenizer.bos_id, Tokenizer.eos_id
# A sequence holds at least a token and its EOS.
SEQUENCE_LENGTH = Bounds(low=2, integer=True)
# Pairs are tokenised this many at a time, so a progress bar moves on large corpora.
_ENCODE_CHUNK = 10_000


@flax.struct.dataclass
class Batch:
  """One training or evaluation batch; int32 numpy arrays (a pytree: `jax.device_put` works).

  src: `[B, S]` source ids, EOS-terminated, PAD on the right.
  tgt_in: `[B, T]` `<s> y1..yn`, PAD on the right.
  tgt_out: `[B, T]` `y1..yn </s>`, PAD on the right; PAD positions carry no loss.
  example_ids: `[B]` each row's index in the dataset it was encoded from, -1 for
    the all-PAD rows that fill a bucket's last batch. A packed batch's is
    `[B, L]`: entry [b, k - 1] is the index of row b's segment k, -1 past its last.
  src_segments, tgt_segments, src_positions, tgt_positions: None, or for a
    packed batch (`packing.PackingBatcher`, several pairs per row) `masks.Packing`'s
    fields: each token's pair 1..k in its row (0 = PAD) and its position within that pair.
  pad_id: the PAD id of the tokenizer that encoded the rows (`EncodedCorpus.pad_id`; a
    Marian tokenizer's is not ours); static, not an array.
  """

  src: np.ndarray
  tgt_in: np.ndarray
  tgt_out: np.ndarray
  example_ids: np.ndarray
  src_segments: np.ndarray | None = None
  tgt_segments: np.ndarray | None = None
  src_positions: np.ndarray | None = None
  tgt_positions: np.ndarray | None = None
  pad_id: int = flax.struct.field(pytree_node=False, default=PAD_ID)

  @property
  def packing(self) -> masks.Packing | None:
    """The segment ids and positions for the model, or None for one pair per row."""
    if self.src_segments is None:
      return None
    return masks.Packing(
      src_segments=self.src_segments,
      tgt_segments=self.tgt_segments,
      src_positions=self.src_positions,
      tgt_positions=self.tgt_positions,
    )

  @property
  def num_tokens(self):
    """Target tokens that carry loss (non-PAD `tgt_out`), EOS included."""
    return (self.tgt_out != self.pad_id).sum()

  @property
  def num_pairs(self):
    """Rows that hold a sentence pair rather than padding."""
    return (self.example_ids >= 0).sum()


@dataclasses.dataclass(frozen=True, eq=False)
class EncodedCorpus:
  """Token ids of N sentence pairs, stored flat: pair i is `src_ids[src_offsets[i]:src_offsets[i+1]]`.

  src_ids: int32 source ids with EOS after each sentence.
  tgt_ids: int32 target ids with EOS after each sentence (the `tgt_out` rows).
  src_offsets, tgt_offsets: int64 `[N + 1]` start of each pair, then the total.
  example_ids: int64 `[N]` the row of each pair in the encoded dataset.
  max_len: the longest sequence allowed, EOS (or BOS) included.
  num_dropped: pairs of the dataset left out because a side exceeded `max_len`.
  pad_id, bos_id: the tokenizer's, for the batches (a Marian tokenizer's differ from ours).
  """

  src_ids: np.ndarray
  src_offsets: np.ndarray
  tgt_ids: np.ndarray
  tgt_offsets: np.ndarray
  example_ids: np.ndarray
  max_len: int
  num_dropped: int
  pad_id: int = PAD_ID
  bos_id: int = BOS_ID

  def __len__(self) -> int:
    return len(self.example_ids)

  def source(self, i: int) -> np.ndarray:
    """Pair i's source ids, `x1..xm </s>`."""
    return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

  def target(self, i: int) -> np.ndarray:
    """Pair i's target ids, `y1..yn </s>`."""
    return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]

  @property
  def lengths(self) -> np.ndarray:
    """int64 `[N]`: the padded length each pair needs, max(m + 1, n + 1)."""
    return np.maximum(np.diff(self.src_offsets), np.diff(self.tgt_offsets))


def encode_corpus(dataset: datasets.Dataset, tokenizer: Tokenizer, max_len: int) -> EncodedCorpus:
  """Tokenises every pair once; drops pairs with a side longer than `max_len`.

  A pair is kept when m + 1 <= max_len and n + 1 <= max_len, for m source and n
  target subwords: the +1 is the source's EOS and the target's BOS (in
  `tgt_in`) or EOS (in `tgt_out`). `max_len` should not exceed the model's
  `max_len`, the length of its positional-encoding table.
  """
  if not isinstance(dataset, datasets.Dataset):
    raise DataError(
      f'encode_corpus takes one split (a datasets.Dataset), got '
      f'{type(dataset).__name__}; pass e.g. ds["train"]'
    )
  if not {'source', 'target'} <= set(dataset.column_names):
    raise DataError(
      f"encode_corpus needs columns 'source' and 'target', the dataset has {dataset.column_names}"
    )
  check_bounds(max_len, SEQUENCE_LENGTH, 'max_len', DataError, why=' (a token and EOS)')
  src_rows, tgt_rows, kept = [], [], []
  chunks = dataset.select_columns(['source', 'target']).iter(batch_size=_ENCODE_CHUNK)
  for start, chunk in zip(
    itertools.count(0, _ENCODE_CHUNK),
    tqdm(
      chunks,
      desc='encode',
      unit='chunk',
      leave=False,
      total=math.ceil(len(dataset) / _ENCODE_CHUNK),
    ),
  ):
    signals.check()
    for row, src, tgt in zip(
      itertools.count(start),
      tokenizer.encode(chunk['source']),
      tokenizer.encode_target(chunk['target']),
    ):
      if len(src) < max_len and len(tgt) < max_len:
        src_rows.append(src)
        tgt_rows.append(tgt)
        kept.append(row)
  src_ids, src_offsets = _flatten_with_eos(src_rows, tokenizer.eos_id)
  tgt_ids, tgt_offsets = _flatten_with_eos(tgt_rows, tokenizer.eos_id)
  return EncodedCorpus(
    src_ids=src_ids,
    src_offsets=src_offsets,
    tgt_ids=tgt_ids,
    tgt_offsets=tgt_offsets,
    example_ids=np.asarray(kept, np.int64),
    max_len=max_len,
    num_dropped=len(dataset) - len(kept),
    pad_id=tokenizer.pad_id,
    bos_id=tokenizer.bos_id,
  )


def _flatten_with_eos(rows: list[list[int]], eos_id: int = EOS_ID) -> tuple[np.ndarray, np.ndarray]:
  """(int32 ids with EOS after each row, int64 `[len(rows) + 1]` offsets)."""
  offsets = np.zeros(len(rows) + 1, np.int64)
  np.cumsum([len(row) + 1 for row in rows], out=offsets[1:])
  ids = np.fromiter(
    itertools.chain.from_iterable(row + [eos_id] for row in rows), np.int32, count=offsets[-1]
  )
  return ids, offsets


def default_buckets(max_len: int) -> tuple[int, ...]:
  """8, 16, 24, 32, 48, 64, 96, 128, 192, 256, ... below `max_len`, then `max_len`.

  Multiples of 8 (accelerator-friendly tiles); from 16 on each is at most 1.5x
  the previous, so a pair is padded by less than a third of its bucket, and a run
  compiles about 2 log2(max_len) shapes.
  """
  lengths = {8 * 2**k for k in range(max_len.bit_length())} | {
    24 * 2**k for k in range(max_len.bit_length())
  }
  return tuple(sorted(length for length in lengths if length < max_len)) + (max_len,)


def rows_per_batch(max_tokens: int, length: int, row_multiple: int) -> int:
  """rows(L) of `Batcher`: max_tokens // L rounded down to a multiple of row_multiple, at least one
  multiple."""
  return max(row_multiple, max_tokens // length // row_multiple * row_multiple)


class Batcher:
  """Deterministic, resumable token-budget batches over an `EncodedCorpus`.

  Each pair goes to the smallest length bucket >= its padded length
  (`EncodedCorpus.lengths`). A bucket of length L has a fixed row count

      rows(L) = max(row_multiple, (max_tokens // L) rounded down to a multiple of row_multiple)

  so every batch of the run is `[rows(L), L]` for one of the buckets, and holds
  at most `rows(L) * L <= max_tokens` positions per side, padding included
  (more only when `max_tokens < row_multiple * L`, where one row per device is
  the least a batch can hold). A bucket's last batch is topped up with all-PAD
  rows, which carry no loss. `row_multiple` (the number of devices times
  processes) makes every batch split evenly across devices.

  Epoch e is a pure function of (seed, e): within each bucket the pairs are
  shuffled and cut into batches, then all batches are shuffled across buckets.
  `batch_at(step)` indexes the concatenation of epochs 0, 1, 2, ..., so a
  resumed run needs only its step to continue with identical batches.
  With `shuffle=False` (evaluation) every epoch is the buckets in order, each
  in corpus order.
  """

  def __init__(
    self,
    corpus: EncodedCorpus,
    max_tokens: int,
    seed: int,
    length_buckets: Sequence[int] | None = None,
    row_multiple: int = 1,
    shuffle: bool = True,
  ):
    check_bounds(max_tokens, POSITIVE_INT, 'max_tokens', DataError)
    check_bounds(row_multiple, POSITIVE_INT, 'row_multiple', DataError)
    check_bounds(seed, NONNEGATIVE_INT, 'seed', DataError)
    if not len(corpus):
      raise DataError(
        f'the corpus holds no pairs ({corpus.num_dropped:,} were longer than '
        f'max_len={corpus.max_len}); raise max_len'
      )
    buckets = (
      default_buckets(corpus.max_len)
      if length_buckets is None
      else tuple(sorted(set(length_buckets)))
    )
    if any(not isinstance(b, (int, np.integer)) or b < 1 for b in buckets):
      raise DataError(f'length_buckets must be positive integers, got {list(length_buckets)}')
    if buckets[-1] < corpus.max_len:
      raise DataError(
        f'the largest length bucket, {buckets[-1]}, is shorter than the '
        f'corpus max_len={corpus.max_len}; add a bucket of {corpus.max_len}'
      )
    self.corpus = corpus
    self.max_tokens = int(max_tokens)
    self.seed = int(seed)
    self.shuffle = shuffle
    self.length_buckets = tuple(int(b) for b in buckets)
    self.rows = tuple(
      rows_per_batch(max_tokens, length, row_multiple) for length in self.length_buckets
    )
    bucket_of = np.searchsorted(self.length_buckets, corpus.lengths)  # smallest bucket >= length
    self._members = [np.flatnonzero(bucket_of == b) for b in range(len(self.length_buckets))]
    self.num_batches_per_epoch = sum(
      math.ceil(len(members) / rows) for members, rows in zip(self._members, self.rows)
    )
    self._cached_plan: tuple[int, list[tuple[int, np.ndarray]]] | None = None

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
    return EpochBatches(self, self._plan(epoch_index))

  def batch_at(self, step: int) -> Batch:
    """The batch of global step `step` (0-based), counting across epochs."""
    check_bounds(step, NONNEGATIVE, 'step', DataError)
    epoch_index, index = divmod(step, self.num_batches_per_epoch)
    return self._build(*self._plan(epoch_index)[index])

  def describe(self) -> str:
    """One line for logs: batches per epoch, shapes, and how much is padding."""
    target_tokens = int(np.diff(self.corpus.tgt_offsets).sum())
    positions = sum(
      math.ceil(len(members) / rows) * rows * length
      for members, rows, length in zip(self._members, self.rows, self.length_buckets)
    )
    shapes = ' '.join(f'{rows}x{length}' for rows, length in self.shapes)
    return (
      f'{len(self.corpus):,} pairs in {self.num_batches_per_epoch:,} batches per epoch '
      f'of <= {self.max_tokens:,} tokens, shapes [B x L]: {shapes}; '
      f'{1 - target_tokens / positions:.1%} of target positions are padding'
    )

  def _plan(self, epoch_index: int) -> list[tuple[int, np.ndarray]]:
    """[(bucket, pair indices)] per batch of the epoch; the last epoch's plan is memoised."""
    check_bounds(epoch_index, NONNEGATIVE, 'epoch_index', DataError)
    if self._cached_plan is not None and self._cached_plan[0] == epoch_index:
      return self._cached_plan[1]
    rng = np.random.default_rng([self.seed, epoch_index])
    plan = []
    for bucket, (members, rows) in enumerate(zip(self._members, self.rows)):
      order = self._fill_rows(
        bucket, rng.permutation(members) if self.shuffle else members, rng if self.shuffle else None
      )
      plan.extend((bucket, order[start : start + rows]) for start in range(0, len(order), rows))
    if self.shuffle:
      plan = [plan[i] for i in rng.permutation(len(plan))]
    self._cached_plan = (epoch_index, plan)
    return plan

  def _fill_rows(self, bucket: int, pairs: np.ndarray, rng: np.random.Generator | None) -> Sequence:
    """A bucket's pairs, in order -> its rows: here one pair per row (`packing` packs several).

    rng: the epoch's generator (None without shuffling), for a packer that draws from it.
    """
    del bucket, rng
    return pairs

  def _build(self, bucket: int, pairs: np.ndarray) -> Batch:
    rows, length = self.rows[bucket], self.length_buckets[bucket]
    pad = self.corpus.pad_id
    src = np.full((rows, length), pad, np.int32)
    tgt_in = np.full((rows, length), pad, np.int32)
    tgt_out = np.full((rows, length), pad, np.int32)
    example_ids = np.full((rows,), -1, np.int32)
    for row, pair in enumerate(pairs):
      source, target = self.corpus.source(pair), self.corpus.target(pair)
      src[row, : len(source)] = source
      tgt_out[row, : len(target)] = target
      tgt_in[row, 0] = self.corpus.bos_id
      tgt_in[row, 1 : len(target)] = target[:-1]  # the target without its EOS
      example_ids[row] = self.corpus.example_ids[pair]
    return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=example_ids, pad_id=pad)


class EpochBatches(Sequence):
  """The batches of one epoch as a lazy sequence: batch i is built when indexed."""

  def __init__(self, batcher: Batcher, plan: list[tuple[int, np.ndarray]]):
    self._batcher = batcher
    self._plan = plan

  def __len__(self) -> int:
    return len(self._plan)

  def __getitem__(self, index: int) -> Batch:
    if isinstance(index, slice):
      raise TypeError('index one batch at a time; iterate for all of them')
    return self._batcher._build(*self._plan[index])


def shard(batch: Batch, index: int, count: int) -> Batch:
  """Rows `[index * B / count, (index + 1) * B / count)` of every array: process `index`'s part.

  A contiguous block: with the batch axis sharded over processes in process
  order, process p's devices hold exactly these rows of the global batch. B must
  be a multiple of `count` (make `row_multiple` one).
  """
  first, size = process_rows(batch.src.shape[0], index, count)
  return jax.tree.map(lambda array: array[first : first + size], batch)


def process_rows(rows: int, index: int, count: int) -> tuple[int, int]:
  """(first row, rows) of process `index` of `count` in a batch of `rows`: `shard`'s block."""
  if not 0 <= index < count:
    raise DataError(f'shard index {index} is outside [0, {count})')
  if rows % count:
    raise DataError(
      f'a batch of {rows} rows does not split into {count} equal shards; '
      f'make row_multiple a multiple of {count}'
    )
  size = rows // count
  return index * size, size
