"""Where a measurement was made: the machine, its load, the versions and the accelerator.

    environment()                  # {'date', 'cpu', 'cpu_details', 'cores_available', 'python',
                                   #  'versions', 'xla_flags', 'load_average', 'accelerator'}
    environment(packages=('jax', 'torch'), accelerator=False)   # no JAX backend started

A number without this is hard to compare with another: `flax-transformer-bench --json` files
carry it beside their reports, and benchmarks/ writes it into every result file.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform

# The instructions that decide CPU matmul speed, float32 (avx2/fma, avx512f) against
# bfloat16 (avx512_bf16, amx_bf16): on a Zen 2 without the bfloat16 ones, bfloat16 matmuls
# ran at 0.68x the float32 rate (benchmarks/README.md, bfloat16 on a CPU without them).
MATMUL_FLAGS = ('avx2', 'fma', 'avx512f', 'avx512_bf16', 'amx_tile', 'amx_bf16')
# Whose versions a report names by default (an absent package is left out, never imported).
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'numpy')


def first_processor(cpuinfo: str) -> dict[str, str]:
  """The fields of the first processor of a /proc/cpuinfo text ('model name', 'flags', ...)."""
  fields = {}
  for line in cpuinfo.split('\n\n')[0].splitlines():
    key, _, value = line.partition(':')
    fields.setdefault(key.strip(), value.strip())
  return fields


def cpu_description(cpuinfo: str) -> dict:
  """The first processor of a /proc/cpuinfo text: its name, family and model numbers, and
  which of MATMUL_FLAGS it has (x86; on other CPUs, whichever fields are there)."""
  fields = first_processor(cpuinfo)
  flags = set(fields.get('flags', '').split())
  description = {
    'name': fields.get('model name', ''),
    'family': fields.get('cpu family', ''),
    'model': fields.get('model', ''),
    'matmul_flags': [flag for flag in MATMUL_FLAGS if flag in flags],
  }
  return {key: value for key, value in description.items() if value != ''}


def device_info() -> dict:
  """JAX's default backend and its first device, e.g. {'platform': 'gpu', 'device': 'NVIDIA H100'}."""
  import jax

  device = jax.devices()[0]
  return {
    'platform': device.platform,
    'device': getattr(device, 'device_kind', str(device)),
    'device_count': jax.device_count(),
  }


def environment(packages: tuple[str, ...] = PACKAGES, accelerator: bool = True) -> dict:
  """Date, CPU (name and matmul flags, from /proc/cpuinfo where there is one), the cores this
  process may use, Python and `packages`' installed versions, XLA_FLAGS, the load average,
  and (`accelerator=True`, which starts JAX's backend) the default device."""
  cpu, cpu_details = platform.processor() or platform.machine(), {}
  try:
    with open('/proc/cpuinfo') as f:
      cpu_details = cpu_description(f.read())
    cpu = cpu_details.get('name', cpu)
  except OSError:
    pass
  versions = {}
  for package in packages:
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  cores = os.sched_getaffinity(0) if hasattr(os, 'sched_getaffinity') else range(os.cpu_count())
  info = {
    'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    'cpu': cpu,
    'cpu_details': cpu_details,
    'cores_available': len(cores),
    'python': platform.python_version(),
    'versions': versions,
    'xla_flags': os.environ.get('XLA_FLAGS', ''),
  }
  if hasattr(os, 'getloadavg'):
    info['load_average'] = [round(x, 2) for x in os.getloadavg()]
  if accelerator:
    info['accelerator'] = device_info()
  return info
