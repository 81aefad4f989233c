"""The Python-loop batch builders the array assembler replaced (data/assembly.py), kept as
oracles: a loop per pair, per token span, written to be read rather than to be fast.

`LoopBatcher` is a `Batcher` (same plan, same batches) whose batches these loops build;
tests compare its batches with the assembler's, bit for bit.
"""

import itertools

import numpy as np

from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import EOS_ID, Batch, EncodedCorpus, shard


def flatten_with_eos(rows: list[list[int]], eos_id: int = EOS_ID) -> tuple[np.ndarray, np.ndarray]:
  """(int32 ids with EOS after each row, int64 `[len(rows) + 1]` offsets)."""
  offsets = np.zeros(len(rows) + 1, np.int64)
  np.cumsum([len(row) + 1 for row in rows], out=offsets[1:])
  ids = np.fromiter(
    itertools.chain.from_iterable(row + [eos_id] for row in rows), np.int32, count=offsets[-1]
  )
  return ids, offsets


def loop_bucketed(corpus: EncodedCorpus, pairs, rows: int, length: int) -> Batch:
  """One pair a row: its source, its target after BOS (tgt_in), its target (tgt_out)."""
  pad = corpus.pad_id
  src = np.full((rows, length), pad, np.int32)
  tgt_in = np.full((rows, length), pad, np.int32)
  tgt_out = np.full((rows, length), pad, np.int32)
  example_ids = np.full((rows,), -1, np.int32)
  for row, pair in enumerate(pairs):
    source, target = corpus.source(pair), corpus.target(pair)
    src[row, : len(source)] = source
    tgt_out[row, : len(target)] = target
    tgt_in[row, 0] = corpus.bos_id
    tgt_in[row, 1 : len(target)] = target[:-1]  # the target without its EOS
    example_ids[row] = corpus.example_ids[pair]
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=example_ids, pad_id=pad)


def loop_packed(corpus: EncodedCorpus, rows_of_pairs, rows: int, length: int) -> Batch:
  """Pairs one after another in each row, segments from 1, positions restarting per pair."""
  pad = corpus.pad_id
  names = ('src', 'tgt_in', 'tgt_out', 'src_segments', 'tgt_segments')
  names += ('src_positions', 'tgt_positions')
  arrays = {
    name: np.full((rows, length), pad if name in ('src', 'tgt_in', 'tgt_out') else 0, np.int32)
    for name in names
  }
  example_ids = np.full((rows, length), -1, np.int32)
  for row in range(len(rows_of_pairs)):
    src_at = tgt_at = 0
    for segment, pair in enumerate(rows_of_pairs[row], start=1):
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


class LoopBatcher(Batcher):
  """`Batcher` whose batches the loops above build (a process's rows: `shard` of the whole)."""

  def assemble(self, bucket, rows_of_pairs, index=0, count=1, *, epoch) -> Batch:
    del epoch  # the plain segmentation: the oracle has no BPE-dropout
    build = loop_packed if self.plan.packs else loop_bucketed
    batch = build(self.corpus, rows_of_pairs, self.rows[bucket], self.length_buckets[bucket])
    return shard(batch, index, count) if count > 1 else batch
