"""A non-autoregressive Transformer: the conditional masked language model (CMLM).

Ghazvininejad et al. (2019), "Mask-Predict": the encoder is the paper's; the
decoder is the same stack with a self-attention that sees the whole target row
(padding mask only, no look-ahead mask), fed a row in which some or all tokens
are replaced by MASK; a length classifier over the mean-pooled encoder output
predicts how long the target is. Decoding (`decode/non_autoregressive.py`) starts from a row
of N MASKs and fills it in, in parallel, in a few refinement passes.

Axis legend: B batch, S source length, T target length (the canvas), D model dim,
V vocabulary, C = 2O + 1 length classes for O = `config.max_length_offset`, Z sentence
slots of a packed row (Z = S: a row of S source tokens holds at most S sentences).

    model = CMLMTransformer(config)                         # config.kind == 'cmlm'
    variables = model.init(jax.random.key(0), src, tokens)
    token_logits, length_logits = model.apply(variables, src, tokens)   # [B, T, V], [B, C]

Its training objective is `flax_transformer.train.cmlm_objective`.

MASK is id `config.vocab_size`: one learned embedding row beyond the V rows of
the (shared) embedding table, so the tokenizer never produces it and the output
projection, tied to that table, never predicts it. With
`config.cmlm_decoder_input='uniform_copy'` a MASKed position is instead fed the
source token at the same relative position (`uniform_copy`; Gu et al., 2018,
"Non-Autoregressive Neural Machine Translation"), and the model has no MASK row.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_transformer.config import ModelConfig
from flax_transformer.nn import masks
from flax_transformer.nn.attention import KVCache
from flax_transformer.nn.backend import compute_dtype
from flax_transformer.nn.matmul import Dense
from flax_transformer.nn.model import Transformer


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
      self.mask_embedding = self.param(
        'mask_embedding', nn.initializers.normal(c.d_model**-0.5), (c.d_model,)
      )
    self.length_head = Dense(num_length_classes(c), dtype=compute_dtype(c))

  def _embed(
    self,
    tokens: jax.Array,
    side: str,
    offset: jax.Array | int,
    train: bool,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """As `Transformer._embed`; on the target side MASK (id V) gets the 'mask_embedding' row.

    With `cmlm_decoder_input='uniform_copy'` the callers have already replaced
    every MASK by a source token (`uniform_copy`).
    """
    if side == 'source' or self.config.cmlm_decoder_input == 'uniform_copy':
      return super()._embed(tokens, side, offset, train, positions)
    c = self.config
    is_mask = tokens == mask_id(c)  # [B, T]
    # The table has V rows: embed MASK positions as PAD, then swap PAD's row for MASK's.
    # Dropout comes after the swap, so MASK positions are dropped like any other.
    x = super()._embed(jnp.where(is_mask, c.pad_id, tokens), side, offset, False, positions)
    table = self.embedding if c.share_embeddings else self.target_embedding
    swap = (self.mask_embedding - table.embedding[c.pad_id]) * math.sqrt(c.d_model)  # [D]
    x = jnp.where(is_mask[..., None], x + swap.astype(x.dtype), x)
    return self.embedding_dropout(x, deterministic=not train)

  def predict_length(
    self, memory: jax.Array, src_mask: jax.Array, packing: masks.Packing | None = None
  ) -> jax.Array:
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
      weights = segment_slots(packing.src_segments).astype(jnp.float32)  # [B, S, Z]
      pooled = (
        jnp.einsum('BSZ,BSD->BZD', weights, memory.astype(jnp.float32))
        / jnp.maximum(jnp.sum(weights, axis=1), 1.0)[..., None]
      )  # [B, Z, D]
      return self.length_head(pooled.astype(compute_dtype(self.config))).astype(jnp.float32)
    weights = src_mask[:, 0, 0, :, None].astype(jnp.float32)  # [B, S, 1]
    pooled = jnp.sum(memory.astype(jnp.float32) * weights, axis=1) / jnp.maximum(
      jnp.sum(weights, axis=1), 1.0
    )  # [B, D]
    return self.length_head(pooled.astype(compute_dtype(self.config))).astype(jnp.float32)

  def cross_kv(self, memory: jax.Array) -> tuple[KVCache, ...]:
    """Every decoder layer's cross-attention keys and values `[B, N, S, H]` of the memory.

    Refinement passes over one source reuse them: `decode_parallel_from_kv`.
    """
    return self.decoder.cross_kv(memory)

  def decode_parallel_from_kv(
    self,
    tokens: jax.Array,
    cross_kv: tuple[KVCache, ...],
    src_mask: jax.Array,
    train: bool = False,
    src: jax.Array | None = None,
    packing: masks.Packing | None = None,
  ) -> jax.Array:
    """`decode_parallel` with the memory's keys and values from `cross_kv`."""
    self._check_length(tokens, 'target')
    if self.config.cmlm_decoder_input == 'uniform_copy':
      if src is None:
        raise ValueError(
          "model.cmlm_decoder_input='uniform_copy' needs the source ids (src=...) "
          'to copy into the MASKed positions'
        )
      tokens = jnp.where(
        tokens == mask_id(self.config),
        uniform_copy(src, tokens, self.config.pad_id, packing),
        tokens,
      )
    segments, positions = (
      (None, None) if packing is None else (packing.tgt_segments, packing.tgt_positions)
    )
    # Padding mask only: every position sees the whole row (and the restricted window, if set);
    # packed, the whole of its own sentence.
    self_mask = self._self_attention_mask(tokens, False, segments)
    y, _ = self.decoder(
      self._embed(tokens, 'target', 0, train, positions),
      cross_kv,
      self_mask,
      self._cross_mask(src_mask, packing),
      train,
    )
    return self._logits(y)

  def decode_parallel(
    self,
    tokens: jax.Array,
    memory: jax.Array,
    src_mask: jax.Array,
    train: bool = False,
    src: jax.Array | None = None,
    packing: masks.Packing | None = None,
  ) -> jax.Array:
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
    return self.decode_parallel_from_kv(
      tokens, self.cross_kv(memory), src_mask, train, src, packing
    )

  def __call__(
    self,
    src: jax.Array,
    tokens: jax.Array,
    train: bool = False,
    packing: masks.Packing | None = None,
  ) -> tuple[jax.Array, jax.Array]:
    """Source `[B, S]` and decoder input `[B, T]` -> token logits `[B, T, V]`, length logits `[B, C]`
    (packed rows: `[B, Z, C]`, one per sentence slot, `predict_length`)."""
    memory = self.encode(src, train, packing)
    src_mask = self.source_mask(src, packing)
    return (
      self.decode_parallel(tokens, memory, src_mask, train, src, packing),
      self.predict_length(memory, src_mask, packing),
    )


def segment_slots(segments: jax.Array) -> jax.Array:
  """bool `[B, L, Z]`: token l of a packed row is in segment z + 1; Z = L slots, as many as a
  row of L tokens can hold segments."""
  return segments[:, :, None] == jnp.arange(1, segments.shape[1] + 1)


def uniform_copy(
  src: jax.Array, tokens: jax.Array, pad_id: int, packing: masks.Packing | None = None
) -> jax.Array:
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
    in_row = tokens != pad_id  # [B, T]
    packing = masks.Packing(
      src_segments=(src != pad_id).astype(jnp.int32),
      tgt_segments=in_row.astype(jnp.int32),
      src_positions=None,
      tgt_positions=jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
    )
  in_row = packing.tgt_segments > 0  # [B, T]
  src_slots = segment_slots(packing.src_segments)  # [B, S, Z]
  slot = jnp.clip(packing.tgt_segments - 1, 0, src.shape[1] - 1)  # [B, T]
  per_token = lambda per_slot: jnp.take_along_axis(per_slot, slot, axis=1)  # [B, Z] -> [B, T]
  src_lengths = per_token(jnp.sum(src_slots, axis=1, dtype=jnp.int32))
  src_starts = per_token(jnp.argmax(src_slots, axis=1).astype(jnp.int32))
  lengths = jnp.maximum(
    jnp.sum(
      packing.tgt_segments[:, :, None] == packing.tgt_segments[:, None], axis=2, dtype=jnp.int32
    ),
    1,
  )  # [B, T]
  position = jnp.asarray(packing.tgt_positions, jnp.int32)  # [B, T]
  # round(j S / N) = floor((2 j S + N) / 2N), in integers.
  index = (2 * position * src_lengths + lengths) // (2 * lengths)  # [B, T]
  copied = jnp.take_along_axis(
    src, src_starts + jnp.minimum(index, jnp.maximum(src_lengths - 1, 0)), axis=1
  )
  return jnp.where(in_row, copied, pad_id)


# --- length classes --------------------------------------------------------------


def length_classes(tgt_lengths: jax.Array, src_lengths: jax.Array, max_offset: int) -> jax.Array:
  """Target lengths -> classes: clip(tgt - src, -O, O) + O, int32 in [0, 2O].

  For O = 2: offsets -5, -2, 0, 1, 7 -> classes 0, 0, 2, 3, 4.
  """
  offset = jnp.asarray(tgt_lengths, jnp.int32) - jnp.asarray(src_lengths, jnp.int32)
  return jnp.clip(offset, -max_offset, max_offset) + max_offset


def lengths_from_classes(
  classes: jax.Array, src_lengths: jax.Array, max_offset: int, max_len: int
) -> jax.Array:
  """Classes -> target lengths src + class - O, clipped to [1, max_len]; int32, broadcasting."""
  lengths = jnp.asarray(src_lengths, jnp.int32) + jnp.asarray(classes, jnp.int32) - max_offset
  return jnp.clip(lengths, 1, max_len)
