"""The environment of the processes that tests start.

A portability run (docs/contributing.md, "The same results on every CPU") sets XLA_FLAGS
for the whole suite, e.g. `--xla_cpu_max_isa=AVX2`; a test that starts its own JAX process
with flags of its own (a device count, no backend optimisation) adds them to those, so the
child computes with the same instruction set as the test that checks it.
"""

import os


def xla_flags(*flags: str) -> str:
  """This process's XLA_FLAGS with `flags` added; a flag named here replaces the same flag there.

  xla_flags('--xla_force_host_platform_device_count=2') under
  XLA_FLAGS='--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8'
  -> '--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2'
  """
  names = {flag.split('=', 1)[0] for flag in flags}
  inherited = [
    flag for flag in os.environ.get('XLA_FLAGS', '').split() if flag.split('=', 1)[0] not in names
  ]
  return ' '.join([*inherited, *flags])
