"""How train.py, decode.py, distill.py and export.py fail: one line on standard error and a status.

    def main(argv=None):
      return run_program('train.py', lambda: _main(argv), argv, train_failure)

Exit status of the programs (the one table; their docstrings point here):

  0    train.py trained and evaluated; decode.py translated; distill.py wrote its output;
         export.py wrote its directory
  1    train.py: an error in the data, the run directory (in use by another run, a checkpoint
         of another model, a foreign tokenizer), a write (full disk), the device out of memory
         in a step (a batch shape too large), or anything unexpected (the checkpoints written
         stay)
       decode.py: writing the output failed, or anything unexpected part way (the
         translations written stay)
       distill.py: writing the output failed, or anything unexpected (the output directory
         is complete or untouched)
       export.py: writing failed (a full disk), or anything unexpected: the output is the
         earlier export or absent, never half-written
       train.py, several processes: they did not all join the coordinator within
         --coordinator-timeout (nothing listens at --coordinator, a process missing)
  2    refused before any work, naming the problem:
       train.py: a bad option or setting (a model too large for the machine's memory, more
         --devices than there are, included); a --workdir that is not a run of train.py (a
         pretrained model, an averaged output, another tool's files, the current directory)
         or that is, holds or lies inside an input (--data, --init-from): nothing in it
         touched; an --init-from directory with a damaged config.json (the file, field and
         value named), weights or tokenizer file (the file named)
       decode.py: bad arguments, input or checkpoint (missing, damaged, another model, too
         large for the machine, a foreign tokenizer; a Marian directory's file named with what
         is wrong), a beam too large for the memory, an --output over an input, before any
         translation
       distill.py: a bad option, teacher checkpoint (missing, a cmlm model), data or output
         (over an input or its run, or --overwrite of a directory distill.py did not write)
       export.py: a bad option or run directory (missing, damaged), a model Marian cannot
         express (pre-LN, cmlm, restricted attention; the setting named), an output over the
         run or holding other files than an earlier export: nothing written
  3    train.py: a step's loss or gradient not finite (more than --skip-nonfinite times)
  130  SIGINT (Ctrl-C), 143 SIGTERM: at any point up to the process's end, with one line.
         The handler only records the signal (`flax_transformer.signals`); the program
         stops at its next safe point: train.py after the step under way, saving it
         (an evaluation under way is abandoned), decode.py and distill.py between
         batches, any program after its work is done. A second SIGINT ends the
         process at once.

No Python traceback reaches the user unless `--debug` is given or the
environment sets FLAX_TRANSFORMER_DEBUG=1: then the traceback comes first, and
the line and the status are the same. Without it, what the checkpoint library
prints from its own threads after a failed write (tensorstore's callbacks into
orbax's closed event loop, reported through `sys.unraisablehook` or
`threading.excepthook`), what orbax logs (absl logging: each failed write
thread's traceback, warnings) and what asyncio logs of its failed futures
("Future exception was never retrieved", when they are collected) are silenced
while the program runs, and the failure's leftovers are collected before the
silencing ends, so the program's line comes alone, whichever save failed.

Run as a process's own program (`main()` without argv), a program ends the
process itself once its work is done and reported (`_end_process`): Python's
teardown, seconds of JAX and orbax closing, runs with SIGTERM's default action
restored, so a SIGTERM then would end the process without a word.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence

from flax_transformer import errors, signals

DEBUG_ENVIRONMENT = 'FLAX_TRANSFORMER_DEBUG'
# Characters of an unexpected error's message shown in its one line.
_MESSAGE_CHARS = 300


# train.py's status of the library's errors, by base class, the first that matches (the table
# above); each reported as 'error: MESSAGE'.
TRAIN_STATUS: tuple[tuple[type[BaseException], int], ...] = (
  (errors.ConfigError, 2),  # a setting; --init-from's directory (PretrainedError)
  (errors.NotARun, 2),  # a --workdir that no run of train.py wrote
  (errors.NonFiniteError, 3),
  (errors.Error, 1),  # the data, the run directory, its lock, a checkpoint, the tokenizer
  (OSError, 1),  # a write (WriteError), a full disk
)
# decode.py, distill.py and export.py before their work: every error of the library (it names
# its problem) is a refusal.
REFUSED = 2


class Failure(Exception):
  """A failure the program reports as `message` (its one line, less the program's name)."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


def add_debug_option(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    '--debug',
    action='store_true',
    help=f'print the Python traceback of a failure (also: {DEBUG_ENVIRONMENT}=1)',
  )


def debug_requested(argv: Sequence[str]) -> bool:
  return '--debug' in argv or os.environ.get(DEBUG_ENVIRONMENT, '') not in ('', '0')


def run_program(
  script: str,
  body: Callable[[], int],
  argv: Sequence[str] | None,
  report: Callable[[BaseException], tuple[str, int] | None],
) -> int:
  """`body()`'s status; a failure becomes one line 'SCRIPT: ...' and its status.

  `report(error)` words the program's own failures as (line, status), or None
  for the generic wording. SystemExit (argparse's usage errors) passes through.
  argv None (the process's own command line): the process ends here, see `_end_process`.
  """
  exiting = argv is None
  argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
  debug = debug_requested(argv)
  # Under jax.distributed, SIGTERM belongs to JAX's preemption service, and SIGINT keeps
  # its default: one process alone cannot stop at a step the others agree on.
  distributed = any(a.startswith(('--distributed', '--coordinator')) for a in argv)
  recording = contextlib.nullcontext() if distributed else signals.recording(script)
  with _quiet_libraries(debug), recording:
    failed = False
    try:
      status = body()
    except (Exception, KeyboardInterrupt, signals.Stopped) as error:
      if debug:
        traceback.print_exc()
      line, status = report(error) or describe(error)
      _say(script, line)
      failed = True
    if failed:
      # The failure's frames held the checkpoint library's objects (`error` is gone now): its
      # failed writes' futures report themselves when collected, which must happen while quiet.
      gc.collect()
    status = _after_the_work(script, status, signals.received())
    if exiting and not distributed:
      _end_process(script, status)
    return status


def describe(error: BaseException) -> tuple[str, int]:
  """The generic (line, status) of a failure no program words itself."""
  if isinstance(error, Failure):
    return f'error: {error}', error.exit_code
  if isinstance(error, KeyboardInterrupt):
    return 'interrupted by SIGINT', 128 + signal.SIGINT
  if isinstance(error, signals.Stopped):
    # distill.py and export.py: their outputs are staged and renamed into place when complete.
    return f'{error} before its work was done; its output was not written', error.exit_code
  return f'error: {one_line(error)}', 1


def one_line(error: BaseException) -> str:
  """'TypeName: first line of the message', shortened, with where to find the rest."""
  text = str(error).strip().splitlines()
  text = f'{type(error).__name__}: {text[0] if text else "(no message)"}'
  if len(text) > _MESSAGE_CHARS:
    text = text[: _MESSAGE_CHARS - 3] + '...'
  return f'{text} (unexpected; --debug or {DEBUG_ENVIRONMENT}=1 shows the traceback)'


def train_failure(error: BaseException) -> tuple[str, int] | None:
  """train.py's wording and status of a failure (see the table in the module docstring)."""
  from flax_transformer.train.interruption import Interrupted

  if isinstance(error, Interrupted):
    return str(error), error.exit_code
  if isinstance(error, KeyboardInterrupt):
    return (
      'interrupted by SIGINT, nothing more saved; the checkpoints on disk are complete: '
      'run the same command to resume from the latest'
    ), 128 + signal.SIGINT
  if isinstance(error, signals.Stopped):
    return (
      f'{error} before the first step (while loading); nothing new was saved: run the '
      'same command to resume from the latest checkpoint, if any'
    ), error.exit_code
  if isinstance(error, MemoryError):
    return 'error: out of memory; choose a smaller model or train.max_tokens', 1
  if _device_out_of_memory(error):
    # XLA's estimate for a batch shape comes only when that shape first compiles and runs,
    # so a run can pass the step before and fail here: the saved checkpoints are complete.
    detail = str(error).strip().splitlines()[0].split('RESOURCE_EXHAUSTED:', 1)[-1].strip()
    return (
      f'error: the device ran out of memory in a training step ({detail}); lower '
      '--train.max_tokens (tokens per batch) or the model size; the checkpoints on disk '
      'are complete: run again to resume'
    ), 1
  for base, status in TRAIN_STATUS:
    if isinstance(error, base):
      return f'error: {error}', status
  return None


def _device_out_of_memory(error: BaseException) -> bool:
  """XLA's out-of-memory error (on any device, the CPU included)."""
  import jax

  return isinstance(error, jax.errors.JaxRuntimeError) and 'RESOURCE_EXHAUSTED' in str(error)


@contextlib.contextmanager
def _quiet_libraries(debug: bool) -> Iterator[None]:
  """Silences tracebacks of the library's threads and its warnings, unless debugging."""
  if debug:
    yield
    return
  hooks = sys.unraisablehook, threading.excepthook
  # orbax logs each failed write thread's traceback (absl); asyncio each of its failed
  # futures that nobody awaited ("Future exception was never retrieved").
  loggers = [logging.getLogger(name) for name in ('absl', 'asyncio')]
  levels = [logger.level for logger in loggers]
  sys.unraisablehook = threading.excepthook = lambda unraisable: None
  for logger in loggers:
    logger.setLevel(logging.CRITICAL + 1)
  try:
    yield
  finally:
    sys.unraisablehook, threading.excepthook = hooks
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def _after_the_work(script: str, status: int, number: int | None) -> int:
  """The program's status, or 128 + `number` with its line if a signal came that no safe point
  acted on (in the last instant of the work): the work is done, so nothing is lost."""
  if status != 0 or number is None:
    return status
  _say(
    script, f'stopped by {signal.Signals(number).name} after its work was done (nothing is lost)'
  )
  return 128 + number


def _end_process(script: str, status: int) -> None:
  """Ends the process with `status` once the work is done, after the atexit callbacks (which
  may still save: coverage, logging) but without the interpreter's teardown.

  Python restores the default SIGTERM action before that teardown, which takes seconds as
  JAX and orbax close: a SIGTERM then would end the process without a word. A signal during
  the callbacks or the last flush still gets its line and status: it is read last, a few
  bytecodes before the exit (a signal after that meets a process that has ended its work).
  """
  atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(OSError, ValueError):  # a callback may have closed it
      stream.flush()
  status = _after_the_work(script, status, signals.received())
  os._exit(status)


def _say(script: str, line: str) -> None:
  """'SCRIPT: LINE' on standard error, after what standard output holds."""
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
  print(f'{script}: {line}', file=sys.stderr, flush=True)


@contextlib.contextmanager
def deadline(
  seconds: float, script: str, line: str, status: int, waiting: str = ''
) -> Iterator[None]:
  """Ends the process with 'SCRIPT: LINE' and `status` unless the block is done within
  `seconds`: for a main thread stuck in a call that no exception or signal handler reaches
  (JAX's C++ multi-host start-up), which only another thread can end. `waiting`: a line
  printed first (standard error), saying what the block waits for and until when."""
  if waiting:
    print(f'{script}: {waiting}', file=sys.stderr, flush=True)
  timer = threading.Timer(seconds, end_process_now, (script, line, status))
  timer.daemon = True
  timer.start()
  try:
    yield
  finally:
    timer.cancel()


def end_process_now(script: str, line: str, status: int) -> None:
  """Prints 'SCRIPT: LINE' and ends the process with `status` at once, from any thread: for a
  main thread stuck where no exception reaches (a C++ call that will abort)."""
  with contextlib.suppress(OSError, ValueError):
    sys.stdout.flush()
    print(f'{script}: {line}', file=sys.stderr, flush=True)
  os._exit(status)
