"""Autoregressive decoding on the explicit cache: greedy, sampling and beam search.

Axis legend: B batch (source sentences), K beams per sentence, V vocabulary,
S source length, L maximum output length (cache slots and output columns).

Two levels:

* On a model: `greedy`, `sample` and `beam_search` take the `Transformer`, its
  parameters and source ids `[B, S]`, run the encoder once, and decode with
  one jit-compiled program per (config, shapes, settings).

      tokens = greedy(model, params, src)                           # [B, L]
      tokens = sample(model, params, src, jax.random.key(0), top_p=0.9)
      tokens, scores = beam_search(model, params, src, beam_size=4, alpha=0.6)

  Their keyword settings are the fields of the methods defined here, `BeamSearch`,
  `Greedy` and `Sampling` (subclasses of decode/methods.py's `DecodingMethod`), which hold
  each setting's default, help and range once; `method.run(model, params, src)`
  decodes with a method value.

* On a step function: `decode_loop` and `beam_loop` drive any
  `step_fn(tokens [B], cache, position) -> (logits [B, V], cache)` whose cache
  leaves all have the batch (or batch * beam) axis first, or, for beam search,
  whose cache is a `BeamDecodeCache`. The model-level functions wrap
  `Transformer.decode_step` and `Transformer.decode_beam_step` this way; tests
  drive the loops with hand-made step functions whose best sequence is known.

The loop: `lax.scan` over `steps_per_check` steps inside a `lax.while_loop`
that stops once every row is done. Finished rows are carried with a `done`
mask and emit PAD. Rows whose source is all PAD (batch padding) are done
before the first step.

Output conventions, for every method: tokens are y_1 .. y_L without BOS; a
sequence that ends has EOS at its end and PAD after it; a sequence that reaches
its length limit ends without EOS. PAD and BOS are never generated (they are
never training targets); EOS is not generated before `min_len` tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import flax
import jax
import jax.numpy as jnp
import numpy as np

from flax_transformer.config import (
  NONNEGATIVE,
  NONNEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  Bounds,
  ConfigError,
  ModelConfig,
  setting,
)
from flax_transformer.decode.methods import DecodingMethod
from flax_transformer.nn.model import BeamDecodeCache, DecodeCache, Transformer
from flax_transformer.run.sizes import check_decoding_fits

# The paper's default output budget: source length + 50 (§6.1).
EXTRA_OUTPUT_TOKENS = 50
# Steps between two checks for "every row is done" (benchmarks/README.md: how it was chosen).
DEFAULT_STEPS_PER_CHECK = 8

Cache = Any
# step_fn(tokens [B], cache, position) -> (float32 logits [B, V], cache)
StepFn = Callable[[jax.Array, Cache, jax.Array], tuple[jax.Array, Cache]]
# pick(logits [B, V], position) -> tokens [B]; logits of forbidden tokens are -inf.
PickFn = Callable[[jax.Array, jax.Array], jax.Array]


# --- settings ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Settings of the decoding loop shared by all methods (static under jit).

  max_len: output columns L, the cache size; each row also has its own limit <= L.
  min_len: EOS is forbidden at the first `min_len` steps.
  steps_per_check: steps per `lax.scan` chunk; `>= max_len` gives one plain scan
    that runs all L steps whatever `done` says.
  """

  max_len: int
  min_len: int = 0
  steps_per_check: int = DEFAULT_STEPS_PER_CHECK
  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2

  def __post_init__(self):
    if not isinstance(self.max_len, int) or self.max_len < 1:
      raise ConfigError(f'decoding max_len must be a positive integer, got {self.max_len!r}')
    if not isinstance(self.min_len, int) or not 0 <= self.min_len <= self.max_len:
      raise ConfigError(
        f'decoding min_len must be an integer in [0, max_len={self.max_len}], got {self.min_len!r}'
      )
    if not isinstance(self.steps_per_check, int) or self.steps_per_check < 1:
      raise ConfigError(
        f'decoding steps_per_check must be a positive integer, got {self.steps_per_check!r}'
      )

  @classmethod
  def for_model(cls, config: ModelConfig, max_len: int, **settings) -> LoopConfig:
    return cls(
      max_len=max_len, pad_id=config.pad_id, bos_id=config.bos_id, eos_id=config.eos_id, **settings
    )

  @property
  def chunk(self) -> int:
    return min(self.steps_per_check, self.max_len)

  @property
  def buffer_len(self) -> int:
    """Output columns rounded up to whole chunks; the extra columns are dropped."""
    return -(-self.max_len // self.chunk) * self.chunk


# --- the methods: each one's settings, checked, and how it runs ---------------------------


# An autoregressive method's output budget, one field shared by all three.
_MAX_LEN_HELP = (
  "output tokens per sentence (default: source length + 50, at most the model's max_len)"
)


@dataclasses.dataclass(frozen=True)
class BeamSearch(DecodingMethod):
  """Beam search with the GNMT length penalty ((5 + |Y|) / 6)^alpha (paper: beam 4, alpha 0.6)."""

  name: ClassVar[str] = 'beam'
  beam_size: int = setting(4, 'beams K kept per sentence', bounds=POSITIVE_INT)
  # alpha >= 0: the early stop bounds a live beam's best final score by its score at the
  # longest length, which holds only when the penalty grows with length.
  alpha: float = setting(
    0.6,
    'length penalty ((5 + |Y|) / 6)^alpha; 0 ranks by plain log-probability',
    bounds=NONNEGATIVE,
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
    return f'beam search (beam {self.beam_size}, alpha {self.alpha})'


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


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al., 2016, eq. 14).

  A hypothesis scores log P(Y | X) / lp(Y); |Y| counts its EOS when it has one.
  lp(1) = 1 for every alpha, and lp grows with |Y| when alpha > 0.
  """
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


# --- the loop on a step function ----------------------------------------------


@flax.struct.dataclass
class DecodeState:
  """Loop state of greedy decoding and sampling.

  position: int32 scalar, the step = number of tokens emitted so far.
  tokens: int32 `[B, buffer_len]`, PAD where nothing was emitted.
  done: bool `[B]`, the row emitted EOS or reached its limit.
  cache: the step function's cache.
  """

  position: jax.Array
  tokens: jax.Array
  done: jax.Array
  cache: Cache


@flax.struct.dataclass
class BeamState:
  """Loop state of beam search: K live beams and the n best finished hypotheses.

  Finished hypotheses live in their own arrays, so beams that end together
  never crowd out the live ones.

  position: int32 scalar, the step.
  live_tokens: int32 `[B, K, buffer_len]`; live_logprobs: float32 `[B, K]`,
    sum of log-probabilities, sorted best first (-inf: no hypothesis).
  finished_tokens: int32 `[B, n, buffer_len]`; finished_scores: float32
    `[B, n]`, log P / length_penalty, sorted best first (-inf: empty slot).
  done: bool `[B]`, no live beam can still enter the n best, or the limit is reached.
  cache: the step function's cache, leaves `[B * K, ...]` in beam order.
  """

  position: jax.Array
  live_tokens: jax.Array
  live_logprobs: jax.Array
  finished_tokens: jax.Array
  finished_scores: jax.Array
  done: jax.Array
  cache: Cache


def decode_loop(
  step_fn: StepFn, pick: PickFn, cache: Cache, limits: jax.Array, config: LoopConfig
) -> DecodeState:
  """Greedy or sampled decoding: feeds each picked token back until all rows are done.

  Args:
    step_fn: `(tokens [B], cache, position) -> (logits [B, V], cache)`.
    pick: chooses the next tokens `[B]` from the allowed logits `[B, V]`.
    cache: the initial cache for B rows.
    limits: int32 `[B]`, the most tokens each row may emit (<= config.max_len);
      0 marks batch padding.
    config: loop settings.

  Returns:
    The final state; `state.tokens[:, :config.max_len]` are the outputs and
    `state.position` the number of steps run.
  """
  batch = limits.shape[0]
  state = DecodeState(
    position=jnp.int32(0),
    tokens=jnp.full((batch, config.buffer_len), config.pad_id, jnp.int32),
    done=limits <= 0,
    cache=cache,
  )

  def step(state: DecodeState) -> DecodeState:
    position = state.position
    logits, cache = step_fn(
      _last_tokens(state.tokens, position, config), state.cache, _cache_position(position, config)
    )
    token = pick(_allowed_logits(logits, position, config), position)
    token = jnp.where(state.done, config.pad_id, token).astype(jnp.int32)
    return DecodeState(
      position=position + 1,
      tokens=_write_column(state.tokens, token, position),
      done=state.done | (token == config.eos_id) | (position + 1 >= limits),
      cache=cache,
    )

  return _run_until_done(step, state, config)


def beam_loop(
  step_fn: StepFn,
  cache: Cache,
  limits: jax.Array,
  config: LoopConfig,
  beam: BeamSearch,
  n_best: int = 1,
) -> BeamState:
  """Beam search with finished hypotheses kept apart and the cache reordered with the beams.

  At each step the 2K best one-token extensions of the live beams are scored
  (at most K of them end in EOS, so K live ones always remain). Those ending in
  EOS, or reaching the row's limit, compete for the n finished slots by
  log P / length_penalty; the K best others become the new live beams, and
  the cache is gathered along `B * K` to follow them. A row is done when the
  best live beam, even at its best possible final score (log P can only fall
  and, for alpha >= 0, lp is largest at the limit), cannot beat the n-th
  finished hypothesis.

  Args:
    step_fn: `(tokens [B*K], cache, position) -> (logits [B*K, V], cache)`.
    cache: the initial cache: a `BeamDecodeCache`, or any pytree of `[B*K, ...]`
      leaves, the K beams of a sentence adjacent (see `reorder_beams`).
    limits: int32 `[B]` per-sentence length limits (0: batch padding).
    config: loop settings.
    beam: the beam settings (beam_size K, alpha).
    n_best: finished hypotheses kept per sentence, in [1, K].

  Returns:
    The final state; `finished_tokens[:, :, :config.max_len]` and
    `finished_scores` are the n best hypotheses per sentence.
  """
  if isinstance(n_best, bool) or not isinstance(n_best, int) or not 1 <= n_best <= beam.beam_size:
    # n_best is the functional API's, not a method setting: a method's run returns the best.
    raise ConfigError(
      f'n_best must be an integer in [1, beam_size={beam.beam_size}], got {n_best!r}'
    )
  batch, beam_size, n = limits.shape[0], beam.beam_size, n_best
  length = config.buffer_len
  state = BeamState(
    position=jnp.int32(0),
    live_tokens=jnp.full((batch, beam_size, length), config.pad_id, jnp.int32),
    # Only beam 0 is live at the start: K copies of BOS would fill the beam with duplicates.
    live_logprobs=jnp.where(jnp.arange(beam_size) == 0, 0.0, -jnp.inf)[None].repeat(batch, 0),
    finished_tokens=jnp.full((batch, n, length), config.pad_id, jnp.int32),
    finished_scores=jnp.full((batch, n), -jnp.inf),
    done=limits <= 0,
    cache=cache,
  )

  def step(state: BeamState) -> BeamState:
    position = state.position
    flat_tokens = state.live_tokens.reshape(batch * beam_size, length)
    logits, cache = step_fn(
      _last_tokens(flat_tokens, position, config), state.cache, _cache_position(position, config)
    )
    logits = _allowed_logits(logits, position, config)  # [B*K, V]
    cand_logprobs, cand_parent, cand_token = _best_extensions(logits, state.live_logprobs)
    cand_tokens = _write_column(
      jnp.take_along_axis(state.live_tokens, cand_parent[:, :, None], axis=1), cand_token, position
    )  # [B, 2K, Lb]
    is_eos = cand_token == config.eos_id
    finished_tokens, finished_scores = _keep_finished(
      state,
      cand_tokens,
      cand_logprobs,
      is_eos | (position + 1 >= limits)[:, None],
      beam,
      config.pad_id,
    )
    live_logprobs, keep = jax.lax.top_k(jnp.where(is_eos, -jnp.inf, cand_logprobs), beam_size)
    live_tokens = jnp.take_along_axis(cand_tokens, keep[:, :, None], axis=1)
    cache = reorder_beams(cache, jnp.take_along_axis(cand_parent, keep, axis=1))  # [B, K]
    best_possible = live_logprobs[:, 0] / length_penalty(limits, beam.alpha)
    done = state.done | (position + 1 >= limits) | (finished_scores[:, -1] >= best_possible)
    return BeamState(
      position + 1, live_tokens, live_logprobs, finished_tokens, finished_scores, done, cache
    )

  return _run_until_done(step, state, config)


def _best_extensions(
  logits: jax.Array, live_logprobs: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The 2K best one-token extensions of a row's K live beams: (log P, parent beam, token),
  each `[B, 2K]`, from logits `[B*K, V]` and the beams' log P `[B, K]`.

  The 2K best extensions of all beams are among the 2K best of each beam, so only
  those are normalised and ranked: no log_softmax is written out over all K * V values.
  """
  batch, beam_size = live_logprobs.shape
  per_beam = min(2 * beam_size, logits.shape[-1])
  top_logits, top_tokens = jax.lax.top_k(logits, per_beam)  # [B*K, 2K]
  top_logprobs = top_logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)
  extended = live_logprobs[:, :, None] + top_logprobs.reshape(batch, beam_size, per_beam)
  cand_logprobs, cand_index = jax.lax.top_k(
    extended.reshape(batch, beam_size * per_beam), 2 * beam_size
  )
  cand_token = jnp.take_along_axis(
    top_tokens.reshape(batch, beam_size * per_beam), cand_index, axis=1
  )
  return cand_logprobs, cand_index // per_beam, cand_token


def _keep_finished(
  state: BeamState,
  cand_tokens: jax.Array,
  cand_logprobs: jax.Array,
  ends: jax.Array,
  beam: BeamSearch,
  pad_id: int,
) -> tuple[jax.Array, jax.Array]:
  """The n best finished hypotheses after this step: the old ones and the candidates that
  `ends` `[B, 2K]` (EOS, or the row's limit), scored log P / length_penalty. A done row is
  frozen: its finished set is final. Returns (tokens `[B, n, Lb]`, scores `[B, n]`)."""
  n = state.finished_scores.shape[1]
  cand_scores = jnp.where(
    ends & ~state.done[:, None],
    cand_logprobs / length_penalty(state.position + 1, beam.alpha),
    -jnp.inf,
  )
  finished_scores, best = jax.lax.top_k(
    jnp.concatenate([state.finished_scores, cand_scores], axis=1), n
  )
  # A slot that no hypothesis filled (score -inf) holds only PAD.
  cand_tokens_or_pad = jnp.where(jnp.isneginf(cand_scores)[:, :, None], pad_id, cand_tokens)
  finished_tokens = jnp.take_along_axis(
    jnp.concatenate([state.finished_tokens, cand_tokens_or_pad], axis=1), best[:, :, None], axis=1
  )
  return finished_tokens, finished_scores


def reorder_beams(cache: Cache, parent: jax.Array) -> Cache:
  """The cache after live beam k of sentence b became an extension of beam parent[b, k] `[B, K]`.

  A `BeamDecodeCache` only updates its history; any other cache has its
  `[B*K, ...]` rows gathered.
  """
  if isinstance(cache, BeamDecodeCache):
    return cache.reorder(parent)
  batch, beam_size = parent.shape
  if beam_size == 1:
    return cache
  rows = (jnp.arange(batch)[:, None] * beam_size + parent).reshape(-1)
  return jax.tree.map(lambda x: x[rows], cache)


def _run_until_done(step, state, config: LoopConfig):
  """`lax.scan` over chunks of `config.chunk` steps, inside a while loop on "any row not done".

  Every row is done at its limit (<= max_len), so the loop ends by step
  `buffer_len`. Steps past max_len (to fill the last chunk) see only done rows.
  """

  def chunk(state):
    state, _ = jax.lax.scan(lambda s, _: (step(s), None), state, None, length=config.chunk)
    return state

  return jax.lax.while_loop(lambda s: ~jnp.all(s.done), chunk, state)


def _last_tokens(tokens: jax.Array, position: jax.Array, config: LoopConfig) -> jax.Array:
  """The decoder input at `position`: BOS first, then the previous output column. `[B]`."""
  previous = jax.lax.dynamic_index_in_dim(
    tokens, jnp.maximum(position - 1, 0), axis=-1, keepdims=False
  )
  return jnp.where(position == 0, config.bos_id, previous)


def _cache_position(position: jax.Array, config: LoopConfig) -> jax.Array:
  # Steps that only fill the last chunk run on done rows; keep their writes inside the cache.
  return jnp.minimum(position, config.max_len - 1)


def _write_column(tokens: jax.Array, column: jax.Array, position: jax.Array) -> jax.Array:
  """tokens `[..., Lb]` with `column` `[...]` written at index `position` of the last axis."""
  return jax.lax.dynamic_update_index_in_dim(tokens, column, position, axis=-1)


def never_output(vocab_size: int, pad_id: int, bos_id: int) -> jax.Array:
  """`[V]` True for PAD and BOS, which no search (autoregressive or mask-predict) emits."""
  vocab = jnp.arange(vocab_size)
  return (vocab == pad_id) | (vocab == bos_id)


def _allowed_logits(logits: jax.Array, position: jax.Array, config: LoopConfig) -> jax.Array:
  """Logits `[B, V]` with PAD, BOS, and EOS before `min_len`, set to -inf."""
  vocab = jnp.arange(logits.shape[-1])
  forbidden = never_output(logits.shape[-1], config.pad_id, config.bos_id) | (
    (vocab == config.eos_id) & (position < config.min_len)
  )
  return jnp.where(forbidden, -jnp.inf, logits)


def argmax_pick(logits: jax.Array, position: jax.Array) -> jax.Array:
  """Greedy choice, `[B, V]` -> `[B]`: the first index of the largest logit, as `jnp.argmax`."""
  del position
  # Two plain reductions: XLA:CPU runs argmax's (value, index) reduction several
  # times slower than a max and a min.
  # NaN is the largest, as in jnp.argmax: weights gone non-finite (a damaged checkpoint
  # loaded with --allow-unverified) still give ids inside the vocabulary.
  vocab = logits.shape[-1]
  best = jnp.max(logits, axis=-1, keepdims=True)
  is_best = (logits == best) | jnp.isnan(logits)
  return jnp.min(jnp.where(is_best, jnp.arange(vocab), vocab), axis=-1)


def sampling_pick(rng: jax.Array, config: Sampling) -> PickFn:
  """A pick function drawing from the truncated, tempered distribution.

  The key of step p is `fold_in(rng, p)`: the draws do not depend on the
  chunking of the loop.
  """

  def pick(logits: jax.Array, position: jax.Array) -> jax.Array:
    # Inverse-CDF sampling: one uniform number per row, where `jax.random.categorical`
    # draws Gumbel noise for every token, several times the cost on CPU. Token i
    # is drawn when cdf[i-1] <= u < cdf[i], so a token of probability 0 never is.
    cdf = jnp.cumsum(jax.nn.softmax(truncated_logits(logits, config), axis=-1), axis=-1)
    u = jax.random.uniform(jax.random.fold_in(rng, position), (logits.shape[0], 1))
    return jnp.sum(cdf <= u * cdf[:, -1:], axis=-1)

  return pick


def truncated_logits(logits: jax.Array, config: Sampling) -> jax.Array:
  """Tempered logits `[B, V]` with everything outside top-k and the top-p nucleus at -inf.

  Tokens tied with the last kept one are kept too.
  """
  logits = logits / config.temperature
  if config.top_k:
    kth_best = jax.lax.top_k(logits, min(config.top_k, logits.shape[-1]))[0][:, -1:]
    logits = jnp.where(logits < kth_best, -jnp.inf, logits)
  if config.top_p < 1.0:
    probs = jax.nn.softmax(logits, axis=-1)
    descending = -jnp.sort(-probs, axis=-1)
    # A token is in the nucleus while the mass before it is still short of top_p.
    in_nucleus = jnp.cumsum(descending, axis=-1) - descending < config.top_p
    smallest_kept = jnp.min(jnp.where(in_nucleus, descending, jnp.inf), axis=-1, keepdims=True)
    logits = jnp.where(probs < smallest_kept, -jnp.inf, logits)
  return logits


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
  """Beam search with the GNMT length penalty (see `beam_loop`): `settings` are
  `BeamSearch`'s fields (beam_size, alpha, max_len), its defaults the paper's beam 4, alpha 0.6.

  Returns:
    n_best == 1: tokens `[B, L]` and scores `[B]`; n_best (<= beam_size) > 1: tokens
    `[B, n_best, L]` and scores `[B, n_best]`, best first. A score is
    log P(Y | X) / length_penalty(|Y|, alpha), |Y| counting EOS; batch-padding
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
  variables = cast_matrices(variables, config.compute_dtype)
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
