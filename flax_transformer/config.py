"""Model configuration: one frozen dataclass, with the paper's sizes as presets.

Every default of the architecture is decided here and nowhere else. Presets are
classmethods that take overrides, e.g. `ModelConfig.base(vocab_size=8000)`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax.numpy as jnp


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the option."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the encoder–decoder Transformer.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  """

  vocab_size: int = 37_000
  d_model: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_ff: int = 2048
  # Dropout on embeddings + positions and on every sub-layer output (paper §5.4).
  dropout_rate: float = 0.1
  # Dropout on the attention weights; the paper does not use it.
  attention_dropout_rate: float = 0.0
  # Length of the positional-encoding table: the longest source or target sequence.
  max_len: int = 256
  activation: Literal['relu', 'gelu'] = 'relu'
  # 'post': LayerNorm(x + Sublayer(x)) as in the paper; 'pre': x + Sublayer(LayerNorm(x)).
  norm_placement: Literal['post', 'pre'] = 'post'
  # One embedding matrix for source, target and the pre-softmax projection (paper §3.4).
  share_embeddings: bool = True
  # Restricted self-attention (paper §4): each position sees positions within this
  # distance. None means unrestricted.
  attention_radius: int | None = None
  # Compute dtype ('float32' or 'bfloat16'); parameters, logits and loss stay float32.
  dtype: Literal['float32', 'bfloat16'] = 'float32'
  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2
  unk_id: int = 3

  def __post_init__(self):
    positive = ('vocab_size', 'd_model', 'num_heads', 'num_encoder_layers', 'num_decoder_layers',
                'd_ff', 'max_len')
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f'model.{name} must be a positive integer, got {value!r}')
    if self.d_model % self.num_heads:
      raise ConfigError(f'model.d_model={self.d_model} is not divisible by model.num_heads='
                        f'{self.num_heads}: each head needs d_model / num_heads dimensions')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise ConfigError(f'model.{name} must be in [0, 1), got {value!r}')
    if self.activation not in ('relu', 'gelu'):
      raise ConfigError(f"model.activation must be 'relu' or 'gelu', got {self.activation!r}")
    if self.norm_placement not in ('post', 'pre'):
      raise ConfigError(f"model.norm_placement must be 'post' or 'pre', got {self.norm_placement!r}")
    if self.dtype not in ('float32', 'bfloat16'):
      raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.attention_radius is not None and self.attention_radius < 0:
      raise ConfigError(f'model.attention_radius must be >= 0 or None, got {self.attention_radius!r}')
    special = {'pad_id': self.pad_id, 'bos_id': self.bos_id, 'eos_id': self.eos_id,
               'unk_id': self.unk_id}
    if len(set(special.values())) != len(special):
      raise ConfigError(f'special token ids must be distinct, got {special}')
    for name, value in special.items():
      if not 0 <= value < self.vocab_size:
        raise ConfigError(f'model.{name}={value} is outside the vocabulary '
                          f'(model.vocab_size={self.vocab_size})')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  def replace(self, **overrides) -> ModelConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A few-thousand-parameter model for tests: d=32, 2+2 layers, 4 heads."""
    defaults = dict(vocab_size=64, d_model=32, num_heads=4, num_encoder_layers=2,
                    num_decoder_layers=2, d_ff=64, dropout_rate=0.1, max_len=64)
    return cls(**{**defaults, **overrides})

  @classmethod
  def base(cls, **overrides) -> ModelConfig:
    """The paper's base model (Table 3): N=6, d=512, d_ff=2048, h=8, dropout 0.1."""
    return cls(**overrides)

  @classmethod
  def big(cls, **overrides) -> ModelConfig:
    """The paper's big model (Table 3): N=6, d=1024, d_ff=4096, h=16, dropout 0.3."""
    defaults = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return cls(**{**defaults, **overrides})
