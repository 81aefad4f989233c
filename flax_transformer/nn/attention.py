"""Scaled dot-product attention (a pure function), its banded form, and the multi-head module.

Axis legend for the einsums in this module:
  B batch, T query length, S key length, N heads, H head dim, D model dim;
  banded attention: U blocks of J positions, each scoring E = (2 or 3) * J keys.
"""

from __future__ import annotations

from collections.abc import Callable

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.nn import masks
from flax_transformer.nn.dropout import Dropout
from flax_transformer.nn.matmul import Dense, dense_dot


def scaled_dot_product_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None = None,
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


def _attention(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None, keys_transposed: bool = False
) -> tuple[jax.Array, jax.Array]:
  """`scaled_dot_product_attention` with keys and values `[B, N, S, H]`, as a `KVCache` holds them.

  keys_transposed: k is `[B, N, H, S]` (a pooled beam cache's layout).
  """
  head_dim = q.shape[-1]
  # Scale q (T*H values) rather than the logits (T*S values).
  q = q * jnp.asarray(head_dim**-0.5, q.dtype)
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
  directly, XLA:CPU swaps the operands into a dot its fast kernels do not take.
  """
  return jnp.einsum('BNTS,BNSH->BNTH', weights.astype(v.dtype), v).transpose(0, 2, 1, 3)


def fused_attention(
  q: jax.Array, k: jax.Array, v: jax.Array, mask: masks.KeyLengths, implementation: str = 'xla'
) -> jax.Array:
  """`scaled_dot_product_attention` by `jax.nn.dot_product_attention` (no weights returned).

  Args:
    q: `[B, T, N, H]` queries.
    k, v: `[B, S, N, H]` keys and values.
    mask: the visible keys as lengths, causal or not (`masks.KeyLengths`); a causal mask is
      aligned top-left, so it serves a whole sequence (T == S), not a cached step (there:
      lengths, not causal).
    implementation: 'xla' (any backend) or 'cudnn' (cuDNN flash attention: a GPU, bfloat16
      or float16, H <= 256 and a multiple of 8).

  Returns:
    out `[B, T, N, H]`, equal to `scaled_dot_product_attention(q, k, v, mask.dense(T, S))`
    (logits and softmax in float32 either way).
  """
  return jax.nn.dot_product_attention(
    q,
    k,
    v,
    is_causal=mask.causal,
    key_value_seq_lengths=mask.lengths,
    implementation=implementation,
  )


def banded_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  radius: int,
  *,
  causal: bool = False,
  key_padding: jax.Array | None = None,
) -> jax.Array:
  """Restricted self-attention (paper §4) that computes only the band: O(T r) scores, not T^2.

  Equals `scaled_dot_product_attention(q, k, v, band.dense(T))` for `band =
  masks.Band(key_padding, radius=radius, causal=causal)`: query i attends to
  keys |i - j| <= radius (and j <= i when causal) that key_padding allows. The
  sequence is cut into U blocks of J = max(radius, 1) positions (zero-padded to
  U * J); block u's queries score only blocks u - 1, u, u + 1 (causal: u - 1, u),
  E = 3J (2J) keys, where every key within the radius lies, and the exact mask
  is applied inside them.

  Args:
    q, k, v: `[B, T, N, H]` (self-attention: as many keys as queries).
    radius: r >= 0.
    causal: also hide keys after the query (a decoder).
    key_padding: bool `[B, T]`, True where a key may be attended; None: all.

  Returns:
    out `[B, T, N, H]`; a query with no visible key gets zeros, as in the full form.
  """
  band = masks.Band(key_padding=key_padding, radius=radius, causal=causal)
  return _banded_attention(q, _heads_first(k), _heads_first(v), band)


def _banded_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  band: masks.Band,
  weights_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
  """`banded_attention` with keys and values `[B, N, T, H]`; weights_fn transforms the block
  weights `[B, N, U, J, E]` (attention dropout) before they weigh the values."""
  length, width = q.shape[1], max(band.radius, 1)
  neighbours = (-1, 0) if band.causal else (-1, 0, 1)
  blocks = -(-length // width)
  q_blocks = jnp.pad(q, ((0, 0), (0, blocks * width - length), (0, 0), (0, 0)))
  q_blocks = q_blocks.reshape(q.shape[0], blocks, width, *q.shape[2:])  # [B, U, J, N, H]
  q_blocks = q_blocks * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
  k_blocks = _neighbour_blocks(k, 2, width, blocks, neighbours)  # [B, N, U, E, H]
  logits = jnp.einsum('BUJNH,BNUEH->BNUJE', q_blocks, k_blocks, preferred_element_type=jnp.float32)
  mask = jnp.asarray(_band_positions(length, band.radius, width, blocks, neighbours, band.causal))
  if band.key_padding is not None:
    padding = _neighbour_blocks(band.key_padding, 1, width, blocks, neighbours)  # [B, U, E]
    mask = mask & padding[:, None, :, None, :]  # [B, 1, U, J, E]
  # finite, not -inf: a fully masked row must give zeros, not NaN
  logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
  weights = jnp.where(mask, jax.nn.softmax(logits, axis=-1), 0.0)
  if weights_fn is not None:
    weights = weights_fn(weights)
  v_blocks = _neighbour_blocks(v, 2, width, blocks, neighbours)  # [B, N, U, E, H]
  out = jnp.einsum('BNUJE,BNUEH->BNUJH', weights.astype(v.dtype), v_blocks)
  out = out.reshape(*out.shape[:2], blocks * width, out.shape[-1])  # [B, N, U * J, H]
  return out.transpose(0, 2, 1, 3)[:, :length]


def _neighbour_blocks(
  x: jax.Array, axis: int, width: int, blocks: int, neighbours: tuple[int, ...]
) -> jax.Array:
  """For each block u of `width` positions on `axis`, blocks u + o for o in neighbours, side by side.

  x `[..., T, ...]` -> `[..., U, E, ...]` with E = len(neighbours) * width;
  positions outside 0..T-1 are zeros (False).
  """
  length = x.shape[axis]
  pad = [(0, 0)] * x.ndim
  pad[axis] = (width, (blocks + 1) * width - length)  # [.., (U + 2) J, ..]
  x = jnp.pad(x, pad)
  shape = (*x.shape[:axis], blocks, width, *x.shape[axis + 1 :])
  windows = [
    jax.lax.slice_in_dim(x, (1 + o) * width, (1 + o + blocks) * width, axis=axis).reshape(shape)
    for o in neighbours
  ]
  return jnp.concatenate(windows, axis=axis + 1)


def _band_positions(
  length: int, radius: int, width: int, blocks: int, neighbours: tuple[int, ...], causal: bool
) -> np.ndarray:
  """bool `[U, J, E]`: query u * J + a may see the e-th key of its neighbour blocks."""
  query = (np.arange(blocks)[:, None] * width + np.arange(width)[None, :])[:, :, None]  # [U, J, 1]
  key = np.concatenate(
    [(np.arange(blocks)[:, None] + o) * width + np.arange(width)[None, :] for o in neighbours],
    axis=1,
  )[:, None, :]  # [U, 1, E]
  visible = (np.abs(query - key) <= radius) & (key >= 0) & (key < length)
  return visible & (key <= query) if causal else visible


def _band_is_worth_it(length: int, band: masks.Band) -> bool:
  """Whether a whole sequence of `length` takes the banded path: when it spans more than the
  E = (2 or 3) * max(r, 1) keys a block attends to; shorter, the full masked scores are no bigger."""
  return length > (2 if band.causal else 3) * max(band.radius, 1)


def _cached_band_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  band: masks.Band,
  weights_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array]:
  """T queries at positions offset.. against a cache of S slots `[B, N, S, H]`, with r + T < S.

  Only keys offset - r .. offset + T - 1 can be visible, so attention reads a
  dynamic_slice of r + T slots instead of the whole cache.
  """
  window, slots = band.radius + q.shape[1], k.shape[2]
  start = jnp.clip(band.offset - band.radius, 0, slots - window)
  k, v = (jax.lax.dynamic_slice_in_dim(x, start, window, axis=2) for x in (k, v))
  query_pos = band.offset + jnp.arange(q.shape[1])[:, None]  # [T, 1]
  key_pos = start + jnp.arange(window)[None, :]  # [1, r + T]
  mask = (jnp.abs(query_pos - key_pos) <= band.radius) & (
    (key_pos <= query_pos) | (not band.causal)
  )
  mask = mask[None, None]
  if band.key_padding is not None:
    padding = jax.lax.dynamic_slice_in_dim(band.key_padding, start, window, axis=1)
    mask = mask & padding[:, None, None, :]
  return _masked_attention(q, k, v, mask, weights_fn)


def _masked_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  mask: jax.Array | None,
  weights_fn: Callable[[jax.Array], jax.Array] | None = None,
  keys_transposed: bool = False,
) -> tuple[jax.Array, jax.Array]:
  """`_attention`, then weights_fn on the weights `[B, N, T, S]` and the output recomputed."""
  out, weights = _attention(q, k, v, mask, keys_transposed)
  if weights_fn is not None:
    out = _weighted_values(weights_fn(weights), v)
  return out, weights


def _band_attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  band: masks.Band,
  weights_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> jax.Array:
  """Attention under a `masks.Band`, by the cheapest exact path; keys and values `[B, N, S, H]`.

  A whole sequence (T == S) takes `_banded_attention` when `_band_is_worth_it`,
  a cached step (T < S) the r + T slots around it; otherwise the full masked form.
  """
  length, slots = q.shape[1], k.shape[2]
  if length == slots and _band_is_worth_it(length, band):
    return _banded_attention(q, k, v, band, weights_fn)
  if length < slots and band.radius + length < slots:
    return _cached_band_attention(q, k, v, band, weights_fn)[0]
  return _masked_attention(q, k, v, band.dense(length, slots), weights_fn)[0]


def _write_beam_blocks(
  buf: jax.Array, x: jax.Array, index: jax.Array | int, slot_axis: int
) -> jax.Array:
  """Writes x's K columns, one per beam, at position `index` of the K blocks of buf's slot axis.

  buf has K * L slots on `slot_axis`; x has the K beams on that same axis.
  Reshaped to `[..., K, L, ...]`, the write is one dynamic_update_slice.
  """
  beam_size = x.shape[slot_axis]
  shape = buf.shape
  blocks = buf.reshape(
    *shape[:slot_axis], beam_size, shape[slot_axis] // beam_size, *shape[slot_axis + 1 :]
  )
  update = jnp.expand_dims(x, slot_axis + 1).astype(buf.dtype)
  return jax.lax.dynamic_update_slice_in_dim(blocks, update, index, axis=slot_axis + 1).reshape(
    shape
  )


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

  Beam search pools the K beams of a sentence into one row: `beam_size=K`, B counts
  sentences and S = K * L, beam j's key for position p in slot j * L + p. Each
  step writes the K beams' new keys into their own blocks, and a mask (see
  `masks.beam_history_mask`) picks, per beam, the slots of its own history, so
  reordering the beams never moves a key or a value. A pooled cache holds its
  keys transposed, k `[B, N, H, S]`: its K queries against K * L keys are a
  product XLA:CPU runs faster in that layout (for one query, `[B, N, S, H]` is
  as fast or faster; docs/benchmarks.md has the measurements).
  """

  k: jax.Array
  v: jax.Array
  beam_size: int = flax.struct.field(pytree_node=False, default=1)


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
  # The kernel a `masks.KeyLengths` mask runs on: 'einsum' (its dense form), 'xla' or 'cudnn'
  # (`fused_attention`); other masks always take einsum.
  kernel: str = 'einsum'
  # Xavier-uniform gain of the query, key and value kernels (`ModelConfig.qkv_init_gain`).
  qkv_init_gain: float = 1.0

  def setup(self):
    dense = lambda name, gain=1.0, use_bias=True: Dense(
      self.d_model,
      dtype=self.dtype,
      name=name,
      use_bias=use_bias,
      # Xavier-uniform with a gain: variance gain^2 * 2 / (fan_in + fan_out).
      kernel_init=nn.initializers.variance_scaling(gain**2, 'fan_avg', 'uniform'),
    )
    gain = self.qkv_init_gain
    self.query, self.value = dense('query', gain), dense('value', gain)
    self.out = dense('out')
    # No key bias: q . (k + b) adds q . b to a whole row of logits, which the
    # softmax cancels, so b would get an exactly-zero gradient (rounding noise
    # that Adam's tiny epsilon turns into full-size steps).
    self.key = dense('key', gain, use_bias=False)
    self.weights_dropout = Dropout(self.attention_dropout_rate)

  def _split_heads(self, x: jax.Array) -> jax.Array:
    """[B, L, D] -> [B, L, N, H]."""
    return x.reshape(*x.shape[:-1], self.num_heads, self.d_model // self.num_heads)

  def _fused(self, x: jax.Array, names: tuple[str, ...]) -> list[jax.Array]:
    """`x` `[B, L, D]` through the Dense layers `names` as one product; each output `[B, L, N, H]`.

    Their kernels are put side by side, `[D, len(names) * D]`, inside the
    computation: one wide matmul (and one input gradient in training) instead of
    several, while the parameters stay separate layers, as checkpoints and the
    Marian mapping (pretrained/marian_weights.py) have them. At init each layer runs on
    its own, which declares each layer's parameters.
    """
    layers = [getattr(self, name) for name in names]
    if self.is_initializing():
      return [self._split_heads(layer(x)) for layer in layers]
    params = [layer.variables['params'] for layer in layers]
    # Concatenated in float32: dense_dot returns the weight gradient in its kernel's dtype.
    kernel = jnp.concatenate([p['kernel'] for p in params], axis=1)  # [D, k * D]
    bias = jnp.concatenate(
      [p['bias'] if 'bias' in p else jnp.zeros(self.d_model, jnp.float32) for p in params]
    )  # [k * D]
    y = (dense_dot(x.astype(self.dtype), kernel) + bias).astype(self.dtype)  # [B, L, k * D]
    return [self._split_heads(part) for part in jnp.split(y, len(names), axis=-1)]

  def project_kv(self, inputs_kv: jax.Array) -> KVCache:
    """Keys and values `[B, N, S, H]` of `inputs_kv` `[B, S, D]`."""
    return KVCache(
      k=_heads_first(self._split_heads(self.key(inputs_kv))),
      v=_heads_first(self._split_heads(self.value(inputs_kv))),
    )

  def project_qkv(self, inputs: jax.Array, fuse: bool = False) -> tuple[jax.Array, KVCache]:
    """Self-attention's queries `[B, T, N, H]` (for `attend`) and keys and values `[B, N, T, H]`
    of `inputs` `[B, T, D]`.

    fuse: one [D, 3D] product (`_fused`) rather than three [D, D]. It pays on a
    decoding step's few rows, not on a training batch's many (measured in
    docs/benchmarks.md).
    """
    if fuse:
      q, k, v = self._fused(inputs, ('query', 'key', 'value'))
      return q, KVCache(k=_heads_first(k), v=_heads_first(v))
    kv = self.project_kv(inputs)  # before the queries: the order fixes the float sums
    return self._split_heads(self.query(inputs)), kv

  def extend_cache(self, inputs: jax.Array, cache: KVCache, index: jax.Array | int) -> KVCache:
    """Writes the keys and values of `inputs` `[B, T, D]` into the cache at position `index`
    (see `write_cache`)."""
    return self.write_cache(self.project_kv(inputs), cache, index)

  def write_cache(self, new: KVCache, cache: KVCache, index: jax.Array | int) -> KVCache:
    """Writes keys and values `new` (`[B, N, T, H]`) into the cache at position `index`.

    A plain cache takes T consecutive tokens into slots index..index+T-1. A
    pooled cache (`cache.beam_size == K`) takes one token per beam, T = K, each into
    its own beam's block at position `index`.
    """
    if cache.beam_size == 1:
      write = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(
        buf, x.astype(buf.dtype), index, axis=2
      )
      return KVCache(k=write(cache.k, new.k), v=write(cache.v, new.v))
    if new.k.shape[2] != cache.beam_size:
      raise ValueError(
        f'a cache pooling {cache.beam_size} beams takes one token per beam, got {new.k.shape[2]}'
      )
    # Keys [B, N, H, K * L] take their new column on the last axis, values [B, N, K * L, H] on axis 2.
    return KVCache(
      k=_write_beam_blocks(cache.k, new.k.transpose(0, 1, 3, 2), index, slot_axis=3),
      v=_write_beam_blocks(cache.v, new.v, index, slot_axis=2),
      beam_size=cache.beam_size,
    )

  def __call__(
    self,
    inputs_q: jax.Array,
    kv: KVCache,
    mask: jax.Array | masks.Band | None,
    deterministic: bool = True,
  ) -> jax.Array:
    """Attends from `inputs_q` `[B, T, D]` to `kv`; returns `[B, T, D]`.

    mask: bool broadcastable to `[B, N, T, S]`; a `masks.Band` (self-attention
    with a plain cache): then only the band is computed (`_band_attention`); or a
    `masks.KeyLengths`: then the module's `kernel` computes it.

    The attention weights `[B, N, T, S]` are sown into the 'intermediates'
    collection (free unless the caller asks for it as mutable); see
    `flax_transformer.nn.model.attention_weights`.
    """
    return self.attend(self._split_heads(self.query(inputs_q)), kv, mask, deterministic)

  def attend(
    self, q: jax.Array, kv: KVCache, mask: jax.Array | masks.Band | None, deterministic: bool = True
  ) -> jax.Array:
    """`__call__` from queries `[B, T, N, H]` already projected (`project_qkv`); returns `[B, T, D]`."""
    k, v = kv.k.astype(q.dtype), kv.v.astype(q.dtype)
    weights_fn = None
    if self.attention_dropout_rate > 0.0 and not deterministic:
      # Dropout on the weights needs them explicitly: the output is computed after it.
      weights_fn = lambda weights: self.weights_dropout(weights, deterministic=False)
    sowing = self.is_mutable_collection('intermediates')
    if isinstance(mask, masks.Band) and not sowing:
      out = _band_attention(q, k, v, mask, weights_fn)
    elif (
      isinstance(mask, masks.KeyLengths)
      and self.kernel != 'einsum'
      and weights_fn is None
      and not sowing
    ):
      out = fused_attention(q, _heads_first(k), _heads_first(v), mask, self.kernel)
    else:
      # Asked for the weights `[B, N, T, S]`, a Band is materialized: they are that big anyway.
      if isinstance(mask, (masks.Band, masks.KeyLengths)):
        mask = mask.dense(q.shape[1], k.shape[2])
      out, weights = _masked_attention(q, k, v, mask, weights_fn, keys_transposed=kv.beam_size > 1)
      self.sow('intermediates', 'attention_weights', weights)
    out = out.reshape(*out.shape[:-2], self.d_model)  # [B, T, D]
    return self.out(out)
