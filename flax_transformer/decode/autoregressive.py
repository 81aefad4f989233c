"""Autoregressive decoding on the explicit cache: greedy, sampling and beam search on a model.

Axis legend: B batch (source sentences), K beams per sentence, V vocabulary,
S source length, L maximum output length (cache slots and output columns).

Two levels:

* On a model (here): `greedy`, `sample` and `beam_search` take the `Transformer`, its
  parameters and source ids `[B, S]`, run the encoder once, and decode with
  one jit-compiled program per (config, shapes, settings).

      tokens = greedy(model, params, src)                           # [B, L]
      tokens = sample(model, params, src, jax.random.key(0), top_p=0.9)
      tokens, scores = beam_search(model, params, src, beam_size=4, alpha=0.6)

  Their keyword settings are the fields of the methods they run, `BeamSearch`, `Greedy`
  and `Sampling` (defined in decode/methods.py, still importable from here), which hold
  each setting's default, help and range once; `method.run(model, params, src)`
  decodes with a method value.

* On a step function (`search.py`, its names still importable from here): `decode_loop`
  and `beam_loop` drive any `step_fn(tokens [B], cache, position) -> (logits [B, V], cache)`.
  The model-level functions wrap `Transformer.decode_step` and
  `Transformer.decode_beam_step` this way (`model_step_fn`, on the KV cache).

Output conventions, for every method: tokens are y_1 .. y_L without BOS; a
sequence that ends has EOS at its end and PAD after it; a sequence that reaches
its length limit ends without EOS. PAD and BOS are never generated (they are
never training targets); EOS is not generated before `min_len` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.config import ModelConfig
from flax_transformer.decode.methods import EXTRA_OUTPUT_TOKENS, BeamSearch, Greedy, Sampling
from flax_transformer.decode.search import (
  DEFAULT_STEPS_PER_CHECK,
  BeamState,
  Cache,
  DecodeState,
  LoopConfig,
  PickFn,
  StepFn,
  argmax_pick,
  beam_loop,
  decode_loop,
  length_penalty,
  never_output,
  reorder_beams,
  sampling_pick,
  truncated_logits,
)
from flax_transformer.nn.backend import compute_dtype
from flax_transformer.nn.model import BeamDecodeCache, DecodeCache, Transformer

# The loops on a step function and their pieces moved to `search`, the methods to `methods`;
# they are still here.
__all__ = [
  'DEFAULT_STEPS_PER_CHECK',
  'EXTRA_OUTPUT_TOKENS',
  'BeamSearch',
  'BeamState',
  'Cache',
  'DecodeState',
  'Greedy',
  'LoopConfig',
  'PickFn',
  'Sampling',
  'StepFn',
  'argmax_pick',
  'as_variables',
  'beam_loop',
  'beam_search',
  'cast_matrices',
  'check_source',
  'decode_loop',
  'greedy',
  'length_penalty',
  'model_step_fn',
  'never_output',
  'output_limits',
  'reorder_beams',
  'sample',
  'sampling_pick',
  'truncated_logits',
]

# --- on the model --------------------------------------------------------------


def greedy(
  model: Transformer,
  params,
  src,
  *,
  min_len: int = 0,
  steps_per_check: int = DEFAULT_STEPS_PER_CHECK,
  **settings,
) -> jax.Array:
  """Greedy decoding: the most probable token at each step.

  Args:
    model: the `Transformer` (only its config is used).
    params: the parameter dict, or the full variables `{'params': ...}`.
    src: int source ids `[B, S]` (numpy or jax), PAD-padded, EOS-terminated as in training.
    min_len: EOS is forbidden before this many tokens.
    steps_per_check: steps between checks for "every sentence is done".
    **settings: `Greedy`'s fields, its defaults and checks: max_len, the output tokens
      per sentence (None: each sentence's source length (non-PAD tokens) + 50, capped at
      `model.config.max_len` with a warning).

  Returns:
    int32 tokens `[B, L]`: EOS-terminated, PAD after EOS (see the module docstring).
  """
  method = Greedy(**settings)
  variables, src, limits, loop = _prepare(
    model, params, src, method.max_len, min_len, steps_per_check
  )
  return _greedy(model.config, variables, src, limits, loop)


def sample(
  model: Transformer,
  params,
  src,
  rng: jax.Array,
  *,
  min_len: int = 0,
  steps_per_check: int = DEFAULT_STEPS_PER_CHECK,
  **settings,
) -> jax.Array:
  """Ancestral sampling with temperature, top-k and top-p: `settings` are `Sampling`'s fields
  (temperature, top_k, top_p, max_len; a seed is not read: `rng` draws).

  The same `rng` gives the same tokens; `top_k=1` gives greedy's tokens. Other
  arguments and the result are as in `greedy`.
  """
  method = Sampling(**settings)
  variables, src, limits, loop = _prepare(
    model, params, src, method.max_len, min_len, steps_per_check
  )
  # Compiled once per what the loop reads: the seed is in `rng`, the output length in `loop`.
  static = dataclasses.replace(method, seed=0, max_len=None)
  return _sample(model.config, variables, src, limits, rng, loop, static)


def beam_search(
  model: Transformer,
  params,
  src,
  *,
  n_best: int = 1,
  min_len: int = 0,
  steps_per_check: int = DEFAULT_STEPS_PER_CHECK,
  **settings,
) -> tuple[jax.Array, jax.Array]:
  """Beam search with a length penalty (see `beam_loop`): `settings` are `BeamSearch`'s fields
  (beam_size, alpha, penalty_form, max_len), its defaults the paper's beam 4, alpha 0.6, GNMT's
  penalty.

  Returns:
    n_best == 1: tokens `[B, L]` and scores `[B]`; n_best (<= beam_size) > 1: tokens
    `[B, n_best, L]` and scores `[B, n_best]`, best first. A score is
    log P(Y | X) / length_penalty(|Y|, alpha, penalty_form), |Y| counting EOS; batch-padding
    rows (all-PAD source) score -inf. With beam_size=1 and alpha=0 the result is
    greedy's, except where an EOS that greedy passed over scores higher than
    greedy's whole sequence: then it is that shorter, more probable hypothesis.
  Other arguments are as in `greedy`.
  """
  method = BeamSearch(**settings)
  variables, src, limits, loop = _prepare(
    model, params, src, method.max_len, min_len, steps_per_check
  )
  static = dataclasses.replace(method, max_len=None)  # the output length is in `loop`
  tokens, scores = _beam_search(model.config, variables, src, limits, loop, static, n_best)
  return (tokens[:, 0], scores[:, 0]) if n_best == 1 else (tokens, scores)


def as_variables(params) -> Mapping:
  """`{'params': params}` for a bare parameter dict; full variables pass through."""
  if not isinstance(params, Mapping):
    raise TypeError(
      f'params must be the parameter dict or the variables {{"params": ...}}, '
      f'got {type(params).__name__}'
    )
  return params if 'params' in params else {'params': params}


def cast_matrices(variables, dtype) -> Mapping:
  """`variables` with every floating matrix (kernels, embedding tables) in `dtype`; vectors as they are.

  Each `Dense` casts its float32 kernel to the compute dtype at every use, which
  in a decoding loop means at every step; cast once before the loop, the
  `Transformer`'s products are bit for bit the same (casting a bfloat16 kernel
  to bfloat16 is nothing; a cmlm model's MASK embedding shift reads one table
  row rounded to bfloat16). Biases and LayerNorm parameters stay float32, as
  they are added in float32. A no-op for float32 compute, and for matrices
  already in `dtype`.
  """
  if jnp.dtype(dtype) == jnp.float32:
    return variables
  cast = lambda x: x.astype(dtype) if x.ndim >= 2 and jnp.issubdtype(x.dtype, jnp.floating) else x
  return jax.tree.map(cast, variables)


def output_limits(
  src: np.ndarray, config: ModelConfig, max_len: int | None
) -> tuple[int, np.ndarray]:
  """The output length L of a batch and each sentence's limit `[B]` (0 for all-PAD rows).

  max_len None: a sentence of n source tokens may emit n + 50, capped at
  `config.max_len` (the positional table) with a warning; L = min(S + 50, config.max_len).
  """
  lengths = (src != config.pad_id).sum(axis=1)
  if max_len is None:
    wanted = lengths + EXTRA_OUTPUT_TOKENS
    if (wanted > config.max_len).any():
      warnings.warn(
        f'source length {lengths.max()} + {EXTRA_OUTPUT_TOKENS} exceeds '
        f'model.max_len={config.max_len}: output capped at {config.max_len} tokens',
        stacklevel=4,
      )
    total = min(src.shape[1] + EXTRA_OUTPUT_TOKENS, config.max_len)
  else:
    if not isinstance(max_len, (int, np.integer)) or not 1 <= max_len <= config.max_len:
      raise ValueError(
        f'max_len must be an integer in [1, model.max_len={config.max_len}] '
        f'(the positional-encoding table), got {max_len!r}'
      )
    wanted = np.full_like(lengths, max_len)
    total = int(max_len)
  return total, np.where(lengths == 0, 0, np.minimum(wanted, total)).astype(np.int32)


def check_source(src, config: ModelConfig) -> np.ndarray:
  """Source ids `[B, S]` (numpy or jax) -> int32 numpy, or ValueError naming what is wrong."""
  src = np.asarray(src)
  if src.ndim != 2 or not np.issubdtype(src.dtype, np.integer):
    raise ValueError(
      f'src must be integer token ids [batch, length], got {src.dtype} array of shape {src.shape}'
    )
  if src.shape[1] > config.max_len:
    raise ValueError(
      f'source length {src.shape[1]} exceeds model.max_len={config.max_len}; truncate the input'
    )
  if src.size and (src.min() < 0 or src.max() >= config.vocab_size):
    raise ValueError(f'src has token ids outside [0, model.vocab_size={config.vocab_size})')
  return src.astype(np.int32)


def _prepare(model: Transformer, params, src, max_len, min_len, steps_per_check):
  """Validates the inputs; returns variables, src, limits and the loop settings."""
  config = model.config
  if config.kind != 'autoregressive':
    # Its parameters would load into the causal decoder and give fluent-looking garbage.
    raise ValueError(
      f'greedy, sample and beam_search decode an autoregressive model; '
      f'model.kind={config.kind!r} decodes with non_autoregressive.mask_predict'
    )
  src = check_source(src, config)
  total, limits = output_limits(src, config, max_len)
  loop = LoopConfig.for_model(config, total, min_len=min_len, steps_per_check=steps_per_check)
  return as_variables(params), src, limits, loop


def model_step_fn(
  config: ModelConfig, variables, src: jax.Array, max_len: int, beam_size: int = 1
) -> tuple[StepFn, Cache]:
  """Runs the encoder once; returns the step function on `[B * K]` rows and its initial cache.

  beam_size 1: the cache is the self-attention cache only (`[B, N, L, H]` per
  layer); the cross-attention keys and values are computed here, once, and
  closed over. beam_size K > 1: the cache is a `BeamDecodeCache`, which
  `reorder_beams` reorders without moving keys or values.
  """
  model = Transformer(config)
  variables = cast_matrices(variables, compute_dtype(config))
  if beam_size > 1:

    def beam_step_fn(tokens: jax.Array, cache: BeamDecodeCache, position: jax.Array):
      logits, cache = model.apply(
        variables,
        tokens.reshape(-1, beam_size),
        cache,
        position,
        method=Transformer.decode_beam_step,
      )
      return logits.reshape(tokens.shape[0], -1), cache

    return beam_step_fn, model.apply(
      variables, src, max_len, beam_size, method=Transformer.start_beam_decoding
    )

  start = model.apply(variables, src, max_len, method=Transformer.start_decoding)
  cross_kv, src_mask = start.cross_kv, start.src_mask

  def step_fn(tokens: jax.Array, self_kv: Cache, position: jax.Array):
    cache = DecodeCache(self_kv=self_kv, cross_kv=cross_kv, src_mask=src_mask)
    logits, cache = model.apply(
      variables, tokens[:, None], cache, position, method=Transformer.decode_step
    )
    return logits[:, 0], cache.self_kv

  return step_fn, start.self_kv


@functools.partial(jax.jit, static_argnames=('config', 'loop'))
def _greedy(config: ModelConfig, variables, src, limits, loop: LoopConfig) -> jax.Array:
  step_fn, cache = model_step_fn(config, variables, src, loop.max_len)
  return decode_loop(step_fn, argmax_pick, cache, limits, loop).tokens[:, : loop.max_len]


@functools.partial(jax.jit, static_argnames=('config', 'loop', 'sampling'))
def _sample(
  config: ModelConfig, variables, src, limits, rng, loop: LoopConfig, sampling: Sampling
) -> jax.Array:
  step_fn, cache = model_step_fn(config, variables, src, loop.max_len)
  pick = sampling_pick(rng, sampling)
  return decode_loop(step_fn, pick, cache, limits, loop).tokens[:, : loop.max_len]


@functools.partial(jax.jit, static_argnames=('config', 'loop', 'beam', 'n_best'))
def _beam_search(
  config: ModelConfig, variables, src, limits, loop: LoopConfig, beam: BeamSearch, n_best: int = 1
) -> tuple[jax.Array, jax.Array]:
  step_fn, cache = model_step_fn(config, variables, src, loop.max_len, beam.beam_size)
  state = beam_loop(step_fn, cache, limits, loop, beam, n_best)
  return state.finished_tokens[:, :, : loop.max_len], state.finished_scores
