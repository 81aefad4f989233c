"""Mask-predict decoding of a `CMLMTransformer` (Ghazvininejad et al., 2019).

Axes (the package legend): B sentences, M candidate lengths per sentence (the length
beam), R = B * M candidate rows, S source length, W canvas width, V vocabulary,
C length classes, I iterations, O = model.max_length_offset.

    tokens = mask_predict(model, params, src, iterations=10, length_beam=3)   # [B, W]

The steps, all in one jit-compiled program:

1. Encode the source once; the length classifier's top-M classes give M
   candidate lengths N per sentence (`length='predict'`), or each sentence gets
   N = min(source length + O, model.max_len) (`length='fixed'`, M = 1). A length
   adjustment (`length_ratio`, `length_offset`; `adjust_lengths`) then lengthens
   or shortens every candidate, like FastSpeech's speed control.
2. Each candidate is a row of the canvas `[R, W]`: N MASKs, then PAD (which no
   position attends to). W is the longest candidate plus one (room for its EOS),
   rounded up to a multiple of 8 and capped at model.max_len: the lengths come
   back to the host between two programs, so the canvas is only as wide as the
   sentences need (W = S + O would compute 2-4x more positions on short sources),
   and one program serves each bucket of widths.
3. Iteration 0 predicts every position at once and keeps each token with its
   log-probability. Iteration t = 1 .. I-1 re-masks the n = floor(N (I - t) / I)
   positions of lowest log-probability and predicts them again (the others keep
   their tokens and log-probabilities). For N = 10, I = 4: 10, 7, 5, 2 masked.
4. Per sentence, the candidate with the highest mean log-probability over its N
   positions wins; its tokens are cut at the first EOS.

The output has greedy's format (`autoregressive.py`): tokens y_1 .., then EOS, then
PAD. A row in which the model put no EOS gets one appended after its N tokens,
unless N = model.max_len, where it ends without EOS like a greedy row at its limit. PAD and
BOS are never predicted; all-PAD source rows (batch padding) give all-PAD rows.
A sentence decodes to the same tokens whatever else is in its batch and
however wide its source row is padded.
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp

from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.decode import autoregressive
from flax_transformer.decode.methods import MaskPredict
from flax_transformer.nn import masks
from flax_transformer.nn.cmlm import (
  CMLMTransformer,
  lengths_from_classes,
  mask_id,
  num_length_classes,
)

# Canvas widths are rounded up to a multiple of this: few compiled programs, little waste.
WIDTH_MULTIPLE = 8


@flax.struct.dataclass
class Canvas:
  """The refinement loop's state: every candidate row's current tokens and their confidence.

  tokens: int32 `[R, W]`, PAD beyond each row's length N.
  scores: float32 `[R, W]`, the log-probability each token had when it was last predicted
    (0 beyond N).
  """

  tokens: jax.Array
  scores: jax.Array


def mask_predict(model: CMLMTransformer, params, src, *, return_history: bool = False, **settings):
  """Non-autoregressive decoding with iterative refinement (see the module docstring).

  Args:
    model: the `CMLMTransformer` (only its config is used).
    params: the parameter dict, or the full variables `{'params': ...}`.
    src: int source ids `[B, S]` (numpy or jax), PAD-padded, EOS-terminated.
    return_history: also return the per-iteration record.
    **settings: `MaskPredict`'s fields, its defaults and checks: iterations,
      length_beam, length, length_ratio, length_offset.

  Returns:
    int32 tokens `[B, W]`, W = `canvas_width(longest candidate, model.max_len)`; with `return_history`,
    `(tokens, history)` where history holds, for the R = B * M candidate rows
    (sentence b's candidates are rows b * M .. b * M + M - 1):
      'lengths': int32 `[R]`, each candidate's N, adjusted (0 for batch padding);
      'masked_counts': int32 `[I, R]`, positions (re-)masked at each iteration
        (N at iteration 0, then floor(N (I - t) / I));
      'tokens': int32 `[I, R, W]`, the canvas after each iteration;
      'scores': float32 `[B, M]`, each candidate's mean log-probability;
      'chosen': int32 `[B]`, the winning candidate of each sentence.
  """
  if not isinstance(model, CMLMTransformer):
    raise TypeError(
      f"mask_predict needs a CMLMTransformer (model.kind='cmlm'), got {type(model).__name__}"
    )
  settings = MaskPredict(**settings)
  config = model.config
  if settings.length_beam > num_length_classes(config):
    raise ConfigError(
      f'mask-predict length_beam={settings.length_beam} exceeds the '
      f'{num_length_classes(config)} length classes '
      f'(2 * model.max_length_offset + 1, max_length_offset='
      f'{config.max_length_offset})'
    )
  src = autoregressive.check_source(src, config)
  variables = autoregressive.as_variables(params)
  memory, lengths = _encode(config, variables, src, settings)
  width = canvas_width(int(jnp.max(lengths, initial=0)), config.max_len)
  # The adjustment is in `lengths` already: without it, refining compiles once per width.
  plain = dataclasses.replace(settings, length_ratio=1.0, length_offset=0)
  tokens, history = _refine(config, variables, src, memory, lengths, plain, width)
  return (tokens, history) if return_history else tokens


def canvas_width(longest: int, max_len: int) -> int:
  """Canvas columns for candidates of up to `longest` tokens: one more for the EOS, rounded
  up to a multiple of `WIDTH_MULTIPLE` (one compiled program per bucket), at most `max_len`.

  canvas_width(13, 128) == 16; canvas_width(16, 128) == 24; canvas_width(127, 128) == 128.
  """
  return min(-(-(longest + 1) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, max_len)


@functools.partial(jax.jit, static_argnames=('config', 'settings'))
def _encode(
  config: ModelConfig, variables, src: jax.Array, settings: MaskPredict
) -> tuple[jax.Array, jax.Array]:
  """Source `[B, S]` -> (memory `[B, S, D]`, candidate lengths int32 `[R]`)."""

  def encode(module: CMLMTransformer, src: jax.Array):
    memory = module.encode(src)
    return memory, module.predict_length(memory, masks.padding_mask(src, config.pad_id))

  memory, length_logits = CMLMTransformer(config).apply(variables, src, method=encode)
  lengths = _candidate_lengths(length_logits, src, config, settings)  # [B, M]
  return memory, lengths.reshape(-1)


def _canvas_predictor(model, variables, cross_kv, src_mask, candidate_src, config: ModelConfig):
  """`predict(tokens)`: canvas `[R, W]` -> the most likely token at every position and its
  log-probability, the decoder reading the candidates' encoder keys and values."""
  never_target = autoregressive.never_output(config.vocab_size, config.pad_id, config.bos_id)  # [V]

  def predict(tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    logits = model.apply(
      variables,
      tokens,
      cross_kv,
      src_mask,
      src=candidate_src,
      method=CMLMTransformer.decode_parallel_from_kv,
    )  # [R, W, V]
    # PAD and BOS are never targets; forbid them as greedy decoding does.
    logits = jnp.where(never_target, -jnp.inf, logits)
    # The best token's log-probability is its logit minus the logsumexp: two reductions
    # over the vocabulary, where log_softmax would write a second [R, W, V] array.
    best_log_prob = jnp.max(logits, axis=-1) - jax.nn.logsumexp(logits, axis=-1)
    return autoregressive.argmax_pick(logits, 0), best_log_prob

  return predict


@functools.partial(jax.jit, static_argnames=('config', 'settings', 'width'))
def _refine(
  config: ModelConfig,
  variables,
  src: jax.Array,
  memory: jax.Array,
  lengths: jax.Array,
  settings: MaskPredict,
  width: int,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The I passes over the canvas `[R, W]` and the choice among each sentence's M candidates."""
  model = CMLMTransformer(config)
  batch, length_beam, iterations = src.shape[0], settings.length_beam, settings.iterations
  cross_kv, src_mask, candidate_src = _candidate_inputs(
    model, variables, src, memory, config, length_beam
  )

  position = jnp.arange(width)
  in_row = position < lengths[:, None]  # [R, W]
  predict = _canvas_predictor(model, variables, cross_kv, src_mask, candidate_src, config)

  def update(canvas: Canvas, remask: jax.Array) -> Canvas:
    """Predicts the `remask` positions `[R, W]` again; the others keep their tokens and scores."""
    tokens, scores = predict(jnp.where(remask, mask_id(config), canvas.tokens))
    return Canvas(
      tokens=jnp.where(remask, tokens, canvas.tokens).astype(jnp.int32),
      scores=jnp.where(remask, scores, canvas.scores),
    )

  first = update(
    Canvas(
      tokens=jnp.full((batch * length_beam, width), config.pad_id, jnp.int32),
      scores=jnp.zeros((batch * length_beam, width), jnp.float32),
    ),
    in_row,
  )

  def refine(canvas: Canvas, t: jax.Array):
    count = lengths * (iterations - t) // iterations  # [R]
    remask = _lowest(canvas.scores, in_row, count)
    canvas = update(canvas, remask)
    return canvas, (jnp.sum(remask, axis=1, dtype=jnp.int32), canvas.tokens)

  last, (counts, canvases) = jax.lax.scan(refine, first, jnp.arange(1, iterations))

  output, mean_scores, chosen = _choose_candidates(
    last, in_row, lengths, batch, length_beam, config
  )
  history = {
    'lengths': lengths,
    'masked_counts': jnp.concatenate([lengths[None], counts], axis=0),
    'tokens': jnp.concatenate([first.tokens[None], canvases], axis=0),
    'scores': mean_scores,
    'chosen': chosen,
  }
  return output, history


def _candidate_inputs(
  model: CMLMTransformer,
  variables,
  src: jax.Array,
  memory: jax.Array,
  config: ModelConfig,
  length_beam: int,
):
  """Cross-attention keys/values, source mask and source, each repeated for the M candidate
  rows `b * M + j`: the M candidates of a sentence share its memory."""
  cross_kv = model.apply(variables, memory, method=CMLMTransformer.cross_kv)
  src_mask = masks.padding_mask(src, config.pad_id)
  return jax.tree.map(lambda x: jnp.repeat(x, length_beam, axis=0), (cross_kv, src_mask, src))


def _choose_candidates(
  last: Canvas,
  in_row: jax.Array,
  lengths: jax.Array,
  batch: int,
  length_beam: int,
  config: ModelConfig,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The final canvas `[R, W]` -> each sentence's best candidate by mean token log-probability:
  (its tokens cut at EOS, the mean scores `[B, M]`, the chosen candidate `[B]`)."""
  mean_scores = (
    jnp.sum(jnp.where(in_row, last.scores, 0.0), axis=1) / jnp.maximum(lengths, 1)
  ).reshape(batch, length_beam)  # [B, M]
  chosen = jnp.argmax(mean_scores, axis=1).astype(jnp.int32)  # [B]
  rows = jnp.arange(batch) * length_beam + chosen
  return _cut_at_eos(last.tokens[rows], lengths[rows], config), mean_scores, chosen


def _candidate_lengths(
  length_logits: jax.Array, src: jax.Array, config: ModelConfig, settings: MaskPredict
) -> jax.Array:
  """int32 `[B, M]`: the top-M predicted lengths, or the fixed one, adjusted; 0 for all-PAD
  sources."""
  src_lengths = jnp.sum(src != config.pad_id, axis=1, dtype=jnp.int32)[:, None]  # [B, 1]
  if settings.length == 'fixed':
    lengths = jnp.minimum(src_lengths + config.max_length_offset, config.max_len)
  else:
    _, classes = jax.lax.top_k(length_logits, settings.length_beam)  # [B, M]
    lengths = lengths_from_classes(classes, src_lengths, config.max_length_offset, config.max_len)
  lengths = adjust_lengths(lengths, settings.length_ratio, settings.length_offset, config.max_len)
  return jnp.where(src_lengths > 0, lengths, 0)


def adjust_lengths(lengths: jax.Array, ratio: float, offset: int, max_len: int) -> jax.Array:
  """Lengths N (int, any shape) -> clip(round(ratio * N) + offset, 1, max_len), int32.

  Halves round up. For N = 10, max_len 16: ratio 0.5 -> 5; offset 2 -> 12; ratio 1.25 with
  offset -1 -> 12 (12.5 rounds to 13); ratio 2 -> 16 (clipped); offset -20 -> 1.
  """
  # Rounded and clipped in float32, where every length is an exact integer: a huge ratio or
  # offset saturates at the ends instead of wrapping around int32.
  rounded = jnp.floor(jnp.asarray(lengths, jnp.float32) * ratio + 0.5)
  return jnp.clip(rounded + offset, 1, max_len).astype(jnp.int32)


def _lowest(scores: jax.Array, in_row: jax.Array, count: jax.Array) -> jax.Array:
  """bool `[R, W]`: the `count` `[R]` positions of each row with the lowest scores.

  Only positions inside the row compete; ties go to the earlier position. For
  scores (-1, -3, -2, -3), all in the row, and count 2: positions 1 and 3.
  """
  keys = jnp.where(in_row, scores, jnp.inf)
  rank = jnp.argsort(jnp.argsort(keys, axis=1), axis=1)  # stable: ties keep position order
  return rank < count[:, None]


def _cut_at_eos(tokens: jax.Array, lengths: jax.Array, config: ModelConfig) -> jax.Array:
  """Candidate rows `[B, W]` of N tokens -> the tokens before the first EOS, then EOS, then PAD.

  Without an EOS among its N tokens a row gets one at position N, when N < W.
  Rows with N = 0 (batch padding) are all PAD. For N = 4, W = 6 (E = EOS, P = PAD):
    a b E c P P -> a b E P P P
    a b c d P P -> a b c d E P
  """
  position = jnp.arange(tokens.shape[1])
  inside = position < lengths[:, None]
  end = jnp.min(
    jnp.where(inside & (tokens == config.eos_id), position, lengths[:, None]), axis=1
  )  # [B]
  output = jnp.where(position < end[:, None], tokens, config.pad_id)
  return jnp.where((position == end[:, None]) & (lengths[:, None] > 0), config.eos_id, output)
