"""Loss, learning-rate schedule, optimizer and the data-parallel training step.

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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from flax_transformer import cmlm, packing, scheduled_sampling
from flax_transformer.batching import Batch, shard
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.losses import label_smoothed_cross_entropy, loss_sums, token_losses
from flax_transformer.model import Transformer

AXIS = 'data'  # the mapped device axis, in both shard_map and pmap

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


# --- the objective ------------------------------------------------------------
# token_losses, label_smoothed_cross_entropy and loss_sums live in `losses` (the CMLM
# objective in `nat` uses them too); they stay importable from here.

def token_metrics(sums: Mapping[str, float]) -> dict[str, float]:
  """Sums from any number of steps -> loss (label-smoothed, per token), ppl, accuracy.

  Perplexity is exp of the plain negative log-likelihood per token: smoothing is
  a training device, not part of the model's probability of the reference.
  For a cmlm model the tokens are the masked target positions.
  """
  tokens = max(float(sums['tokens']), 1.0)
  return {'loss': float(sums['loss_sum']) / tokens,
          'ppl': float(np.exp(min(float(sums['nll_sum']) / tokens, 100.0))),
          'accuracy': float(sums['correct']) / tokens}


def length_metrics(sums: Mapping[str, float]) -> dict[str, float]:
  """A cmlm model's sums -> length_loss (NLL of the true length class per sentence) and
  length_accuracy (the fraction of sentences whose length class is the classifier's argmax)."""
  sentences = max(float(sums['sentences']), 1.0)
  return {'length_loss': float(sums['length_loss_sum']) / sentences,
          'length_accuracy': float(sums['length_correct']) / sentences}


def cmlm_objective(sums: Mapping[str, jax.Array], global_tokens: jax.Array,
                   global_sentences: jax.Array, length_loss_weight: float) -> jax.Array:
  """The CMLM training loss of one device's sums, normalised by the global batch's counts:

    loss_sum / global masked tokens + length_loss_weight * length_loss_sum / global sentences

  Summed over devices it is the per-masked-token loss of the whole batch plus the
  weighted per-sentence length loss, whatever the number of devices.
  """
  tokens = jnp.maximum(global_tokens, 1).astype(jnp.float32)
  sentences = jnp.maximum(global_sentences, 1).astype(jnp.float32)
  return sums['loss_sum'] / tokens + length_loss_weight * sums['length_loss_sum'] / sentences


# --- schedule and optimizer ------------------------------------------------------

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
    return scale * d_model ** -0.5 * jnp.minimum(lax.rsqrt(n), n * warmup_steps ** -1.5)

  return schedule


def make_schedule(train_config: TrainConfig, model_config: ModelConfig) -> optax.Schedule:
  return transformer_schedule(model_config.d_model, train_config.warmup_steps,
                              train_config.lr_scale)


def make_optimizer(train_config: TrainConfig, model_config: ModelConfig
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
    transforms.append(optax.adamw(schedule, c.adam_b1, c.adam_b2, c.adam_eps,
                                  weight_decay=c.weight_decay,
                                  mask=lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)))
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
  (count,) = [value for path, value in optax.tree_utils.tree_get_all_with_path(opt_state, 'count')
              if path[-1].tuple_name == 'ScaleByScheduleState']
  return count


def create_train_state(model: Transformer, optimizer: optax.GradientTransformation, seed: int
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
    return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                      opt_state=optimizer.init(params))

  return init()


# --- the per-device step --------------------------------------------------------

def train_step(state: TrainState, batch: Batch, *, model: Transformer,
               optimizer: optax.GradientTransformation, train_config: TrainConfig
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
  dropout_key = jax.random.fold_in(jax.random.fold_in(dropout_key, state.step),
                                   lax.axis_index(AXIS))
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

  params, opt_state = lax.cond(finite, apply_update, lambda params, opt_state: (params, opt_state),
                               state.params, state.opt_state)
  metrics = {**sums, 'grad_norm': grad_norm,
             'learning_rate': make_schedule(train_config, config)(schedule_count(state.opt_state)),
             'nonfinite': 1.0 - finite.astype(jnp.float32)}
  new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state)
  return new_state, metrics


def _autoregressive_loss_fn(model: Transformer, batch: Batch, dropout_key: jax.Array,
                            train_config: TrainConfig) -> Callable:
  """params -> (label-smoothed loss per target token of the global batch, this device's sums)."""
  config = model.config
  global_tokens = lax.psum(jnp.sum(batch.tgt_out != config.pad_id), AXIS)

  def loss_fn(params):
    logits = model.apply({'params': params}, batch.src, batch.tgt_in, train=True,
                         rngs={'dropout': dropout_key}, packing=batch.packing)  # [B, T, V]
    sums = loss_sums(logits, batch.tgt_out, train_config.label_smoothing, config.pad_id)
    return sums['loss_sum'] / jnp.maximum(global_tokens, 1).astype(jnp.float32), sums

  return loss_fn


def _with_scheduled_sampling(model: Transformer, state: TrainState, batch: Batch,
                             seed_key: jax.Array, train_config: TrainConfig) -> Batch:
  """`batch` whose tgt_in [B, T] is the scheduled-sampling mix of gold and first-pass tokens;
  tgt_out stays gold. Row keys: seed -> stream -> step -> the row's index in the global batch."""
  key = jax.random.fold_in(jax.random.fold_in(seed_key, _SCHEDULED_SAMPLING_STREAM), state.step)
  first_row = lax.axis_index(AXIS) * batch.src.shape[0]
  mixed = scheduled_sampling.scheduled_inputs(model, state.params, batch.src, batch.tgt_in,
                                              state.step, key, first_row, train_config,
                                              batch.packing)
  return batch.replace(tgt_in=mixed)


def _cmlm_loss_fn(model, batch: Batch, mask_key: jax.Array, dropout_key: jax.Array,
                  train_config: TrainConfig) -> Callable:
  """params -> (`cmlm_objective` of this device's rows, this device's sums)."""
  config = model.config
  inputs = _cmlm_inputs(mask_key, batch, config, train_config.eos_fill_rate)
  global_tokens = lax.psum(jnp.sum(inputs.masked), AXIS)
  global_sentences = lax.psum(jnp.sum(inputs.tgt_lengths > 0), AXIS)
  target_tokens = jnp.sum(batch.tgt_out != config.pad_id).astype(jnp.float32)

  def loss_fn(params):
    token_logits, length_logits = model.apply(
        {'params': params}, inputs.src, inputs.tokens, train=True,
        rngs={'dropout': dropout_key}, packing=inputs.packing)      # [B, T, V], [B(, Z), 2R + 1]
    sums = cmlm.cmlm_loss_sums(token_logits, length_logits, inputs, config,
                               train_config.label_smoothing)
    loss = cmlm_objective(sums, global_tokens, global_sentences, train_config.length_loss_weight)
    return loss, {**sums, 'target_tokens': target_tokens}

  return loss_fn


def _cmlm_inputs(key: jax.Array, batch: Batch, config: ModelConfig, eos_fill_rate: float):
  """`cmlm.cmlm_inputs` row by row, row r drawing from `key` folded with r's index in the
  global batch (the device index * rows per device + r): the masks of a row do not depend
  on the number of devices, so 1, 2 or 4 devices train exactly alike. Call it mapped."""
  rows = batch.src.shape[0]
  first = lax.axis_index(AXIS) * rows
  keys = jax.vmap(lambda row: jax.random.fold_in(key, row))(first + jnp.arange(rows))
  one_row = jax.tree.map(lambda x: x[:, None], batch)                   # leaves [B, 1, ...]
  inputs = jax.vmap(lambda k, b: cmlm.cmlm_inputs(k, b, config, eos_fill_rate))(keys, one_row)
  return jax.tree.map(lambda x: x[:, 0], inputs)


def eval_step(params, batch: Batch, *, model: Transformer, label_smoothing: float
              ) -> dict[str, jax.Array]:
  """Teacher-forced loss sums of this device's rows, summed over AXIS (no dropout).

  A cmlm model is scored on masks drawn from a fixed key (and no EOS-filled
  rows), so the validation loss is deterministic: the sums of `cmlm_loss_sums`.
  """
  config = model.config
  if config.kind == 'cmlm':
    key = jax.random.fold_in(jax.random.key(_EVAL_MASK_SEED), _MASK_STREAM)
    inputs = _cmlm_inputs(key, batch, config, eos_fill_rate=0.0)
    token_logits, length_logits = model.apply({'params': params}, inputs.src, inputs.tokens,
                                              packing=inputs.packing)
    sums = cmlm.cmlm_loss_sums(token_logits, length_logits, inputs, config, label_smoothing)
  else:
    logits = model.apply({'params': params}, batch.src, batch.tgt_in, packing=batch.packing)
    sums = loss_sums(logits, batch.tgt_out, label_smoothing, config.pad_id)
  return lax.psum(sums, AXIS)


# --- mapping over devices -------------------------------------------------------

class DataParallel:
  """Places state and batches on devices and maps per-device functions over them.

  'shard_map': state leaves are global arrays replicated over a `('data',)`
    mesh (`P()`); batch rows are split over it (`P('data')`).
  'pmap': state leaves carry a leading axis over this process's devices
    `[D_local, ...]`; this process's rows of a batch are reshaped to
    `[G_local, B / G, ...]`. The pmap spans the devices of every process.

  Multi-host: every process builds the same global batch (step-indexed, from
  the same seed), keeps its contiguous block of rows (`batching.shard`), and
  `jax.make_array_from_process_local_data` assembles the global array; the
  collectives in the step span all processes' devices.
  """

  def __init__(self, devices: Sequence[jax.Device] | None = None,
               mode: Literal['shard_map', 'pmap'] = 'shard_map'):
    if mode not in ('shard_map', 'pmap'):
      raise ValueError(f"parallel mode must be 'shard_map' or 'pmap', got {mode!r}")
    if devices is None:
      devices = jax.devices()
    elif jax.process_count() > 1 and len(devices) != jax.device_count():
      raise ValueError('with several processes, training uses every device of every process; '
                       f'got {len(devices)} of {jax.device_count()}')
    self.mode = mode
    self.devices = tuple(devices)
    self.local_devices = tuple(d for d in self.devices if d.process_index == jax.process_index())
    self.mesh = Mesh(np.array(self.devices), (AXIS,))

  @property
  def num_devices(self) -> int:
    return len(self.devices)

  def map(self, fn: Callable, donate_first: bool = False) -> Callable:
    """`fn(replicated, batch) -> replicated outputs` -> the jitted function over all devices."""
    if self.mode == 'pmap':
      # Every device of every process, the same list on each: pmap given only this
      # process's devices would run its collectives over those alone, and each
      # process would then train its own model on its share of the batch.
      return jax.pmap(fn, axis_name=AXIS, devices=self.devices,
                      donate_argnums=(0,) if donate_first else ())
    replicated, split = PartitionSpec(), PartitionSpec(AXIS)
    return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=(replicated, split),
                                 out_specs=replicated),
                   donate_argnums=(0,) if donate_first else ())

  def replicate(self, tree):
    """A host or single-device pytree -> the layout `map`ped functions take."""
    if self.mode == 'pmap':
      count = len(self.local_devices)
      stacked = jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (count, *np.shape(x))), tree)
      # Through an identity pmap, so the state has exactly the layout pmap outputs:
      # the step then compiles once, not once for host input and again for its own output.
      return jax.pmap(lambda x: x, axis_name=AXIS, devices=self.devices)(stacked)
    sharding = NamedSharding(self.mesh, PartitionSpec())
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)),
                        tree)

  def unreplicate(self, tree):
    """Replicated outputs of a `map`ped function -> one host copy (numpy)."""
    def first(x):
      local = np.asarray(x.addressable_data(0))
      return local.reshape(local.shape[1:]) if self.mode == 'pmap' else local
    return jax.tree.map(first, tree)

  def shard_batch(self, batch: Batch) -> Batch:
    """The global batch (identical on every process) -> its rows split over all devices."""
    rows = batch.src.shape[0]
    if rows % self.num_devices:
      raise ValueError(f'a batch of {rows} rows does not split over {self.num_devices} devices; '
                       'build the Batcher with row_multiple = the number of devices')
    local = shard(batch, jax.process_index(), jax.process_count())
    if self.mode == 'pmap':
      count = len(self.local_devices)
      return jax.tree.map(lambda x: np.asarray(x).reshape(count, -1, *x.shape[1:]), local)
    sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
    return jax.tree.map(
        lambda g, x: jax.make_array_from_process_local_data(sharding, np.asarray(x), g.shape),
        batch, local)


def make_parallel_step(model: Transformer, optimizer: optax.GradientTransformation,
                       train_config: TrainConfig, parallel: DataParallel
                       ) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
  """`train_step` jitted over `parallel`'s devices, donating the state's buffers.

  Takes the state from `parallel.replicate` (or a previous step) and a batch
  from `parallel.shard_batch`; returns the new state and replicated metrics.
  """
  step = functools.partial(train_step, model=model, optimizer=optimizer, train_config=train_config)
  return parallel.map(step, donate_first=True)


def make_parallel_eval(model: Transformer, train_config: TrainConfig, parallel: DataParallel
                       ) -> Callable[[Any, Batch], dict[str, jax.Array]]:
  """`eval_step(params, batch)` over `parallel`'s devices; params as in the replicated state."""
  step = functools.partial(eval_step, model=model, label_smoothing=train_config.label_smoothing)
  return parallel.map(step)
