"""Wall-clock timing of calls that block until their work is done.

    timing = time_rounds(run_step, rounds=10, warmup=2)
    timing.median_s, timing.p10_s, timing.p90_s

    timings = alternating_rounds({'a': run_a, 'b': run_b}, rounds=10)   # a, b, a, b, ...

Several contenders are timed in alternating rounds, so that a burst of load from elsewhere on
a shared machine falls on all of them alike; a median of rounds after warm-up is the number a
report gives.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import numpy as np


@dataclasses.dataclass(frozen=True)
class Timing:
  """Seconds of each timed call, in the order they ran."""

  times_s: tuple[float, ...]

  def __post_init__(self):
    if not self.times_s:
      raise ValueError('a Timing needs at least one timed call')

  @property
  def median_s(self) -> float:
    return float(np.median(self.times_s))

  @property
  def p10_s(self) -> float:
    return float(np.percentile(self.times_s, 10))

  @property
  def p90_s(self) -> float:
    return float(np.percentile(self.times_s, 90))

  def to_dict(self) -> dict:
    return {
      'median_s': self.median_s,
      'p10_s': self.p10_s,
      'p90_s': self.p90_s,
      'rounds': len(self.times_s),
      'times_s': list(self.times_s),
    }


def check_rounds(rounds: int, warmup: int) -> None:
  """Raises ValueError for fewer than one timed round or a negative warm-up."""
  if not isinstance(rounds, int) or rounds < 1:
    raise ValueError(f'rounds must be a positive integer, got {rounds!r}')
  if not isinstance(warmup, int) or warmup < 0:
    raise ValueError(f'warmup must be a non-negative integer, got {warmup!r}')


def time_rounds(fn: Callable[[], object], rounds: int, warmup: int = 1) -> Timing:
  """`warmup` untimed calls of `fn`, then `rounds` timed ones. `fn` must block until done."""
  return alternating_rounds({'fn': fn}, rounds, warmup)['fn']


def alternating_rounds(
  contenders: Mapping[str, Callable[[], object]],
  rounds: int,
  warmup: int = 1,
  progress: Callable[[], object] | None = None,
) -> dict[str, Timing]:
  """Times several blocking calls side by side: round r calls every contender once, in turn,
  after `warmup` untimed calls of each. `progress()` follows every timed call (a bar)."""
  check_rounds(rounds, warmup)
  for fn in contenders.values():
    for _ in range(warmup):
      fn()
  times = {name: [] for name in contenders}
  for _ in range(rounds):
    for name, fn in contenders.items():
      start = time.perf_counter()
      fn()
      times[name].append(time.perf_counter() - start)
      if progress is not None:
        progress()
  return {name: Timing(tuple(ts)) for name, ts in times.items()}
