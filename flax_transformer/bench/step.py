"""The training step train.py compiles, timed on a batch of a chosen shape.

    report = step_report(ModelConfig.base(), TrainConfig(), BatchShape(64, 32, 32))
    print(report.table())            # compile, step time, tokens/s, FLOPs, MFU, memory
    report.to_dict()

    step = TrainingStep(model_config, train_config, shape)   # compiled once
    step.run()                                               # one update, blocking

The step is `train.step.compiled_training`, the function train.py's loop calls, mapped over
the same devices (shard_map or pmap), with the same dtype, remat, attention kernel and
packing; only the batch is synthetic: full-length rows of random ordinary tokens, or with
`train.packing` rows of `pair_len`-token pairs with their segment ids and positions, as the
packing batcher builds them. Its shape is rows x source x target positions; train.py's
batches are `BatchShape.for_tokens(max_tokens, length)` for each length bucket.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flax_transformer.bench.breakdown import Breakdown, breakdown
from flax_transformer.bench.compiled import (
  Compilation,
  CompiledMemory,
  compile_programs,
  format_bytes,
  memory_of,
)
from flax_transformer.bench.flops import BatchShape, train_flops, xla_flops
from flax_transformer.bench.matmul_bound import MatmulBound, matmul_bound
from flax_transformer.bench.peaks import PeakReport, datasheet_peak
from flax_transformer.bench.timing import Timing, time_rounds
from flax_transformer.config import ConfigError, ModelConfig, TrainConfig
from flax_transformer.data.batching import Batch
from flax_transformer.nn.backend import compute_dtype, resolve_attention_kernel, resolve_loss_chunk
from flax_transformer.nn.build import abstract_params
from flax_transformer.nn.model import count_params
from flax_transformer.run.sizes import check_fits, physical_memory
from flax_transformer.train.parallel import DataParallel
from flax_transformer.train.step import compiled_training, create_train_state

PAIR_LEN = 16  # tokens per side of a packed pair: about a Multi30k sentence's


def synthetic_batch(
  config: ModelConfig, shape: BatchShape, packing: int = 0, pair_len: int = PAIR_LEN, seed: int = 0
) -> Batch:
  """A batch of `shape` of random ordinary ids, EOS-terminated (NumPy int32).

  packing 0: one pair per row, every position a token (`src [B, S]`, `tgt_in`/`tgt_out
  [B, T]`, example_ids `[B]`). packing > 0: each row of L = src_len = tgt_len positions holds
  L // pair_len pairs of pair_len tokens a side, PAD after them, with segment ids 1..k and
  positions restarting in every pair (example_ids `[B, L]`, -1 past a row's last pair).
  """
  rng = np.random.default_rng(seed)
  first = config.unk_id + 1  # ordinary tokens only
  B, S, T = shape.batch, shape.src_len, shape.tgt_len

  def tokens(length):  # [B, length]
    ids = rng.integers(first, config.vocab_size, (B, length)).astype(np.int32)
    ids[:, -1] = config.eos_id
    return ids

  if not packing:
    src, tgt_out = tokens(S), tokens(T)
    tgt_in = np.concatenate([np.full((B, 1), config.bos_id, np.int32), tgt_out[:, :-1]], 1)
    return Batch(
      src=src,
      tgt_in=tgt_in,
      tgt_out=tgt_out,
      example_ids=np.arange(B, dtype=np.int32),
      pad_id=config.pad_id,
    )
  if S != T:
    raise ValueError(f'a packed batch has rows of one length on both sides; got {shape}')
  if not 1 <= pair_len <= S:
    raise ValueError(f'pair_len must be between 1 and the row length {S}, got {pair_len}')
  pairs = S // pair_len
  used = pairs * pair_len
  position = np.tile(np.arange(pair_len, dtype=np.int32), pairs)  # [used]
  segment = np.repeat(np.arange(1, pairs + 1, dtype=np.int32), pair_len)  # [used]
  arrays = {
    name: np.full((B, S), config.pad_id if name in ('src', 'tgt_in', 'tgt_out') else 0, np.int32)
    for name in (
      'src',
      'tgt_in',
      'tgt_out',
      'src_segments',
      'tgt_segments',
      'src_positions',
      'tgt_positions',
    )
  }
  for side in ('src', 'tgt_out'):
    ids = rng.integers(first, config.vocab_size, (B, used)).astype(np.int32)
    ids[:, position == pair_len - 1] = config.eos_id
    arrays[side][:, :used] = ids
  shifted = np.roll(arrays['tgt_out'][:, :used], 1, axis=1)
  arrays['tgt_in'][:, :used] = np.where(position == 0, config.bos_id, shifted)
  for side in ('src', 'tgt'):
    arrays[f'{side}_segments'][:, :used] = segment
    arrays[f'{side}_positions'][:, :used] = position
  example_ids = np.full((B, S), -1, np.int32)
  example_ids[:, :pairs] = np.arange(B * pairs, dtype=np.int32).reshape(B, pairs)
  return Batch(example_ids=example_ids, pad_id=config.pad_id, **arrays)


def describe_model(config: ModelConfig) -> str:
  """'d512 6+6 layers, 8 heads, ff 2048, vocab 37000' and the model kind if not the paper's."""
  kind = '' if config.kind == 'autoregressive' else f' {config.kind}'
  return (
    f'd{config.d_model} {config.num_encoder_layers}+{config.num_decoder_layers} layers, '
    f'{config.num_heads} heads, ff {config.d_ff}, vocab {config.vocab_size}{kind}'
  )


# The operations a report's JSON keeps from a breakdown (the table prints --breakdown's N).
BREAKDOWN_KEPT = 50


@dataclasses.dataclass(frozen=True)
class StepReport:
  """One training step's cost. FLOPs are per step over all devices; memory is per device.

  tokens_per_s: real (non-PAD) target tokens per second at the median step time.
  flops_per_s, mfu: the hand count (`flops.train_flops`: the model's matmuls) over the median
    time, and that against a peak: the measured one (`peak_flops_per_s`) and the datasheet's.
  xla_flops: what XLA counts in the compiled step (remat's recomputation and the elementwise
    work included), None where the backend gives no count.
  """

  model: str
  parameters: int
  shape: BatchShape
  packing: int
  dtype: str
  attention_kernel: str
  remat: str
  device: str
  devices: int
  parallel: str
  real_tokens: int
  compilation: Compilation
  timing: Timing
  analytic_flops: int
  xla_flops: float | None
  memory: CompiledMemory | None
  peak_flops_per_s: float | None = None
  datasheet_flops_per_s: float | None = None
  loss_chunk: int = 0  # model.loss_chunk resolved: the loss fused over chunks of this many tokens
  time_budget: str | None = None  # train.time_budget, for `budget_steps`
  matmul_bound: MatmulBound | None = None  # the products alone (`--matmul-bound`)
  breakdown: Breakdown | None = None  # the operations by time, profiled (`--breakdown`)

  @property
  def bound_ratio(self) -> float | None:
    """The median step as a multiple of its matmul bound; None without one."""
    return None if self.matmul_bound is None else self.timing.median_s / self.matmul_bound.seconds

  @property
  def budget_steps(self) -> int | None:
    """The steps of this one that train.time_budget holds, training alone: one compile and
    the rest at the median step (train.py also times a validation and a decoding, and so
    fixes fewer). None without a budget."""
    if self.time_budget is None:
      return None
    budget_s = TrainConfig(time_budget=self.time_budget).time_budget_s
    return max(0, int((budget_s - self.compilation.seconds) // self.timing.median_s))

  @property
  def tokens_per_s(self) -> float:
    return self.real_tokens / self.timing.median_s

  @property
  def flops_per_s(self) -> float:
    return self.analytic_flops / self.timing.median_s

  @property
  def mfu(self) -> float | None:
    """Model FLOP/s over the measured peak of all the devices."""
    return (
      self.flops_per_s / (self.peak_flops_per_s * self.devices) if self.peak_flops_per_s else None
    )

  @property
  def datasheet_mfu(self) -> float | None:
    return (
      self.flops_per_s / (self.datasheet_flops_per_s * self.devices)
      if self.datasheet_flops_per_s
      else None
    )

  def with_peak(self, peak: PeakReport | float | None) -> StepReport:
    """This report against `peak`: a PeakReport (its measured FLOP/s) or FLOP/s."""
    value = peak.flops_per_s if isinstance(peak, PeakReport) else peak
    return dataclasses.replace(self, peak_flops_per_s=value)

  def to_dict(self) -> dict:
    return {
      'kind': 'step',
      'model': self.model,
      'parameters': self.parameters,
      'shape': str(self.shape),
      'rows': self.shape.batch,
      'src_len': self.shape.src_len,
      'tgt_len': self.shape.tgt_len,
      'packing': self.packing,
      'dtype': self.dtype,
      'attention_kernel': self.attention_kernel,
      'remat': self.remat,
      'loss_chunk': self.loss_chunk,
      'device': self.device,
      'devices': self.devices,
      'parallel': self.parallel,
      'real_tokens': self.real_tokens,
      'compilation': self.compilation.to_dict(),
      'timing': self.timing.to_dict(),
      'tokens_per_s': self.tokens_per_s,
      'analytic_flops': self.analytic_flops,
      'xla_flops': self.xla_flops,
      'flops_per_s': self.flops_per_s,
      'peak_flops_per_s': self.peak_flops_per_s,
      'mfu': self.mfu,
      'datasheet_flops_per_s': self.datasheet_flops_per_s,
      'datasheet_mfu': self.datasheet_mfu,
      'memory': self.memory and self.memory.to_dict(),
      'time_budget': self.time_budget,
      'budget_steps': self.budget_steps,
      'matmul_bound': self.matmul_bound and self.matmul_bound.to_dict(),
      'bound_ratio': self.bound_ratio,
      'breakdown': self.breakdown and self.breakdown.to_dict(top=BREAKDOWN_KEPT),
    }

  def table(self) -> str:
    t, m = self.timing, self.memory
    percent = lambda x: 'n/a' if x is None else f'{100 * x:.1f}%'
    xla = 'n/a' if self.xla_flops is None else f'{self.xla_flops / 1e9:,.2f} GFLOP'
    rows = [
      ('model', f'{self.model} ({self.parameters:,} parameters)'),
      (
        'computes',
        f'{self.dtype}, {self.attention_kernel} attention, remat {self.remat}'
        + (f', loss fused over {self.loss_chunk} tokens' if self.loss_chunk else '')
        + (f', packed rows of {self.packing}' if self.packing else ''),
      ),
      ('devices', f'{self.devices} x {self.device} via {self.parallel}'),
      ('batch', f'{self.shape} ({self.real_tokens:,} real target tokens)'),
      ('compile', f'{self.compilation.seconds:.2f} s (cache: {self.compilation.cache})'),
      (
        'step',
        f'{t.median_s * 1e3:.2f} ms median, p10 {t.p10_s * 1e3:.2f}, p90 '
        f'{t.p90_s * 1e3:.2f} ({len(t.times_s)} rounds)',
      ),
      ('tokens/s', f'{self.tokens_per_s:,.0f}'),
      ('FLOPs', f'{self.analytic_flops / 1e9:,.2f} GFLOP by hand, {xla} by XLA'),
      ('FLOP/s', f'{self.flops_per_s / 1e12:.3f} TFLOP/s'),
      (
        'MFU',
        f'{percent(self.mfu)} of the measured peak'
        + (f' ({self.peak_flops_per_s / 1e12:.3f} TFLOP/s)' if self.peak_flops_per_s else '')
        + f", {percent(self.datasheet_mfu)} of the datasheet's",
      ),
      (
        'memory',
        'n/a'
        if m is None
        else f'{format_bytes(m.total)} per device: temporaries {format_bytes(m.temporaries)}, '
        f'arguments {format_bytes(m.arguments)}, outputs {format_bytes(m.outputs)} '
        f'({format_bytes(m.aliased)} aliased)',
      ),
    ]
    if self.matmul_bound is not None:
      bound = self.matmul_bound
      rows.append(
        (
          'matmuls',
          f'{bound.seconds * 1e3:.2f} ms alone ({len(bound.products)} distinct products, '
          f'{bound.flops / 1e9:,.2f} GFLOP): the step is {self.bound_ratio:.2f}x its matmul bound',
        )
      )
    if self.time_budget is not None:
      rows.append(
        (
          'budget',
          f'{self.time_budget}: at most {self.budget_steps:,} of these steps (train.py '
          'also times a validation and a decoding, and fixes the steps that fit them too)',
        )
      )
    return '\n'.join(f'{name:>9s}  {value}' for name, value in rows)


def check_step(
  model_config: ModelConfig,
  train_config: TrainConfig,
  shape: BatchShape | None,
  devices: int | None = None,
) -> tuple[BatchShape, int]:
  """(the batch shape, the device count) a TrainingStep of these settings would use; raises
  ValueError (or ConfigError, for an attention kernel that cannot run here) naming the
  problem, before anything is compiled."""
  local = jax.local_devices()
  count = len(local) if devices is None else devices
  if not 1 <= count <= len(local):
    raise ValueError(f'devices must be between 1 and the {len(local)} here, got {devices}')
  if shape is None:
    shape = BatchShape.for_tokens(
      train_config.max_tokens, train_config.packing or min(model_config.max_len, 64), count
    )
  if shape.batch % count:
    raise ValueError(f'a batch of {shape.batch} rows does not split over {count} devices')
  if max(shape.src_len, shape.tgt_len) > model_config.max_len:
    raise ValueError(f'batch {shape} is longer than model.max_len={model_config.max_len}')
  if train_config.packing and shape.src_len != train_config.packing:
    raise ValueError(
      f'train.packing={train_config.packing} packs rows of that length; '
      f'the batch {shape} has rows of {shape.src_len}'
    )
  resolve_attention_kernel(model_config)
  # What the run itself would refuse (a lower bound: params, gradients, Adam, activations).
  tokens = shape.batch * max(shape.src_len, shape.tgt_len) // count
  check_fits(model_config, tokens, memory=physical_memory())
  return shape, count


def check_compiled_fits(compiled, device, shape: BatchShape) -> None:
  """Raises ConfigError, before the step runs, when its compiled program needs more memory per
  device than the device has (a CPU: the machine's physical memory): running it would end in
  an out-of-memory error deep inside XLA, or the machine swapping."""
  memory = memory_of([compiled])
  if device.platform == 'cpu':
    available = physical_memory()
  else:
    available = (device.memory_stats() or {}).get('bytes_limit')
  if memory is None or available is None or memory.total <= available:
    return
  raise ConfigError(
    f'the step of batch {shape} needs {format_bytes(memory.total)} per device (compiled: '
    f'temporaries {format_bytes(memory.temporaries)}), more than the '
    f'{format_bytes(available)} of {device.platform} memory here: a smaller batch (--shape, '
    '--train.max_tokens), or --model.remat layer'
  )


class TrainingStep:
  """train.py's step for these settings on one synthetic batch, compiled (once) at creation.

  `run()` is one update (the state's buffers donated, as in training) that blocks until
  done and returns the step's metrics; `report(timing)` is the StepReport of timed `run()` calls.
  """

  def __init__(
    self,
    model_config: ModelConfig,
    train_config: TrainConfig | None = None,
    shape: BatchShape | None = None,
    *,
    devices: int | None = None,
    parallel: str = 'shard_map',
    pair_len: int = PAIR_LEN,
  ):
    train_config = train_config or TrainConfig()
    shape, count = check_step(model_config, train_config, shape, devices)
    kernel = resolve_attention_kernel(model_config)
    self.model_config, self.train_config, self.shape = model_config, train_config, shape
    self.parallel = DataParallel(jax.local_devices()[:count], mode=parallel)
    model, optimizer, step = compiled_training(model_config, train_config, self.parallel)
    host_batch = synthetic_batch(model_config, shape, train_config.packing, pair_len)
    batch = self.parallel.shard_batch(host_batch)
    state = self.parallel.replicate(create_train_state(model, optimizer, train_config.seed))
    self.lowered = None

    def lower():
      self.lowered = step.lower(state, batch)
      return [self.lowered]

    (compiled,), self.compilation = compile_programs(lower)
    check_compiled_fits(compiled, self.parallel.devices[0], shape)
    # What `matmul_bound` traces: the step and its arguments' shapes (the state is donated).
    self._step_fn = step
    self._abstract_args = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), (state, batch)
    )
    self.compiled = compiled
    self._state, self._batch = state, batch
    self.real_tokens = int(host_batch.num_tokens)
    self.kernel = kernel

  def run(self) -> dict[str, jax.Array]:
    """One update; blocks until it is done and returns its metrics (the step's sums)."""
    self._state, metrics = self.compiled(self._state, self._batch)
    return jax.block_until_ready((self._state, metrics))[1]

  def matmul_bound(self, rounds: int = 5) -> MatmulBound:
    """The step's matrix products, each compiled and timed alone (`bench.matmul_bound`)."""
    return matmul_bound(self._step_fn, *self._abstract_args, rounds=rounds)

  def breakdown(self, steps: int = 3) -> Breakdown:
    """The step's operations by time over `steps` profiled updates (`bench.breakdown`)."""
    return breakdown(self.compiled, self.run, steps)

  def report(
    self,
    timing: Timing,
    peak: PeakReport | float | None = None,
    bound: MatmulBound | None = None,
    profile: Breakdown | None = None,
  ) -> StepReport:
    device = self.parallel.devices[0]
    kind = getattr(device, 'device_kind', device.platform)
    per_device = xla_flops(self.compiled)
    config = self.model_config
    return StepReport(
      model=describe_model(config),
      parameters=count_params(abstract_params(config)),
      shape=self.shape,
      packing=self.train_config.packing,
      dtype=compute_dtype(config).name,
      attention_kernel=self.kernel,
      remat=config.remat,
      device=kind,
      devices=self.parallel.num_devices,
      parallel=self.parallel.mode,
      real_tokens=self.real_tokens,
      compilation=self.compilation,
      timing=timing,
      analytic_flops=train_flops(config, self.shape),
      xla_flops=None if per_device is None else per_device * self.parallel.num_devices,
      memory=memory_of([self.compiled]),
      datasheet_flops_per_s=datasheet_peak(kind, compute_dtype(config).name),
      time_budget=self.train_config.time_budget,
      loss_chunk=resolve_loss_chunk(
        config, self.shape.batch * self.shape.tgt_len // self.parallel.num_devices
      ),
      matmul_bound=bound,
      breakdown=profile,
    ).with_peak(peak)


def step_report(
  model_config: ModelConfig,
  train_config: TrainConfig | None = None,
  shape: BatchShape | None = None,
  *,
  rounds: int = 10,
  warmup: int = 2,
  peak: PeakReport | float | None = None,
  devices: int | None = None,
  parallel: str = 'shard_map',
  pair_len: int = PAIR_LEN,
) -> StepReport:
  """Compiles train.py's step for these settings and times `rounds` updates after `warmup`.

  shape: rows x source x target positions; None: train.max_tokens at length 64 (or
  train.packing), as train.py would batch it. peak: a PeakReport (`measure_peak`) or FLOP/s
  for the MFU column. Raises ValueError (or ConfigError) before compiling for a shape or
  device count that cannot run.
  """
  step = TrainingStep(
    model_config, train_config, shape, devices=devices, parallel=parallel, pair_len=pair_len
  )
  return step.report(time_rounds(step.run, rounds, warmup), peak)
