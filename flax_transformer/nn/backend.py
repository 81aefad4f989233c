"""The computation settings resolved where the model runs: `ModelConfig.dtype`,
`ModelConfig.attention_kernel` and `ModelConfig.loss_chunk` say 'auto', and this module turns
them into what this backend computes with (the settings themselves stay backend-free, in
`config`).

`compute_dtype(config)` is the dtype the layers compute in; `resolve_attention_kernel(config)`
the kernel attention runs (einsum, xla or cudnn); `resolve_loss_chunk(config, tokens)` the
chunk a training step fuses its output layer and loss over (0: the whole batch at once).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_transformer.config import CUDNN_DTYPES, ModelConfig
from flax_transformer.errors import ConfigError


def compute_dtype(config: ModelConfig) -> jnp.dtype:
  """The dtype `config`'s model computes in here: `config.dtype`, with 'auto' resolved
  (`resolve_dtype`)."""
  return jnp.dtype(resolve_dtype(config.dtype))


def resolve_dtype(dtype: str, backend: str | None = None) -> str:
  """`ModelConfig.dtype` as a dtype name: 'auto' is 'bfloat16' on a GPU or TPU (their matrix
  units run it at several times float32's rate) and 'float32' on a CPU (`backend`, default
  JAX's), where bfloat16 is slower without bfloat16 instructions (docs/benchmarks.md)."""
  if dtype != 'auto':
    return dtype
  return 'float32' if (backend or jax.default_backend()) == 'cpu' else 'bfloat16'


# auto picks cuDNN up to this head size, which every GPU it picks cuDNN on takes (Hopper and
# later take config.CUDNN_MAX_HEAD_DIM, 256; earlier cards 128).
AUTO_CUDNN_MAX_HEAD_DIM = 128


def resolve_attention_kernel(config: ModelConfig, backend: str | None = None) -> str:
  """`ModelConfig.attention_kernel` as the kernel the model runs on `backend` (default JAX's):
  'einsum', 'xla' or 'cudnn'.

  auto is cudnn on a GPU when cuDNN takes the model (bfloat16 compute, head_dim <= 128 and a
  multiple of 8, no attention dropout; an Ampere or later card): its saving is the `[B, N, T,
  S]` scores a training step keeps for the backward pass. Elsewhere auto is einsum: a CPU runs
  the same products either way (docs/training_step.md), and a TPU has no cuDNN. Raises
  ConfigError for cudnn where no GPU is.
  """
  if backend is None and jax.default_backend() == 'gpu' and not _flash_capable_gpu():
    backend = 'gpu (before Ampere)'  # no cuDNN flash attention: auto takes einsum
  backend = backend or jax.default_backend()
  if config.attention_kernel == 'cudnn' and backend != 'gpu':
    raise ConfigError(
      f'model.attention_kernel=cudnn needs a GPU (cuDNN); this runs on {backend}: '
      'use auto, einsum or xla'
    )
  if config.attention_kernel != 'auto':
    return config.attention_kernel
  dtype = resolve_dtype(config.dtype, backend)
  fits = (
    dtype in CUDNN_DTYPES
    and config.head_dim <= AUTO_CUDNN_MAX_HEAD_DIM
    and config.head_dim % 8 == 0
    and config.attention_dropout_rate == 0
  )
  return 'cudnn' if backend == 'gpu' and fits else 'einsum'


def _flash_capable_gpu() -> bool:
  """Whether JAX's first device is a GPU of compute capability 8.0 or later (Ampere on), the
  cards cuDNN's flash attention runs on."""
  try:
    return float(jax.devices()[0].compute_capability) >= 8.0
  except (AttributeError, TypeError, ValueError):
    return False


# auto fuses the loss over chunks of this many tokens where it measured faster: a CPU computing
# in float32 once a batch's float32 logits pass AUTO_FUSED_LOSS_BYTES (docs/training_step.md:
# 11-13% off the Multi30k step, 40% of its memory, on a Zen 4; the [tokens, vocabulary] logits
# are memory-bound there). A GPU streams such logits at its memory's rate, where the chunks'
# sequential loop would only cost, and bfloat16 steps were not measured faster.
AUTO_LOSS_CHUNK = 1024
AUTO_FUSED_LOSS_BYTES = 64 * 2**20


def resolve_loss_chunk(config: ModelConfig, tokens: int, backend: str | None = None) -> int:
  """`ModelConfig.loss_chunk` as the chunk (in tokens) a training step of `tokens` target
  tokens fuses its loss over on `backend` (default JAX's); 0 is the whole batch at once.

  auto is AUTO_LOSS_CHUNK on a CPU computing in float32 when the batch's `[tokens, vocabulary]`
  float32 logits would hold AUTO_FUSED_LOSS_BYTES or more and make more than one chunk, else 0.
  """
  if config.loss_chunk != 'auto':
    return config.loss_chunk
  backend = backend or jax.default_backend()
  logits_bytes = tokens * config.vocab_size * 4
  fuses = (
    backend == 'cpu'
    and resolve_dtype(config.dtype, backend) == 'float32'
    and logits_bytes >= AUTO_FUSED_LOSS_BYTES
    and tokens > AUTO_LOSS_CHUNK
  )
  return AUTO_LOSS_CHUNK if fuses else 0
