"""Scaled dot-product attention (a pure function) and the multi-head module.

Axis legend for the einsums in this module:
  B batch, T query length, S key length, N heads, H head dim, D model dim.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_transformer.dropout import Dropout
from flax_transformer.matmul import Dense


def scaled_dot_product_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """softmax(Q K^T / sqrt(d_k)) V, per head.

  Args:
    q: `[B, T, N, H]` queries.
    k: `[B, S, N, H]` keys.
    v: `[B, S, N, H]` values.
    mask: bool, broadcastable to `[B, N, T, S]`; True where query t may attend
      to key s. None attends everywhere.

  Returns:
    out `[B, T, N, H]` (in q's dtype) and weights `[B, N, T, S]` (float32).
    Masked keys get weight exactly 0. A fully masked query row gets all-zero
    weights and a zero output, never NaN, whatever the dtype.
  """
  return _attention(q, _heads_first(k), _heads_first(v), mask)


def _heads_first(x: jax.Array) -> jax.Array:
  """`[B, S, N, H]` -> `[B, N, S, H]`, the layout of a `KVCache`."""
  return x.transpose(0, 2, 1, 3)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None,
               keys_transposed: bool = False) -> tuple[jax.Array, jax.Array]:
  """`scaled_dot_product_attention` with keys and values `[B, N, S, H]`, as a `KVCache` holds them.

  keys_transposed: k is `[B, N, H, S]` (a pooled beam cache's layout).
  """
  head_dim = q.shape[-1]
  # Scale q (T*H values) rather than the logits (T*S values).
  q = q * jnp.asarray(head_dim ** -0.5, q.dtype)
  key_axes = 'BNHS' if keys_transposed else 'BNSH'
  logits = jnp.einsum(f'BTNH,{key_axes}->BNTS', q, k, preferred_element_type=jnp.float32)
  if mask is not None:
    # finite, not -inf: a fully masked row must give zeros, not NaN
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jax.nn.softmax(logits, axis=-1)
  if mask is not None:
    # A fully masked row softmaxes to uniform weights; zero it explicitly.
    weights = jnp.where(mask, weights, 0.0)
  return _weighted_values(weights, v), weights


def _weighted_values(weights: jax.Array, v: jax.Array) -> jax.Array:
  """weights `[B, N, T, S]` times values `[B, N, S, H]` -> `[B, T, N, H]`.

  The product is taken heads-first and transposed after: asked for `BTNH`
  directly, XLA:CPU swaps the operands into a dot its fast kernels do not take
  (8x slower for beam search's 4 x 128 attention, 1.8x at training's 32 x 32).
  """
  return jnp.einsum('BNTS,BNSH->BNTH', weights.astype(v.dtype), v).transpose(0, 2, 1, 3)


def _write_beam_blocks(buf: jax.Array, x: jax.Array, index: jax.Array | int, slot_axis: int
                       ) -> jax.Array:
  """Writes x's K columns, one per beam, at position `index` of the K blocks of buf's slot axis.

  buf has K * L slots on `slot_axis`; x has the K beams on that same axis.
  Reshaped to `[..., K, L, ...]`, the write is one dynamic_update_slice.
  """
  beams = x.shape[slot_axis]
  shape = buf.shape
  blocks = buf.reshape(*shape[:slot_axis], beams, shape[slot_axis] // beams, *shape[slot_axis + 1:])
  update = jnp.expand_dims(x, slot_axis + 1).astype(buf.dtype)
  return jax.lax.dynamic_update_slice_in_dim(blocks, update, index, axis=slot_axis + 1).reshape(shape)


@flax.struct.dataclass
class KVCache:
  """Keys and values of one attention layer, each `[B, N, S, H]`.

  Heads come before positions: the attention products read this layout, so a
  decode step uses its cache as it is. (Stored `[B, S, N, H]`, XLA:CPU copied
  every layer's whole cache into this layout at every step: a quarter of a base
  model's greedy step, 40% of a beam-search step.)

  For self-attention while decoding, S is the maximum output length and slots
  past the current position are zeros (hidden by the causal mask). For
  cross-attention, S is the source length and the values never change.

  Beam search pools the K beams of a sentence into one row: `beams=K`, B counts
  sentences and S = K * L, beam j's key for position p in slot j * L + p. Each
  step writes the K beams' new keys into their own blocks, and a mask (see
  `masks.beam_history_mask`) picks, per beam, the slots of its own history, so
  reordering the beams never moves a key or a value. A pooled cache holds its
  keys transposed, k `[B, N, H, S]`: its K queries against K * L keys are a
  product XLA:CPU runs 6x faster in that layout (for one query, `[B, N, S, H]`
  is as fast or faster).
  """
  k: jax.Array
  v: jax.Array
  beams: int = flax.struct.field(pytree_node=False, default=1)


class MultiHeadAttention(nn.Module):
  """h heads of d_k = d_v = d_model / h, then the output projection W_O.

  Keys and values come in as a `KVCache`, so that the same module serves
  self-attention (`project_kv` of its own input), cross-attention (`project_kv`
  of the encoder memory, computed once) and cached decoding (`extend_cache`).
  """
  num_heads: int
  d_model: int
  attention_dropout_rate: float = 0.0
  dtype: jnp.dtype = jnp.float32

  def setup(self):
    dense = lambda name, use_bias=True: Dense(self.d_model, dtype=self.dtype, name=name,
                                              use_bias=use_bias,
                                              kernel_init=nn.initializers.xavier_uniform())
    self.query, self.value, self.out = dense('query'), dense('value'), dense('out')
    # No key bias: q . (k + b) adds q . b to a whole row of logits, which the
    # softmax cancels, so b would get an exactly-zero gradient (rounding noise
    # that Adam's tiny epsilon turns into full-size steps).
    self.key = dense('key', use_bias=False)
    self.weights_dropout = Dropout(self.attention_dropout_rate)

  def _split_heads(self, x: jax.Array) -> jax.Array:
    """[B, L, D] -> [B, L, N, H]."""
    return x.reshape(*x.shape[:-1], self.num_heads, self.d_model // self.num_heads)

  def project_kv(self, inputs_kv: jax.Array) -> KVCache:
    """Keys and values `[B, N, S, H]` of `inputs_kv` `[B, S, D]`."""
    return KVCache(k=_heads_first(self._split_heads(self.key(inputs_kv))),
                   v=_heads_first(self._split_heads(self.value(inputs_kv))))

  def extend_cache(self, inputs: jax.Array, cache: KVCache, index: jax.Array | int) -> KVCache:
    """Writes the keys and values of `inputs` `[B, T, D]` into the cache at position `index`.

    A plain cache takes T consecutive tokens into slots index..index+T-1. A
    pooled cache (`cache.beams == K`) takes one token per beam, T = K, each into
    its own beam's block at position `index`.
    """
    new = self.project_kv(inputs)                                    # [B, N, T, H]
    if cache.beams == 1:
      write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index,
                                                                 axis=2)
      return KVCache(k=write(cache.k, new.k), v=write(cache.v, new.v))
    if inputs.shape[1] != cache.beams:
      raise ValueError(f'a cache pooling {cache.beams} beams takes one token per beam, '
                       f'got {inputs.shape[1]}')
    # Keys [B, N, H, K * L] take their new column on the last axis, values [B, N, K * L, H] on axis 2.
    return KVCache(k=_write_beam_blocks(cache.k, new.k.transpose(0, 1, 3, 2), index, slot_axis=3),
                   v=_write_beam_blocks(cache.v, new.v, index, slot_axis=2), beams=cache.beams)

  def __call__(self, inputs_q: jax.Array, kv: KVCache, mask: jax.Array | None,
               deterministic: bool = True) -> jax.Array:
    """Attends from `inputs_q` `[B, T, D]` to `kv`; returns `[B, T, D]`.

    The attention weights `[B, N, T, S]` are sown into the 'intermediates'
    collection (free unless the caller asks for it as mutable); see
    `flax_transformer.model.attention_weights`.
    """
    q = self._split_heads(self.query(inputs_q))                      # [B, T, N, H]
    out, weights = _attention(q, kv.k.astype(q.dtype), kv.v.astype(q.dtype), mask,
                              keys_transposed=kv.beams > 1)
    self.sow('intermediates', 'attention_weights', weights)
    if self.attention_dropout_rate > 0.0 and not deterministic:
      # Dropout on the weights needs them explicitly: recompute the output.
      weights = self.weights_dropout(weights, deterministic=False)
      out = _weighted_values(weights.astype(q.dtype), kv.v.astype(q.dtype))
    out = out.reshape(*out.shape[:-2], self.d_model)                 # [B, T, D]
    return self.out(out)
