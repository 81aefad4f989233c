"""The decoding loops on a step function: greedy and sampled decoding, and beam search.

Axis legend: B batch (source sentences), K beams per sentence, V vocabulary,
L maximum output length (cache slots and output columns).

`decode_loop` and `beam_loop` drive any
`step_fn(tokens [B], cache, position) -> (logits [B, V], cache)` whose cache
leaves all have the batch (or batch * beam) axis first, or, for beam search,
whose cache is a `BeamDecodeCache`. `autoregressive.py`'s model-level functions
(`greedy`, `sample`, `beam_search`) wrap `Transformer.decode_step` and
`Transformer.decode_beam_step` this way; tests drive the loops with hand-made
step functions whose best sequence is known. `decode_loop` takes a pick function
(`argmax_pick`, or `sampling_pick` for a `Sampling` method's settings);
`beam_loop` reads a `BeamSearch` method's beam_size and alpha.

The loop: `lax.scan` over `steps_per_check` steps inside a `lax.while_loop`
that stops once every row is done. Finished rows are carried with a `done`
mask and emit PAD. Rows whose source is all PAD (batch padding) are done
before the first step. The output conventions are `autoregressive.py`'s
(module docstring).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import flax
import jax
import jax.numpy as jnp

from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.nn.model import BeamDecodeCache

# Steps between two checks for "every row is done" (docs/benchmarks.md: how it was chosen).
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


# What the loops read of the methods: `autoregressive.py` defines them, and imports this
# module, so they are named here by what they have.
class BeamSettings(Protocol):
  """`BeamSearch`'s settings that `beam_loop` reads: beams K per sentence, the length penalty's
  exponent alpha and its form ('gnmt' or 'fairseq', `length_penalty`)."""

  beam_size: int
  alpha: float
  penalty_form: str


class SamplingSettings(Protocol):
  """`Sampling`'s settings that `sampling_pick` reads: the temperature and the truncation."""

  temperature: float
  top_k: int
  top_p: float


def length_penalty(length: jax.Array | int, alpha: float, form: str = 'gnmt') -> jax.Array:
  """The length penalty lp(Y) a hypothesis's log P(Y | X) is divided by; |Y| counts its EOS
  when it has one. `form`:

    'gnmt'     ((5 + |Y|) / 6)^alpha (Wu et al., 2016, eq. 14; the paper's alpha 0.6)
    'fairseq'  |Y|^alpha: fairseq's --lenpen (1 ranks by log-probability per token), as
               transformers' and CTranslate2's beam searches divide too

  lp(1) = 1 for every alpha, and lp grows with |Y| when alpha > 0.
  """
  length = jnp.asarray(length, jnp.float32)
  if form == 'gnmt':
    return ((5.0 + length) / 6.0) ** alpha
  if form == 'fairseq':
    return length**alpha
  raise ValueError(f"length penalty form must be 'gnmt' or 'fairseq', got {form!r}")


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
  beam: BeamSettings,
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
    beam: the beam settings (beam_size K, alpha, penalty_form).
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
    best_possible = live_logprobs[:, 0] / length_penalty(limits, beam.alpha, beam.penalty_form)
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
  beam: BeamSettings,
  pad_id: int,
) -> tuple[jax.Array, jax.Array]:
  """The n best finished hypotheses after this step: the old ones and the candidates that
  `ends` `[B, 2K]` (EOS, or the row's limit), scored log P / length_penalty. A done row is
  frozen: its finished set is final. Returns (tokens `[B, n, Lb]`, scores `[B, n]`)."""
  n = state.finished_scores.shape[1]
  cand_scores = jnp.where(
    ends & ~state.done[:, None],
    cand_logprobs / length_penalty(state.position + 1, beam.alpha, beam.penalty_form),
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


def sampling_pick(rng: jax.Array, config: SamplingSettings) -> PickFn:
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


def truncated_logits(logits: jax.Array, config: SamplingSettings) -> jax.Array:
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
