"""The encoder–decoder Transformer: encode(), decode(), __call__() and the cached decode step.

Axis legend: B batch, S source length, T target length, D model dim, V vocab,
N heads, H head dim, L maximum decoding length (cache slots).

    model = Transformer(ModelConfig.tiny())
    variables = model.init(jax.random.key(0), src, tgt_in)
    logits = model.apply(variables, src, tgt_in)                      # [B, T, V] float32

Decoding runs the encoder once and then one step at a time on an explicit cache:

    cache = model.apply(variables, src, max_len, method=Transformer.start_decoding)
    logits, cache = model.apply(variables, tokens, cache, position,
                                method=Transformer.decode_step)      # tokens [B, 1]

Beam search has its own cache, whose K beams per sentence are reordered
without moving keys and values (`BeamDecodeCache`):

    cache = model.apply(variables, src, max_len, K, method=Transformer.start_beam_decoding)
    logits, cache = model.apply(variables, tokens, cache, position,
                                method=Transformer.decode_beam_step)  # tokens [B, K]
    cache = cache.reorder(parent)                                     # parent [B, K]
"""

from __future__ import annotations

import math

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_transformer.config import ModelConfig
from flax_transformer.nn import masks
from flax_transformer.nn.attention import KVCache
from flax_transformer.nn.backend import compute_dtype, resolve_attention_kernel
from flax_transformer.nn.dropout import Dropout
from flax_transformer.nn.layers import Decoder, Encoder, sinusoidal_positions
from flax_transformer.nn.matmul import Dense, dense_dot


@flax.struct.dataclass
class DecodeCache:
  """Everything a decode step needs besides the new tokens and their position.

  self_kv: per decoder layer, keys and values of the tokens decoded so far,
    `[B, N, L, H]`; slots past the current position are zeros.
  cross_kv: per decoder layer, keys and values of the encoder memory,
    `[B, N, S, H]`, computed once before the loop.
  src_mask: bool `[B, 1, 1, S]`, the source padding mask for cross-attention.
  """

  self_kv: tuple[KVCache, ...]
  cross_kv: tuple[KVCache, ...]
  src_mask: jax.Array

  @property
  def max_len(self) -> int:
    return self.self_kv[0].k.shape[2]


@flax.struct.dataclass
class BeamDecodeCache:
  """The decode cache of K beams per sentence, reordered without moving keys or values.

  self_kv: per decoder layer, keys `[B, N, H, K * L]` and values
    `[B, N, K * L, H]` pooled over the K beams of a sentence (`KVCache` with
    beam_size=K): beam k writes its token at position p into slot k * L + p.
  history: int32 `[B, K, L]`; history[b, k, p] is the beam block that holds
    live beam k's keys for position p (`masks.beam_history_mask`).
  cross_kv: per decoder layer, keys and values of the encoder memory,
    `[B, N, S, H]`, once per sentence: its K beams attend to them as K queries.
  src_mask: bool `[B, 1, 1, S]`.

  Moving the self-attention cache with the beams would copy every layer's
  keys and values at every step (a base model at batch 32, beam 4 and 32
  positions: 50 MB per step); moving `history` copies B * K * L integers.
  """

  self_kv: tuple[KVCache, ...]
  history: jax.Array
  cross_kv: tuple[KVCache, ...]
  src_mask: jax.Array

  @property
  def max_len(self) -> int:
    return self.history.shape[2]

  def reorder(self, parent: jax.Array) -> BeamDecodeCache:
    """The cache after live beam k of sentence b became an extension of beam parent[b, k] `[B, K]`."""
    return self.replace(history=jnp.take_along_axis(self.history, parent[:, :, None], axis=1))


def empty_self_cache(
  config: ModelConfig,
  batch_size: int,
  max_len: int,
  dtype: jnp.dtype | None = None,
  beam_size: int = 1,
) -> tuple[KVCache, ...]:
  """Zero self-attention caches, one `[B, N, L, H]` pair per decoder layer.

  With beam_size=K, one pair per layer pooling the K beams of each of B sentences:
  keys `[B, N, H, K * L]`, values `[B, N, K * L, H]` (see `KVCache`). Built
  from the config alone: no forward pass is traced to discover shapes.
  """
  if max_len > config.max_len:
    raise ValueError(
      f'decoding length {max_len} exceeds model.max_len={config.max_len}, '
      'the length of the positional-encoding table'
    )
  v_shape = (batch_size, config.num_heads, beam_size * max_len, config.head_dim)
  # A pooled cache holds its keys transposed, `[B, N, H, K * L]` (see KVCache).
  k_shape = v_shape if beam_size == 1 else (*v_shape[:2], v_shape[3], v_shape[2])
  dtype = compute_dtype(config) if dtype is None else dtype
  return tuple(
    KVCache(k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype), beam_size=beam_size)
    for _ in range(config.num_decoder_layers)
  )


class Transformer(nn.Module):
  """Vaswani et al. (2017), with the paper's choices as `ModelConfig` defaults."""

  config: ModelConfig

  def setup(self):
    c = self.config
    embed = lambda name: nn.Embed(
      c.vocab_size,
      c.d_model,
      dtype=compute_dtype(c),
      name=name,
      # Unit variance after the sqrt(d_model) scaling of §3.4.
      embedding_init=nn.initializers.normal(stddev=c.d_model**-0.5),
    )
    if c.share_embeddings:
      self.embedding = embed('embedding')
    else:
      self.source_embedding = embed('source_embedding')
      self.target_embedding = embed('target_embedding')
      self.output_projection = Dense(
        c.vocab_size,
        use_bias=False,
        dtype=compute_dtype(c),
        kernel_init=nn.initializers.xavier_uniform(),
      )
    if c.logits_bias:
      self.logits_bias = self.param(
        'logits_bias', nn.initializers.zeros_init(), (c.vocab_size,), jnp.float32
      )
    self.embedding_dropout = Dropout(c.dropout_rate)
    self.encoder = Encoder(c)
    self.decoder = Decoder(c)

  # --- pieces -------------------------------------------------------------

  def _embed(
    self,
    tokens: jax.Array,
    side: str,
    offset: jax.Array | int,
    train: bool,
    positions: jax.Array | None = None,
  ) -> jax.Array:
    """Token ids `[B, L]` -> embeddings * sqrt(D) + positions offset..offset+L-1, `[B, L, D]`.

    positions: int `[B, L]`, each token's own position instead (packed rows,
    `masks.Packing`: they restart in every sentence); None: offset..offset+L-1.
    """
    c = self.config
    table = self.embedding if c.share_embeddings else getattr(self, f'{side}_embedding')
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(f'token ids must be integers, got dtype {tokens.dtype}')
    # Gather float32 rows, then cast: nn.Embed would cast the whole [V, D] table first.
    x = jnp.take(table.embedding, tokens, axis=0).astype(compute_dtype(c))
    x = x * jnp.asarray(math.sqrt(c.d_model), compute_dtype(c))
    table = sinusoidal_positions(c.max_len, c.d_model, c.positions)  # [max_len, D]
    if positions is None:
      encoding = jax.lax.dynamic_slice_in_dim(table, offset, tokens.shape[1])  # [L, D]
    else:
      encoding = jnp.take(table, positions, axis=0)  # [B, L, D]
    return self.embedding_dropout(x + encoding.astype(x.dtype), deterministic=not train)

  def _logits(self, y: jax.Array) -> jax.Array:
    """Decoder output `[B, T, D]` -> float32 logits `[B, T, V]` (+ the logits bias, if any)."""
    if self.config.share_embeddings:
      # Against the table `[V, D]` itself (kernel_axis=1); products accumulate in float32.
      logits = dense_dot(y.astype(compute_dtype(self.config)), self.embedding.embedding, 1)
    else:
      logits = self.output_projection(y).astype(jnp.float32)
    return logits + self.logits_bias if self.config.logits_bias else logits

  def _check_length(self, tokens: jax.Array, what: str):
    if tokens.ndim != 2:
      raise ValueError(f'{what} token ids must be [batch, length], got shape {tokens.shape}')
    if tokens.shape[1] > self.config.max_len:
      raise ValueError(
        f'{what} length {tokens.shape[1]} exceeds model.max_len='
        f'{self.config.max_len}; truncate the input or raise max_len'
      )

  def _self_attention_mask(
    self, tokens: jax.Array, causal: bool, segments: jax.Array | None = None
  ) -> jax.Array | masks.Band:
    """The self-attention mask of ids `[B, L]`: PAD keys hidden, look-ahead too when causal.

    With `attention_radius` set, a `masks.Band` that adds the window (§4):
    attention then computes only the band, O(r L) scores per layer. With
    `segments` int `[B, L]` (a packed row), keys of the query's own sentence
    only (`masks.segment_mask`), which hides PAD too.
    """
    c = self.config
    if segments is not None:
      if c.attention_radius is not None:
        raise ValueError(
          f'packed rows (segment ids) cannot be combined with '
          f'model.attention_radius={c.attention_radius}: the band has no segments'
        )
      return masks.combine(
        masks.segment_mask(segments, segments),
        masks.causal_mask(tokens.shape[1]) if causal else None,
      )
    visible = self._visible_keys(tokens, causal)  # [B, L]
    if c.attention_radius is not None:
      return masks.Band(key_padding=visible, radius=c.attention_radius, causal=causal)
    if self._fused_kernel():
      return masks.KeyLengths.of_visible(visible, causal)
    return masks.combine(
      visible[:, None, None, :], masks.causal_mask(tokens.shape[1]) if causal else None
    )

  def _fused_kernel(self, cached: bool = False) -> bool:
    """Whether attention takes a fused kernel here (`nn.backend.resolve_attention_kernel`): masks are
    then built as `masks.KeyLengths`. A cached step (one query) takes it when the kernel is
    asked for by name: auto keeps einsum there, as a step keeps no scores to save."""
    if resolve_attention_kernel(self.config) == 'einsum':
      return False
    return not cached or self.config.attention_kernel != 'auto'

  def _cross_mask(
    self, src_mask: jax.Array, packing: masks.Packing | None = None, cached: bool = False
  ) -> jax.Array | masks.KeyLengths:
    """The cross-attention mask the decoder takes: `source_mask`'s bool `[B, 1, 1, S]`, as
    `masks.KeyLengths` where a fused kernel runs (packed rows keep their segment mask)."""
    if packing is None and self._fused_kernel(cached):
      return masks.KeyLengths.of_visible(src_mask)
    return src_mask

  def _visible_keys(self, tokens: jax.Array, causal: bool) -> jax.Array:
    """bool `[B, L]`: the non-PAD positions of ids `[B, L]`.

    A decoder (causal) that starts from PAD (bos_id == pad_id, as Marian's) must
    still see its start token at position 0.
    """
    visible = tokens != self.config.pad_id
    if causal and self.config.bos_id == self.config.pad_id:
      visible = visible | (jnp.arange(tokens.shape[1]) == 0)
    return visible

  # --- the public methods -------------------------------------------------

  def encode(
    self, src: jax.Array, train: bool = False, packing: masks.Packing | None = None
  ) -> jax.Array:
    """Source ids `[B, S]` -> memory `[B, S, D]`; packed rows when `packing` is given."""
    self._check_length(src, 'source')
    segments, positions = (
      (None, None) if packing is None else (packing.src_segments, packing.src_positions)
    )
    mask = self._self_attention_mask(src, False, segments)  # [B, 1, 1 or S, S]
    return self.encoder(self._embed(src, 'source', 0, train, positions), mask, train)

  def source_mask(self, src: jax.Array, packing: masks.Packing | None = None) -> jax.Array:
    """The cross-attention mask: bool `[B, 1, 1, S]` (`masks.padding_mask`), or for packed rows
    `[B, 1, T, S]`, target sentence k seeing source sentence k only (`masks.segment_mask`)."""
    if packing is None:
      return masks.padding_mask(src, self.config.pad_id)
    return masks.segment_mask(packing.tgt_segments, packing.src_segments)

  def decode(
    self,
    tgt_in: jax.Array,
    memory: jax.Array,
    src_mask: jax.Array,
    train: bool = False,
    packing: masks.Packing | None = None,
  ) -> jax.Array:
    """Teacher-forced decoder: `<bos> y1 .. yn` `[B, T]` -> float32 logits `[B, T, V]`.

    Args:
      tgt_in: target ids shifted right, `[B, T]`.
      memory: the encoder output `[B, S, D]`.
      src_mask: `source_mask(src, packing)`: bool `[B, 1, 1, S]`, or `[B, 1, T, S]` packed.
      train: dropout on.
      packing: segment ids and positions of packed rows; None: one pair per row.
    """
    return self._logits(self._decoder_states(tgt_in, memory, src_mask, train, packing))

  def _decoder_states(
    self,
    tgt_in: jax.Array,
    memory: jax.Array,
    src_mask: jax.Array,
    train: bool,
    packing: masks.Packing | None,
  ) -> jax.Array:
    """`decode` up to the output projection: the decoder's last states `[B, T, D]`."""
    self._check_length(tgt_in, 'target')
    segments, positions = (
      (None, None) if packing is None else (packing.tgt_segments, packing.tgt_positions)
    )
    self_mask = self._self_attention_mask(tgt_in, True, segments)
    y, _ = self.decoder(
      self._embed(tgt_in, 'target', 0, train, positions),
      self.decoder.cross_kv(memory),
      self_mask,
      self._cross_mask(src_mask, packing),
      train,
    )
    return y

  def __call__(
    self,
    src: jax.Array,
    tgt_in: jax.Array,
    train: bool = False,
    packing: masks.Packing | None = None,
  ) -> jax.Array:
    """Source `[B, S]` and shifted target `[B, T]` ids -> float32 logits `[B, T, V]`.

    packing: `batching.Batch.packing` of packed rows (several pairs per row).
    """
    memory = self.encode(src, train, packing)
    return self.decode(tgt_in, memory, self.source_mask(src, packing), train, packing)

  def decoder_states(
    self,
    src: jax.Array,
    tgt_in: jax.Array,
    train: bool = False,
    packing: masks.Packing | None = None,
  ) -> jax.Array:
    """`__call__` without the output projection: the decoder's last states `[B, T, D]`, which
    `logits` turns into `__call__`'s logits (a loss may project them a chunk at a time)."""
    memory = self.encode(src, train, packing)
    return self._decoder_states(tgt_in, memory, self.source_mask(src, packing), train, packing)

  def logits(self, states: jax.Array) -> jax.Array:
    """Decoder states `[..., D]` -> float32 logits `[..., V]`."""
    return self._logits(states)

  def start_decoding(self, src: jax.Array, max_len: int) -> DecodeCache:
    """Runs the encoder once and returns the cache for up to `max_len` decode steps."""
    memory = self.encode(src)
    return DecodeCache(
      self_kv=empty_self_cache(self.config, src.shape[0], max_len),
      cross_kv=self.decoder.cross_kv(memory),
      src_mask=masks.padding_mask(src, self.config.pad_id),
    )

  def decode_step(
    self, tokens: jax.Array, cache: DecodeCache, position: jax.Array | int
  ) -> tuple[jax.Array, DecodeCache]:
    """Decodes `tokens` `[B, T]` at positions position..position+T-1 (usually T = 1).

    Returns float32 logits `[B, T, V]` and the cache with these tokens' keys and
    values written in. Only cache slots <= each query's position are attended,
    so the logits equal those of `decode` on the same prefix. `position` may be
    traced (a `lax.scan` counter); the caller keeps position + T <= cache.max_len.
    """
    batch, length = tokens.shape
    radius = self.config.attention_radius
    # With a radius, attention reads only the r + T cache slots that can be visible.
    if radius is not None:
      self_mask = masks.Band(offset=position, radius=radius, causal=True)
    elif length == 1 and self._fused_kernel(cached=True):
      # A fused kernel's look-ahead mask is aligned top-left: one query sees slots 0..position.
      self_mask = masks.KeyLengths(jnp.full((batch,), position + 1, jnp.int32))
    else:
      self_mask = masks.causal_mask(length, cache.max_len, position)
    y, self_kv = self.decoder(
      self._embed(tokens, 'target', position, False),
      cache.cross_kv,
      self_mask,
      self._cross_mask(cache.src_mask, cached=True),
      False,
      cache.self_kv,
      position,
    )
    return self._logits(y), cache.replace(self_kv=self_kv)

  def start_beam_decoding(self, src: jax.Array, max_len: int, beam_size: int) -> BeamDecodeCache:
    """Runs the encoder once and returns the pooled cache of `beam_size` beams per sentence."""
    memory = self.encode(src)
    batch = src.shape[0]
    return BeamDecodeCache(
      self_kv=empty_self_cache(self.config, batch, max_len, beam_size=beam_size),
      history=jnp.zeros((batch, beam_size, max_len), jnp.int32),
      cross_kv=self.decoder.cross_kv(memory),
      src_mask=masks.padding_mask(src, self.config.pad_id),
    )

  def decode_beam_step(
    self, tokens: jax.Array, cache: BeamDecodeCache, position: jax.Array | int
  ) -> tuple[jax.Array, BeamDecodeCache]:
    """Decodes the K beams' tokens `[B, K]`, all at `position`.

    The K beams of a sentence pass through the decoder as K queries of one
    row: each attends to its own history in the pooled self-attention cache
    and to the sentence's source. Returns float32 logits `[B, K, V]`, beam k's
    equal to `decode_step`'s on the tokens of its history, and the cache with
    the new keys written into each beam's own block.

    With `attention_radius` set, the window stays a mask over all K * L slots
    (unlike `decode_step`, which slices the r + 1 slots it can see): a beam's
    keys lie scattered over the K beam blocks, so no slice holds its last r + 1.
    """
    batch, beam_size = tokens.shape
    max_len = cache.max_len
    own_block = jnp.broadcast_to(jnp.arange(beam_size, dtype=jnp.int32), (batch, beam_size))
    history = jax.lax.dynamic_update_index_in_dim(cache.history, own_block, position, axis=2)
    radius = self.config.attention_radius
    window = (
      None if radius is None else masks.local_mask(1, radius, max_len, position)
    )  # [1, 1, 1, L]
    self_mask = masks.combine(
      masks.beam_history_mask(history, position),
      None if window is None else jnp.tile(window, (1, 1, 1, beam_size)),
    )
    x = self._embed(tokens.reshape(batch * beam_size, 1), 'target', position, False)
    y, self_kv = self.decoder(
      x.reshape(batch, beam_size, -1),
      cache.cross_kv,
      self_mask,
      cache.src_mask,
      False,
      cache.self_kv,
      position,
    )
    return self._logits(y), cache.replace(self_kv=self_kv, history=history)


def attention_weights(
  model: Transformer,
  variables,
  src: jax.Array,
  tgt_in: jax.Array,
  packing: masks.Packing | None = None,
) -> dict[str, jax.Array]:
  """Every attention layer's weights for one forward pass, for plotting.

  Returns a dict from names like 'encoder/layer_0/self_attention' or
  'decoder/layer_1/cross_attention' to float32 weights `[B, N, T, S]`.
  """
  _, state = model.apply(variables, src, tgt_in, packing=packing, mutable=['intermediates'])
  flat = flax.traverse_util.flatten_dict(state['intermediates'], sep='/')
  suffix = '/attention_weights'
  return {name[: -len(suffix)]: value[0] for name, value in flat.items() if name.endswith(suffix)}


def count_params(params) -> int:
  """Number of scalars in a parameter pytree."""
  return sum(x.size for x in jax.tree_util.tree_leaves(params))
