"""Calling the command-line scripts' `main(argv)` in-process, as the CLI tests do."""

import contextlib
import io
import re

import pytest


def call(main, argv) -> tuple[int, str, str]:
  """A script's `main(argv)`: (exit status, argparse's SystemExit included; stdout; stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
      status = main([str(a) for a in argv])
    except SystemExit as exit_info:
      status = exit_info.code
  return status, out.getvalue(), err.getvalue()


def error_line(err: str, script: str) -> str:
  """The script's one error line on standard error (the rest: progress bars, warnings)."""
  (line,) = [line for line in re.split(r'[\r\n]', err) if line.startswith(f'{script}: error')]
  return line


def usage_error(main, argv) -> str:
  """Standard error of `main(argv)`, which must stop with SystemExit(2), as argparse refuses."""
  err = io.StringIO()
  with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  return err.getvalue()
