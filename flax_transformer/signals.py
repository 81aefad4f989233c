"""SIGTERM and SIGINT: recorded when they arrive, acted on where stopping is safe.

Python runs a signal handler between any two bytecodes of the main thread:
inside a library's cleanup, a weakref callback or a `finally` block, where an
exception raised by the handler is dropped ("Exception ignored in ...") or
breaks what that code was keeping consistent. So the handler here only records
the signal, and the code asks for it at the points where stopping leaves
everything valid, between units of work:

    with signals.recording('decode.py'):
      for batch in batches:
        signals.check()          # raises Stopped if SIGTERM or SIGINT came
        translate(batch)

- `check()` raises `Stopped`, a BaseException (as KeyboardInterrupt), so no
  `except Exception` on the way swallows it.
- `received()` is the signal that came, or None: for code that stops its own way
  (training saves the step reached first, then raises).
- A SIGINT after a SIGINT is for whoever does not want to wait for the next safe
  point: a program (`recording(program)`) ends at once with one line and status
  130, keeping what it wrote before (checkpoints and outputs are renamed into
  place complete); library code (no program) gets KeyboardInterrupt, as Python's
  default, e.g. in a notebook.

Handlers can only be installed from the main thread; elsewhere `recording`
installs nothing and nothing is recorded (the defaults stay). Nested `recording`
blocks share one record, which the outermost one starts empty and ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)

# The record shared by nested `recording` blocks: `depth` blocks open, the first signal
# received, and the program whose line a second SIGINT prints.
_record: dict = {'depth': 0, 'received': None, 'program': '', 'previous': {}}


class Stopped(BaseException):
  """A signal acted on at a safe point: the unit of work under way was abandoned.

  signal_number: SIGTERM or SIGINT; exit_code: 128 + signal_number (143, 130),
  the shell's code for a process ended by that signal.
  """

  def __init__(self, signal_number: int):
    self.signal_number = int(signal_number)
    super().__init__(f'stopped by {self.name}')

  @property
  def name(self) -> str:
    return signal.Signals(self.signal_number).name

  @property
  def exit_code(self) -> int:
    return 128 + self.signal_number


def received() -> int | None:
  """The first SIGTERM or SIGINT recorded since the outermost `recording` began, or None."""
  return _record['received']


def check() -> None:
  """Raises Stopped if a signal was recorded: call it where abandoning the work is safe.

  The record stays, so that every caller on the way out sees the same signal.
  """
  if _record['received'] is not None:
    raise Stopped(_record['received'])


@contextlib.contextmanager
def recording(program: str = '') -> Iterator[None]:
  """Within the block, SIGTERM and SIGINT are recorded instead of acted on (see the module
  docstring); `program` names the line a second SIGINT ends the process with."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  outermost = _record['depth'] == 0
  if outermost:
    _record.update(
      received=None,
      program=program,
      previous={number: signal.signal(number, _note) for number in SIGNALS},
    )
  _record['depth'] += 1
  try:
    yield
  finally:
    _record['depth'] -= 1
    if outermost:
      for number, handler in _record['previous'].items():
        signal.signal(number, handler)
      _record.update(received=None, program='', previous={})


def _note(number: int, frame: FrameType | None) -> None:
  if _record['received'] is None:
    _record['received'] = number
    if _record['program']:  # answered at once: the safe point may be a step or two away
      _write_line(
        f'{_record["program"]} received {signal.Signals(number).name}: stopping at the next '
        'safe point (train.py: after the step under way, which it saves); Ctrl-C again stops '
        'now without saving\n'
      )
  elif _record['received'] == signal.SIGINT and number == signal.SIGINT:
    _second_interrupt()


def _second_interrupt() -> None:
  if not _record['program']:
    raise KeyboardInterrupt('second SIGINT: stopped at once')
  line = (
    f'{_record["program"]}: interrupted twice: stopped at once, without waiting for a '
    'safe point; what was written before stays (checkpoints and outputs are complete)\n'
  )
  _write_line(line)
  os._exit(128 + signal.SIGINT)


def _write_line(line: str) -> None:
  """One line on standard error from a signal handler (os.write: no buffer to re-enter)."""
  with contextlib.suppress(OSError):
    os.write(2, line.encode())
