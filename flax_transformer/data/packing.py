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

    batcher = Batcher(corpus, max_tokens=4096, seed=0, plan=BestFit(32))   # data.batcher
    batch = batcher.batch_at(step)          # a batching.Batch with its packing fields set

Pairs no longer than `row_length` are packed into rows of that length; longer
ones go to the larger length buckets and are packed there too, so every batch
still has one of a few fixed shapes (one compiled program each). Which pairs share a row
is the plan's (`plans.FirstFit`, `plans.BestFit`); this module holds what packing asks of
the other settings (`check_settings`) and how much of a batch is padding (`padding_share`).
"""

from __future__ import annotations

from collections.abc import Sequence

from flax_transformer.config import ConfigError, ModelConfig, TrainConfig, check_bounds
from flax_transformer.data.batching import SEQUENCE_LENGTH, Batch


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
  # Refused here, before the data loads, rather than by the plan after.
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
