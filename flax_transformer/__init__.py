"""The original encoder–decoder Transformer (Vaswani et al., 2017) in JAX/Flax."""

from flax_transformer.attention import KVCache, MultiHeadAttention, scaled_dot_product_attention
from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.layers import sinusoidal_positions
from flax_transformer.model import (BeamDecodeCache, DecodeCache, Transformer, attention_weights,
                                    count_params, empty_self_cache)

__version__ = '0.1.0'

__all__ = [
    'BeamDecodeCache', 'ConfigError', 'DecodeCache', 'KVCache', 'ModelConfig', 'MultiHeadAttention', 'Transformer',
    'attention_weights', 'count_params', 'empty_self_cache', 'scaled_dot_product_attention',
    'sinusoidal_positions',
]
