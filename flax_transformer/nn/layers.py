"""Positional encoding, feed-forward, residual sub-layers and the encoder/decoder stacks.

Axis legend: B batch, T target length, S source length, D model dim.
The stacks take already-embedded inputs `[B, L, D]` and masks built by the
caller (see `masks.py`), so the same stacks serve the autoregressive model and
decoders with other masks.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.config import ModelConfig
from flax_transformer.nn.attention import KVCache, MultiHeadAttention
from flax_transformer.nn.backend import compute_dtype, resolve_attention_kernel
from flax_transformer.nn.dropout import Dropout
from flax_transformer.nn.matmul import Dense


def sinusoidal_positions(length: int, d_model: int, layout: str = 'interleaved') -> jax.Array:
  """The paper's positional encoding (§3.5), float32 `[length, d_model]`.

  PE(pos, 2i) = sin(pos / 10000^(2i / d_model)) and
  PE(pos, 2i + 1) = cos(pos / 10000^(2i / d_model)): with layout 'interleaved'
  sine and cosine alternate along the feature axis, each pair sharing one
  wavelength; with 'concatenated' (Marian's) the ceil(D/2) sines come first,
  then the floor(D/2) cosines of the same wavelengths.
  """
  return jnp.asarray(_sinusoid_table(length, d_model, layout))


@functools.lru_cache(maxsize=16)
def _sinusoid_table(length: int, d_model: int, layout: str) -> np.ndarray:
  """`sinusoidal_positions` as a read-only NumPy float32 table.

  A constant, so computed in float64 and rounded once: float32 angles put the
  table 1.6e-5 off the formula by position 249 (d_model 512), and further on.
  """
  position = np.arange(length, dtype=np.float64)[:, None]  # [L, 1]
  two_i = np.arange(0, d_model, 2, dtype=np.float64)[None, :]  # [1, ceil(D/2)]
  angle = position / np.power(10_000.0, two_i / d_model)  # [L, ceil(D/2)]
  if layout == 'concatenated':
    table = np.concatenate([np.sin(angle), np.cos(angle)[:, : d_model // 2]], axis=-1)
  else:
    table = np.stack([np.sin(angle), np.cos(angle)], axis=-1)  # [L, ceil(D/2), 2]
    table = table.reshape(length, -1)[:, :d_model]
  table = table.astype(np.float32)
  table.flags.writeable = False
  return table


class FeedForward(nn.Module):
  """FFN(x) = W_2 Dropout(act(W_1 x + b_1)) + b_2, applied at each position; the dropout on the
  hidden activations [..., d_ff] is model.activation_dropout_rate's (0, the paper's: none)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
    c = self.config
    dense = lambda features, name: Dense(
      features, dtype=compute_dtype(c), name=name, kernel_init=nn.initializers.xavier_uniform()
    )
    activation = {'relu': nn.relu, 'gelu': nn.gelu, 'silu': nn.silu}[c.activation]
    hidden = activation(dense(c.d_ff, 'wi')(x))  # [..., d_ff]
    hidden = Dropout(c.activation_dropout_rate, name='activation_dropout')(
      hidden, deterministic=not train
    )
    return dense(c.d_model, 'wo')(hidden)


class Sublayer(nn.Module):
  """The residual connection and LayerNorm around one sub-layer.

  post-LN (the paper): LayerNorm(x + Dropout(Sublayer(x)))
  pre-LN:              x + Dropout(Sublayer(LayerNorm(x)))

  Usage: `h = s.normalize_input(x)`, run the sub-layer on h to get y, then
  `x = s(x, y, train)`.
  """

  config: ModelConfig

  def setup(self):
    self.norm = nn.LayerNorm(
      epsilon=self.config.layer_norm_epsilon, dtype=compute_dtype(self.config)
    )
    self.dropout = Dropout(self.config.dropout_rate)

  def normalize_input(self, x: jax.Array) -> jax.Array:
    return self.norm(x) if self.config.norm_placement == 'pre' else x

  def __call__(self, x: jax.Array, sublayer_out: jax.Array, train: bool) -> jax.Array:
    residual = x + self.dropout(sublayer_out, deterministic=not train)
    return residual if self.config.norm_placement == 'pre' else self.norm(residual)


def _attention(config: ModelConfig, name: str) -> MultiHeadAttention:
  return MultiHeadAttention(
    num_heads=config.num_heads,
    d_model=config.d_model,
    attention_dropout_rate=config.attention_dropout_rate,
    dtype=compute_dtype(config),
    kernel=resolve_attention_kernel(config),
    qkv_init_gain=config.qkv_init_gain,
    name=name,
  )


class EncoderBlock(nn.Module):
  """Self-attention, then feed-forward, each wrapped in a `Sublayer`."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool) -> jax.Array:
    """x `[B, S, D]`, mask broadcastable to `[B, N, S, S]` -> `[B, S, D]`."""
    attention = _attention(self.config, 'self_attention')
    attention_sublayer = Sublayer(self.config, name='self_attention_sublayer')
    h = attention_sublayer.normalize_input(x)
    q, kv = attention.project_qkv(h)
    x = attention_sublayer(x, attention.attend(q, kv, mask, not train), train)

    ffn_sublayer = Sublayer(self.config, name='ffn_sublayer')
    return ffn_sublayer(
      x, FeedForward(self.config, name='ffn')(ffn_sublayer.normalize_input(x), train), train
    )


class DecoderBlock(nn.Module):
  """Masked self-attention, cross-attention over the memory, then feed-forward."""

  config: ModelConfig

  def setup(self):
    self.self_attention = _attention(self.config, 'self_attention')
    self.self_attention_sublayer = Sublayer(self.config)
    self.cross_attention = _attention(self.config, 'cross_attention')
    self.cross_attention_sublayer = Sublayer(self.config)
    self.ffn = FeedForward(self.config)
    self.ffn_sublayer = Sublayer(self.config)

  def cross_kv(self, memory: jax.Array) -> KVCache:
    """Cross-attention keys and values `[B, N, S, H]` of the memory `[B, S, D]`."""
    return self.cross_attention.project_kv(memory)

  def __call__(
    self,
    y: jax.Array,
    cross_kv: KVCache,
    self_mask: jax.Array | None,
    cross_mask: jax.Array | None,
    train: bool,
    cache: KVCache | None = None,
    cache_index: jax.Array | int = 0,
  ) -> tuple[jax.Array, KVCache | None]:
    """One decoder layer.

    Args:
      y: `[B, T, D]` target-side inputs.
      cross_kv: this layer's keys and values of the encoder memory.
      self_mask: broadcastable to `[B, N, T, T]`, or `[B, N, T, max_len]` with a cache.
      cross_mask: broadcastable to `[B, N, T, S]`.
      train: dropout on.
      cache: self-attention keys and values of the earlier positions, `[B, N, max_len, H]`;
        None for a full (teacher-forced) pass.
      cache_index: the position of y's first token, where its keys are written.

    Returns:
      `[B, T, D]` and the updated cache (None when no cache came in).
    """
    deterministic = not train
    h = self.self_attention_sublayer.normalize_input(y)
    # Fused on a decoding step's few rows only (see project_qkv).
    q, kv = self.self_attention.project_qkv(h, fuse=cache is not None)
    if cache is not None:
      kv = cache = self.self_attention.write_cache(kv, cache, cache_index)
    y = self.self_attention_sublayer(
      y, self.self_attention.attend(q, kv, self_mask, deterministic), train
    )

    h = self.cross_attention_sublayer.normalize_input(y)
    y = self.cross_attention_sublayer(
      y, self.cross_attention(h, cross_kv, cross_mask, deterministic), train
    )
    return self.ffn_sublayer(y, self.ffn(self.ffn_sublayer.normalize_input(y), train), train), cache


# What each `ModelConfig.remat` keeps for the backward pass: `layer` saves nothing inside a
# layer (its input is kept by the caller); `dots` saves the products without batch dimensions,
# the dense projections and the feed-forward, and recomputes the batched attention products,
# the softmax, the LayerNorms and dropout.
REMAT_POLICIES = {'layer': None, 'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def _stacked(trees: list):
  """Pytrees of one structure -> one pytree whose leaves gain a leading axis, one per tree."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _scans(module: nn.Module, train: bool) -> bool:
  """Whether a stack runs as `scanned_layers`: training with `model.remat`, past init (which
  declares each layer's parameters on its own)."""
  return module.config.remat != 'none' and train and not module.is_initializing()


def scanned_layers(
  apply_layer, layers: list, x: jax.Array, per_layer: list | None, remat: str, rng: jax.Array
) -> jax.Array:
  """The layers as one `lax.scan` over their parameters stacked, each step rematerialised.

  apply_layer(params, dropout_key, x, extra) -> x: one layer; layers: each layer's
  parameters, as the model names them (`layer_0`, ...); x `[B, L, D]`: the stack's input,
  carried from layer to layer; per_layer: one pytree per layer that the layer reads (a
  decoder's cross-attention keys and values; `extra`), or None; rng: split into one dropout
  key per layer (so the dropout masks are not those of the unrolled layers).

  Unrolled, the recomputation of `jax.checkpoint` saves nothing on XLA:CPU, which schedules
  it as soon as its inputs exist (docs/training_step.md); a scan's loop makes the backward
  pass recompute one layer at a time. The parameters stay separate on disk: only this
  computation stacks them.
  """
  keys = jax.random.split(rng, len(layers))

  def step(carry, layer):
    params, key, extra = layer
    return apply_layer(params, key, carry, extra), None

  step = jax.checkpoint(step, policy=REMAT_POLICIES[remat], prevent_cse=False)
  extras = None if per_layer is None else _stacked(per_layer)
  return jax.lax.scan(step, x, (_stacked(layers), keys, extras))[0]


class Encoder(nn.Module):
  """N encoder blocks (plus a final LayerNorm when pre-LN)."""

  config: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array, mask: jax.Array | None, train: bool) -> jax.Array:
    """x `[B, S, D]` (embedded source) -> memory `[B, S, D]`."""
    names = [f'layer_{i}' for i in range(self.config.num_encoder_layers)]
    if _scans(self, train):
      block = EncoderBlock(self.config, parent=None)
      apply_layer = lambda params, key, x, _: block.apply(
        {'params': params}, x, mask, True, rngs={'dropout': key}
      )
      x = scanned_layers(
        apply_layer,
        [self.variables['params'][name] for name in names],
        x,
        None,
        self.config.remat,
        self.make_rng('dropout'),
      )
    else:
      for name in names:
        x = EncoderBlock(self.config, name=name)(x, mask, train)
    if self.config.norm_placement == 'pre':
      x = nn.LayerNorm(
        epsilon=self.config.layer_norm_epsilon, dtype=compute_dtype(self.config), name='final_norm'
      )(x)
    return x


class Decoder(nn.Module):
  """N decoder blocks (plus a final LayerNorm when pre-LN)."""

  config: ModelConfig

  def setup(self):
    self.layers = [
      DecoderBlock(self.config, name=f'layer_{i}') for i in range(self.config.num_decoder_layers)
    ]
    if self.config.norm_placement == 'pre':
      self.final_norm = nn.LayerNorm(
        epsilon=self.config.layer_norm_epsilon, dtype=compute_dtype(self.config)
      )

  def cross_kv(self, memory: jax.Array) -> tuple[KVCache, ...]:
    """Every layer's cross-attention keys and values of the memory `[B, S, D]`."""
    return tuple(layer.cross_kv(memory) for layer in self.layers)

  def __call__(
    self,
    y: jax.Array,
    cross_kv: tuple[KVCache, ...],
    self_mask: jax.Array | None,
    cross_mask: jax.Array | None,
    train: bool,
    caches: tuple[KVCache, ...] | None = None,
    cache_index: jax.Array | int = 0,
  ) -> tuple[jax.Array, tuple[KVCache, ...] | None]:
    """y `[B, T, D]` (embedded target) -> `[B, T, D]`, and the updated per-layer caches."""
    if _scans(self, train) and caches is None:
      block = DecoderBlock(self.config, parent=None)
      apply_layer = lambda params, key, y, kv: block.apply(
        {'params': params}, y, kv, self_mask, cross_mask, True, rngs={'dropout': key}
      )[0]
      layers = [self.variables['params'][f'layer_{i}'] for i in range(len(self.layers))]
      y = scanned_layers(
        apply_layer, layers, y, list(cross_kv), self.config.remat, self.make_rng('dropout')
      )
      return (self.final_norm(y) if self.config.norm_placement == 'pre' else y), None
    new_caches = []
    for i, layer in enumerate(self.layers):
      y, cache = layer(
        y,
        cross_kv[i],
        self_mask,
        cross_mask,
        train,
        None if caches is None else caches[i],
        cache_index,
      )
      new_caches.append(cache)
    if self.config.norm_placement == 'pre':
      y = self.final_norm(y)
    return y, None if caches is None else tuple(new_caches)
