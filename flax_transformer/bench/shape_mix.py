"""An epoch's batch shapes and the batches of each: what train.py's step costs on average.

train.py buckets pairs by length, so one run's steps come in several shapes (Multi30k at 8,192
tokens: 1024x8 to 128x64), and a step of long rows costs more than one of short rows at the same
tokens. Its log names them with their batches an epoch (`Batcher.describe`: `shapes [B x
L:batches] 1024x8:2,512x16:13,...`); given that list, `flax-transformer-bench step --shape`
times each shape and reports their mean weighted by batches: the figure to hold train.py's own
seconds per step against (the loop's cost is the difference).

    mix = ShapeMix.parse('1024x8:2,512x16:13')
    report = MixReport(mix, [step_report(config, train, shape) for shape in mix.shapes])
    report.step_s       # (2 * t(1024x8) + 13 * t(512x16)) / 15
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from flax_transformer.bench.flops import BatchShape
from flax_transformer.config import TrainConfig

if TYPE_CHECKING:  # the step's module compiles with jax; a mix is parsed before it is needed
  from flax_transformer.bench.step import StepReport


@dataclasses.dataclass(frozen=True)
class ShapeMix:
  """Batch shapes and how many batches of each (an epoch's, or any weights)."""

  shapes: tuple[BatchShape, ...]
  batches: tuple[int, ...]

  def __post_init__(self):
    if not self.shapes or len(self.shapes) != len(self.batches):
      raise ValueError('a shape mix needs at least one shape and one batch count per shape')
    if len(set(self.shapes)) != len(self.shapes):
      raise ValueError(f'{self}: a shape is named twice')
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in self.batches):
      raise ValueError(f'{self}: batch counts must be positive integers')

  @classmethod
  def parse(cls, text: str) -> ShapeMix:
    """'SHAPE[:BATCHES],...': '1024x8:2,512x16:13' (train.py's log), or one shape ('64x32+32',
    one batch); each SHAPE as `BatchShape.parse` reads it."""
    shapes, batches = [], []
    for item in text.split(','):
      shape, colon, count = item.strip().partition(':')
      shapes.append(BatchShape.parse(shape))
      try:
        batches.append(int(count) if colon else 1)
      except ValueError:
        raise ValueError(f'{item!r}: the batches after ":" must be an integer') from None
    return cls(tuple(shapes), tuple(batches))

  def __str__(self):
    return ','.join(f'{shape}:{n}' for shape, n in zip(self.shapes, self.batches))

  def weighted(self, values: list[float]) -> float:
    """The mean of `values` (one per shape, in order) weighted by each shape's batches."""
    return sum(n * v for n, v in zip(self.batches, values, strict=True)) / sum(self.batches)


@dataclasses.dataclass(frozen=True)
class MixReport:
  """Each shape's step (`StepReport`s, in the mix's order) and their mean over the mix."""

  mix: ShapeMix
  steps: list[StepReport]

  @property
  def step_s(self) -> float:
    """Seconds a step, the shapes' medians weighted by their batches."""
    return self.mix.weighted([report.timing.median_s for report in self.steps])

  @property
  def positions_per_s(self) -> float:
    """Target positions a second over the mix (full rows: padding counts as positions)."""
    positions = self.mix.weighted([report.shape.target_tokens for report in self.steps])
    return positions / self.step_s

  @property
  def budget_steps(self) -> int | None:
    """The steps of this mix that train.time_budget holds, training alone: each shape
    compiled once, the rest at the mean step. None without a budget."""
    budget = self.steps[0].time_budget
    if budget is None:
      return None
    compile_s = sum(report.compilation.seconds for report in self.steps)
    return max(0, int((TrainConfig(time_budget=budget).time_budget_s - compile_s) // self.step_s))

  def to_dict(self) -> dict:
    return {
      'kind': 'shape_mix',
      'shapes': str(self.mix),
      'batches': sum(self.mix.batches),
      'step_s': self.step_s,
      'target_positions_per_s': self.positions_per_s,
      'time_budget': self.steps[0].time_budget,
      'budget_steps': self.budget_steps,
    }

  def table(self) -> str:
    line = (
      f'the mix of {sum(self.mix.batches):,} batches ({len(self.steps)} shapes): '
      f'{self.step_s * 1e3:.2f} ms a step weighted by batches, '
      f'{self.positions_per_s:,.0f} target positions/s'
    )
    if self.budget_steps is not None:
      line += f'; {self.steps[0].time_budget}: at most {self.budget_steps:,} steps'
    return line


def shape_argument(text: str) -> ShapeMix:
  """`flax-transformer-bench step --shape`'s type: the mix, or argparse's one-line refusal."""
  try:
    return ShapeMix.parse(text)
  except ValueError as error:
    raise argparse.ArgumentTypeError(str(error)) from None
