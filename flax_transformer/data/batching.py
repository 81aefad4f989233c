"""Token ids -> batches of a few fixed shapes, each filled up to a token budget.

Axis legend: B rows (sentence pairs) in a batch, S source length, T target length.
Here S == T == the batch's length bucket: both sides are padded to one length.

Two steps, so that tokenisation runs once per run and batching once per epoch:

    corpus = encode_corpus(ds['train'], tokenizer, max_len=128)   # drops over-long pairs
    batcher = Batcher(corpus, max_tokens=4096, seed=0, row_multiple=jax.device_count())
    for batch in batcher.epoch(0): ...           # data.batcher; or batcher.batch_at(step)

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

import datasets
import flax
import jax
import numpy as np
from tqdm.auto import tqdm

from flax_transformer import signals
from flax_transformer.config import Bounds, check_bounds
from flax_transformer.data.encoding import encoded_blocks
from flax_transformer.data.pair_sources import DatasetPairs
from flax_transformer.errors import DataError
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
    packed batch (`plans.FirstFit`/`BestFit`, several pairs per row) `masks.Packing`'s
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
  # The encoder the corpus cache uses, in this process.
  parts: dict[str, list[np.ndarray]] = {name: [] for name in ('src', 'src_len', 'tgt', 'tgt_len')}
  kept = []
  blocks = encoded_blocks(
    DatasetPairs(dataset, content=''), tokenizer, max_len, 1, _ENCODE_CHUNK, len(dataset)
  )
  total = math.ceil(len(dataset) / _ENCODE_CHUNK)
  for first, (_, block) in zip(
    itertools.count(0, _ENCODE_CHUNK),
    tqdm(blocks, desc='encode', unit='chunk', leave=False, total=total),
  ):
    signals.check()
    src_ids, src_lengths, tgt_ids, tgt_lengths, kept_rows, _ = block
    for name, array in zip(parts, (src_ids, src_lengths, tgt_ids, tgt_lengths)):
      parts[name].append(array)
    kept.append(first + kept_rows)
  src_ids, src_offsets = _flat_with_offsets(parts['src'], parts['src_len'])
  tgt_ids, tgt_offsets = _flat_with_offsets(parts['tgt'], parts['tgt_len'])
  example_ids = np.concatenate(kept).astype(np.int64) if kept else np.zeros(0, np.int64)
  return EncodedCorpus(
    src_ids=src_ids,
    src_offsets=src_offsets,
    tgt_ids=tgt_ids,
    tgt_offsets=tgt_offsets,
    example_ids=example_ids,
    max_len=max_len,
    num_dropped=len(dataset) - len(example_ids),
    pad_id=tokenizer.pad_id,
    bos_id=tokenizer.bos_id,
  )


def _flat_with_offsets(
  ids: list[np.ndarray], lengths: list[np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
  """(int32 ids, EOS included, int64 `[rows + 1]` offsets) of blocks' ids and row lengths."""
  lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
  offsets = np.zeros(len(lengths) + 1, np.int64)
  np.cumsum(lengths, out=offsets[1:])
  return (np.concatenate(ids) if ids else np.zeros(0, np.int32)).astype(np.int32), offsets


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
