"""What compiling costs and what the compiled program holds: seconds, cache, memory.

compiled, compilation = compile_programs(lambda: [jitted.lower(*args)])
compilation.seconds, compilation.cache            # 'read' from the persistent cache?
memory_of(compiled)                               # CompiledMemory: XLA's own account
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax

from flax_transformer.cli import compilation_cache


@dataclasses.dataclass(frozen=True)
class Compilation:
  """Wall seconds from tracing to an executable (lowering and XLA together), and what JAX's
  persistent compilation cache did: 'off' (no cache directory), 'read' (every program came
  from it), 'compiled' (none did) or 'partly read'."""

  seconds: float
  cache: str
  programs: int

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
  """Bytes of one compiled program, per device, from XLA's `memory_analysis()`: temporaries
  (activations kept for the backward pass, workspace), arguments, outputs, and the part of
  the outputs that reuses argument buffers (a donated training state)."""

  temporaries: int
  arguments: int
  outputs: int
  aliased: int

  @property
  def total(self) -> int:
    """What the program needs at once: arguments + outputs - aliased + temporaries."""
    return self.arguments + self.outputs - self.aliased + self.temporaries

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self), 'total': self.total}


def compile_programs(
  lowerings: Callable[[], Sequence[jax.stages.Lowered]],
) -> tuple[list[jax.stages.Compiled], Compilation]:
  """Lowers (`lowerings()`) and compiles programs, timing both and watching the cache."""
  compilation_cache.listen()
  read_before, compiled_before = compilation_cache.totals()
  start = time.perf_counter()
  compiled = [lowered.compile() for lowered in lowerings()]
  seconds = time.perf_counter() - start
  read, missed = (
    after - before
    for after, before in zip(compilation_cache.totals(), (read_before, compiled_before))
  )
  if not jax.config.jax_enable_compilation_cache or jax.config.jax_compilation_cache_dir is None:
    cache = 'off'
  else:
    cache = 'read' if read and not missed else 'partly read' if read else 'compiled'
  return compiled, Compilation(seconds=seconds, cache=cache, programs=len(compiled))


def memory_of(compiled: Sequence[jax.stages.Compiled]) -> CompiledMemory | None:
  """The memory of the program that needs the most of it (`total`); None where the backend
  gives no analysis."""
  accounts = []
  for program in compiled:
    try:
      stats = program.memory_analysis()
    except Exception:  # noqa: BLE001  # a backend without the analysis raises; none is known
      stats = None
    if stats is None:
      return None
    accounts.append(
      CompiledMemory(
        temporaries=int(stats.temp_size_in_bytes),
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        aliased=int(stats.alias_size_in_bytes),
      )
    )
  return max(accounts, key=lambda memory: memory.total) if accounts else None


def format_bytes(count: int | None) -> str:
  if count is None:
    return 'n/a'
  for unit, size in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if count >= size:
      return f'{count / size:.2f} {unit}'
  return f'{count} B'
