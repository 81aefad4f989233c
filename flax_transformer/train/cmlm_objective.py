"""The conditional masked LM's training objective (Ghazvininejad et al. 2019, §3).

Axis legend as in `flax_transformer.nn.cmlm`: B rows, S source length, T target
length, V vocabulary, C length classes, Z sentence slots of a packed row.

One step's inputs and additive loss statistics:

    inputs = cmlm_inputs(rng, batch, config, eos_fill_rate=0.1)
    token_logits, length_logits = model.apply(variables, inputs.src, inputs.tokens, train=True,
                                              rngs={'dropout': key})
    sums = cmlm_loss_sums(token_logits, length_logits, inputs, config, smoothing=0.1)
    loss = sums['loss_sum'] / sums['tokens'] + 0.1 * sums['length_loss_sum'] / sums['sentences']
"""

from __future__ import annotations

from collections.abc import Mapping

import flax
import jax
import jax.numpy as jnp

from flax_transformer.config import ModelConfig
from flax_transformer.data.batching import Batch
from flax_transformer.nn import masks
from flax_transformer.nn.cmlm import length_classes, mask_id, segment_slots
from flax_transformer.train.losses import loss_sums


@flax.struct.dataclass
class CMLMInputs:
  """One batch as the CMLM objective sees it.

  src: `[B, S]` source ids.
  tokens: `[B, T]` decoder input: `targets` with the `masked` positions set to MASK.
  targets: `[B, T]` what each position should predict: `tgt_out`, or for an
    EOS-filled row `tgt_out` with its PAD positions set to EOS.
  masked: bool `[B, T]`, the positions whose loss counts.
  tgt_lengths: int32 `[B]`, the true target length (EOS included), also for
    EOS-filled rows; 0 for the all-PAD rows of batch padding. Packed rows:
    `[B, Z]`, each sentence slot's (`CMLMTransformer.predict_length`), 0 when empty.
  packing: the batch's segment ids and positions when its rows are packed, else None.
  """

  src: jax.Array
  tokens: jax.Array
  targets: jax.Array
  masked: jax.Array
  tgt_lengths: jax.Array
  packing: masks.Packing | None = None


def cmlm_inputs(
  rng: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float
) -> CMLMInputs:
  """Draws the EOS fill and the masked positions of every row (pure `jax.random`, jit-able).

  Per row of n target tokens (EOS included): with probability `eos_fill_rate`
  its PAD positions, up to the batch width T, become EOS and the row counts T
  tokens; then k ~ Uniform{1, .., row length} positions, a uniformly random
  subset, are replaced by MASK (fairseq's CMLM). All-PAD rows stay all PAD and
  mask nothing. For `tgt_out` "a b </s> <pad>" and k = 2 one draw is:

      targets  a      b  </s>   <pad>
      tokens   <mask> b  <mask> <pad>
      masked   1      0  1      0

  Packed rows (`batch.packing`): each sentence draws its own k from its own
  length and its own subset, as it would alone in a row; no EOS fill (a packed
  row's PAD belongs to no sentence), so eos_fill_rate must be 0.
  """
  if batch.packing is not None:
    return _packed_cmlm_inputs(rng, batch, config, eos_fill_rate)
  fill_key, count_key, order_key = jax.random.split(rng, 3)
  targets = jnp.asarray(batch.tgt_out, jnp.int32)  # [B, T]
  rows, width = targets.shape
  real = targets != config.pad_id
  tgt_lengths = jnp.sum(real, axis=1, dtype=jnp.int32)  # [B]
  fill = jax.random.bernoulli(fill_key, eos_fill_rate, (rows,)) & (tgt_lengths > 0)
  targets = jnp.where(fill[:, None] & ~real, config.eos_id, targets)
  in_row = targets != config.pad_id
  row_lengths = jnp.sum(in_row, axis=1, dtype=jnp.int32)
  # randint(1, 1) of an all-PAD row gives 1; the minimum makes it 0.
  count = jnp.minimum(jax.random.randint(count_key, (rows,), 1, row_lengths + 1), row_lengths)
  # The k smallest of iid uniform keys form a uniformly random k-subset; keys of 2.0
  # put the positions outside the row after every position inside it.
  keys = jnp.where(in_row, jax.random.uniform(order_key, (rows, width)), 2.0)
  rank = jnp.argsort(jnp.argsort(keys, axis=1), axis=1)  # [B, T]
  masked = rank < count[:, None]
  return CMLMInputs(
    src=jnp.asarray(batch.src, jnp.int32),
    tokens=jnp.where(masked, mask_id(config), targets),
    targets=targets,
    masked=masked,
    tgt_lengths=tgt_lengths,
  )


def _packed_cmlm_inputs(
  rng: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float
) -> CMLMInputs:
  """`cmlm_inputs` of packed rows: per sentence (segment) k ~ Uniform{1, .., its length}."""
  if eos_fill_rate:
    raise ValueError(
      f'eos_fill_rate={eos_fill_rate} fills the PAD after a sentence, and a packed '
      "row's PAD belongs to none: pass 0 with packed batches"
    )
  count_key, order_key = jax.random.split(rng)
  packing = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), batch.packing)
  segments = packing.tgt_segments  # [B, T]
  rows, width = segments.shape
  # Z = S slots, as `predict_length` has them.
  slot_of = segments[:, :, None] == jnp.arange(1, batch.src.shape[1] + 1)  # [B, T, Z]
  tgt_lengths = jnp.sum(slot_of, axis=1, dtype=jnp.int32)  # [B, Z]
  count = jnp.minimum(
    jax.random.randint(count_key, tgt_lengths.shape, 1, tgt_lengths + 1), tgt_lengths
  )  # [B, Z]
  # Ranks in a row ordered by (segment, uniform key): a token's rank within its own
  # segment is its row rank less the tokens of the segments before it.
  keys = jnp.where(
    segments > 0, segments + jax.random.uniform(order_key, (rows, width)), width + 2.0
  )
  rank = jnp.argsort(jnp.argsort(keys, axis=1), axis=1)  # [B, T]
  earlier = jnp.sum(
    (segments[:, None, :] > 0) & (segments[:, None, :] < segments[:, :, None]), axis=2
  )  # [B, T]
  slot = jnp.clip(segments - 1, 0, tgt_lengths.shape[1] - 1)
  masked = (segments > 0) & (rank - earlier < jnp.take_along_axis(count, slot, axis=1))
  targets = jnp.asarray(batch.tgt_out, jnp.int32)
  return CMLMInputs(
    src=jnp.asarray(batch.src, jnp.int32),
    tokens=jnp.where(masked, mask_id(config), targets),
    targets=targets,
    masked=masked,
    tgt_lengths=tgt_lengths,
    packing=packing,
  )


def cmlm_loss_sums(
  token_logits: jax.Array,
  length_logits: jax.Array,
  inputs: CMLMInputs,
  config: ModelConfig,
  smoothing: float,
) -> dict[str, jax.Array]:
  """Additive loss statistics of one batch (sum them over devices, then normalise).

  Args:
    token_logits: float32 `[B, T, V]`.
    length_logits: float32 `[B, C]` (packed: `[B, Z, C]`, a sentence per slot).
    inputs: the batch's `cmlm_inputs`.
    config: the model's config (PAD id, O).
    smoothing: label smoothing of the token loss.

  Returns float32 scalars:
    loss_sum, nll_sum, correct, tokens: label-smoothed cross-entropy, plain NLL,
      argmax hits and count over the masked positions only, exactly as
      `losses.loss_sums` computes them over all positions for the autoregressive model;
    length_loss_sum: NLL of the true length class, summed over real rows;
    length_correct: real rows whose most likely class is the true one;
    sentences: the number of real rows (tgt_lengths > 0).
  """
  # PAD in the targets of the unmasked positions keeps them out of every sum.
  sums = loss_sums(
    token_logits, jnp.where(inputs.masked, inputs.targets, config.pad_id), smoothing, config.pad_id
  )
  if inputs.packing is None:
    src_lengths = jnp.sum(inputs.src != config.pad_id, axis=1, dtype=jnp.int32)  # [B]
  else:  # per sentence slot, as length_logits [B, Z, C] and tgt_lengths [B, Z]
    src_lengths = jnp.sum(segment_slots(inputs.packing.src_segments), axis=1, dtype=jnp.int32)
  classes = length_classes(inputs.tgt_lengths, src_lengths, config.max_length_offset)  # [B(, Z)]
  length_logits = length_logits.astype(jnp.float32)
  nll = (
    jax.nn.logsumexp(length_logits, axis=-1)
    - jnp.take_along_axis(length_logits, classes[..., None], axis=-1)[..., 0]
  )  # [B(, Z)]
  correct = jnp.argmax(length_logits, axis=-1) == classes
  real = (inputs.tgt_lengths > 0).astype(jnp.float32)
  return {
    **sums,
    'length_loss_sum': jnp.sum(nll * real),
    'length_correct': jnp.sum(correct * real),
    'sentences': jnp.sum(real),
  }


def cmlm_objective(
  sums: Mapping[str, jax.Array],
  global_tokens: jax.Array,
  global_sentences: jax.Array,
  length_loss_weight: float,
) -> jax.Array:
  """The CMLM training loss of one device's sums, normalised by the global batch's counts:

    loss_sum / global masked tokens + length_loss_weight * length_loss_sum / global sentences

  Summed over devices it is the per-masked-token loss of the whole batch plus the
  weighted per-sentence length loss, whatever the number of devices.
  """
  tokens = jnp.maximum(global_tokens, 1).astype(jnp.float32)
  sentences = jnp.maximum(global_sentences, 1).astype(jnp.float32)
  return sums['loss_sum'] / tokens + length_loss_weight * sums['length_loss_sum'] / sentences
