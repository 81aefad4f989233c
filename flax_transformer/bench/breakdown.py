"""Where a compiled step's time goes: its operations by time, from a profile of a few runs.

    ops = breakdown(step.compiled, step.run, steps=3)     # a profile of 3 calls
    print(ops.table(10))                                    # the top 10 by time

The step runs `steps` times under `jax.profiler.trace`; the trace's events that carry the name
of one of the compiled program's instructions (XLA's thunks on a CPU, its kernels on a GPU:
`fusion.12`, `ynn_fusion.3`, `dot.4` ...) are summed by name and divided by `steps`. Each is
described from the compiled HLO text: its opcode (a fusion's kind, and `dot` when the fusion
computes a matrix product), its output shape and the JAX operation it came from
(`metadata.op_name`). Control flow (`while`, `conditional`, `call`) is left out: its body's
own instructions are what it spends. On a CPU, XLA runs independent thunks on several
threads at once, so the operations' times can sum to more than the step's wall time; the
shares are of that sum.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import re
import tempfile
from collections.abc import Callable

import jax
from jax.profiler import ProfileData

# `  ROOT %fusion.3 = f32[8,16]{1,0} fusion(%p.1, ...), kind=kLoop, calls=%fused_computation.3,
# metadata={op_name="jit(step)/..."}`: its name, shape, opcode and the rest of the line.
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([a-z][\w\-]*)\((.*)$')
_COMPUTATION = re.compile(r'^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$')
_CALLS = re.compile(r'calls=%?([\w.\-]+)')
_KIND = re.compile(r'kind=(k\w+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_LAYOUT = re.compile(r'\{[^{}]*\}')
# Instructions that only hold others: their time is their body's.
CONTAINERS = frozenset({'while', 'conditional', 'call', 'async-start', 'async-done'})
MATMUL_OPCODES = frozenset({'dot', 'convolution', 'ragged-dot'})


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a compiled HLO module, as its text describes it."""

  name: str
  opcode: str  # 'fusion:kLoop', 'fusion:kCustom+dot', 'dot', 'copy' ...
  shape: str  # the output's, without layouts: 'f32[8192,512]'
  source: str  # the JAX operation it came from (metadata op_name), '' when none


def hlo_instructions(hlo_text: str) -> dict[str, Instruction]:
  """Every instruction of `hlo_text` (`compiled.as_text()`) by name; a fusion's opcode names
  its kind and, when its fused computation multiplies matrices, `+dot`."""
  opcodes_in: dict[str, set[str]] = collections.defaultdict(set)
  found: list[tuple[str, str, str, str]] = []  # name, shape, opcode, the rest of its line
  computation = ''
  for line in hlo_text.splitlines():
    if (header := _COMPUTATION.match(line)) is not None and ' = ' not in line:
      computation = header.group(1)
      continue
    if (match := _INSTRUCTION.match(line)) is None:
      continue
    name, shape, opcode, rest = match.groups()
    opcodes_in[computation].add(opcode)
    found.append((name, shape, opcode, rest))
  instructions = {}
  for name, shape, opcode, rest in found:
    if opcode == 'fusion':
      kind = _KIND.search(rest)
      called = _CALLS.search(rest)
      fused = opcodes_in.get(called.group(1), set()) if called else set()
      opcode = f'fusion:{kind.group(1) if kind else "?"}' + (
        '+dot' if fused & MATMUL_OPCODES else ''
      )
    source = _OP_NAME.search(rest)
    instructions[name] = Instruction(
      name, opcode, _LAYOUT.sub('', shape), source.group(1) if source else ''
    )
  return instructions


@dataclasses.dataclass(frozen=True)
class OpTime:
  instruction: Instruction
  seconds: float  # per step, summed over the threads that ran it
  calls: float  # per step

  def to_dict(self) -> dict:
    return {**dataclasses.asdict(self.instruction), 'seconds': self.seconds, 'calls': self.calls}


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """A compiled step's operations by time per step, the largest first."""

  ops: tuple[OpTime, ...]
  steps: int  # the profiled calls the times are averaged over

  @property
  def seconds(self) -> float:
    """The operations' summed time per step (above the wall time when threads overlap)."""
    return sum(op.seconds for op in self.ops)

  def matmul_share(self) -> float:
    """The share of the summed time spent in matrix products (dots, and fusions with one)."""
    matmul = sum(
      op.seconds
      for op in self.ops
      if op.instruction.opcode in MATMUL_OPCODES or op.instruction.opcode.endswith('+dot')
    )
    return matmul / self.seconds if self.seconds else 0.0

  def to_dict(self, top: int | None = None) -> dict:
    return {
      'steps': self.steps,
      'seconds': self.seconds,
      'matmul_share': self.matmul_share(),
      'ops': [op.to_dict() for op in self.ops[:top]],
    }

  def table(self, top: int = 10) -> str:
    rows = [
      f'{op.seconds * 1e3:9.2f} ms {op.seconds / self.seconds:6.1%}  {op.instruction.name} '
      f'({op.instruction.opcode}) -> {op.instruction.shape}  {_short(op.instruction.source)}'
      for op in self.ops[:top]
    ]
    return '\n'.join(
      [
        f'{self.seconds * 1e3:,.2f} ms of operations per step over {len(self.ops)} kinds, '
        f'{self.matmul_share():.0%} in matrix products; the top {min(top, len(self.ops))}:',
        *rows,
      ]
    )


def _short(source: str, keep: int = 70) -> str:
  """The op_name's tail: where in the model the operation is (its start is `jit(...)`)."""
  return source if len(source) <= keep else '...' + source[-keep:]


def breakdown(compiled, run: Callable[[], object], steps: int = 3) -> Breakdown:
  """Profiles `steps` calls of `run` (which runs `compiled` and blocks until done) and returns
  `compiled`'s operations by time per call."""
  instructions = hlo_instructions(compiled.as_text())
  with tempfile.TemporaryDirectory(prefix='flax-transformer-profile-') as directory:
    with jax.profiler.trace(directory):
      for _ in range(steps):
        run()
    (path,) = glob.glob(f'{directory}/**/*.xplane.pb', recursive=True)
    profile = ProfileData.from_file(path)
    durations: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    for plane in profile.planes:
      for line in plane.lines:
        for event in line.events:
          instruction = instructions.get(event.name)
          if instruction is not None and instruction.opcode not in CONTAINERS:
            durations[event.name] += event.duration_ns * 1e-9
            calls[event.name] += 1
  ops = sorted(
    (
      OpTime(instructions[name], seconds / steps, calls[name] / steps)
      for name, seconds in durations.items()
    ),
    key=lambda op: -op.seconds,
  )
  return Breakdown(tuple(ops), steps)
