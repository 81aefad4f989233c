"""The networks: masks and attention as pure functions, the Flax modules that call them.

Layer 1 of the package (above `config` only): nothing here reads files, data or
checkpoints. Modules, bottom up: `masks`, `matmul`, `dropout`, `attention`,
`layers`, `model` (the paper's Transformer), `cmlm` (the conditional masked LM),
`build` (either model from its ModelConfig); `backend` resolves the computation settings
(dtype, attention kernel, loss chunk) where the model runs.
"""

from flax_transformer.nn import masks
from flax_transformer.nn.attention import (
  KVCache,
  MultiHeadAttention,
  banded_attention,
  scaled_dot_product_attention,
)
from flax_transformer.nn.backend import (
  compute_dtype,
  resolve_attention_kernel,
  resolve_dtype,
  resolve_loss_chunk,
)
from flax_transformer.nn.build import abstract_params, build_model
from flax_transformer.nn.cmlm import CMLMTransformer, mask_id, num_length_classes
from flax_transformer.nn.layers import Decoder, Encoder, sinusoidal_positions
from flax_transformer.nn.matmul import Dense
from flax_transformer.nn.model import (
  BeamDecodeCache,
  DecodeCache,
  Transformer,
  attention_weights,
  count_params,
  empty_self_cache,
)

__all__ = [
  'BeamDecodeCache',
  'CMLMTransformer',
  'DecodeCache',
  'Decoder',
  'Dense',
  'Encoder',
  'KVCache',
  'MultiHeadAttention',
  'Transformer',
  'abstract_params',
  'attention_weights',
  'banded_attention',
  'build_model',
  'compute_dtype',
  'count_params',
  'empty_self_cache',
  'mask_id',
  'masks',
  'num_length_classes',
  'resolve_attention_kernel',
  'resolve_dtype',
  'resolve_loss_chunk',
  'scaled_dot_product_attention',
  'sinusoidal_positions',
]
