"""Copy-task batches for the training-step tests and the device workers they start."""

import numpy as np

from flax_transformer.data.batching import Batch

PAD, BOS, EOS = 0, 1, 2


def copy_batch(rng, rows, length, vocab):
  """Copy rows `x1..xm </s>` of very different lengths (long first), then one all-PAD row."""
  src, tgt_in, tgt_out = (np.zeros((rows, length), np.int32) for _ in range(3))
  for row in range(rows - 1):
    words = rng.integers(4, vocab, max(1, length - 1 - 2 * row))
    src[row, : len(words) + 1] = [*words, EOS]
    tgt_in[row, : len(words) + 1] = [BOS, *words]
    tgt_out[row, : len(words) + 1] = [*words, EOS]
  example_ids = np.arange(rows, dtype=np.int32)
  example_ids[-1] = -1
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=example_ids)


def random_copy_batch(rng, rows, length, vocab, min_words=1):
  """Copy rows `x1..xm </s>` -> `<s> x1..xm` / `x1..xm </s>`, m drawn from [min_words, length), PAD after."""
  src, tgt_in, tgt_out = (np.zeros((rows, length), np.int32) for _ in range(3))
  for row in range(rows):
    words = rng.integers(4, vocab, rng.integers(min_words, length))
    src[row, : len(words) + 1] = [*words, EOS]
    tgt_in[row, : len(words) + 1] = [BOS, *words]
    tgt_out[row, : len(words) + 1] = [*words, EOS]
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out, example_ids=np.arange(rows, dtype=np.int32))
