"""Stopping a training run on SIGTERM or SIGINT at a step boundary, after a checkpoint.

A preemptible machine gets SIGTERM some seconds before it is taken away, and a
person stops a run with Ctrl-C (SIGINT). Either way the run should finish the
step it is in, save a checkpoint of it, and exit, so that the same command
resumes there:

    with StopSignals() as stop:
      for step in ...:
        state = train_step(state, ...)
        if stop.requested(step + 1):
          save(state)
          raise Interrupted(stop.signal_number, step + 1)

One process: the signals are recorded (`flax_transformer.signals`), never raised
inside whatever code runs, and `requested` reads the record. A second SIGINT
stops at once, for whoever does not want to wait for the save (the checkpoints
already on disk are complete: orbax writes each one to a temporary directory and
renames it).

Several processes (after `jax.distributed.initialize`): every process has to stop
at the same step, or the others would wait forever in the checkpoint's
collectives. JAX's preemption service catches SIGTERM on any process and agrees
on a step with the others through the coordination service, without a device
synchronisation; `requested(step)` asks it at every step (the processes must
call it for every step from the same first one, which resumed runs do). SIGINT
keeps Python's default there: KeyboardInterrupt, without a save.

Outside the `with` block (and any outer `signals.recording`, as the programs
hold) the default handlers are back: SIGTERM ends the process at once, SIGINT
raises KeyboardInterrupt.
"""

from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from flax_transformer import signals


class Interrupted(Exception):
  """Training stopped on a signal after saving the step it reached.

  signal_number: the signal (SIGTERM for a preemption agreed between processes).
  step: the steps trained, and the number of the checkpoint saved.
  checkpoint: the checkpoint's directory.
  evaluating: the signal came in the final evaluation, after the last step was
    saved; the same command evaluates it again.
  exit_code: 128 + signal_number, the shell's code for a process ended by that
    signal (143 for SIGTERM, 130 for SIGINT): the run did not finish, so
    `train.py && decode.py` stops, and a scheduler that restarts failed jobs
    restarts it, to resume from `checkpoint`.
  """

  def __init__(self, signal_number: int, step: int, checkpoint: Path, evaluating: bool = False):
    self.signal_number = signal_number
    self.step = step
    self.checkpoint = checkpoint
    name = signal.Signals(signal_number).name
    super().__init__(
      f'stopped by {name} in the final evaluation of step {step}, saved in {checkpoint}. Run '
      'the same command again to evaluate it.'
      if evaluating
      else f'stopped by {name} after step {step}; saved {checkpoint}. Run the same command again '
      'to resume from there.'
    )

  @property
  def exit_code(self) -> int:
    return 128 + self.signal_number


class StopSignals:
  """Context manager: records SIGTERM and SIGINT instead of dying; see the module docstring.

  Signal handlers can only be installed by the main thread; elsewhere (a
  training run started from a worker thread) the defaults stay, and
  `requested` answers from the preemption service alone.
  """

  def __init__(self):
    self.signal_number: int | None = None
    self._multiprocess = jax.process_count() > 1
    self._recording = contextlib.ExitStack()

  def __enter__(self) -> StopSignals:
    # With several processes SIGTERM belongs to JAX's preemption notifier, and SIGINT
    # keeps its default: one process alone cannot stop at a step the others agree on.
    if not self._multiprocess:
      self._recording.enter_context(signals.recording())
    return self

  def __exit__(self, *exc_info) -> None:
    self.received()
    self._recording.close()

  def requested(self, step: int) -> bool:
    """Whether to stop after `step` (call it once per step, with the steps done)."""
    if self._multiprocess:
      if multihost_utils.reached_preemption_sync_point(step):
        self.signal_number = signal.SIGTERM
        return True
      return False
    return self.received() is not None

  def received(self) -> int | None:
    """The signal that asked to stop (kept after the block), or None."""
    if self.signal_number is None and not self._multiprocess:
      self.signal_number = signals.received()
    return self.signal_number
