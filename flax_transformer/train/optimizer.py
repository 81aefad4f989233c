"""The paper's optimizer: Adam (0.9, 0.98, 1e-9) on the warm-up schedule of §5.3, or on a
schedule that ends at the last update (`train.schedule`: linear, wsd)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from flax_transformer.config import ModelConfig, TrainConfig


def transformer_schedule(d_model: int, warmup_steps: int, scale: float = 1.0) -> optax.Schedule:
  """The paper's learning rate (§5.3) as an optax schedule of the update count.

  lrate(n) = scale * d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5), where
  n = count + 1 is the paper's 1-based step number: optax counts updates from 0,
  and n = 0 would waste the first update on a zero rate. The rate rises
  linearly for `warmup_steps` updates, peaks at
  scale * (d_model * warmup_steps)^-0.5, then decays as n^-0.5.
  """
  if warmup_steps <= 0:
    raise ValueError(f'warmup_steps must be positive, got {warmup_steps}')

  def schedule(count):
    n = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model**-0.5 * jnp.minimum(lax.rsqrt(n), n * warmup_steps**-1.5)

  return schedule


def ending_schedule(
  peak: float, warmup_steps: int, total_updates: int, shape: str, cooldown_fraction: float = 0.2
) -> optax.Schedule:
  """A learning rate that reaches zero at update `total_updates`: `linear` or `wsd`.

  With n = count + 1 (the paper's 1-based update number, as `transformer_schedule`), both rise
  as peak * n / warmup_steps, as the paper's does, then
  - linear: peak * (T - n) / (T - W), a straight line to zero at n = T;
  - wsd (warmup-stable-decay, Hu et al. 2024; Hägele et al. 2024): the peak, held until the
    cooldown's start C = T - cooldown_fraction * T, then peak * (1 - sqrt((n - C) / (T - C))),
    steep at first and flat at the end.
  The rate is the least of the warm-up ramp and the decay, so a cooldown longer than the
  stable part simply starts during the warm-up. Zero for every update past T (a run resumed
  beyond its schedule's end is refused by `run.config_file.check_resumable`).
  """
  if shape not in ('linear', 'wsd'):
    raise ValueError(f'shape must be linear or wsd, got {shape!r}')
  if not 0 < warmup_steps < total_updates:
    raise ValueError(f'need 0 < warmup_steps < total_updates, got {warmup_steps}, {total_updates}')
  cooldown_start = total_updates - cooldown_fraction * total_updates

  def schedule(count):
    n = jnp.asarray(count, jnp.float32) + 1.0
    ramp = n / warmup_steps
    if shape == 'linear':
      decay = (total_updates - n) / (total_updates - warmup_steps)
    else:
      progress = jnp.clip((n - cooldown_start) / (total_updates - cooldown_start), 0.0, 1.0)
      decay = 1.0 - jnp.sqrt(progress)
    return peak * jnp.clip(jnp.minimum(ramp, decay), 0.0, 1.0)

  return schedule


def peak_learning_rate(train_config: TrainConfig, model_config: ModelConfig) -> float:
  """`peak_lr`, or the paper's peak (d_model * warmup_steps)^-0.5 scaled by `lr_scale`."""
  if train_config.peak_lr is not None:
    return train_config.peak_lr
  return train_config.lr_scale * (model_config.d_model * train_config.warmup_steps) ** -0.5


def make_schedule(train_config: TrainConfig, model_config: ModelConfig) -> optax.Schedule:
  """train.schedule: the paper's (inverse_sqrt), or one that ends at train.steps' last update.

  The paper's rate is fairseq's inverse_sqrt in another form: a linear warmup to the peak
  (d_model * warmup_steps)^-0.5, then peak * (warmup_steps / n)^0.5. So a peak of P is the
  paper's schedule scaled by P * (d_model * warmup_steps)^0.5. `linear` and `wsd` rise to the
  same peak the same way and then fall to zero (`ending_schedule`).
  """
  c = train_config
  if c.schedule != 'inverse_sqrt':
    peak = peak_learning_rate(c, model_config)
    return ending_schedule(peak, c.warmup_steps, c.total_updates, c.schedule, c.cooldown_fraction)
  scale = c.lr_scale
  if c.peak_lr is not None:
    scale = c.peak_lr * (model_config.d_model * c.warmup_steps) ** 0.5
  return transformer_schedule(model_config.d_model, c.warmup_steps, scale)


class ParameterEmaState(NamedTuple):
  """The state of `with_parameter_ema`: the wrapped optimizer's, the updates averaged, and the
  average itself (a parameter pytree, float32)."""

  inner: optax.OptState
  ema_count: jax.Array
  ema: Any


def with_parameter_ema(
  inner: optax.GradientTransformation, decay: float
) -> optax.GradientTransformation:
  """`inner`, also keeping an exponential moving average of the parameters it updates.

  After each update, ema <- d * ema + (1 - d) * new_params with d = min(decay, (1 + n) /
  (10 + n)), n the updates averaged before (TensorFlow's ExponentialMovingAverage with
  num_updates): the first updates replace most of the average, so it does not hold on to the
  initialisation for ~1 / (1 - decay) updates. It lives in the optimizer's state, so it is
  checkpointed, restored on resume, and left untouched by a step whose update is withheld.
  """

  def init(params):
    return ParameterEmaState(
      inner.init(params), jnp.zeros((), jnp.int32), jax.tree.map(jnp.asarray, params)
    )

  def update(updates, state, params=None):
    updates, inner_state = inner.update(updates, state.inner, params)
    new_params = optax.apply_updates(params, updates)
    n = state.ema_count.astype(jnp.float32)
    d = jnp.minimum(decay, (1.0 + n) / (10.0 + n))
    ema = jax.tree.map(lambda e, p: d * e + (1.0 - d) * p, state.ema, new_params)
    return updates, ParameterEmaState(inner_state, state.ema_count + 1, ema)

  return optax.GradientTransformation(init, update)


def ema_params(opt_state) -> Any | None:
  """The parameters' moving average that `with_parameter_ema` keeps in `opt_state`, or None
  when the run keeps none (train.ema_decay 0)."""
  found = [
    value
    for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, 'ema')
    if path[-1].tuple_name == 'ParameterEmaState'
  ]
  return found[0] if found else None


def make_optimizer(
  train_config: TrainConfig, model_config: ModelConfig
) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) on the paper's schedule, with the optional extras of TrainConfig.

  - max_grad_norm: clip the global gradient norm first.
  - weight_decay: decoupled (AdamW) decay of matrices and embeddings only;
    biases and LayerNorm scales are not decayed.
  - ema_decay: a moving average of the parameters in the state (`with_parameter_ema`),
    updated with each update.
  - grad_accum_steps K > 1: optax.MultiSteps averages the gradients of K
    consecutive steps (each normalised by its own token count) and updates
    once; the schedule then counts updates, not steps.
  """
  c = train_config
  schedule = make_schedule(train_config, model_config)
  transforms = []
  if c.max_grad_norm is not None:
    transforms.append(optax.clip_by_global_norm(c.max_grad_norm))
  if c.weight_decay > 0:
    transforms.append(
      optax.adamw(
        schedule,
        c.adam_b1,
        c.adam_b2,
        c.adam_eps,
        weight_decay=c.weight_decay,
        mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params),
      )
    )
  else:
    transforms.append(optax.adam(schedule, c.adam_b1, c.adam_b2, c.adam_eps))
  optimizer = optax.chain(*transforms)
  if c.ema_decay > 0:
    optimizer = with_parameter_ema(optimizer, c.ema_decay)
  if c.grad_accum_steps > 1:
    optimizer = optax.MultiSteps(optimizer, every_k_schedule=c.grad_accum_steps)
  return optimizer


def schedule_count(opt_state) -> jax.Array:
  """The update count the optimizer's schedule reads for its next update: updates applied,
  not steps taken (a skipped non-finite step applies none; with grad_accum_steps K, one
  per K steps), so learning_rate is the rate the update used."""
  (count,) = [
    value
    for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, 'count')
    if path[-1].tuple_name == 'ScaleByScheduleState'
  ]
  return count
