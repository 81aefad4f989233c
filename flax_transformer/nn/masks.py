"""Pure attention-mask builders.

A mask is a bool array broadcastable to `[B, N, T, S]` (batch, heads, query
length, key length): True where query t may attend to key s. Builders return
the smallest broadcastable shape, and `combine` ANDs them together. The model
builds its masks once per forward pass and hands the same objects to every
layer: a mask applied in the first layer only would let PAD leak into the rest.

All builders are plain `jax.numpy` and work under `jit`, `vmap` and `grad`.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp


def padding_mask(tokens: jax.Array, pad_id: int = 0) -> jax.Array:
  """Keys that are not PAD may be attended.

  Args:
    tokens: int `[B, S]` token ids.
    pad_id: the id of the PAD token.

  Returns:
    bool `[B, 1, 1, S]`. For the 4-token sentence "a b c PAD" (1 = may attend),
    broadcast over the 4 query rows:
      1 1 1 0
      1 1 1 0
      1 1 1 0
      1 1 1 0
    Only the PAD *column* is masked: the PAD query row still attends to a, b, c,
    so it stays finite and informative and never needs special treatment. Its
    output is ignored downstream (the loss skips PAD targets, and no real token
    attends to it).
  """
  return (tokens != pad_id)[:, None, None, :]


def causal_mask(
  length: int, kv_length: int | None = None, offset: int | jax.Array = 0
) -> jax.Array:
  """Look-ahead mask: position i may attend to positions <= i.

  Args:
    length: number of queries T.
    kv_length: number of keys S; defaults to `length`.
    offset: absolute position of the first query. Decoding one token at
      position p against a cache of S slots is `causal_mask(1, S, offset=p)`:
      only the filled slots 0..p are visible. May be a traced scalar.

  Returns:
    bool `[1, 1, T, S]`. For length 4 (1 = may attend):
      1 0 0 0
      1 1 0 0
      1 1 1 0
      1 1 1 1
  """
  query_pos, key_pos = _positions(length, kv_length, offset)
  return (key_pos <= query_pos)[None, None]


def local_mask(
  length: int, radius: int, kv_length: int | None = None, offset: int | jax.Array = 0
) -> jax.Array:
  """Restricted self-attention (paper §4): position i sees |i - j| <= radius.

  Compose with `causal_mask` for a decoder (then i sees i - radius .. i).
  `kv_length` and `offset` mean what they mean in `causal_mask`.

  The radius r is a distance: an encoder position sees a window of 2r + 1 keys,
  a decoder position r + 1. The paper's Table 1 counts "a neighborhood of size
  r" (the window itself), so its r is our 2r + 1 (encoder) or r + 1 (decoder);
  either way the cost is O(r n d) (`attention.banded_attention`).

  Returns:
    bool `[1, 1, T, S]`. For length 4, radius 1:
      1 1 0 0
      1 1 1 0
      0 1 1 1
      0 0 1 1
  """
  query_pos, key_pos = _positions(length, kv_length, offset)
  return (jnp.abs(query_pos - key_pos) <= radius)[None, None]


def segment_mask(q_segments: jax.Array, k_segments: jax.Array) -> jax.Array:
  """Packed rows: a query attends only to keys of its own sentence (segment).

  Args:
    q_segments: int `[B, T]`, each query's segment id, 1..k per sentence of a
      packed row (`batching.Batch.src_segments`), 0 for PAD.
    k_segments: int `[B, S]`, the keys' segment ids, same numbering.

  Returns:
    bool `[B, 1, T, S]`, True where q_segments[b, t] == k_segments[b, s] != 0.
    For the row "a b | c PAD" (segments 1 1 2 0), self-attention:
      1 1 0 0
      1 1 0 0
      0 0 1 0
      0 0 0 0
    PAD keys are hidden (segment 0 matches nothing) and so is the PAD query's
    whole row: attention gives it zero weights, and its output carries no loss.
    Cross-attention is `segment_mask(tgt_segments, src_segments)`: target
    sentence k sees source sentence k only.
  """
  same = q_segments[:, :, None] == k_segments[:, None, :]  # [B, T, S]
  return (same & (k_segments[:, None, :] != 0))[:, None]


@flax.struct.dataclass
class Packing:
  """Where each token of a packed batch belongs: several sentence pairs per row.

  src_segments: int32 `[B, S]`, 1..k for the k pairs of a row, 0 for PAD.
  tgt_segments: int32 `[B, T]`, the same numbering: target k is pair k's.
  src_positions, tgt_positions: int32 `[B, S]`, `[B, T]`, each token's position
    within its own sentence, restarting at 0 in every segment (0 on PAD).
  """

  src_segments: jax.Array
  tgt_segments: jax.Array
  src_positions: jax.Array
  tgt_positions: jax.Array


@flax.struct.dataclass
class Band:
  """A restricted-attention mask kept as a rule, never as a `[T, S]` array.

  Key j is visible to query i iff |i - j| <= radius (`local_mask`), j <= i when
  causal, and key_padding[b, j]. Attention given a Band computes only the band,
  O(r n) scores (`attention.banded_attention`); `dense` is the same mask as a
  bool array.

  key_padding: bool `[B, S]`, True where a key may be attended; None: all.
  offset: absolute position of the first query: 0 for a whole sequence, the
    decoding position for a cached step (then S is the cache length). May be traced.
  """

  key_padding: jax.Array | None = None
  offset: jax.Array | int = 0
  radius: int = flax.struct.field(pytree_node=False, default=0)
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  def dense(self, length: int, kv_length: int | None = None) -> jax.Array:
    """The mask as bool `[B or 1, 1, T, S]` for T = length queries and S = kv_length keys."""
    return combine(
      local_mask(length, self.radius, kv_length, self.offset),
      causal_mask(length, kv_length, self.offset) if self.causal else None,
      None if self.key_padding is None else self.key_padding[:, None, None, :],
    )


@flax.struct.dataclass
class KeyLengths:
  """A padding (and look-ahead) mask kept as each row's count of visible keys: the form a fused
  kernel takes (`jax.nn.dot_product_attention`'s `key_value_seq_lengths` and `is_causal`).

  Key s is visible to query t iff s < lengths[b] and, when causal, s <= t. Rows are
  right-padded, as batching makes them: the visible keys are a prefix. `dense` is the same
  mask as a bool array.

  lengths: int32 `[B]`, at least 1 (`of_visible` makes it so).
  """

  lengths: jax.Array
  causal: bool = flax.struct.field(pytree_node=False, default=False)

  @classmethod
  def of_visible(cls, visible: jax.Array, causal: bool = False) -> KeyLengths:
    """From bool `[B, S]` (or a padding mask `[B, 1, 1, S]`), True on a right-padded prefix.

    A row with no visible key (an all-PAD filler row) counts one: a fused kernel would give it
    no zero row (xla: the values' mean; cuDNN: undefined), and its outputs carry no loss.
    """
    lengths = jnp.sum(visible.reshape(visible.shape[0], -1), axis=-1, dtype=jnp.int32)
    return cls(lengths=jnp.maximum(lengths, 1), causal=causal)

  def dense(self, length: int, kv_length: int | None = None) -> jax.Array:
    """The mask as bool `[B, 1, T, S]` for T = length queries and S = kv_length keys."""
    kv_length = length if kv_length is None else kv_length
    visible = (jnp.arange(kv_length) < self.lengths[:, None])[:, None, None, :]  # [B, 1, 1, S]
    return combine(visible, causal_mask(length, kv_length) if self.causal else None)


def beam_history_mask(history: jax.Array, position: jax.Array | int) -> jax.Array:
  """Which slots of a pooled beam cache hold each beam's own earlier tokens.

  Beam search keeps the keys of beam j's token at position p in slot j * L + p
  of a cache pooled over the K beams of a sentence (`attention.KVCache` with
  `beam_size=K`), and records, instead of moving keys when beams are reordered,
  where each live beam's history lies.

  Args:
    history: int `[B, K, L]`; history[b, k, p] = j: live beam k's token at
      position p has its keys in beam block j.
    position: the current step; positions after it are not yet written.

  Returns:
    bool `[B, 1, K, K * L]`, True at (k, j * L + p) iff history[b, k, p] == j
    and p <= position. For K = 2, L = 3, position 1, and history rows
    k=0: [1, 0, *], k=1: [1, 1, *] (both extend the first token of beam block
    1; each wrote its second token into its own block):
           block 0  block 1
      k=0:  0 1 0 | 1 0 0
      k=1:  0 0 0 | 1 1 0
  """
  batch, beam_size, length = history.shape
  in_block = history[:, :, None, :] == jnp.arange(beam_size)[None, None, :, None]  # [B, K, K, L]
  written = jnp.arange(length) <= position  # [L]
  return (in_block & written).reshape(batch, 1, beam_size, beam_size * length)


def combine(*masks: jax.Array | None) -> jax.Array | None:
  """Logical AND of masks with broadcasting; `None` entries are ignored.

  Returns None when every entry is None (no masking at all).
  """
  present = [m for m in masks if m is not None]
  if not present:
    return None
  return functools.reduce(jnp.logical_and, present)


def _positions(
  length: int, kv_length: int | None, offset: int | jax.Array
) -> tuple[jax.Array, jax.Array]:
  """Query positions `[T, 1]` and key positions `[1, S]`, for broadcasting."""
  kv_length = length if kv_length is None else kv_length
  query_pos = jnp.arange(length)[:, None] + offset
  key_pos = jnp.arange(kv_length)[None, :]
  return query_pos, key_pos
