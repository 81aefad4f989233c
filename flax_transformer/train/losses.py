"""Per-token losses of a batch of logits: label-smoothed cross-entropy and its sums.

Axis legend: B rows, T positions, V vocabulary.

Shared by the autoregressive step (`train_step`) and the non-autoregressive CMLM
objective (`cmlm.cmlm_loss_sums`), which scores only its masked positions by
giving the others PAD targets.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


def token_losses(
  logits: jax.Array, targets: jax.Array, smoothing: float
) -> tuple[jax.Array, jax.Array]:
  """Per-token label-smoothed cross-entropy and plain negative log-likelihood.

  The smoothed target puts 1 - eps on the reference token and eps spread
  uniformly over all V tokens, so
    smoothed = (1 - eps) * nll + eps * mean_v(-log p_v)
  with -log p_v = logsumexp(logits) - logits_v. Written with one logsumexp and
  two reductions of the logits: no one-hot or log-softmax tensor `[B, T, V]`.

  Args:
    logits: `[B, T, V]`, float32.
    targets: int `[B, T]`.
    smoothing: eps in [0, 1).

  Returns:
    (smoothed, nll), both float32 `[B, T]`, not masked.
  """
  logits = logits.astype(jnp.float32)
  log_z = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  nll = log_z - target_logit
  uniform = log_z - jnp.mean(logits, axis=-1)  # mean_v(-log p_v)
  return (1.0 - smoothing) * nll + smoothing * uniform, nll


def label_smoothed_cross_entropy(
  logits: jax.Array, targets: jax.Array, smoothing: float, pad_id: int
) -> tuple[jax.Array, jax.Array]:
  """Sum of label-smoothed cross-entropy over non-PAD targets, and their count.

  Returns float32 scalars (loss_sum, weight_sum); loss per token is their ratio.
  Positions where `targets == pad_id` contribute to neither.
  """
  smoothed, _ = token_losses(logits, targets, smoothing)
  weights = (targets != pad_id).astype(jnp.float32)
  return jnp.sum(smoothed * weights), jnp.sum(weights)


def loss_sums(
  logits: jax.Array, targets: jax.Array, smoothing: float, pad_id: int
) -> dict[str, jax.Array]:
  """The additive statistics behind every reported metric, over non-PAD targets."""
  smoothed, nll = token_losses(logits, targets, smoothing)
  weights = (targets != pad_id).astype(jnp.float32)
  # Correct when the target's logit is the largest (an exact tie counts as correct): the same
  # max and gather as the loss's, which XLA shares, where jnp.argmax's (value, index)
  # reduction over [B, T, V] cost more on CPU than the whole loss.
  target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  correct = (target_logit >= jnp.max(logits, axis=-1)).astype(jnp.float32)
  return {
    'loss_sum': jnp.sum(smoothed * weights),
    'nll_sum': jnp.sum(nll * weights),
    'correct': jnp.sum(correct * weights),
    'tokens': jnp.sum(weights),
  }


def chunked_loss_sums(
  logits_fn: Callable[[jax.Array], jax.Array],
  states: jax.Array,
  targets: jax.Array,
  smoothing: float,
  pad_id: int,
  chunk: int = 2048,
) -> dict[str, jax.Array]:
  """`loss_sums(logits_fn(states), ...)` with never more than `chunk` tokens' logits at once.

  states `[B, T, D]` and targets `[B, T]` are flattened and cut into chunks of `chunk`
  tokens (the last padded with PAD targets); a `lax.scan` projects and scores one chunk at a
  time, each step under `jax.checkpoint`, so the backward pass recomputes a chunk's `[chunk,
  V]` logits instead of keeping the whole batch's `[B, T, V]` (at the base preset's 25,000
  tokens and 37,000 pieces, 3.4 GiB a copy). The same sums, added in another order.
  """
  width = states.shape[-1]
  states, targets = states.reshape(-1, width), targets.reshape(-1)  # [N, D], [N]
  chunks = -(-targets.shape[0] // chunk)
  padding = chunks * chunk - targets.shape[0]
  states = jnp.pad(states, ((0, padding), (0, 0))).reshape(chunks, chunk, width)
  targets = jnp.pad(targets, (0, padding), constant_values=pad_id).reshape(chunks, chunk)

  @jax.checkpoint
  def chunk_sums(chunk_states, chunk_targets):
    return loss_sums(logits_fn(chunk_states), chunk_targets, smoothing, pad_id)

  # Each chunk's sums as the scan's outputs, not a carry: under shard_map a carry would have to
  # start as a per-device value.
  per_chunk = jax.lax.map(lambda inputs: chunk_sums(*inputs), (states, targets))
  return jax.tree.map(lambda x: jnp.sum(x, axis=0), per_chunk)


def fused_loss_sums(
  logits_fn: Callable[[object, jax.Array], jax.Array],
  params,
  states: jax.Array,
  targets: jax.Array,
  smoothing: float,
  pad_id: int,
  chunk: int,
) -> dict[str, jax.Array]:
  """`loss_sums(logits_fn(params, states), ...)` and its gradient in one pass over chunks of
  `chunk` tokens, never holding the batch's `[B, T, V]` logits.

  states `[B, T, D]` and targets `[B, T]` are flattened and cut into chunks (the last padded
  with PAD targets). For each chunk a `lax.scan` projects the `[chunk, V]` logits, takes their
  sums, and at once the gradient of the loss sum: d loss / d logits = softmax - q, q the
  smoothed target ((1 - eps) on the reference token, eps / V on every token), zero at PAD,
  carried back through the projection to the states and to `params` (the shared embedding,
  accumulated over chunks). The backward pass then only scales what the forward pass kept by
  the loss sum's cotangent: no `[B, T, V]` array, and no second projection as recomputation
  would need. The other sums (nll, correct, tokens) are metrics: no gradient flows from them.
  """
  width = states.shape[-1]
  flat_states, flat_targets = states.reshape(-1, width), targets.reshape(-1)  # [N, D], [N]
  chunks = -(-flat_targets.shape[0] // chunk)
  padding = chunks * chunk - flat_targets.shape[0]
  chunk_states = jnp.pad(flat_states, ((0, padding), (0, 0))).reshape(chunks, chunk, width)
  chunk_targets = jnp.pad(flat_targets, (0, padding), constant_values=pad_id)
  return _fused_sums(logits_fn, smoothing, pad_id, params, chunk_states, chunk_targets)


def _fused_forward(logits_fn, smoothing, pad_id, params, chunk_states, targets):
  """(the sums, (d loss_sum / d params, d loss_sum / d states [C, chunk, D]))."""
  chunks, chunk, _ = chunk_states.shape
  chunk_targets = targets.reshape(chunks, chunk)

  def one_chunk(params_grad, inputs):
    states, chunk_target = inputs  # [chunk, D], [chunk]
    logits, pullback = jax.vjp(logits_fn, params, states)  # [chunk, V]
    logits = logits.astype(jnp.float32)
    sums = loss_sums(logits, chunk_target, smoothing, pad_id)
    vocab = logits.shape[-1]
    probabilities = jax.nn.softmax(logits, axis=-1)
    smoothed = jax.nn.one_hot(chunk_target, vocab, dtype=jnp.float32) * (1.0 - smoothing)
    weights = (chunk_target != pad_id).astype(jnp.float32)[:, None]
    d_logits = (probabilities - smoothed - smoothing / vocab) * weights
    d_params, d_states = pullback(d_logits.astype(logits.dtype))
    return jax.tree.map(jnp.add, params_grad, d_params), (sums, d_states)

  zeros = jax.tree.map(jnp.zeros_like, params)
  params_grad, (per_chunk, states_grad) = jax.lax.scan(
    one_chunk, zeros, (chunk_states, chunk_targets)
  )
  sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), per_chunk)
  return sums, (params_grad, states_grad)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _fused_sums(logits_fn, smoothing, pad_id, params, chunk_states, targets):
  return _fused_forward(logits_fn, smoothing, pad_id, params, chunk_states, targets)[0]


def _fused_sums_forward(logits_fn, smoothing, pad_id, params, chunk_states, targets):
  return _fused_forward(logits_fn, smoothing, pad_id, params, chunk_states, targets)


def _fused_sums_backward(logits_fn, smoothing, pad_id, gradients, sums_cotangent):
  params_grad, states_grad = gradients
  scale = sums_cotangent['loss_sum']
  return (
    jax.tree.map(lambda g: (scale * g).astype(g.dtype), params_grad),
    (scale * states_grad).astype(states_grad.dtype),
    None,
  )


_fused_sums.defvjp(_fused_sums_forward, _fused_sums_backward)
