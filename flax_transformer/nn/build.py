"""The model a config names: `build_model(config)` and its parameter shapes.

    model = build_model(config)      # Transformer, or CMLMTransformer when config.kind == 'cmlm'
    shapes = abstract_params(config) # jax.ShapeDtypeStruct leaves, nothing computed

Both modules are called as `model(src, tokens)`; everything that turns a
config.json into a module (training, checkpoints, translation) goes through here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_transformer.config import ModelConfig
from flax_transformer.nn.backend import resolve_attention_kernel
from flax_transformer.nn.cmlm import CMLMTransformer
from flax_transformer.nn.model import Transformer


def build_model(config: ModelConfig) -> Transformer | CMLMTransformer:
  """The paper's `Transformer` (kind 'autoregressive') or the `CMLMTransformer` (kind 'cmlm').

  Raises ConfigError for a model.attention_kernel that cannot run here (cudnn without a GPU).
  """
  resolve_attention_kernel(config)
  return CMLMTransformer(config) if config.kind == 'cmlm' else Transformer(config)


def abstract_params(config: ModelConfig):
  """The model's parameter shapes and dtypes (`jax.ShapeDtypeStruct` leaves), computing nothing."""
  tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
  return jax.eval_shape(
    lambda src, tgt: build_model(config).init(jax.random.key(0), src, tgt)['params'], tokens, tokens
  )
