"""The paper's optimizer: Adam (0.9, 0.98, 1e-9) on the warm-up schedule of §5.3."""

from __future__ import annotations

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


def make_schedule(train_config: TrainConfig, model_config: ModelConfig) -> optax.Schedule:
  """The paper's schedule, scaled by `lr_scale` or to peak at `peak_lr`.

  The paper's rate is fairseq's inverse_sqrt in another form: a linear warmup to the peak
  (d_model * warmup_steps)^-0.5, then peak * (warmup_steps / n)^0.5. So a peak of P is the
  paper's schedule scaled by P * (d_model * warmup_steps)^0.5.
  """
  scale = train_config.lr_scale
  if train_config.peak_lr is not None:
    scale = train_config.peak_lr * (model_config.d_model * train_config.warmup_steps) ** 0.5
  return transformer_schedule(model_config.d_model, train_config.warmup_steps, scale)


def make_optimizer(
  train_config: TrainConfig, model_config: ModelConfig
) -> optax.GradientTransformation:
  """Adam(b1, b2, eps) on the paper's schedule, with the optional extras of TrainConfig.

  - max_grad_norm: clip the global gradient norm first.
  - weight_decay: decoupled (AdamW) decay of matrices and embeddings only;
    biases and LayerNorm scales are not decayed.
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
