"""A training run inside a wall-clock budget (`train.time_budget`): how many steps fit.

A user knows their budget (a laptop evening, a one-hour GPU slot); a schedule that ends
(`train.schedule` linear or wsd) needs the number of steps before it starts. So, before the
first step of a new run, `measure_costs` times what the run will spend its time on, on this
host: a few compiled training steps (on a copy of the state, so nothing is trained twice), one
pass over the validation batches, one greedy decoding of the validation split; `steps_within`
turns those into the most steps whose training, validations, BLEU decodings and final
evaluation end inside what is left of the budget. The steps are then fixed: config.json
records them beside the budget, and a resume with the same budget keeps them (`resumed_steps`),
so the schedule it follows is the one it started on.

    costs = measure_costs(run_step, run_validation, run_decoding, clock=time.perf_counter)
    steps = steps_within(budget_s, spent_s, costs, train_config, final_decodings=2)
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable

from flax_transformer.config import ConfigError, TrainConfig
from flax_transformer.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class RunCosts:
  """What one run's time goes to on this host, in seconds (`measure_costs`).

  step_s: one compiled training step, the median of the timed ones.
  compile_s: the first step, compilation included: the step is compiled once more for the
    fixed steps (its schedule's end is a constant of the program).
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


def measure_costs(
  run_step: Callable[[int], None],
  run_validation: Callable[[], None] | None,
  run_decoding: Callable[[], None] | None,
  clock: Callable[[], float],
  timed_steps: int = 5,
) -> RunCosts:
  """Times `run_step(i)` for i = 0 (compiling) .. timed_steps, then one `run_validation()`
  and one `run_decoding()` (each None when the run has no such split). Each callable must
  return only once its work is done (blocked on the devices)."""
  start = clock()
  run_step(0)
  compile_s = clock() - start
  times = []
  for index in range(1, timed_steps + 1):
    start = clock()
    run_step(index)
    times.append(clock() - start)
  validation_s = decoding_s = 0.0
  if run_validation is not None:
    start = clock()
    run_validation()
    validation_s = clock() - start
  if run_decoding is not None:
    start = clock()
    run_decoding()
    decoding_s = clock() - start
  return RunCosts(statistics.median(times), compile_s, validation_s, decoding_s)


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
  """Measures this run's costs (`measure_costs`, on a copy of the replicated `state` from
  step `start`), fixes train.steps at the last step that fits train.time_budget (every
  process takes process 0's answer), checks what depends on it and returns the run's
  settings with those steps; the caller recompiles the step (a schedule's end is a constant
  of its program). `run` and `loop` are train.loop's `TrainingRun` and `TrainingLoop`."""
  import jax
  import numpy as np
  from jax.experimental import multihost_utils

  from flax_transformer.train.report import split_scores
  from flax_transformer.train.setup import check_average_last, check_patience

  config = run.train_config
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
    split_scores(run, run.data_parallel.unreplicate(state.params), split)

  measure_start = clock()
  costs = measure_costs(
    run_step,
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
  run.say(
    f'time budget {config.time_budget}: {steps - start:,} steps fit, so train.steps={steps:,} '
    f'({costs.describe()}; {spent:,.0f} s spent before training)'
  )
  fitted = config.replace(steps=steps)
  check_average_last(fitted, average_last)
  check_patience(fitted)
  return fitted
