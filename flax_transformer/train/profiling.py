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


def profile_plan(steps: tuple[int, int] | None, start: int, last: int) -> str | None:
  """One line when the steps traced are not START+1..STOP (`steps`, train.profile) as asked:
  a run resumed at `start` inside or past the range, or one whose last step `last` comes
  before STOP; None otherwise (or without a profile)."""
  if steps is None:
    return None
  first, stop = steps
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


class StepTrace:
  """The trace itself: started and stopped where `cadence.due` says (`profile_start`,
  `profile_stop`), and stopped by `close` whenever the steps end early."""

  def __init__(self, directory: Path, say: Callable[[str], None]):
    self.directory = directory
    self.say = say
    self.tracing = False
    self.first = 0

  def start(self, state, done: int) -> None:
    """Starts the trace before step `done` + 1, once the state before it is ready."""
    jax.block_until_ready(state)  # the steps before are not in the trace
    jax.profiler.start_trace(self.directory, create_perfetto_trace=True)
    self.tracing = True
    self.first = done + 1

  def stop(self, state, done: int) -> None:
    """Stops the trace once the state after step `done` is ready, and says where it is."""
    if not self.tracing:
      return
    jax.block_until_ready(state)
    self.close()
    self.say(
      f'profile: steps {self.first} to {done} traced into {self.directory} (tensorboard '
      f'--logdir {self.directory}, or *.trace.json.gz in ui.perfetto.dev)'
    )

  def close(self) -> None:
    """Stops a trace under way, writing it (also when the steps stop early)."""
    if self.tracing:
      self.tracing = False
      jax.profiler.stop_trace()
