"""flax_transformer/errors.py: one hierarchy of the library's errors, and the exit status each
program gives them by base class (cli/failures.py)."""

import ast
import importlib
from pathlib import Path

import pytest

from flax_transformer import errors
from flax_transformer.cli.failures import train_failure

PACKAGE = Path(errors.__file__).resolve().parent
# Exceptions that are not errors of the library: a program's reported failure, a signal's stop
# (a BaseException, as KeyboardInterrupt), a run interrupted after saving.
NOT_ERRORS = {'Failure', 'Stopped', 'Interrupted'}


def test_every_exception_class_of_the_package_is_defined_in_errors():
  elsewhere = []
  for path in PACKAGE.rglob('*.py'):
    if path.name == 'errors.py':
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and node.name not in NOT_ERRORS:
        bases = {ast.unparse(base) for base in node.bases}
        if any(base.endswith(('Error', 'Exception')) for base in bases):
          elsewhere.append(f'{path.relative_to(PACKAGE)}: {node.name}')
  assert not elsewhere, f'exception classes outside errors.py: {elsewhere}'


def test_each_error_is_one_class_under_error_that_keeps_its_builtin_base_and_old_home():
  homes = {
    'ConfigError': 'config',
    'DataError': 'data.corpus',
    'CacheError': 'data.cache',
    'TokenizerError': 'data.tokenizer',
    'CheckpointError': 'run.directory',
    'NotARun': 'run.directory',
    'WriteError': 'run.directory',
    'DamagedCheckpoint': 'run.checkpoints',
    'RotatedCheckpoint': 'run.checkpoints',
    'RunDirectoryInUse': 'run.lock',
    'DistillError': 'train.distill',
    'NonFiniteError': 'train.loop',
    'InputError': 'cli.text_io',
    'PretrainedError': 'pretrained.marian',
    'ExportError': 'pretrained.export',
  }
  assert set(homes) == set(errors.__all__) - {'Error'}
  for name, home in homes.items():
    cls = getattr(errors, name)
    assert getattr(importlib.import_module(f'flax_transformer.{home}'), name) is cls, name
    assert issubclass(cls, errors.Error) != issubclass(cls, OSError), name
  # `except ValueError` catches what it caught before the move.
  for name in ('ConfigError', 'DataError', 'TokenizerError', 'CheckpointError', 'DistillError'):
    assert issubclass(getattr(errors, name), ValueError), name
  assert issubclass(errors.NonFiniteError, RuntimeError)
  assert issubclass(errors.RunDirectoryInUse, RuntimeError)
  assert issubclass(errors.PretrainedError, errors.ConfigError)
  assert issubclass(errors.CacheError, errors.DataError)


@pytest.mark.parametrize(
  'error, status',
  [
    (errors.ConfigError('model.d_model must be a positive integer, got 0'), 2),
    (errors.PretrainedError('opus: no config.json'), 2),
    (errors.NotARun('run: holds what no run of train.py wrote: notes.txt'), 2),
    (errors.NonFiniteError('step 7: the loss is nan', step=7), 3),
    (errors.DataError('train.en, line 3: empty'), 1),
    (errors.DamagedCheckpoint('step 4: params changed', step=4, file=Path('params')), 1),
    (errors.RunDirectoryInUse('run is in use by process 12'), 1),
    (errors.WriteError(28, 'No space left on device'), 1),
  ],
)
def test_train_py_maps_each_error_to_its_status_by_base_class(error, status):
  line, code = train_failure(error)
  assert (line, code) == (f'error: {error}', status)


def test_an_error_outside_the_library_is_left_to_the_generic_wording():
  assert train_failure(ZeroDivisionError('division by zero')) is None
