"""Memory a model config needs, estimated from its numbers before anything is allocated.

    check_fits(model_config, max_tokens=train_config.max_tokens)   # training: raises ConfigError
    check_fits(model_config)                                       # decoding
    check_decoding_fits(model_config, rows=64, beams=4, option='--beam-size')

A config.json with d_ff=10**12, max_len=10**9 or a million layers would
otherwise end in an allocation traceback, an out-of-memory error part way, or
an initialisation that never returns. The estimate is a lower bound (float32
arrays that cannot be avoided: parameters, gradients and Adam's two moments;
the positional-encoding table [max_len, D]; per layer the feed-forward hidden
state and two residual streams of one batch's tokens, and the batch's logits
[tokens, V]), so a config refused here could not have run; it is compared with
the machine's physical memory.
"""

from __future__ import annotations

import os

from flax_transformer.config import ConfigError, ModelConfig

FLOAT_BYTES = 4
# float32 copies per parameter in training: the parameters, a gradient, Adam's mu and nu.
TRAINING_COPIES = 4
# Without os.sysconf's page counts (not POSIX): a bound no single machine exceeds today.
FALLBACK_MEMORY = 2**44


def parameter_count(config: ModelConfig) -> int:
  """The weight matrices' entries (biases and norms, a few D per layer, left out)."""
  d, f = config.d_model, config.d_ff
  embeddings = config.vocab_size * d * (1 if config.share_embeddings else 3)
  encoder = config.num_encoder_layers * (4 * d * d + 2 * d * f)
  decoder = config.num_decoder_layers * (8 * d * d + 2 * d * f)
  return embeddings + encoder + decoder


def activation_bytes(config: ModelConfig, tokens: int) -> int:
  """One batch of `tokens` tokens per side: each layer's hidden states, the logits, positions."""
  layers = config.num_encoder_layers + config.num_decoder_layers
  per_token = layers * (2 * config.d_model + config.d_ff) + config.vocab_size
  return FLOAT_BYTES * (tokens * per_token + config.max_len * config.d_model)


def physical_memory() -> int:
  """Bytes of physical memory of this machine (FALLBACK_MEMORY where the OS does not say)."""
  try:
    return os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
  except (ValueError, OSError, AttributeError):
    return FALLBACK_MEMORY


def check_fits(
  config: ModelConfig,
  max_tokens: int | None = None,
  training: bool = True,
  memory: int | None = None,
) -> None:
  """Raises ConfigError, with the numbers, when the config cannot fit in `memory`.

  Args:
    config: the model; a training run's vocab_size is at most data.vocab_size.
    max_tokens: tokens per batch and side (training); None: one max_len sentence.
    training: count gradients and Adam's moments besides the parameters.
    memory: bytes available; None: this machine's physical memory.
  """
  memory = physical_memory() if memory is None else memory
  params = parameter_count(config)
  copies = TRAINING_COPIES if training else 1
  tokens = max_tokens if max_tokens is not None else config.max_len
  needed = params * copies * FLOAT_BYTES, activation_bytes(config, tokens)
  if sum(needed) <= memory:
    return
  what = 'parameters, gradients and Adam state' if training else 'parameters'
  raise ConfigError(
    f'the model is too large for this machine: about {params:,} parameters ({_gib(needed[0])} '
    f'for {what}) and {_gib(needed[1])} of activations for one batch of {tokens:,} tokens and '
    f'the positional table of max_len rows, '
    f'{_gib(sum(needed))} in all, more than its {_gib(memory)} of memory (model.d_model='
    f'{config.d_model}, d_ff={config.d_ff}, num_encoder_layers={config.num_encoder_layers}, '
    f'num_decoder_layers={config.num_decoder_layers}, max_len={config.max_len}, vocab_size='
    f'{config.vocab_size})'
  )


def _gib(count: int) -> str:
  return f'{count / 2**30:,.1f} GiB'


def decoding_bytes(config: ModelConfig, rows: int, beams: int, length: int) -> int:
  """A lower bound of one decoding batch's memory: `rows` sentences of `beams` beams and
  `length` output positions. Per decoder layer the cache's keys and values [B, K, L, D] each,
  one layer's attention scores over the pooled beams [B, N, K, K * L], and the logits
  [B, K, V]."""
  cache = 2 * config.num_decoder_layers * config.d_model
  scores = config.num_heads * beams
  return FLOAT_BYTES * rows * beams * (length * (cache + scores) + config.vocab_size)


def check_decoding_fits(
  config: ModelConfig,
  rows: int,
  beams: int,
  option: str,
  length: int | None = None,
  memory: int | None = None,
) -> None:
  """Raises ConfigError naming `option` (the beam count's) when decoding `rows` sentences of
  `beams` beams at once cannot fit in `memory` (`decoding_bytes`; length: the output
  positions, at most the model's max_len)."""
  memory = physical_memory() if memory is None else memory
  length = min(length or config.max_len, config.max_len)
  needed = decoding_bytes(config, rows, beams, length) + parameter_count(config) * FLOAT_BYTES
  if needed > memory:
    raise ConfigError(
      f'{option}={beams} is too large for this machine: decoding {rows:,} '
      f'sentence{"s" * (rows != 1)} of {beams:,} beams and {length:,} positions needs at least '
      f'{_gib(needed)}, more than its {_gib(memory)} of memory; use fewer beams (or a smaller '
      '--batch-size)'
    )
