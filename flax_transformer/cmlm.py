"""A non-autoregressive Transformer: the conditional masked language model (CMLM).

Ghazvininejad et al. (2019), "Mask-Predict": the encoder is the paper's; the
decoder is the same stack with a self-attention that sees the whole target row
(padding mask only, no look-ahead mask), fed a row in which some or all tokens
are replaced by MASK; a length classifier over the mean-pooled encoder output
predicts how long the target is. Decoding (`cmlm_decoding.py`) starts from a row
of N MASKs and fills it in, in parallel, in a few refinement passes.

Axis legend: B batch, S source length, T target length (the canvas), D model dim,
V vocabulary, C = 2O + 1 length classes for O = `config.max_length_offset`, Z sentence
slots of a packed row (Z = S: a row of S source tokens holds at most S sentences).

    model = CMLMTransformer(config)                         # config.kind == 'cmlm'
    variables = model.init(jax.random.key(0), src, tokens)
    token_logits, length_logits = model.apply(variables, src, tokens)   # [B, T, V], [B, C]

Training (one step's inputs and additive loss statistics):

    inputs = cmlm_inputs(rng, batch, config, eos_fill_rate=0.1)
    token_logits, length_logits = model.apply(variables, inputs.src, inputs.tokens, train=True,
                                              rngs={'dropout': key})
    sums = cmlm_loss_sums(token_logits, length_logits, inputs, config, smoothing=0.1)
    loss = sums['loss_sum'] / sums['tokens'] + 0.1 * sums['length_loss_sum'] / sums['sentences']

MASK is id `config.vocab_size`: one learned embedding row beyond the V rows of
the (shared) embedding table, so the tokenizer never produces it and the output
projection, tied to that table, never predicts it. With
`config.cmlm_decoder_input='uniform_copy'` a MASKed position is instead fed the
source token at the same relative position (`uniform_copy`; Gu et al., 2018,
"Non-Autoregressive Neural Machine Translation"), and the model has no MASK row.
"""

from __future__ import annotations

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_transformer import masks
from flax_transformer.attention import KVCache
from flax_transformer.batching import Batch
from flax_transformer.config import ModelConfig
from flax_transformer.losses import loss_sums
from flax_transformer.matmul import Dense
from flax_transformer.model import Transformer


def mask_id(config: ModelConfig) -> int:
  """The MASK placeholder's id: `config.vocab_size`, one past the real vocabulary."""
  return config.vocab_size


def num_length_classes(config: ModelConfig) -> int:
  """C = 2O + 1: target length - source length in [-O, O]."""
  return 2 * config.max_length_offset + 1


class CMLMTransformer(Transformer):
  """The encoder–decoder with a non-causal decoder over MASKed rows and a length classifier.

  Parameters beyond `Transformer`'s: 'mask_embedding' `[D]` (the MASK row; not
  with `cmlm_decoder_input='uniform_copy'`) and 'length_head' (Dense D -> C over
  the mean-pooled encoder output).
  """

  def setup(self):
    super().setup()
    c = self.config
    if c.cmlm_decoder_input == 'mask':
      # Same initialisation as the table's rows: unit variance after the sqrt(D) scaling.
      self.mask_embedding = self.param('mask_embedding',
                                       nn.initializers.normal(c.d_model ** -0.5), (c.d_model,))
    self.length_head = Dense(num_length_classes(c), dtype=c.compute_dtype)

  def _embed(self, tokens: jax.Array, side: str, offset: jax.Array | int, train: bool,
             positions: jax.Array | None = None) -> jax.Array:
    """As `Transformer._embed`; on the target side MASK (id V) gets the 'mask_embedding' row.

    With `cmlm_decoder_input='uniform_copy'` the callers have already replaced
    every MASK by a source token (`uniform_copy`).
    """
    if side == 'source' or self.config.cmlm_decoder_input == 'uniform_copy':
      return super()._embed(tokens, side, offset, train, positions)
    c = self.config
    is_mask = tokens == mask_id(c)                                              # [B, T]
    # The table has V rows: embed MASK positions as PAD, then swap PAD's row for MASK's.
    # Dropout comes after the swap, so MASK positions are dropped like any other.
    x = super()._embed(jnp.where(is_mask, c.pad_id, tokens), side, offset, False, positions)
    table = self.embedding if c.share_embeddings else self.target_embedding
    swap = (self.mask_embedding - table.embedding[c.pad_id]) * math.sqrt(c.d_model)   # [D]
    x = jnp.where(is_mask[..., None], x + swap.astype(x.dtype), x)
    return self.embedding_dropout(x, deterministic=not train)

  def predict_length(self, memory: jax.Array, src_mask: jax.Array,
                     packing: masks.Packing | None = None) -> jax.Array:
    """Length-class logits from the mean of the encoder output over real source positions.

    Args:
      memory: `[B, S, D]`, the encoder output.
      src_mask: bool `[B, 1, 1, S]`, `masks.padding_mask(src)`; not read when packed.
      packing: packed rows: each sentence (segment) of a row is pooled on its own.

    Returns:
      float32 `[B, C]`; class j means target length = source length + j - O
      (`lengths_from_classes`). An all-PAD source row pools to zeros. Packed:
      `[B, Z, C]`, slot z for the row's segment z + 1 (Z = S slots, the most
      segments a row can hold; empty slots pool to zeros).
    """
    if packing is not None:
      weights = segment_slots(packing.src_segments).astype(jnp.float32)        # [B, S, Z]
      pooled = jnp.einsum('BSZ,BSD->BZD', weights, memory.astype(jnp.float32)) / jnp.maximum(
          jnp.sum(weights, axis=1), 1.0)[..., None]                              # [B, Z, D]
      return self.length_head(pooled.astype(self.config.compute_dtype)).astype(jnp.float32)
    weights = src_mask[:, 0, 0, :, None].astype(jnp.float32)                   # [B, S, 1]
    pooled = jnp.sum(memory.astype(jnp.float32) * weights, axis=1) / jnp.maximum(
        jnp.sum(weights, axis=1), 1.0)                                          # [B, D]
    return self.length_head(pooled.astype(self.config.compute_dtype)).astype(jnp.float32)

  def cross_kv(self, memory: jax.Array) -> tuple[KVCache, ...]:
    """Every decoder layer's cross-attention keys and values `[B, N, S, H]` of the memory.

    Refinement passes over one source reuse them: `decode_parallel_from_kv`.
    """
    return self.decoder.cross_kv(memory)

  def decode_parallel_from_kv(self, tokens: jax.Array, cross_kv: tuple[KVCache, ...],
                              src_mask: jax.Array, train: bool = False,
                              src: jax.Array | None = None,
                              packing: masks.Packing | None = None) -> jax.Array:
    """`decode_parallel` with the memory's keys and values from `cross_kv`."""
    self._check_length(tokens, 'target')
    if self.config.cmlm_decoder_input == 'uniform_copy':
      if src is None:
        raise ValueError("model.cmlm_decoder_input='uniform_copy' needs the source ids (src=...) "
                         'to copy into the MASKed positions')
      tokens = jnp.where(tokens == mask_id(self.config),
                         uniform_copy(src, tokens, self.config.pad_id, packing), tokens)
    segments, positions = (None, None) if packing is None else (packing.tgt_segments,
                                                                packing.tgt_positions)
    # Padding mask only: every position sees the whole row (and the restricted window, if set);
    # packed, the whole of its own sentence.
    self_mask = self._self_attention_mask(tokens, False, segments)
    y, _ = self.decoder(self._embed(tokens, 'target', 0, train, positions), cross_kv, self_mask,
                        src_mask, train)
    return self._logits(y)

  def decode_parallel(self, tokens: jax.Array, memory: jax.Array, src_mask: jax.Array,
                      train: bool = False, src: jax.Array | None = None,
                      packing: masks.Packing | None = None) -> jax.Array:
    """All target positions at once: partly MASKed row `[B, T]` -> float32 logits `[B, T, V]`.

    Args:
      tokens: ids `[B, T]`, some of them `mask_id(config)`; PAD marks positions
        beyond the row, which no position attends to.
      memory: the encoder output `[B, S, D]`.
      src_mask: bool `[B, 1, 1, S]`, `masks.padding_mask(src)`.
      train: dropout on.
      src: the source ids `[B, S]`; needed only with `cmlm_decoder_input='uniform_copy'`.
      packing: segment ids and positions of packed rows (training); None: one pair per row.

    The logits of a position depend on every non-PAD position of its row, before
    and after it, and not on PAD columns: appending PAD changes nothing.
    """
    return self.decode_parallel_from_kv(tokens, self.cross_kv(memory), src_mask, train, src,
                                        packing)

  def __call__(self, src: jax.Array, tokens: jax.Array, train: bool = False,
               packing: masks.Packing | None = None) -> tuple[jax.Array, jax.Array]:
    """Source `[B, S]` and decoder input `[B, T]` -> token logits `[B, T, V]`, length logits `[B, C]`
    (packed rows: `[B, Z, C]`, one per sentence slot, `predict_length`)."""
    memory = self.encode(src, train, packing)
    src_mask = self.source_mask(src, packing)
    return (self.decode_parallel(tokens, memory, src_mask, train, src, packing),
            self.predict_length(memory, src_mask, packing))


def segment_slots(segments: jax.Array) -> jax.Array:
  """bool `[B, L, Z]`: token l of a packed row is in segment z + 1; Z = L slots, as many as a
  row of L tokens can hold segments."""
  return segments[:, :, None] == jnp.arange(1, segments.shape[1] + 1)


def uniform_copy(src: jax.Array, tokens: jax.Array, pad_id: int,
                 packing: masks.Packing | None = None) -> jax.Array:
  """The source token at each target position's relative place: int32 `[B, T]`.

  Position j of a row with N non-PAD tokens gets source token round(j * S / N)
  (halves round up; at most S - 1), S the row's non-PAD source tokens (EOS
  included): Gu et al.'s uniform copy. Source "a b c </s>" (S = 4) over N = 6
  positions: a b b c </s> </s>; over N = 2: a c. PAD beyond the row; a row
  with N = 0 stays all PAD, and an all-PAD source (S = 0, batch padding)
  copies PAD, which no position then attends to.

  Packed rows (`packing`): the same within each sentence, j its position in
  its target sentence k, N that sentence's length, S the length of source
  sentence k, whose tokens alone it copies.
  """
  src = jnp.asarray(src, jnp.int32)
  if packing is None:  # one sentence per row: a row of segment ids 1, PAD 0
    in_row = tokens != pad_id                                                   # [B, T]
    packing = masks.Packing(src_segments=(src != pad_id).astype(jnp.int32),
                            tgt_segments=in_row.astype(jnp.int32), src_positions=None,
                            tgt_positions=jnp.broadcast_to(jnp.arange(tokens.shape[1]),
                                                           tokens.shape))
  in_row = packing.tgt_segments > 0                                             # [B, T]
  src_slots = segment_slots(packing.src_segments)                              # [B, S, Z]
  slot = jnp.clip(packing.tgt_segments - 1, 0, src.shape[1] - 1)               # [B, T]
  per_token = lambda per_slot: jnp.take_along_axis(per_slot, slot, axis=1)    # [B, Z] -> [B, T]
  src_lengths = per_token(jnp.sum(src_slots, axis=1, dtype=jnp.int32))
  src_starts = per_token(jnp.argmax(src_slots, axis=1).astype(jnp.int32))
  lengths = jnp.maximum(jnp.sum(packing.tgt_segments[:, :, None] == packing.tgt_segments[:, None],
                                axis=2, dtype=jnp.int32), 1)                    # [B, T]
  position = jnp.asarray(packing.tgt_positions, jnp.int32)                      # [B, T]
  # round(j S / N) = floor((2 j S + N) / 2N), in integers.
  index = (2 * position * src_lengths + lengths) // (2 * lengths)               # [B, T]
  copied = jnp.take_along_axis(
      src, src_starts + jnp.minimum(index, jnp.maximum(src_lengths - 1, 0)), axis=1)
  return jnp.where(in_row, copied, pad_id)


# --- length classes --------------------------------------------------------------


def length_classes(tgt_lengths: jax.Array, src_lengths: jax.Array, max_offset: int) -> jax.Array:
  """Target lengths -> classes: clip(tgt - src, -O, O) + O, int32 in [0, 2O].

  For O = 2: offsets -5, -2, 0, 1, 7 -> classes 0, 0, 2, 3, 4.
  """
  offset = jnp.asarray(tgt_lengths, jnp.int32) - jnp.asarray(src_lengths, jnp.int32)
  return jnp.clip(offset, -max_offset, max_offset) + max_offset


def lengths_from_classes(classes: jax.Array, src_lengths: jax.Array, max_offset: int,
                         max_len: int) -> jax.Array:
  """Classes -> target lengths src + class - O, clipped to [1, max_len]; int32, broadcasting."""
  lengths = jnp.asarray(src_lengths, jnp.int32) + jnp.asarray(classes, jnp.int32) - max_offset
  return jnp.clip(lengths, 1, max_len)


# --- the training objective ---------------------------------------------------------


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


def cmlm_inputs(rng: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float
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
  targets = jnp.asarray(batch.tgt_out, jnp.int32)                               # [B, T]
  rows, width = targets.shape
  real = targets != config.pad_id
  tgt_lengths = jnp.sum(real, axis=1, dtype=jnp.int32)                          # [B]
  fill = jax.random.bernoulli(fill_key, eos_fill_rate, (rows,)) & (tgt_lengths > 0)
  targets = jnp.where(fill[:, None] & ~real, config.eos_id, targets)
  in_row = targets != config.pad_id
  row_lengths = jnp.sum(in_row, axis=1, dtype=jnp.int32)
  # randint(1, 1) of an all-PAD row gives 1; the minimum makes it 0.
  count = jnp.minimum(jax.random.randint(count_key, (rows,), 1, row_lengths + 1), row_lengths)
  # The k smallest of iid uniform keys form a uniformly random k-subset; keys of 2.0
  # put the positions outside the row after every position inside it.
  keys = jnp.where(in_row, jax.random.uniform(order_key, (rows, width)), 2.0)
  rank = jnp.argsort(jnp.argsort(keys, axis=1), axis=1)                         # [B, T]
  masked = rank < count[:, None]
  return CMLMInputs(src=jnp.asarray(batch.src, jnp.int32),
                    tokens=jnp.where(masked, mask_id(config), targets),
                    targets=targets, masked=masked, tgt_lengths=tgt_lengths)


def _packed_cmlm_inputs(rng: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float
                        ) -> CMLMInputs:
  """`cmlm_inputs` of packed rows: per sentence (segment) k ~ Uniform{1, .., its length}."""
  if eos_fill_rate:
    raise ValueError(f'eos_fill_rate={eos_fill_rate} fills the PAD after a sentence, and a packed '
                     "row's PAD belongs to none: pass 0 with packed batches")
  count_key, order_key = jax.random.split(rng)
  packing = jax.tree.map(lambda x: jnp.asarray(x, jnp.int32), batch.packing)
  segments = packing.tgt_segments                                                # [B, T]
  rows, width = segments.shape
  # Z = S slots, as `predict_length` has them.
  slot_of = segments[:, :, None] == jnp.arange(1, batch.src.shape[1] + 1)       # [B, T, Z]
  tgt_lengths = jnp.sum(slot_of, axis=1, dtype=jnp.int32)                       # [B, Z]
  count = jnp.minimum(jax.random.randint(count_key, tgt_lengths.shape, 1, tgt_lengths + 1),
                      tgt_lengths)                                              # [B, Z]
  # Ranks in a row ordered by (segment, uniform key): a token's rank within its own
  # segment is its row rank less the tokens of the segments before it.
  keys = jnp.where(segments > 0, segments + jax.random.uniform(order_key, (rows, width)),
                   width + 2.0)
  rank = jnp.argsort(jnp.argsort(keys, axis=1), axis=1)                         # [B, T]
  earlier = jnp.sum((segments[:, None, :] > 0) & (segments[:, None, :] < segments[:, :, None]),
                    axis=2)                                                     # [B, T]
  slot = jnp.clip(segments - 1, 0, tgt_lengths.shape[1] - 1)
  masked = (segments > 0) & (rank - earlier < jnp.take_along_axis(count, slot, axis=1))
  targets = jnp.asarray(batch.tgt_out, jnp.int32)
  return CMLMInputs(src=jnp.asarray(batch.src, jnp.int32),
                    tokens=jnp.where(masked, mask_id(config), targets), targets=targets,
                    masked=masked, tgt_lengths=tgt_lengths, packing=packing)


def cmlm_loss_sums(token_logits: jax.Array, length_logits: jax.Array, inputs: CMLMInputs,
                   config: ModelConfig, smoothing: float) -> dict[str, jax.Array]:
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
  sums = loss_sums(token_logits, jnp.where(inputs.masked, inputs.targets, config.pad_id),
                   smoothing, config.pad_id)
  if inputs.packing is None:
    src_lengths = jnp.sum(inputs.src != config.pad_id, axis=1, dtype=jnp.int32)       # [B]
  else:  # per sentence slot, as length_logits [B, Z, C] and tgt_lengths [B, Z]
    src_lengths = jnp.sum(segment_slots(inputs.packing.src_segments), axis=1, dtype=jnp.int32)
  classes = length_classes(inputs.tgt_lengths, src_lengths, config.max_length_offset)   # [B(, Z)]
  length_logits = length_logits.astype(jnp.float32)
  nll = (jax.nn.logsumexp(length_logits, axis=-1)
         - jnp.take_along_axis(length_logits, classes[..., None], axis=-1)[..., 0])      # [B(, Z)]
  correct = jnp.argmax(length_logits, axis=-1) == classes
  real = (inputs.tgt_lengths > 0).astype(jnp.float32)
  return {**sums, 'length_loss_sum': jnp.sum(nll * real),
          'length_correct': jnp.sum(correct * real), 'sentences': jnp.sum(real)}
