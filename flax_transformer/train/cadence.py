"""What is due at each step boundary of a training run, as one pure function of the settings.

The loop (`loop.TrainingLoop`) asks `due(config, done, start, ...)` once after every step
(and once at `start`, before the first) and does what the answer says, in its order: fetch
the step metrics, log, validate, save, decode for BLEU, count patience, start or stop the
profiler's trace. Nothing here touches a device or a file, so the whole cadence is tested on
a table (tests/test_cadence.py):

    due(TrainConfig(steps=10, eval_every=4, ...), done=8, start=0)
    # Due(log=True, validate=True, bleu=False, save=True, patience=True, final=False, ...)

Patience's own count (how many validations since the best) is `best.BestCheckpoint`'s: it
depends on the scores, which no settings know; `patience` says when to ask it.
"""

from __future__ import annotations

import dataclasses

from flax_transformer.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class Due:
  """What is due once `done` steps are done (before the step after it).

  log: a line of training metrics (bar and metrics.jsonl); also when stopping.
  validate: the validation loss (every eval_every steps and at the last step).
  bleu: the validation BLEU decoding (every bleu_every steps, with a validation split).
  save: a checkpoint (every checkpoint_every steps, at the last, and when stopping).
  patience: a validation of train.best_metric came now, so train.patience is counted.
  final: the last step of train.steps.
  profile_start, profile_stop: train.profile's trace starts before the next step, or stops
    now (its range, clipped to what this run trains).
  """

  log: bool = False
  validate: bool = False
  bleu: bool = False
  save: bool = False
  patience: bool = False
  final: bool = False
  profile_start: bool = False
  profile_stop: bool = False

  @property
  def fetch(self) -> bool:
    """Whether the steps' metrics are read back now (anything that reports or saves)."""
    return self.log or self.validate or self.bleu or self.save


def due(
  config: TrainConfig,
  done: int,
  start: int,
  *,
  stopping: bool = False,
  has_validation: bool = True,
) -> Due:
  """What is due once `done` steps are done, in a run (or resumed run) that began at step
  `start`; `stopping`: a signal asked to stop (the step is logged and saved, nothing is
  evaluated); `has_validation`: the data has a validation split (BLEU needs it)."""
  profile_start, profile_stop = _profile(config, done, start)
  if done == start:  # before the run's first step: only the trace may start
    return Due(profile_start=profile_start)
  final = done == config.steps
  every = lambda interval: bool(interval) and done % interval == 0
  validate = not stopping and (every(config.eval_every) or final)
  bleu = not stopping and has_validation and every(config.bleu_every)
  return Due(
    log=stopping or final or every(config.log_every),
    validate=validate,
    bleu=bleu,
    save=stopping or final or every(config.checkpoint_every),
    patience=bleu if config.best_metric == 'bleu' else validate,
    final=final,
    profile_start=profile_start and not stopping,
    profile_stop=profile_stop or (stopping and _tracing(config, done, start)),
  )


def _profile(config: TrainConfig, done: int, start: int) -> tuple[bool, bool]:
  """(the trace starts before step done + 1, it stops after step `done`): train.profile's
  steps FIRST+1..STOP, those this run trains (from `start` to train.steps)."""
  if config.profile_steps is None:
    return False, False
  first, stop = config.profile_steps
  begin, end = max(first, start), min(stop, config.steps)
  if begin >= end:  # the range is behind a resumed run, or past its last step
    return False, False
  return done == begin, done == end


def _tracing(config: TrainConfig, done: int, start: int) -> bool:
  """Whether the trace is under way after step `done` (begun, not yet stopped)."""
  if config.profile_steps is None:
    return False
  first, stop = config.profile_steps
  return max(first, start) < done < min(stop, config.steps)
