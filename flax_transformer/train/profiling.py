"""A `jax.profiler` trace of chosen training steps, for TensorBoard or Perfetto.

    python train.py --train.profile=10,15     # the 5 steps after step 10

The trace goes to WORKDIR/profile: `plugins/profile/<time>/<host>.xplane.pb`,
which TensorBoard's profile plugin reads (`pip install tensorboard-plugin-profile`,
then `tensorboard --logdir WORKDIR/profile`, the Profile tab), and beside it
`<host>.trace.json.gz`, which https://ui.perfetto.dev opens. Steps run
asynchronously, so the trace starts once the state before its first step is ready
and stops once its last step's state is: it holds those steps' device work and
the host's work around them (batches, logging). A run resumed inside the range
traces the steps that remain; a run stopped inside it (a signal, an error) still
writes what was traced.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax


class StepTrace:
  """Starts and stops the trace around steps START+1..STOP (`TrainConfig.profile_steps`)."""

  def __init__(self, steps: tuple[int, int] | None, directory: Path, say: Callable[[str], None]):
    self.steps = steps
    self.directory = directory
    self.say = say
    self.tracing = False

  def plan(self, start: int, last: int) -> str | None:
    """One line when the steps traced are not START+1..STOP as asked: a run resumed at
    `start` inside or past the range, or one whose last step `last` comes before STOP."""
    if self.steps is None:
      return None
    first, stop = self.steps
    asked = f'train.profile={first},{stop}'
    if start >= stop:
      return (
        f'{asked}: this run resumed at step {start}, past those steps; nothing is traced '
        '(ask for later steps)'
      )
    traced = f'steps {max(first, start) + 1} to {min(stop, last)} are traced'
    if start > first and stop > last:
      return f'{asked}: resumed at step {start} and ending at train.steps={last}: {traced}'
    if start > first:
      return f'{asked}: this run resumed at step {start}, inside the range: {traced}'
    if stop > last:
      return f'{asked}: the run ends at train.steps={last}, inside the range: {traced}'
    return None

  def before_step(self, step: int, state) -> None:
    """Called before the step that takes the run from `step` to `step + 1` steps done."""
    if self.steps is None or self.tracing or not self.steps[0] <= step < self.steps[1]:
      return
    jax.block_until_ready(state)  # the steps before are not in the trace
    jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
    self.tracing = True

  def after_step(self, done: int, state) -> None:
    """Called once `done` steps are done; stops the trace after step STOP."""
    if self.tracing and done >= self.steps[1]:
      jax.block_until_ready(state)
      self.close()
      self.say(
        f'profile: steps {self.steps[0] + 1} to {self.steps[1]} traced into '
        f'{self.directory} (tensorboard --logdir {self.directory}, or '
        '*.trace.json.gz in ui.perfetto.dev)'
      )

  def close(self) -> None:
    """Stops a trace under way, writing it (also when the steps stop early)."""
    if self.tracing:
      self.tracing = False
      jax.profiler.stop_trace()
