"""The matmul peak an MFU is measured against: timed on this backend, or from a datasheet.

    peak = measure_peak('bfloat16', size=4096)    # PeakReport: FLOP/s of [n, n] @ [n, n] here
    datasheet_peak('NVIDIA H100 80GB HBM3', 'bfloat16')   # 989.4e12 (dense, no sparsity)

A measured peak is what this machine's matmuls reach at a large square shape, the honest
denominator on a CPU, whose datasheet number no library reaches; a datasheet peak is the
number MFU is usually quoted against on an accelerator. Reports show both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_transformer.bench.timing import Timing, time_rounds

# Dense matmul FLOP/s of known accelerators, by a substring of jax's `device_kind` (first
# match wins: 'TPU v5 lite' before 'TPU v5'). float32 is what XLA's default precision runs a
# float32 dot at: TF32 tensor cores on NVIDIA since Ampere, bfloat16 passes on a TPU (no entry).
DATASHEET_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
  ('H200', {'bfloat16': 989.4e12, 'float16': 989.4e12, 'float32': 494.7e12}),
  ('H100', {'bfloat16': 989.4e12, 'float16': 989.4e12, 'float32': 494.7e12}),
  ('A100', {'bfloat16': 312e12, 'float16': 312e12, 'float32': 156e12}),
  ('L40S', {'bfloat16': 362.05e12, 'float16': 362.05e12, 'float32': 183.2e12}),
  ('L4', {'bfloat16': 121e12, 'float16': 121e12, 'float32': 60e12}),
  ('V100', {'float16': 125e12, 'float32': 15.7e12}),
  ('TPU v6 lite', {'bfloat16': 918e12}),
  ('TPU v5 lite', {'bfloat16': 197e12}),
  ('TPU v5p', {'bfloat16': 459e12}),
  ('TPU v5', {'bfloat16': 459e12}),
  ('TPU v4', {'bfloat16': 275e12}),
)


def datasheet_peak(device_kind: str, dtype: str) -> float | None:
  """The datasheet's dense FLOP/s of `device_kind` (jax's name for it) in `dtype`; None for an
  unknown device (every CPU) or a dtype its sheet gives no number for."""
  for name, peaks in DATASHEET_PEAKS:
    if name in device_kind:
      return peaks.get(dtype)
  return None


@dataclasses.dataclass(frozen=True)
class PeakReport:
  """FLOP/s of `iterations` [size, size] @ [size, size] products in one jitted loop."""

  device: str
  dtype: str
  size: int
  iterations: int
  timing: Timing
  datasheet_flops_per_s: float | None

  @property
  def flops(self) -> int:
    """FLOPs of one timed call: 2 n^3 per product."""
    return 2 * self.size**3 * self.iterations

  @property
  def flops_per_s(self) -> float:
    return self.flops / self.timing.median_s

  def to_dict(self) -> dict:
    return {
      'kind': 'peak',
      'device': self.device,
      'dtype': self.dtype,
      'size': self.size,
      'iterations': self.iterations,
      'flops': self.flops,
      'flops_per_s': self.flops_per_s,
      'datasheet_flops_per_s': self.datasheet_flops_per_s,
      'timing': self.timing.to_dict(),
    }

  def table(self) -> str:
    sheet = (
      f'{self.datasheet_flops_per_s / 1e12:.1f} TFLOP/s'
      if self.datasheet_flops_per_s
      else 'none known'
    )
    return (
      f'matmul peak on {self.device}, {self.dtype} [{self.size}, {self.size}]^2 x '
      f'{self.iterations}\n'
      f'  measured   {self.flops_per_s / 1e12:10.3f} TFLOP/s  (median of '
      f'{len(self.timing.times_s)}, p10-p90 {self.flops / self.timing.p90_s / 1e12:.3f}-'
      f'{self.flops / self.timing.p10_s / 1e12:.3f})\n'
      f'  datasheet  {sheet}'
    )


def matmul_loop(size: int, dtype: str, iterations: int, device: jax.Device | None = None):
  """`run()`: `iterations` products [size, size] @ [size, size] in one jitted loop, float32
  accumulation, blocking until done.

  Each iteration's left operand is shifted by the loop index (a 1/n share of the dot's
  work), so XLA can neither hoist the dot out of the loop nor share it; the products are
  summed so that none is dead.
  """
  device = device or jax.devices()[0]
  x = jax.device_put(jax.random.normal(jax.random.key(0), (size, size)).astype(dtype), device)
  w = jax.device_put(jax.random.normal(jax.random.key(1), (size, size)).astype(dtype), device)

  @jax.jit
  def loop(x, w):
    def body(i, total):
      shifted = x + (i * 1e-3).astype(x.dtype)  # [n, n]
      return total + jnp.dot(shifted, w, preferred_element_type=jnp.float32)  # [n, n]

    return jax.lax.fori_loop(0, iterations, body, jnp.zeros((size, size), jnp.float32))

  return lambda: loop(x, w).block_until_ready()


def measure_peak(
  dtype: str = 'float32',
  size: int | None = None,
  iterations: int = 8,
  rounds: int = 5,
  warmup: int = 1,
  device: jax.Device | None = None,
) -> PeakReport:
  """The matmul FLOP/s of `device` (default jax's first) in `dtype`: median of `rounds`.

  size: the square's side; default 1,024 on a CPU (seconds) and 8,192 on an accelerator
  (large enough to fill one).
  """
  device = device or jax.devices()[0]
  if size is None:
    size = 1024 if device.platform == 'cpu' else 8192
  if size < 1 or iterations < 1:
    raise ValueError(f'size and iterations must be positive, got {size}, {iterations}')
  jnp.dtype(dtype)  # an unknown dtype raises TypeError here, naming it
  kind = getattr(device, 'device_kind', device.platform)
  timing = time_rounds(matmul_loop(size, dtype, iterations, device), rounds, warmup)
  return PeakReport(
    device=kind,
    dtype=dtype,
    size=size,
    iterations=iterations,
    timing=timing,
    datasheet_flops_per_s=datasheet_peak(kind, dtype),
  )
