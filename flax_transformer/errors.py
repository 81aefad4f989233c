"""Every error the library raises on purpose, as one hierarchy: its message names the problem.

    Error                         what the library refuses or cannot do; the message is shown as is
    ├── ConfigError               a setting or option (its name and value)
    │   ├── PretrainedError       a directory that is not a Marian model this library loads
    │   └── ExportError           a model Marian cannot express (the setting)
    ├── DataError                 the data (the file, line or option at fault)
    │   └── CacheError            the corpus cache (the directory and what to do)
    ├── TokenizerError            a tokenizer that cannot be trained, loaded or used
    ├── CheckpointError           a run directory or checkpoint: missing, incomplete, another model
    │   ├── NotARun               a --workdir holding what no run of train.py wrote
    │   ├── DamagedCheckpoint     a checkpoint's file changed or unreadable after it was written
    │   └── RotatedCheckpoint     a checkpoint deleted while read (rotated by the run beside it)
    ├── RunDirectoryInUse         another process holds the run directory's lock
    ├── DistillError              a distillation that cannot run as asked
    ├── InputError                a program's command-line input (decode.py's text)
    └── NonFiniteError            a training step's loss or gradient not finite
    WriteError (an OSError)       a file of the run directory could not be written

Each class keeps the builtin base it always had (ConfigError is a ValueError,
RunDirectoryInUse a RuntimeError), so `except ValueError` still catches what it caught. The
programs map a failure to its exit status by these base classes (cli/failures.py's tables:
`except Error` is every failure that names its problem). Their old homes (`config.ConfigError`,
`data.corpus.DataError`, ...) still hold the same classes.

The bottom layer: imports nothing of the package, so any module can raise these.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
  'CacheError',
  'CheckpointError',
  'ConfigError',
  'DamagedCheckpoint',
  'DataError',
  'DistillError',
  'Error',
  'ExportError',
  'InputError',
  'NonFiniteError',
  'NotARun',
  'PretrainedError',
  'RotatedCheckpoint',
  'RunDirectoryInUse',
  'TokenizerError',
  'WriteError',
]


class Error(Exception):
  """What the library refuses or cannot do; the message names the file, setting or value."""


class ConfigError(Error, ValueError):
  """A configuration value is invalid; the message names the option."""


class PretrainedError(ConfigError):
  """A directory is not a Marian model this library can load; the message says why.

  A ConfigError: the programs report it as they report a bad setting, in one line.
  """


class ExportError(ConfigError):
  """The model cannot be written as a Marian model; the message names the setting."""


class DataError(Error, ValueError):
  """The data cannot be loaded; the message names the file, line or option at fault."""


class CacheError(DataError):
  """The cache cannot be used or written; the message names the directory and what to do."""


class TokenizerError(Error, ValueError):
  """A tokenizer cannot be trained, loaded or used; the message says which and why."""


class CheckpointError(Error, ValueError):
  """A run directory or checkpoint is missing, incomplete or does not fit the request."""


class NotARun(CheckpointError):
  """A directory train.py was asked to write or clear holds what no run of it wrote (a
  pretrained model, an averaged output, another tool's files); nothing in it was touched."""


class DamagedCheckpoint(CheckpointError):
  """A checkpoint's files cannot be read or changed after they were written.

  step: the checkpoint's step; file: the damaged file (or item directory).
  """

  def __init__(self, message: str, step: int, file: Path):
    super().__init__(message)
    self.step = step
    self.file = file


class RotatedCheckpoint(CheckpointError):
  """A checkpoint was deleted while it was read: rotated away by the run writing beside the
  reader (its train.keep_checkpoints), not damaged. step: the checkpoint's step."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class RunDirectoryInUse(Error, RuntimeError):
  """Another process holds the run directory's lock."""


class DistillError(Error, ValueError):
  """The distillation cannot run as asked; the message names the option at fault."""


class InputError(Error):
  """Bad command-line input: the message is shown as is."""


class NonFiniteError(Error, RuntimeError):
  """Training stopped at a step whose loss or gradient was not finite.

  step: the step (numbered as in metrics.jsonl and the checkpoints: the s-th batch).
  """

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class WriteError(OSError):
  """A file of the run directory could not be written (no permission, disk full, ...).

  The message names the path; the files written before are intact. An OSError, as the write
  that failed: a program reports it as it reports any failed write.
  """
