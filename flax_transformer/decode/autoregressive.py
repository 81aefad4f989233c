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

  Their keyword settings are the fields of the methods defined here, `BeamSearch`,
  `Greedy` and `Sampling` (subclasses of decode/methods.py's `DecodingMethod`), which hold
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
from typing import ClassVar, Literal

import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.config import (
  NONNEGATIVE,
  NONNEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  Bounds,
  ModelConfig,
  setting,
)
from flax_transformer.decode.methods import DecodingMethod
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
from flax_transformer.run.sizes import check_decoding_fits

# The loops on a step function and their pieces moved to `search`; they are still here.
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

# The paper's default output budget: source length + 50 (§6.1).
EXTRA_OUTPUT_TOKENS = 50


# --- the methods: each one's settings, checked, and how it runs ---------------------------


# An autoregressive method's output budget, one field shared by all three.
_MAX_LEN_HELP = (
  "output tokens per sentence (default: source length + 50, at most the model's max_len)"
)


@dataclasses.dataclass(frozen=True)
class BeamSearch(DecodingMethod):
  """Beam search ranking log P(Y | X) / lp(Y): GNMT's lp ((5 + |Y|) / 6)^alpha (paper: beam 4,
  alpha 0.6), or fairseq's |Y|^alpha (`penalty_form='fairseq'`; its `--lenpen 1` is alpha 1)."""

  name: ClassVar[str] = 'beam'
  beam_size: int = setting(4, 'beams K kept per sentence', bounds=POSITIVE_INT)
  # alpha >= 0: the early stop bounds a live beam's best final score by its score at the
  # longest length, which holds only when the penalty grows with length.
  alpha: float = setting(
    0.6,
    "the length penalty's exponent (its form: penalty_form); 0 ranks by plain log-probability",
    bounds=NONNEGATIVE,
  )
  penalty_form: Literal['gnmt', 'fairseq'] = setting(
    'gnmt',
    "the length penalty: GNMT's ((5 + |Y|) / 6)^alpha, or fairseq's |Y|^alpha (its --lenpen)",
  )
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def check_fits(self, config: ModelConfig, rows: int) -> None:
    # The shortest output budget: a one-token source + 50, unless max_len says.
    check_decoding_fits(
      config, rows, self.beam_size, '--beam-size', self.max_len or 1 + EXTRA_OUTPUT_TOKENS
    )

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    tokens, _ = beam_search(model, params, src, **dataclasses.asdict(self))
    return np.asarray(tokens)

  def describe(self) -> str:
    form = '' if self.penalty_form == 'gnmt' else f', {self.penalty_form} length penalty'
    return f'beam search (beam {self.beam_size}, alpha {self.alpha}{form})'


@dataclasses.dataclass(frozen=True)
class Greedy(DecodingMethod):
  """The most probable token at each step."""

  name: ClassVar[str] = 'greedy'
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    return np.asarray(greedy(model, params, src, **dataclasses.asdict(self)))

  def describe(self) -> str:
    return 'greedy decoding'


@dataclasses.dataclass(frozen=True)
class Sampling(DecodingMethod):
  """Ancestral sampling from softmax(logits / temperature), optionally truncated: top_k keeps
  the k most probable tokens, then top_p the smallest set of them whose mass reaches p
  (nucleus sampling), on the tempered distribution. `seed` makes `run`'s draws repeatable."""

  name: ClassVar[str] = 'sample'
  temperature: float = setting(
    1.0,
    'divides the logits: above 1 flattens the distribution, below 1 sharpens it',
    bounds=POSITIVE,
  )
  top_k: int = setting(0, 'keep the k most probable tokens (0: all)', bounds=NONNEGATIVE_INT)
  top_p: float = setting(
    1.0,
    'nucleus sampling: keep the most probable tokens whose mass reaches p (1: all)',
    bounds=Bounds(low=0, high=1, low_open=True),
  )
  seed: int = setting(
    0,
    'random seed (batch i draws from the seed folded with i)',
    bounds=Bounds(low=-(2**63), high=2**63 - 1, integer=True),
  )
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    # One key per batch: batches draw independently, and a rerun draws the same.
    rng = jax.random.fold_in(jax.random.key(self.seed), batch_index)
    return np.asarray(sample(model, params, src, rng, **dataclasses.asdict(self)))

  def describe(self) -> str:
    return (
      f'sampling (temperature {self.temperature}, top-k {self.top_k}, top-p {self.top_p}, '
      f'seed {self.seed})'
    )


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
