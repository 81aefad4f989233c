"""Decoding: the cached step against the full pass, greedy against a naive loop, sampling
against its NumPy distribution, beam search against exhaustive search."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ConfigError, ModelConfig, Transformer
from flax_transformer.decode import autoregressive
from flax_transformer.decode.autoregressive import BeamSearch, LoopConfig, Sampling

CONFIG = ModelConfig.tiny(dropout_rate=0.0)
PAD, BOS, EOS = CONFIG.pad_id, CONFIG.bos_id, CONFIG.eos_id
# EOS-terminated sources of different lengths, as the batcher builds them.
SOURCES = [
  [5, 9, 12, 7, 2],
  [30, 2],
  [4, 8, 15, 16, 23, 42, 11, 2],
  [6, 6, 6, 2],
  [40, 41, 2],
  [17, 33, 52, 2],
]
N_BEST = 3


def pad_rows(rows, width=None):
  width = width or max(map(len, rows))
  return np.array([list(row) + [PAD] * (width - len(row)) for row in rows], np.int32)


def masked_log_softmax(logits, position, min_len=0):
  """float64 log-probabilities over the tokens decoding may emit (no PAD, BOS; EOS from min_len)."""
  logits = np.array(logits, np.float64)
  logits[..., [PAD, BOS]] = -np.inf
  if position < min_len:
    logits[..., EOS] = -np.inf
  top = logits.max(axis=-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


def gnmt_penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def hypothesis_length(row, limit):
  """|Y|: up to and including the first EOS, else the row's limit."""
  eos = np.flatnonzero(row == EOS)
  return int(eos[0]) + 1 if eos.size else limit


def assert_well_formed(tokens, limits):
  """Each row: real tokens, then EOS and PAD only, or real tokens up to its limit and PAD."""
  tokens = np.asarray(tokens)
  for row, limit in zip(
    tokens.reshape(-1, tokens.shape[-1]),
    np.repeat(limits, tokens.size // tokens.shape[-1] // len(limits)),
  ):
    length = hypothesis_length(row, limit)
    assert length <= limit, row
    body = row[: length - 1] if row[length - 1] == EOS else row[:length]
    assert not np.isin(body, [PAD, BOS, EOS]).any(), row
    assert (row[length:] == PAD).all(), row


# --- fixtures: one tiny model, each jit compiled once ---------------------------


@pytest.fixture(scope='module')
def model():
  return Transformer(CONFIG)


@pytest.fixture(scope='module')
def params(model):
  params = model.init(jax.random.key(0), pad_rows(SOURCES), pad_rows(SOURCES))['params']
  # A random model repeats one token forever; a longer EOS embedding makes some
  # sentences end after a few tokens, one after many, and others run to their limit.
  params['embedding']['embedding'] = params['embedding']['embedding'].at[EOS].multiply(10.0)
  return params


@pytest.fixture(scope='module')
def src():
  return pad_rows(SOURCES)


@pytest.fixture(scope='module')
def default_limits(src):
  # The paper's budget: source length (EOS included) + 50.
  return (src != PAD).sum(axis=1) + 50


@pytest.fixture(scope='module')
def full_logits(model, params):
  """Teacher-forced logits `[B, T, V]` of the whole model: the uncached reference."""
  return jax.jit(lambda src, tgt_in: model.apply({'params': params}, src, tgt_in))


@pytest.fixture(scope='module')
def greedy_tokens(model, params, src):
  return np.asarray(autoregressive.greedy(model, params, src))


@pytest.fixture(scope='module')
def beam_result(model, params, src):
  tokens, scores = autoregressive.beam_search(
    model, params, src, beam_size=4, alpha=0.6, n_best=N_BEST
  )
  return np.asarray(tokens), np.asarray(scores)


def sequence_scores(full_logits, src, tokens, limits, alpha):
  """NumPy scores log P(Y) / lp(|Y|) of hypotheses `[B, n, L]` from the full forward pass."""
  batch, n, length = tokens.shape
  rows = tokens.reshape(batch * n, length)
  tgt_in = np.concatenate([np.full((batch * n, 1), BOS), rows[:, :-1]], axis=1)
  logprobs = masked_log_softmax(full_logits(np.repeat(src, n, axis=0), tgt_in), position=0)
  scores = []
  for row, logprob, limit in zip(rows, logprobs, np.repeat(limits, n)):
    length = hypothesis_length(row, limit)
    total = logprob[np.arange(length), row[:length]].sum()
    scores.append(total / gnmt_penalty(length, alpha))
  return np.array(scores).reshape(batch, n)


# --- the cached step ------------------------------------------------------------


@pytest.mark.parametrize('beam_size', [1, 3])
def test_cached_step_logits_equal_full_forward_pass(params, src, full_logits, beam_size):
  length = 12
  rng = np.random.default_rng(0)
  tgt_in = np.concatenate(
    [np.full((len(src), 1), BOS), rng.integers(4, CONFIG.vocab_size, (len(src), length - 1))],
    axis=1,
  )

  @jax.jit
  def stepped(src, tgt_in):
    step_fn, cache = autoregressive.model_step_fn(
      CONFIG, {'params': params}, src, length, beam_size
    )
    tokens = jnp.repeat(tgt_in, beam_size, axis=0)  # [B * K, T]

    def body(cache, position):
      logits, cache = step_fn(tokens[:, position], cache, position)
      return cache, logits

    _, logits = jax.lax.scan(body, cache, jnp.arange(length))  # [T, B * K, V]
    return logits.transpose(1, 0, 2)

  expected = np.repeat(np.asarray(full_logits(src, tgt_in)), beam_size, axis=0)
  np.testing.assert_allclose(stepped(src, tgt_in), expected, atol=1e-5, rtol=0)


def row_cache_step_fn(config, params, src, max_len, beam_size):
  """Beam search's step the plain way: K copies of each sentence's `DecodeCache`, rows gathered."""
  model = Transformer(config)
  cache = model.apply(
    {'params': params},
    jnp.repeat(src, beam_size, axis=0),
    max_len,
    method=Transformer.start_decoding,
  )

  def step_fn(tokens, cache, position):
    logits, cache = model.apply(
      {'params': params}, tokens[:, None], cache, position, method=Transformer.decode_step
    )
    return logits[:, 0], cache

  return step_fn, cache


@pytest.mark.parametrize('attention_radius', [None, 2])
def test_pooled_beam_cache_searches_like_gathered_copies(
  params, src, default_limits, attention_radius
):
  """The pooled cache reorders a history table; the reference moves every key and value."""
  config = CONFIG.replace(attention_radius=attention_radius)
  loop = LoopConfig.for_model(config, int(default_limits.max()))
  beam = BeamSearch(beam_size=4, alpha=0.6)
  limits = jnp.asarray(default_limits, jnp.int32)

  @functools.partial(jax.jit, static_argnums=1)
  def search(src, pooled):
    if pooled:
      step_fn, cache = autoregressive.model_step_fn(
        config, {'params': params}, src, loop.max_len, 4
      )
      assert isinstance(cache, autoregressive.BeamDecodeCache)
    else:
      step_fn, cache = row_cache_step_fn(config, params, src, loop.max_len, 4)
    state = autoregressive.beam_loop(step_fn, cache, limits, loop, beam, N_BEST)
    return state.finished_tokens, state.finished_scores

  pooled_tokens, pooled_scores = search(src, True)
  gathered_tokens, gathered_scores = search(src, False)
  np.testing.assert_array_equal(pooled_tokens, gathered_tokens)
  # Scores are float32 sums of up to L log-probabilities (here down to -29): the two caches
  # round their attention sums differently, ~1e-7 relative per step; a wrong reorder is off by > 0.1.
  np.testing.assert_allclose(pooled_scores, gathered_scores, atol=1e-5, rtol=1e-6)
  # Beams must have been reordered for the comparison to mean anything: their first tokens differ.
  assert len(np.unique(np.asarray(pooled_tokens)[:, :, 0])) > 1


# --- greedy ---------------------------------------------------------------------


def naive_greedy(full_logits, src, limits):
  """Re-runs the whole decoder on the prefix at every step and takes the NumPy argmax."""
  batch, length = len(src), int(limits.max())
  tgt_in = np.full((batch, length), PAD, np.int32)
  tgt_in[:, 0] = BOS
  out = np.full((batch, length), PAD, np.int32)
  done = limits == 0
  for position in range(length):
    logits = masked_log_softmax(np.asarray(full_logits(src, tgt_in))[:, position], position)
    token = np.where(done, PAD, logits.argmax(axis=-1))
    out[:, position] = token
    if position + 1 < length:
      tgt_in[:, position + 1] = token
    done |= (token == EOS) | (position + 1 >= limits)
  return out


def test_greedy_equals_a_naive_loop_over_the_full_decoder(
  src, full_logits, greedy_tokens, default_limits
):
  assert greedy_tokens.shape == (len(SOURCES), src.shape[1] + 50)
  np.testing.assert_array_equal(greedy_tokens, naive_greedy(full_logits, src, default_limits))
  ended = (greedy_tokens == EOS).any(axis=1)
  assert ended.any() and not ended.all(), 'the fixture should exercise both ways to stop'


def test_outputs_are_eos_terminated_and_pad_after(greedy_tokens, beam_result, default_limits):
  assert_well_formed(greedy_tokens, default_limits)
  assert_well_formed(beam_result[0], default_limits)


def test_a_batch_decodes_each_sentence_as_it_would_alone(model, params, greedy_tokens, beam_result):
  # The shortest sentence: in the batch it has 6 PAD columns and longer neighbours.
  index = 1
  alone_src = pad_rows([SOURCES[index]])
  alone = np.asarray(autoregressive.greedy(model, params, alone_src))[0]
  np.testing.assert_array_equal(greedy_tokens[index, : len(alone)], alone)
  assert (greedy_tokens[index, len(alone) :] == PAD).all()

  tokens, scores = autoregressive.beam_search(model, params, alone_src, n_best=N_BEST)
  np.testing.assert_array_equal(beam_result[0][index, :, : tokens.shape[-1]], tokens[0])
  assert (beam_result[0][index, :, tokens.shape[-1] :] == PAD).all()
  np.testing.assert_allclose(beam_result[1][index], scores[0], atol=1e-5)


def test_params_or_variables_give_the_same_tokens(model, params, src, greedy_tokens):
  np.testing.assert_array_equal(
    autoregressive.greedy(model, {'params': params}, src), greedy_tokens
  )
  with pytest.raises(TypeError, match='params must be the parameter dict'):
    autoregressive.greedy(model, [params], src)


# --- the loop on a hand-made step function --------------------------------------


def markov_step_fn(tables):
  """Logits `tables[row, previous token, current token]` from float `[R, V, V, V]`.

  The cache holds each decoding row's sentence and previous token, so beam
  search must reorder it with the beams to get the right logits.
  """
  tables = jnp.asarray(tables, jnp.float32)

  def step_fn(tokens, cache, position):
    del position
    row, previous = cache
    return tables[row, previous, tokens], (row, tokens)

  return step_fn


def markov_cache(batch, beam_size=1):
  rows = jnp.repeat(jnp.arange(batch), beam_size)
  return rows, jnp.full_like(rows, BOS)


def run_greedy(tables, limits, loop):
  limits = jnp.asarray(limits, jnp.int32)
  return jax.jit(
    lambda: autoregressive.decode_loop(
      markov_step_fn(tables), autoregressive.argmax_pick, markov_cache(len(limits)), limits, loop
    )
  )()


def run_beam(tables, limits, loop, beam, n_best=1):
  limits = jnp.asarray(limits, jnp.int32)
  return jax.jit(
    lambda: autoregressive.beam_loop(
      markov_step_fn(tables), markov_cache(len(limits), beam.beam_size), limits, loop, beam, n_best
    )
  )()


def eos_after(min_len, vocab=6):
  """A table whose best token is EOS; before min_len (EOS banned) it is token 4."""
  logits = np.zeros(vocab)
  logits[[EOS, 4]] = [5.0, 1.0]
  return np.broadcast_to(logits, (1, vocab, vocab, vocab))


@pytest.mark.parametrize('steps_per_check, steps_run', [(4, 4), (3, 6), (40, 40)])
def test_loop_stops_once_every_row_is_done(steps_per_check, steps_run):
  loop = LoopConfig(max_len=40, min_len=3, steps_per_check=steps_per_check)
  state = run_greedy(eos_after(3), [40, 40], loop)
  expected = [4, 4, 4, EOS] + [PAD] * 36
  np.testing.assert_array_equal(state.tokens[:, :40], [expected, expected])
  # All rows end at step 4: the loop stops after the chunk holding it, except
  # when one chunk spans max_len (a plain scan with a done mask).
  assert int(state.position) == steps_run

  beam = run_beam(eos_after(3), [40, 40], loop, BeamSearch(beam_size=2, alpha=0.0))
  np.testing.assert_array_equal(beam.finished_tokens[:, 0, :40], [expected, expected])
  assert int(beam.position) == steps_run


# A hand-made case where greedy is not the best: after BOS, 'a' (0.5) beats
# 'b' (0.4), but 'b' is almost always followed by EOS (0.9) and 'a' is not.
A, B, C = 3, 4, 5
NEXT = {
  BOS: {A: 0.5, B: 0.4, C: 0.05, EOS: 0.05},
  A: {C: 0.4, A: 0.2, B: 0.2, EOS: 0.2},
  B: {EOS: 0.9, A: 0.04, B: 0.03, C: 0.03},
  C: {EOS: 0.5, C: 0.3, A: 0.1, B: 0.1},
}


def hand_table():
  table = np.full((1, 6, 6, 6), 5.0)  # PAD and BOS get the largest logits: they must stay banned
  for current, probs in NEXT.items():
    for token, p in probs.items():
      table[0, :, current, token] = np.log(p)
  return table


PENALTIES = {'gnmt': gnmt_penalty, 'fairseq': lambda length, alpha: float(length) ** alpha}


def all_hypotheses(table, limit, alpha, min_len=0, form='gnmt'):
  """Exhaustive search: every hypothesis as (score, tokens), best first; a score is the log
  probability over the length penalty of `form`."""
  penalty = PENALTIES[form]
  found = []

  def extend(prefix, previous, current, logprob):
    logprobs = masked_log_softmax(table[previous, current], len(prefix), min_len)
    for token in np.flatnonzero(np.isfinite(logprobs)):
      sequence, total = prefix + [int(token)], logprob + logprobs[token]
      if token == EOS or len(sequence) == limit:
        found.append((total / penalty(len(sequence), alpha), sequence))
      else:
        extend(sequence, current, int(token), total)

  extend([], BOS, BOS, 0.0)
  return sorted(found, key=lambda hypothesis: -hypothesis[0])


def test_beam_search_finds_the_sequence_greedy_misses():
  loop = LoopConfig(max_len=6)
  greedy = np.asarray(run_greedy(hand_table(), [6], loop).tokens[0])
  np.testing.assert_array_equal(greedy, [A, C, EOS, PAD, PAD, PAD])

  state = run_beam(hand_table(), [6], loop, BeamSearch(beam_size=2, alpha=0.0))
  best_score, best = all_hypotheses(hand_table()[0], 6, alpha=0.0)[0]
  np.testing.assert_array_equal(state.finished_tokens[0, 0], best + [PAD] * (6 - len(best)))
  assert best == [B, EOS]
  np.testing.assert_allclose(state.finished_scores[0, 0], best_score, rtol=1e-6)
  assert best_score > np.log(0.5 * 0.4 * 0.5) + 0.5  # greedy's sequence: clearly worse


@pytest.mark.parametrize(
  'alpha, min_len, form',
  [
    *((alpha, min_len, 'gnmt') for alpha in (0.0, 0.6, 2.0) for min_len in (0, 2)),
    (1.0, 0, 'fairseq'),  # fairseq's --lenpen 1: log-probability per token
    (2.0, 2, 'fairseq'),
  ],
)
def test_wide_beam_search_equals_exhaustive_search(alpha, min_len, form):
  # Tokens a, b, c and EOS: after 3 steps there are 27 live prefixes, so a beam of
  # 27 is exact and every score, penalty and cache reorder can be checked.
  tables = np.random.default_rng(1).normal(scale=2.0, size=(3, 6, 6, 6))
  limits = [4, 3, 0]  # the last row is batch padding
  loop = LoopConfig(max_len=4, min_len=min_len)
  beam = BeamSearch(beam_size=27, alpha=alpha, penalty_form=form)
  state = run_beam(tables, limits, loop, beam, n_best=5)
  for row, limit in enumerate(limits[:2]):
    best = all_hypotheses(tables[row], limit, alpha, min_len, form)[:5]
    np.testing.assert_allclose(state.finished_scores[row], [s for s, _ in best], rtol=1e-5)
    np.testing.assert_array_equal(
      state.finished_tokens[row, :, :4], [tokens + [PAD] * (4 - len(tokens)) for _, tokens in best]
    )
  assert np.all(np.isneginf(state.finished_scores[2])) and (state.finished_tokens[2] == PAD).all()


def test_slots_without_a_hypothesis_score_minus_inf_and_hold_pad():
  # One token, EOS banned: only 'a', 'b' and 'c' exist, so the 4th slot stays empty.
  state = run_beam(
    hand_table(),
    [1],
    LoopConfig(max_len=1, min_len=1),
    BeamSearch(beam_size=4, alpha=0.6),
    n_best=4,
  )
  np.testing.assert_array_equal(state.finished_tokens[0, :, 0], [A, B, C, PAD])
  np.testing.assert_allclose(
    state.finished_scores[0, :3], np.log([0.5, 0.4, 0.05]) - np.log(0.95), rtol=1e-6
  )
  assert np.isneginf(state.finished_scores[0, 3])


def test_length_penalty_is_the_gnmt_formula():
  lengths = np.arange(1, 300)
  for alpha in (0.0, 0.6, 1.0):
    np.testing.assert_allclose(
      autoregressive.length_penalty(lengths, alpha), ((5.0 + lengths) / 6.0) ** alpha, rtol=1e-6
    )
  assert float(autoregressive.length_penalty(1, 0.6)) == 1.0


def test_fairseq_length_penalty_is_the_length_to_the_alpha():
  lengths = np.arange(1, 300)
  for alpha in (0.0, 0.6, 1.0):
    np.testing.assert_allclose(
      autoregressive.length_penalty(lengths, alpha, 'fairseq'),
      lengths.astype(np.float64) ** alpha,
      rtol=1e-6,
    )
  with pytest.raises(ValueError, match="'gnmt' or 'fairseq', got 'marian'"):
    autoregressive.length_penalty(lengths, 1.0, 'marian')
  assert BeamSearch(beam_size=5, alpha=1.0, penalty_form='fairseq').describe() == (
    'beam search (beam 5, alpha 1.0, fairseq length penalty)'
  )


def test_the_penalty_form_decides_between_short_and_long():
  # alpha 2: fairseq's lp n^2 favours length more than GNMT's ((5 + n) / 6)^2 at these lengths:
  # on the hand table the one keeps 'b EOS' (0.36), the other a 6-token hypothesis, each as
  # its exhaustive search does.
  loop = LoopConfig(max_len=6)
  winners = {}
  for form in ('gnmt', 'fairseq'):
    beam = BeamSearch(beam_size=4, alpha=2.0, penalty_form=form)
    state = run_beam(hand_table(), [6], loop, beam, n_best=4)
    best_score, best = all_hypotheses(hand_table()[0], 6, 2.0, form=form)[0]
    length = hypothesis_length(np.asarray(state.finished_tokens[0, 0]), 6)
    assert list(np.asarray(state.finished_tokens[0, 0, :length])) == best
    np.testing.assert_allclose(state.finished_scores[0, 0], best_score, rtol=1e-6)
    winners[form] = best
  assert winners == {'gnmt': [B, EOS], 'fairseq': [A, C, C, C, C, EOS]}


def test_length_penalty_decides_between_short_and_long():
  # 'b EOS' has probability 0.36 and 'a c EOS' 0.1; a strong enough length
  # penalty prefers neither by probability alone: check the winner follows the formula.
  loop = LoopConfig(max_len=6)
  for alpha in (0.0, 4.0):
    state = run_beam(hand_table(), [6], loop, BeamSearch(beam_size=4, alpha=alpha), n_best=4)
    best_score, best = all_hypotheses(hand_table()[0], 6, alpha)[0]
    length = hypothesis_length(np.asarray(state.finished_tokens[0, 0]), 6)
    assert list(np.asarray(state.finished_tokens[0, 0, :length])) == best
    np.testing.assert_allclose(state.finished_scores[0, 0], best_score, rtol=1e-6)
  assert (
    all_hypotheses(hand_table()[0], 6, 0.0)[0][1] != all_hypotheses(hand_table()[0], 6, 4.0)[0][1]
  )


# --- beam search on the model ---------------------------------------------------


def test_beam_scores_are_log_probabilities_over_the_length_penalty(
  src, full_logits, beam_result, default_limits
):
  tokens, scores = beam_result
  assert tokens.shape == (len(SOURCES), N_BEST, src.shape[1] + 50)
  np.testing.assert_allclose(
    scores, sequence_scores(full_logits, src, tokens, default_limits, 0.6), atol=2e-4
  )
  assert (np.diff(scores, axis=1) <= 0).all()
  for hypotheses in tokens:
    assert len({row.tobytes() for row in hypotheses}) == N_BEST


def test_beam_size_1_is_greedy_except_for_a_more_probable_earlier_eos(
  model, params, src, full_logits, greedy_tokens, default_limits
):
  tokens, scores = autoregressive.beam_search(model, params, src, beam_size=1, alpha=0.0)
  tokens = np.asarray(tokens)
  greedy_scores = sequence_scores(full_logits, src, greedy_tokens[:, None], default_limits, 0.0)
  np.testing.assert_allclose(
    scores, sequence_scores(full_logits, src, tokens[:, None], default_limits, 0.0)[:, 0], atol=2e-4
  )
  differs = (tokens != greedy_tokens).any(axis=1)
  # Where they differ, beam search took an EOS that greedy passed over, and it scores higher.
  for row in np.flatnonzero(differs):
    length = hypothesis_length(tokens[row], default_limits[row])
    np.testing.assert_array_equal(tokens[row, : length - 1], greedy_tokens[row, : length - 1])
    assert tokens[row, length - 1] == EOS and scores[row] > greedy_scores[row, 0]
  np.testing.assert_array_equal(tokens[~differs], greedy_tokens[~differs])
  assert differs.any() and not differs.all(), 'the fixture should exercise both cases'


# --- sampling -------------------------------------------------------------------


def test_sampling_with_a_fixed_key_is_reproducible(model, params, src, default_limits):
  draw = lambda seed: np.asarray(
    autoregressive.sample(model, params, src, jax.random.key(seed), temperature=1.5)
  )
  first = draw(7)
  np.testing.assert_array_equal(draw(7), first)
  assert (draw(8) != first).any()
  assert_well_formed(first, default_limits)


def test_sampling_from_the_top_1_is_greedy(model, params, src, greedy_tokens):
  tokens = autoregressive.sample(model, params, src, jax.random.key(3), temperature=2.0, top_k=1)
  np.testing.assert_array_equal(tokens, greedy_tokens)


SAMPLING_LOGITS = np.array([3.0, 3.0, 0.5, 1.0, 2.0, -1.0, 0.0, 1.5])  # PAD, BOS banned


def truncated_distribution(logits, sampling):
  """NumPy float64: softmax(logits / T), restricted to top-k, then to the top-p nucleus."""
  p = np.exp(masked_log_softmax(logits / sampling.temperature, 0))
  order = np.argsort(-p, kind='stable')
  if sampling.top_k:
    p[order[sampling.top_k :]] = 0.0
    p /= p.sum()
  if sampling.top_p < 1.0:
    mass_before = np.cumsum(p[order]) - p[order]
    p[order[mass_before >= sampling.top_p]] = 0.0
    p /= p.sum()
  return p


@pytest.mark.parametrize(
  'sampling',
  [
    Sampling(temperature=0.5),
    Sampling(top_k=3),
    Sampling(temperature=1.5, top_p=0.8),
    Sampling(top_k=4, top_p=0.6),
    Sampling(top_p=1e-6),
  ],
  ids=str,
)
def test_sampling_follows_the_truncated_distribution(sampling):
  draws = 20_000
  tables = np.broadcast_to(SAMPLING_LOGITS, (1, 8, 8, 8))
  pick = autoregressive.sampling_pick(jax.random.key(0), sampling)
  state = jax.jit(
    lambda: autoregressive.decode_loop(
      markov_step_fn(tables),
      pick,
      (jnp.zeros(draws, jnp.int32), jnp.full(draws, BOS)),
      jnp.ones(draws, jnp.int32),
      LoopConfig(max_len=1),
    )
  )()
  frequency = np.bincount(np.asarray(state.tokens[:, 0]), minlength=8) / draws
  expected = truncated_distribution(SAMPLING_LOGITS, sampling)
  assert (frequency[expected == 0] == 0).all()
  # Five binomial standard deviations.
  assert (np.abs(frequency - expected) <= 5 * np.sqrt(expected * (1 - expected) / draws)).all()


# --- settings and inputs --------------------------------------------------------


@pytest.mark.parametrize(
  'make, message',
  [
    (lambda: Sampling(temperature=0.0), r'sample\.temperature must be a positive number, got 0.0'),
    (lambda: Sampling(top_k=-1), r'sample\.top_k must be a non-negative integer, got -1'),
    (lambda: Sampling(top_p=0.0), r'top_p must be in \(0, 1\]'),
    (lambda: Sampling(top_p=1.5), r'top_p must be in \(0, 1\]'),
    (lambda: BeamSearch(beam_size=0), 'beam_size must be a positive integer'),
    (lambda: BeamSearch(alpha=-0.1), 'alpha must be >= 0'),
    (
      lambda: autoregressive.beam_loop(
        None, None, jnp.ones(1, jnp.int32), LoopConfig(max_len=1), BeamSearch(beam_size=4), n_best=5
      ),
      r'n_best must be an integer in \[1, beam_size=4\]',
    ),
    (lambda: LoopConfig(max_len=0), 'max_len must be a positive integer'),
    (lambda: LoopConfig(max_len=5, min_len=6), r'min_len must be an integer in \[0, max_len=5\]'),
    (lambda: LoopConfig(max_len=5, steps_per_check=0), 'steps_per_check must be a positive'),
  ],
)
def test_bad_settings_name_the_option(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


@pytest.mark.parametrize(
  'bad_src, message',
  [
    (np.array([5, 6, 2]), r'src must be integer token ids \[batch, length\]'),
    (np.ones((2, 3), np.float32), r'src must be integer token ids'),
    (np.full((1, 65), 5), 'source length 65 exceeds model.max_len=64'),
    (np.array([[5, 64, 2]]), r'outside \[0, model.vocab_size=64\)'),
  ],
)
def test_bad_sources_are_refused_before_compiling(model, params, bad_src, message):
  with pytest.raises(ValueError, match=message):
    autoregressive.greedy(model, params, bad_src)


def test_max_len_beyond_the_positional_table_is_refused(model, params, src):
  with pytest.raises(ValueError, match=r'max_len must be an integer in \[1, model.max_len=64\]'):
    autoregressive.beam_search(model, params, src, max_len=65)


def test_default_budget_is_capped_at_model_max_len_with_a_warning():
  src = pad_rows([[5] * 19 + [EOS], [5, EOS]])
  with pytest.warns(UserWarning, match='source length 20 \\+ 50 exceeds model.max_len=64'):
    total, limits = autoregressive.output_limits(src, CONFIG, None)
  assert total == 64
  np.testing.assert_array_equal(limits, [64, 52])
  total, limits = autoregressive.output_limits(pad_rows([[5, EOS], []], width=4), CONFIG, 10)
  assert total == 10
  np.testing.assert_array_equal(limits, [10, 0])  # all-PAD rows are batch padding


# --- bfloat16 decoding ------------------------------------------------------------


def stepped_logits(config, variables, src, tgt_in):
  """Logits `[B, T, V]` of the cached decode steps fed tgt_in `[B, T]`, as decoding runs them."""
  length = tgt_in.shape[1]

  @jax.jit
  def run(variables, src, tgt_in):
    step_fn, cache = autoregressive.model_step_fn(config, variables, src, length)
    body = lambda cache, position: step_fn(tgt_in[:, position], cache, position)[::-1]
    return jax.lax.scan(body, cache, jnp.arange(length))[1].transpose(1, 0, 2)

  return np.asarray(run(variables, src, tgt_in), np.float64)


def test_bfloat16_step_logits_match_a_float64_reference(params, src):
  from support import numpy_transformer

  rng = np.random.default_rng(0)
  tgt_in = np.concatenate(
    [np.full((len(src), 1), BOS), rng.integers(4, CONFIG.vocab_size, (len(src), 9))], axis=1
  )
  want = numpy_transformer.logits(CONFIG, params, src, tgt_in)
  bf16 = CONFIG.replace(dtype='bfloat16')
  errors = {
    name: np.abs(stepped_logits(config, variables, src, tgt_in) - want).max()
    for name, config, variables in (
      ('float32', CONFIG, {'params': params}),
      ('bfloat16', bf16, {'params': params}),
      ('bfloat16 cast once', bf16, autoregressive.cast_matrices({'params': params}, 'bfloat16')),
    )
  }
  scale = np.abs(want).max()
  assert errors['float32'] < 1e-5 * scale, errors
  # bfloat16 keeps 8 significant bits (relative rounding 2^-9); through 4 layers the logits
  # stay within a few percent of their range, and visibly off float32 (the path is bfloat16).
  assert 1e-4 * scale < errors['bfloat16'] < 0.03 * scale, (errors, scale)
  # Casting the matrices once gives the bits of casting them at every use.
  assert errors['bfloat16 cast once'] == errors['bfloat16']


def test_bfloat16_greedy_and_beam_agree_with_float32_on_most_rows(
  params, src, full_logits, greedy_tokens, beam_result
):
  bf16 = Transformer(CONFIG.replace(dtype='bfloat16'))
  variables = autoregressive.cast_matrices({'params': params}, 'bfloat16')
  assert variables['params']['embedding']['embedding'].dtype == jnp.bfloat16
  assert variables['params']['decoder']['layer_0']['ffn']['wi']['bias'].dtype == jnp.float32
  greedy = np.asarray(autoregressive.greedy(bf16, variables, src))
  tokens, _ = autoregressive.beam_search(bf16, variables, src, beam_size=4, alpha=0.6)
  same_greedy = (greedy == greedy_tokens).all(axis=1)
  same_beam = (np.asarray(tokens) == beam_result[0][:, 0]).all(axis=1)
  # A random model's logits have near-ties that bfloat16 rounding may break the other way.
  assert same_greedy.mean() >= 2 / 3 and same_beam.mean() >= 2 / 3, (same_greedy, same_beam)
  # Where greedy parts, it is at a near-tie: float32 scores bfloat16's token within bfloat16's
  # error of its own pick (the previous test bounds that error by 3% of the logits' range).
  for row in np.flatnonzero(~same_greedy):
    t = np.flatnonzero(greedy[row] != greedy_tokens[row])[0]
    tgt_in = np.concatenate([[BOS], greedy_tokens[row, :t]])[None]
    logits = np.asarray(full_logits(src[row : row + 1], tgt_in), np.float64)[0, -1]
    gap = logits[greedy_tokens[row, t]] - logits[greedy[row, t]]
    assert 0 <= gap < 0.03 * np.abs(logits).max(), (row, t, gap)


def test_argmax_pick_breaks_ties_by_the_lowest_id_as_jnp_argmax():
  """Greedy's own reduction (two passes, not jnp.argmax) takes the first of tied logits, so a
  tie decodes as jnp.argmax would; random logits never tie, hence these hand-made rows."""
  logits = jnp.array(
    [
      [0.5, 2.0, 2.0, -1.0],  # tie between ids 1 and 2
      [3.0, 3.0, 3.0, 3.0],  # all tied
      [-1.0, -2.0, -1.0, -5.0],
    ]
  )  # tie at ids 0 and 2
  picked = np.asarray(autoregressive.argmax_pick(logits, jnp.zeros((3,), jnp.int32)))
  np.testing.assert_array_equal(picked, [1, 0, 0])
  np.testing.assert_array_equal(picked, np.argmax(np.asarray(logits), axis=-1))


def test_argmax_pick_takes_the_first_nan_as_jnp_argmax():
  """Non-finite logits (weights from a damaged checkpoint) still pick an id inside the
  vocabulary: the first NaN, as jnp.argmax and np.argmax do, not one past the end."""
  nan, inf = float('nan'), float('inf')
  logits = jnp.array(
    [[nan, nan, nan, nan], [0.5, nan, 9.0, nan], [-inf, inf, nan, 1.0], [-inf, -inf, -inf, 0.0]]
  )
  picked = np.asarray(autoregressive.argmax_pick(logits, jnp.zeros((4,), jnp.int32)))
  np.testing.assert_array_equal(picked, [0, 1, 2, 3])
  np.testing.assert_array_equal(picked, np.argmax(np.asarray(logits), axis=-1))
