"""The training step: one update of either objective, per device, and its mapped form.

Axis legend: B batch rows (per device inside a mapped step), S source length,
T target length, V vocabulary, G devices.

One per-device function, `train_step`, holds the whole update; `DataParallel`
maps it over devices with `jax.shard_map` (a `('data',)` mesh, parameters
replicated, batch rows split) or with `jax.pmap`, with identical numerics:

    parallel = DataParallel(mode='shard_map')
    step = make_parallel_step(model, optimizer, train_config, parallel)
    state = parallel.replicate(create_train_state(model, optimizer, seed=0))
    state, metrics = step(state, parallel.shard_batch(batch))     # batch: the global Batch

The objective follows `model.config.kind`: 'autoregressive' is the paper's
next-token cross-entropy; 'cmlm' (a `cmlm.CMLMTransformer`) is the conditional
masked LM's loss on masked target positions plus the weighted length loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from jax import lax

from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.data import packing
from flax_transformer.data.batching import Batch
from flax_transformer.nn.backend import resolve_loss_chunk
from flax_transformer.nn.build import build_model
from flax_transformer.nn.model import Transformer
from flax_transformer.train import cmlm_objective, scheduled_sampling
from flax_transformer.train.losses import chunked_loss_sums, fused_loss_sums, loss_sums
from flax_transformer.train.optimizer import make_optimizer, make_schedule, schedule_count
from flax_transformer.train.parallel import AXIS, DataParallel

# Independent random streams derived from TrainConfig.seed.
_INIT_STREAM, _DROPOUT_STREAM, _MASK_STREAM, _SCHEDULED_SAMPLING_STREAM = 0, 1, 2, 3
# cmlm validation masks come from this seed, not the run's: every evaluation of every run
# masks the same positions, so validation losses compare across steps and runs.
_EVAL_MASK_SEED = 0


@flax.struct.dataclass
class TrainState:
  """Everything that changes during training, as one pytree.

  step: int32 [], the number of batches consumed. It indexes the next batch
    (`Batcher.batch_at(step)`) and, folded into the seed, its dropout key, so a
    resumed run needs no iterator or RNG state beyond this counter.
  params: the model parameters, float32.
  opt_state: the optimizer state (Adam moments, update count, and the
    gradient accumulator when `grad_accum_steps` > 1).
  """

  step: jax.Array
  params: Any
  opt_state: optax.OptState


def create_train_state(
  model: Transformer, optimizer: optax.GradientTransformation, seed: int
) -> TrainState:
  """Fresh parameters from `seed` (Flax initialisers) and the optimizer's initial state.

  `model` is a `Transformer` or a `cmlm.CMLMTransformer`: both are called as
  model(src [B, S], tokens [B, T]).
  """
  key = jax.random.fold_in(jax.random.key(seed), _INIT_STREAM)

  @jax.jit
  def init():
    tokens = jnp.ones((1, 1), jnp.int32)
    params = model.init(key, tokens, tokens)['params']
    return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params)
    )

  return init()


# --- the per-device step --------------------------------------------------------


def train_step(
  state: TrainState,
  batch: Batch,
  *,
  model: Transformer,
  optimizer: optax.GradientTransformation,
  train_config: TrainConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
  """One update on this device's rows of the global batch; call it mapped over AXIS.

  The loss is normalised by the number of target tokens in the *global* batch,
  so summing the devices' gradients (psum) gives exactly the gradient of the
  per-token mean over the whole batch, whatever the number of devices and
  however the tokens fall between them. (A pmean of per-device means would
  weight a device's tokens by 1 / its own count instead.) A cmlm model's loss
  (`cmlm_objective`) is normalised the same way by the global counts of masked
  tokens and of sentences.

  Dropout keys: seed -> fold in the step -> fold in the device index, so every
  step and device draws fresh masks and a resumed run draws the same ones.
  cmlm token masks: seed -> fold in the step -> fold in the row's index in the
  global batch, so a row is masked alike whichever device holds it. Scheduled
  sampling's choices (`scheduled_sampling`) come from the seed, step and row alike.

  Args:
    state: replicated TrainState.
    batch: this device's rows, `src [B, S]`, `tgt_in [B, T]`, `tgt_out [B, T]`.

  A step whose loss or gradient is not finite (an overflow, a corrupt batch)
  applies no update: the parameters and optimizer state stay as they were, so
  one bad batch cannot leave NaN in the weights or the Adam moments. Its
  `nonfinite` metric is 1, and the training loop decides whether to stop or to
  go on; `step` advances either way, so the next step reads the next batch.

  Returns:
    (the new state, replicated metrics): summed loss_sum, nll_sum, correct and
    tokens over the global batch, plus grad_norm (global, before clipping),
    learning_rate (the rate this step's update used) and nonfinite (1.0 when
    the update was withheld, else 0.0). A cmlm model's sums are over its masked
    positions ('tokens' counts them), with length_loss_sum, length_correct,
    sentences, and target_tokens (all non-PAD target positions, for throughput).
  """
  config = model.config
  scheduled_sampling.check_model(config, train_config)
  packing.check_settings(config, train_config)
  seed_key = jax.random.key(train_config.seed)
  dropout_key = jax.random.fold_in(seed_key, _DROPOUT_STREAM)
  dropout_key = jax.random.fold_in(
    jax.random.fold_in(dropout_key, state.step), lax.axis_index(AXIS)
  )
  if config.kind == 'cmlm':
    mask_key = jax.random.fold_in(jax.random.fold_in(seed_key, _MASK_STREAM), state.step)
    loss_fn = _cmlm_loss_fn(model, batch, mask_key, dropout_key, train_config)
  else:
    if train_config.scheduled_sampling != 'off':
      batch = _with_scheduled_sampling(model, state, batch, seed_key, train_config)
    loss_fn = _autoregressive_loss_fn(model, batch, dropout_key, train_config)

  # Per-device parameters, so that grad gives this device's gradient and the psum
  # below is the one reduction, under shard_map's replication checks and pmap alike.
  local_params = lax.pcast(state.params, AXIS, to='varying')
  grads, sums = jax.grad(loss_fn, has_aux=True)(local_params)
  grads = lax.psum(grads, AXIS)
  sums = lax.psum(sums, AXIS)
  grad_norm = optax.tree.norm(grads)
  # Global values (after the psums), so every device takes the same decision.
  finite = jnp.isfinite(sums['loss_sum']) & jnp.isfinite(grad_norm)

  def apply_update(params, opt_state):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = lax.cond(
    finite,
    apply_update,
    lambda params, opt_state: (params, opt_state),
    state.params,
    state.opt_state,
  )
  metrics = {
    **sums,
    'grad_norm': grad_norm,
    'learning_rate': make_schedule(train_config, config)(schedule_count(state.opt_state)),
    'nonfinite': 1.0 - finite.astype(jnp.float32),
  }
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def _autoregressive_loss_fn(
  model: Transformer, batch: Batch, dropout_key: jax.Array, train_config: TrainConfig
) -> Callable:
  """params -> (label-smoothed loss per target token of the global batch, this device's sums)."""
  config = model.config
  global_tokens = lax.psum(jnp.sum(batch.tgt_out != config.pad_id), AXIS)

  def loss_fn(params):
    def forward(method=None):  # the logits [B, T, V], or with `decoder_states` [B, T, D]
      return model.apply(
        {'params': params},
        batch.src,
        batch.tgt_in,
        train=True,
        rngs={'dropout': dropout_key},
        packing=batch.packing,
        **({} if method is None else {'method': method}),
      )

    smoothing, pad_id = train_config.label_smoothing, config.pad_id
    loss_chunk = resolve_loss_chunk(config, batch.tgt_out.size)
    if loss_chunk:
      # The projection, loss and gradient a chunk at a time (losses.fused_loss_sums).
      sums = fused_loss_sums(
        lambda p, h: model.apply({'params': p}, h, method=Transformer.logits),
        params,
        forward(Transformer.decoder_states),
        batch.tgt_out,
        smoothing,
        pad_id,
        loss_chunk,
      )
    elif config.remat == 'none':
      sums = loss_sums(forward(), batch.tgt_out, smoothing, pad_id)
    else:
      # Remat trades time for memory in the loss too: the logits a chunk at a time.
      sums = chunked_loss_sums(
        lambda h: model.apply({'params': params}, h, method=Transformer.logits),
        forward(Transformer.decoder_states),
        batch.tgt_out,
        smoothing,
        pad_id,
      )
    return sums['loss_sum'] / jnp.maximum(global_tokens, 1).astype(jnp.float32), sums

  return loss_fn


def _with_scheduled_sampling(
  model: Transformer,
  state: TrainState,
  batch: Batch,
  seed_key: jax.Array,
  train_config: TrainConfig,
) -> Batch:
  """`batch` whose tgt_in [B, T] is the scheduled-sampling mix of gold and first-pass tokens;
  tgt_out stays gold. Row keys: seed -> stream -> step -> the row's index in the global batch."""
  key = jax.random.fold_in(jax.random.fold_in(seed_key, _SCHEDULED_SAMPLING_STREAM), state.step)
  first_row = lax.axis_index(AXIS) * batch.src.shape[0]
  mixed = scheduled_sampling.scheduled_inputs(
    model,
    state.params,
    batch.src,
    batch.tgt_in,
    state.step,
    key,
    first_row,
    train_config,
    batch.packing,
  )
  return batch.replace(tgt_in=mixed)


def _cmlm_loss_fn(
  model, batch: Batch, mask_key: jax.Array, dropout_key: jax.Array, train_config: TrainConfig
) -> Callable:
  """params -> (`cmlm_objective` of this device's rows, this device's sums)."""
  config = model.config
  inputs = _cmlm_inputs(mask_key, batch, config, train_config.eos_fill_rate)
  global_tokens = lax.psum(jnp.sum(inputs.masked), AXIS)
  global_sentences = lax.psum(jnp.sum(inputs.tgt_lengths > 0), AXIS)
  target_tokens = jnp.sum(batch.tgt_out != config.pad_id).astype(jnp.float32)

  def loss_fn(params):
    token_logits, length_logits = model.apply(
      {'params': params},
      inputs.src,
      inputs.tokens,
      train=True,
      rngs={'dropout': dropout_key},
      packing=inputs.packing,
    )  # [B, T, V], [B(, Z), 2R + 1]
    sums = cmlm_objective.cmlm_loss_sums(
      token_logits, length_logits, inputs, config, train_config.label_smoothing
    )
    loss = cmlm_objective.cmlm_objective(
      sums, global_tokens, global_sentences, train_config.length_loss_weight
    )
    return loss, {**sums, 'target_tokens': target_tokens}

  return loss_fn


def _cmlm_inputs(key: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float):
  """`cmlm_objective.cmlm_inputs` row by row, row r drawing from `key` folded with r's index in the
  global batch (the device index * rows per device + r): the masks of a row do not depend
  on the number of devices, so 1, 2 or 4 devices train exactly alike. Call it mapped."""
  rows = batch.src.shape[0]
  first = lax.axis_index(AXIS) * rows
  keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(first + jnp.arange(rows))
  one_row = jax.tree.map(lambda x: x[:, None], batch)  # leaves [B, 1, ...]
  inputs = jax.vmap(lambda k, b: cmlm_objective.cmlm_inputs(k, b, config, eos_fill_rate))(
    keys, one_row
  )
  return jax.tree.map(lambda x: x[:, 0], inputs)


def eval_step(
  params, batch: Batch, *, model: Transformer, label_smoothing: float
) -> dict[str, jax.Array]:
  """Teacher-forced loss sums of this device's rows, summed over AXIS (no dropout).

  A cmlm model is scored on masks drawn from a fixed key (and no EOS-filled
  rows), so the validation loss is deterministic: the sums of `cmlm_loss_sums`.
  """
  config = model.config
  if config.kind == 'cmlm':
    key = jax.random.fold_in(jax.random.key(_EVAL_MASK_SEED), _MASK_STREAM)
    inputs = _cmlm_inputs(key, batch, config, eos_fill_rate=0.0)
    token_logits, length_logits = model.apply(
      {'params': params}, inputs.src, inputs.tokens, packing=inputs.packing
    )
    sums = cmlm_objective.cmlm_loss_sums(
      token_logits, length_logits, inputs, config, label_smoothing
    )
  else:
    logits = model.apply({'params': params}, batch.src, batch.tgt_in, packing=batch.packing)
    sums = loss_sums(logits, batch.tgt_out, label_smoothing, config.pad_id)
  return lax.psum(sums, AXIS)


def make_parallel_step(
  model: Transformer,
  optimizer: optax.GradientTransformation,
  train_config: TrainConfig,
  parallel: DataParallel,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """`train_step` jitted over `parallel`'s devices, donating the state's buffers.

  Takes the state from `parallel.replicate` (or a previous step) and a batch
  from `parallel.shard_batch`; returns the new state and replicated metrics.
  """
  step = functools.partial(train_step, model=model, optimizer=optimizer, train_config=train_config)
  return parallel.map(step, donate_first=True)


def compiled_training(model_config: ModelConfig, train_config: TrainConfig, parallel: DataParallel):
  """(model, optimizer, step): the model, the optimizer and the mapped training step exactly
  as train.py builds them for these settings; `flax_transformer.bench` times the same."""
  model = build_model(model_config)
  optimizer = make_optimizer(train_config, model_config)
  return model, optimizer, make_parallel_step(model, optimizer, train_config, parallel)


def make_parallel_eval(
  model: Transformer, train_config: TrainConfig, parallel: DataParallel
) -> Callable[[Any, Batch], dict[str, jax.Array]]:
  """`eval_step(params, batch)` over `parallel`'s devices; params as in the replicated state."""
  step = functools.partial(eval_step, model=model, label_smoothing=train_config.label_smoothing)
  return parallel.map(step)
