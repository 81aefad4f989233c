"""Mask-predict's rules pinned against independent NumPy computations (issue #33, item 1).

* `_lowest`, the choice of the positions to re-mask: its docstring's worked example, ties
  (the earlier position), positions outside the row, and random rows against NumPy's
  stable argsort.
* The refinement loop, replayed in NumPy on the tiny random cmlm: each pass re-masks exactly
  the floor(N (I - t) / I) positions of lowest log-probability left by the previous pass,
  predicts them again with the model (its logits through the plain forward pass, outside
  mask-predict's compiled program) and keeps every other token and score. The replay must
  give every canvas of `history['tokens']`, the mean scores, the winner and the output;
  the tiny model changes its mind in later passes, so a refinement that kept the first
  pass, re-masked the wrong positions or fed the model the unmasked canvas fails.
* The winning length: a hand-made model whose per-position log-probabilities are known in
  float64 (attention and feed-forward outputs zeroed, so each position's prediction is its
  MASK embedding plus its position, computed by tests/support/numpy_transformer.py), with
  candidate lengths set through the length head so that the candidate with the best MEAN
  log-probability (the paper's rule) is neither the first nor the one with the best SUM;
  its tokens hold an EOS mid-row, where the output must be cut.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer.decode import non_autoregressive
from flax_transformer.nn.cmlm import CMLMTransformer, num_length_classes
from support import numpy_transformer
from support.tiny_cmlm import BOS, CONFIG, EOS, MASK, PAD, SOURCES, R, pad_rows, source_lengths

ITERATIONS, LENGTH_BEAM = 4, 2
# float32 logits of the compiled decoder and of the plain forward pass differ by ~1e-6: every
# decision the replay makes (an argmax, the boundary of the lowest-n set, the winner) must be
# separated by more than this, or the comparison would not be exact on another CPU.
MARGIN = 1e-4


def lowest(scores, in_row, count):
  return np.asarray(
    non_autoregressive._lowest(
      jnp.asarray(scores, jnp.float32), jnp.asarray(in_row), jnp.asarray(count)
    )
  )


# --- _lowest ----------------------------------------------------------------------------------


def test_lowest_follows_its_docstring_example():
  # "For scores (-1, -3, -2, -3), all in the row, and count 2: positions 1 and 3."
  chosen = lowest([[-1, -3, -2, -3]], [[True] * 4], [2])
  np.testing.assert_array_equal(chosen, [[False, True, False, True]])
  # One more goes to the next lowest, -2; one fewer to the earlier of the tied -3s.
  np.testing.assert_array_equal(
    lowest([[-1, -3, -2, -3]], [[True] * 4], [3]), [[False, True, True, True]]
  )
  np.testing.assert_array_equal(
    lowest([[-1, -3, -2, -3]], [[True] * 4], [1]), [[False, True, False, False]]
  )


def test_lowest_breaks_ties_by_position_and_ignores_positions_outside_the_row():
  tied = np.full((1, 6), -2.0)
  np.testing.assert_array_equal(
    lowest(tied, np.ones((1, 6), bool), [2])[0], [True, True, False, False, False, False]
  )
  # Positions beyond the row (PAD, score 0 in the canvas; here made the lowest) never compete.
  scores = [[-1.0, -0.5, -0.7, -9.0, -9.0]]
  in_row = [[True, True, True, False, False]]
  np.testing.assert_array_equal(lowest(scores, in_row, [2])[0], [True, False, True, False, False])
  np.testing.assert_array_equal(lowest(scores, in_row, [0])[0], [False] * 5)
  np.testing.assert_array_equal(lowest(scores, in_row, [3])[0], [True, True, True, False, False])


def test_lowest_matches_a_stable_numpy_sort_on_random_rows_with_ties():
  rng = np.random.default_rng(0)
  scores = -rng.integers(0, 4, (50, 12)).astype(np.float64)  # many ties
  lengths = rng.integers(0, 13, 50)
  in_row = np.arange(12) < lengths[:, None]
  count = (lengths * rng.random(50)).astype(np.int64)
  expected = np.zeros((50, 12), bool)
  for row in range(50):
    inside = np.flatnonzero(in_row[row])
    order = inside[np.argsort(scores[row, inside], kind='stable')]
    expected[row, order[: count[row]]] = True
  np.testing.assert_array_equal(lowest(scores, in_row, count), expected)


# --- the refinement loop, replayed ------------------------------------------------------------


@pytest.fixture(scope='module')
def model():
  return CMLMTransformer(CONFIG)


@pytest.fixture(scope='module')
def forward(model):
  """The plain forward pass: token logits `[R, W, V]` of canvases, as float64."""
  apply = jax.jit(lambda params, src, tokens: model.apply({'params': params}, src, tokens)[0])
  return lambda params, src, tokens: np.asarray(apply(params, src, tokens), np.float64)


def best_tokens(logits):
  """The allowed argmax (PAD and BOS excluded) and its log-probability; and its margin."""
  logits = logits.copy()
  logits[..., [PAD, BOS]] = -np.inf
  top = logits.max(-1, keepdims=True)
  log_probs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
  ordered = np.sort(logits, axis=-1)
  return log_probs.argmax(-1), log_probs.max(-1), ordered[..., -1] - ordered[..., -2]


def replay(forward, params, src, lengths, width, iterations, beam):
  """Mask-predict in NumPy, from the model's logits: the canvas after each pass, the positions
  each pass masked, and the final scores. Asserts every decision has a margin."""
  rows_src = np.repeat(src, beam, axis=0)
  in_row = np.arange(width) < lengths[:, None]
  tokens = np.full(in_row.shape, PAD)
  scores = np.zeros(in_row.shape)
  canvases, masked = [], []
  for t in range(iterations):
    if t == 0:
      remask = in_row.copy()
    else:
      count = lengths * (iterations - t) // iterations
      remask = np.zeros_like(in_row)
      for r in range(len(lengths)):
        inside = np.flatnonzero(in_row[r])
        keys = scores[r, inside]
        order = np.argsort(keys, kind='stable')
        remask[r, inside[order[: count[r]]]] = True
        if 0 < count[r] < len(inside):
          gap = keys[order[count[r]]] - keys[order[count[r] - 1]]
          assert gap > MARGIN, f'pass {t}, row {r}: the lowest {count[r]} are not well separated'
    best, best_lp, gap = best_tokens(forward(params, rows_src, np.where(remask, MASK, tokens)))
    assert gap[remask].min() > MARGIN, f'pass {t}: an argmax too close to call'
    tokens = np.where(remask, best, tokens)
    scores = np.where(remask, best_lp, scores)
    canvases.append(tokens)
    masked.append(remask)
  return np.stack(canvases), np.stack(masked), scores


def cut_at_eos(row, n, width):
  """The output row of a candidate of n tokens: tokens before its first EOS, EOS, PAD."""
  end = next((i for i in range(n) if row[i] == EOS), n)
  out = np.full(width, PAD)
  out[:end] = row[:end]
  if end < width:
    out[end] = EOS
  return out


@pytest.fixture(scope='module')
def decoded(model, forward, cmlm_params):
  src = pad_rows(SOURCES)
  tokens, history = jax.tree.map(
    np.asarray,
    non_autoregressive.mask_predict(
      model, cmlm_params, src, iterations=ITERATIONS, length_beam=LENGTH_BEAM, return_history=True
    ),
  )
  width = history['tokens'].shape[2]
  canvases, masked, scores = replay(
    forward, cmlm_params, src, history['lengths'], width, ITERATIONS, LENGTH_BEAM
  )
  return dict(
    src=src,
    tokens=tokens,
    history=history,
    canvases=canvases,
    masked=masked,
    scores=scores,
    width=width,
  )


def test_every_pass_remasks_the_lowest_scoring_positions_of_the_previous_one(decoded):
  history, canvases, masked = decoded['history'], decoded['canvases'], decoded['masked']
  np.testing.assert_array_equal(history['masked_counts'], masked.sum(axis=2))
  # Every canvas equals the replay's, which re-masked the lowest-scoring positions.
  for t in range(ITERATIONS):
    np.testing.assert_array_equal(history['tokens'][t], canvases[t], err_msg=f'pass {t}')


def test_later_passes_change_tokens_of_the_first_and_keep_the_unmasked_ones(decoded):
  canvases = decoded['history']['tokens']  # [I, R, W]
  changed = canvases[1:] != canvases[:-1]
  # The model changes its mind: refinement is exercised, not a no-op on this model...
  assert changed.sum() >= 5, 'the tiny model should revise some first-pass tokens'
  assert (canvases[0] != canvases[-1]).any()
  # ...and only at the positions the replay re-masked: the others keep their tokens.
  assert not (changed & ~decoded['masked'][1:]).any()
  np.testing.assert_array_equal(canvases[-1], decoded['canvases'][-1])


def test_the_winner_has_the_best_mean_score_and_is_the_output(decoded):
  history, scores = decoded['history'], decoded['scores']
  lengths = history['lengths']
  mean = (scores.sum(axis=1) / np.maximum(lengths, 1)).reshape(-1, LENGTH_BEAM)
  np.testing.assert_allclose(history['scores'], mean, rtol=0, atol=1e-5)
  ordered = np.sort(mean, axis=1)
  assert (ordered[:, -1] - ordered[:, -2]).min() > MARGIN
  np.testing.assert_array_equal(history['chosen'], mean.argmax(axis=1))
  rows = np.arange(len(SOURCES)) * LENGTH_BEAM + history['chosen']
  expected = [cut_at_eos(decoded['canvases'][-1, r], lengths[r], decoded['width']) for r in rows]
  np.testing.assert_array_equal(decoded['tokens'], np.stack(expected))


# --- the winning length, on a hand-made model -------------------------------------------------


def position_only_model(params, class_order):
  """Parameters whose decoder output at position j depends on j alone (every attention and
  feed-forward output projection zeroed: the residual stream is the MASK embedding plus the
  position's sinusoid, LayerNormed), and whose length head ranks the classes `class_order`
  first (bias 10, 9, 8, ... over a zero kernel)."""
  params = jax.tree.map(np.array, params)  # a writable copy
  for i in range(CONFIG.num_decoder_layers):
    layer = params['decoder'][f'layer_{i}']
    for sublayer in ('self_attention', 'cross_attention'):
      layer[sublayer]['out']['kernel'][:] = 0.0
      layer[sublayer]['out']['bias'][:] = 0.0
    layer['ffn']['wo']['kernel'][:] = 0.0
    layer['ffn']['wo']['bias'][:] = 0.0
  head = params['length_head']
  head['kernel'][:] = 0.0
  head['bias'][:] = 0.0
  for rank, cls in enumerate(class_order):
    head['bias'][cls] = 10.0 - rank
  return params


def test_the_candidate_with_the_best_mean_log_probability_wins_not_the_best_sum(model, cmlm_params):
  src = pad_rows([SOURCES[2]])  # 8 source tokens
  src_len = int(source_lengths(src)[0])
  # Position j's log-probability, in float64 from the reference: with no attention it is the
  # same in every pass and for every candidate length.
  all_masks = np.full((1, CONFIG.max_len), MASK)
  probe = position_only_model(cmlm_params, [0])
  best, _, _ = best_tokens(numpy_transformer.cmlm_outputs(CONFIG, probe, src, all_masks)[0][0])
  # EOS's row becomes 1.2 x the row of the token position `src_len - 1` predicts, so that EOS
  # wins there and wherever that token did: the output is then cut at its first EOS. (Only
  # the output projection reads EOS's row: the decoder's inputs are MASKs, and nothing reads
  # the encoder's memory once attention and the length kernel are zeroed.)
  params = jax.tree.map(np.array, cmlm_params)
  table = params['embedding']['embedding']
  table[EOS] = 1.2 * table[best[src_len - 1]]
  logits, _ = numpy_transformer.cmlm_outputs(
    CONFIG, position_only_model(params, [0]), src, all_masks
  )
  best, position_scores, gap = best_tokens(logits[0])
  assert gap.min() > MARGIN
  # Candidate lengths src_len - R .. src_len + R; mean and sum of the first N positions.
  candidates = np.arange(src_len - R, src_len + R + 1)
  mean = np.array([position_scores[:n].mean() for n in candidates])
  total = np.array([position_scores[:n].sum() for n in candidates])
  # Three candidates: the best mean, a shorter one (whose sum is better: every log-probability
  # is negative) listed FIRST, and the worst mean of the others.
  best_mean = int(mean.argmax())
  shorter = [c for c in range(best_mean) if mean[best_mean] - mean[c] > MARGIN]
  assert shorter, 'the hand-made model needs a shorter candidate with a worse mean'
  others = [c for c in range(len(candidates)) if c not in (shorter[0], best_mean)]
  order = [shorter[0], best_mean, min(others, key=lambda c: mean[c])]
  assert total[order].argmax() != 1 and mean[order].argmax() == 1  # sum and mean disagree
  n = candidates[best_mean]
  assert 0 < list(best[:n]).index(EOS) < n - 1, 'the winner should hold an EOS to cut at'
  tokens, history = jax.tree.map(
    np.asarray,
    non_autoregressive.mask_predict(
      model,
      position_only_model(params, order),
      src,
      iterations=3,
      length_beam=3,
      return_history=True,
    ),
  )
  np.testing.assert_array_equal(history['lengths'], candidates[order])
  np.testing.assert_allclose(history['scores'][0], mean[order], rtol=0, atol=1e-5)
  assert history['chosen'][0] == 1
  np.testing.assert_array_equal(tokens[0], cut_at_eos(best[:n], n, tokens.shape[1]))
  assert num_length_classes(CONFIG) == 2 * R + 1
