"""A training run inside a wall-clock budget (`train.time_budget`): how many steps fit.

A user knows their budget (a laptop evening, a one-hour GPU slot); a schedule that ends
(`train.schedule` linear or wsd) needs the number of steps before it starts. So, before the
first step of a new run, `measure_costs` times what the run will spend its time on, on this
host: a few compiled training steps of each batch shape the run's batches come in (on a copy
of the state, so nothing is trained twice), weighted by each shape's share of the steps to come
(a bucket of long rows takes longer than one of short rows at the same tokens, and each shape
compiles once), one pass over the validation batches, one greedy decoding of the validation
split; `steps_within` turns those into the most steps whose training, validations, BLEU
decodings and final evaluation end inside what is left of the budget. The steps are then
fixed: config.json records them beside the budget, and a resume with the same budget keeps
them (`resumed_steps`), so the schedule it follows is the one it started on.

    costs = measure_costs(run_step, shape_steps(shapes_of_steps), run_validation, run_decoding,
                          clock=time.perf_counter)
    steps = steps_within(budget_s, spent_s, costs, train_config, final_decodings=2)
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable, Hashable, Sequence

from flax_transformer.config import ConfigError, TrainConfig
from flax_transformer.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class RunCosts:
  """What one run's time goes to on this host, in seconds (`measure_costs`).

  step_s: one compiled training step: each batch shape's median, weighted by its share.
  compile_s: the first step of each shape, compilation included: the step is compiled once
    more for the fixed steps (its schedule's end is a constant of the program).
  validation_s: one pass over the validation batches (0 without a validation split).
  decoding_s: one greedy decoding of the validation split, compilation included (0 without
    one): a BLEU validation, and the unit of the final evaluation.
  """

  step_s: float
  compile_s: float
  validation_s: float
  decoding_s: float

  def describe(self) -> str:
    parts = [f'a step {self.step_s:.3g} s']
    if self.validation_s:
      parts.append(f'a validation {self.validation_s:.3g} s')
    if self.decoding_s:
      parts.append(f'a validation decoding {self.decoding_s:.3g} s')
    return ', '.join(parts)


# Steps timed of each batch shape after the one that compiles it.
TIMED_PER_SHAPE = 2
# The steps to come whose batch shapes give each shape's share (a shuffled plan's sample).
SHAPE_WINDOW = 1000


def shape_steps(
  shapes: Sequence[Hashable], timed: int = TIMED_PER_SHAPE
) -> list[tuple[float, list[int]]]:
  """`shapes[i]`: the batch shape of the i-th step to come (a window of them). Per shape, in
  the order first met: its share of the window and the indices of its first `timed + 1` steps
  (the first compiles the shape; fewer when the window holds fewer)."""
  counts = collections.Counter(shapes)
  first: dict[Hashable, list[int]] = {}
  for index, shape in enumerate(shapes):
    if len(taken := first.setdefault(shape, [])) <= timed:
      taken.append(index)
  return [(counts[shape] / len(shapes), indices) for shape, indices in first.items()]


def measure_costs(
  run_step: Callable[[int], None],
  steps: Sequence[tuple[float, Sequence[int]]],
  run_validation: Callable[[], None] | None,
  run_decoding: Callable[[], None] | None,
  clock: Callable[[], float],
) -> RunCosts:
  """Times `run_step(i)` for each shape's steps (`shape_steps`: its share, its step indices;
  the first call of a shape compiles it, the others are timed, their median weighted by the
  share), then one `run_validation()` and one `run_decoding()` (each None when the run has no
  such split). Each callable must return only once its work is done (blocked on the devices)."""
  step_s = compile_s = 0.0
  for share, indices in steps:
    times = []
    for index in indices:
      start = clock()
      run_step(index)
      times.append(clock() - start)
    compile_s += times[0]
    step_s += share * statistics.median(times[1:] or times)
  validation_s = decoding_s = 0.0
  if run_validation is not None:
    start = clock()
    run_validation()
    validation_s = clock() - start
  if run_decoding is not None:
    start = clock()
    run_decoding()
    decoding_s = clock() - start
  return RunCosts(step_s, compile_s, validation_s, decoding_s)


def steps_within(
  budget_s: float,
  spent_s: float,
  costs: RunCosts,
  config: TrainConfig,
  start: int = 0,
  final_decodings: float = 1.0,
) -> int:
  """The last step of a run that fits the budget: `start` plus the most steps whose time,
  with a validation every eval_every steps, a BLEU decoding every bleu_every steps (each
  counted in its share per step), one compile and the final evaluation
  (`final_decodings` decodings of the validation split's size: the test split, and the
  average and moving average when they are scored too), fits in budget_s - spent_s.

  Raises ConfigError when not even one step and its validation fit: the budget is too short.
  """
  final_s = costs.decoding_s * final_decodings
  left = budget_s - spent_s - costs.compile_s - final_s - costs.validation_s
  per_step = costs.step_s + costs.validation_s / config.eval_every
  if config.bleu_every:
    per_step += costs.decoding_s / config.bleu_every
  steps = math.floor(left / per_step) if left > 0 else 0
  if steps < 1:
    raise ConfigError(
      f'train.time_budget={config.time_budget} ({budget_s:,.0f} s) is too short for one step and '
      f'its validation here: {spent_s:,.0f} s spent measuring, {costs.describe()}, the final '
      f'evaluation about {final_s:,.0f} s; give it more time'
    )
  return start + steps


def resumed_steps(saved: TrainConfig | None, requested: TrainConfig) -> TrainConfig:
  """The settings a run with a time budget resumes with: the steps its budget fixed when it
  began (config.json's), so that the schedule goes on as it started. Raises CheckpointError
  when the saved run had another budget: its steps were fixed by that one."""
  if requested.time_budget is None or saved is None:
    return requested
  if saved.time_budget is None:
    raise CheckpointError(
      f'train.time_budget: saved none (the run trains to train.steps={saved.steps}), requested '
      f'{requested.time_budget}: a budget fixes the steps when a run begins; resume without '
      'it (--train.time_budget none), with --steps N, or start a new run'
    )
  if saved.time_budget_s != requested.time_budget_s:
    raise CheckpointError(
      f'train.time_budget: saved {saved.time_budget}, requested {requested.time_budget}: the '
      f'saved budget fixed the run at train.steps={saved.steps}; resume with '
      f'--train.time_budget {saved.time_budget} (or none and --steps N), or start a new run'
    )
  return requested.replace(steps=saved.steps)


def fit_steps(
  run, loop, state, start: int, spent_s: float, average_last: int, clock
) -> TrainConfig:
  """Measures this run's costs (`measure_costs`, on a copy of the replicated `state`, with the
  steps of each batch shape among the next SHAPE_WINDOW from `start`), fixes train.steps at
  the last step that fits train.time_budget (every process takes process 0's answer), checks
  what depends on it and returns the run's settings with those steps; the caller recompiles
  the step (a schedule's end is a constant of its program). `run` and `loop` are train.loop's
  `TrainingRun` and `TrainingLoop` (whose `writers` it speaks through)."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from flax_transformer.train.report import split_scores
  from flax_transformer.train.setup import check_average_last, check_patience

  config = run.train_config
  writers = loop.writers
  scratch = jax.tree.map(lambda x: x.copy(), state)

  def run_step(index: int) -> None:
    nonlocal scratch
    scratch, metrics = loop.step_fn(scratch, loop.local_batch(start + index))
    jax.block_until_ready(metrics)

  def run_validation() -> None:
    outputs = [
      loop.eval_fn(state.params, run.data_parallel.shard_batch(b)) for b in loop.val_batches
    ]
    jax.block_until_ready(outputs)

  split = next((name for name in ('validation', 'test') if name in run.dataset), None)
  final_split = next((name for name in ('test', 'validation') if name in run.dataset), None)

  def run_decoding() -> None:
    split_scores(run, run.data_parallel.unreplicate(state.params), split, writers.directory.is_main)

  measure_start = clock()
  shapes = [loop.batcher.entry(start + index)[0] for index in range(SHAPE_WINDOW)]
  costs = measure_costs(
    run_step,
    shape_steps(shapes),
    run_validation if loop.val_batches else None,
    run_decoding if split is not None else None,
    clock,
  )
  del scratch
  finals = 1 + (average_last > 0) + (config.ema_decay > 0)
  size = len(run.dataset[final_split]) / len(run.dataset[split]) if split is not None else 0.0
  spent = spent_s + clock() - measure_start
  steps = steps_within(config.time_budget_s, spent, costs, config, start, finals * size)
  steps = int(multihost_utils.broadcast_one_to_all(np.int64(steps)))
  writers.say(
    f'time budget {config.time_budget}: {steps - start:,} steps fit, so train.steps={steps:,} '
    f'({costs.describe()}; {spent:,.0f} s spent before training)'
  )
  fitted = config.replace(steps=steps)
  check_average_last(fitted, average_last)
  check_patience(fitted)
  return fitted
