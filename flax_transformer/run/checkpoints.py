"""Orbax checkpoints of a run directory: save, restore, check, set aside.

    WORKDIR/checkpoints/<step>/     item 'params', item 'train' (step + optimizer state)

Reading a finished run for decoding, and averaging its checkpoints, is
`loading.py`'s; the rest of the run directory (config.json, tokenizer.json) is
`directory.py`'s.

Damage: once a save is known to be complete, the SHA-256 of each of its files
is recorded in `<step>/sha256sums.json`; a restore checks them, then compares
the saved arrays' names and shapes (orbax's metadata) with the model's before
reading any array (`checkpoint_layout.py`). A file that changed, is missing or
cannot be read raises `DamagedCheckpoint` naming the step and the file; arrays
that do not fit the model of config.json raise `CheckpointError` listing the
first differences.
Training resumes from the newest intact checkpoint and moves damaged ones to
`checkpoints/damaged-<step>` (`set_aside`), outside orbax's step listing.

Rotation: a reader beside a live training run (decoding while it saves, with
train.keep_checkpoints 1) may see the checkpoint it reads deleted by the run's
max_to_keep. A read that fails once the step's directory is gone (or while a
newer step exists and the directory goes within `_ROTATION_WAIT_S`, orbax
deleting it file by file) raises `RotatedCheckpoint`, not `DamagedCheckpoint`:
nothing is wrong with the run, and the reader moves on to the newest one
(`loading.load_for_inference`).

Crash safety: orbax writes each checkpoint to `<step>.orbax-checkpoint-tmp` and
renames it when complete, so a process killed at any moment leaves every
checkpoint either absent or complete. A training run's `Checkpoints` deletes
such leftover temporary directories when it starts.

Nothing here imports the training step or optax: decoding loads checkpoints
without them.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from flax_transformer.config import ModelConfig
from flax_transformer.errors import (
  CheckpointError,
  DamagedCheckpoint,
  RotatedCheckpoint,
  WriteError,
)
from flax_transformer.files import file_digest
from flax_transformer.run.checkpoint_layout import check_layout, check_shapes, shapes_by_name
from flax_transformer.run.directory import CHECKPOINT_DIR

__all__ = ['CheckpointError', 'Checkpoints', 'DamagedCheckpoint', 'RotatedCheckpoint', 'WriteError']

# In each step's directory: {path relative to it: SHA-256} of the files orbax wrote.
DIGESTS_FILE = 'sha256sums.json'
PARAMS_OF_CONFIG = 'parameters of the model in config.json'
# How long a failed read waits for its step's directory to go, when a newer step shows that a
# writer's max_to_keep is deleting it (orbax deletes file by file, the directory last).
_ROTATION_WAIT_S = 1.0


class Checkpoints:
  """orbax `CheckpointManager` over WORKDIR/checkpoints.

  Each step is saved as two items, 'params' and 'train' ({'step', 'opt_state'}),
  so inference restores the parameters without reading the optimizer state.
  Saving is asynchronous: `save` returns once the arrays are copied, and the
  files are written in the background; `check_saved` reports a failed write as
  soon as the background write ends, and `close` waits for it. Write failures
  raise `WriteError`.

  A writer deletes the temporary directories that a process killed while
  saving left behind. Readers (decoding, averaging) pass read_only=True: they
  must not delete the save in progress of a live run.
  """

  def __init__(
    self,
    workdir: str | Path,
    keep: int | None = None,
    read_only: bool = False,
    on_unverified: Callable[[str], object] | None = None,
  ):
    """on_unverified: None refuses a checkpoint without recorded digests as damaged (its
    files cannot be checked); a function loads it and is given the line saying so (the
    programs' --allow-unverified)."""
    self.directory = (Path(workdir) / CHECKPOINT_DIR).resolve()
    self._on_unverified = on_unverified
    # The caller decides when to save: orbax's own interval policy also saves the
    # first step of every run, which would then count among the last K averaged.
    # Not orbax's own read_only option, which logs three warnings on every use.
    options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=not read_only, cleanup_tmp_directories=not read_only
    )
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    except OSError as error:
      raise WriteError(
        f'{self.directory}: cannot create the checkpoint directory ({error.strerror or error})'
      ) from error
    self._unconfirmed_step: int | None = None  # a save not yet known to have succeeded
    self._closed = False
    # Steps whose files matched their digests: a complete checkpoint does not change under
    # us, so decoding's layer check and its restore hash the files once, not twice.
    self._verified: set[int] = set()

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def reload(self) -> list[int]:
    """The steps on disk now (`steps` is the listing read when opened, or last reloaded)."""
    self._manager.reload()
    return self.steps()

  def save(self, state) -> None:
    """Saves a host (numpy) or fully replicated `TrainState` at its own `step`.

    Raises WriteError if this save cannot start or an earlier one failed.
    """
    self._save(
      int(state.step),
      ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        train=ocp.args.StandardSave({'step': state.step, 'opt_state': state.opt_state}),
      ),
    )

  def _save(self, step: int, args: ocp.args.Composite) -> None:
    self._wait()  # an earlier save's failure surfaces here rather than inside orbax's save
    try:
      self._manager.save(step, force=True, args=args)
    except _WRITE_ERRORS as error:
      raise self._write_error(step, error) from error
    self._unconfirmed_step = step

  def check_saved(self) -> None:
    """Raises WriteError if the last save failed; returns at once while it is still writing.

    Cheap enough to call after every training step, so that a run whose save
    failed (full disk) stops then, rather than training on as if it had saved.
    """
    if self._unconfirmed_step is not None and not self._manager.is_saving_in_progress():
      self._wait()

  def _wait(self) -> None:
    """Waits for the pending save and raises WriteError if it failed."""
    if self._unconfirmed_step is None:
      return
    step, self._unconfirmed_step = self._unconfirmed_step, None
    try:
      self._manager.wait_until_finished()
      if jax.process_index() == 0:
        self._record_digests(step)
    except _WRITE_ERRORS as error:
      raise self._write_error(step, error) from error

  def _record_digests(self, step: int) -> None:
    """Writes <step>/sha256sums.json for the complete checkpoint at `step`."""
    directory = self.directory / str(step)
    if not directory.is_dir():  # already deleted by max_to_keep
      return
    digests = {
      str(path.relative_to(directory)): file_digest(path)
      for path in sorted(directory.rglob('*'))
      if path.is_file()
    }
    temporary = directory / f'.{DIGESTS_FILE}.tmp'
    temporary.write_text(json.dumps(digests, indent=0))
    temporary.replace(directory / DIGESTS_FILE)

  def _write_error(self, step: int, error: Exception) -> WriteError:
    kept = [s for s in self._manager.all_steps() if s != step]
    previous = (
      f'the previous checkpoint, {self.directory / str(max(kept))}, is intact'
      if kept
      else 'no earlier checkpoint exists'
    )
    return WriteError(
      f'{self.directory / str(step)}: the checkpoint could not be written '
      f'({type(error).__name__}: {_short(error)}); {previous}. Free disk space or '
      'fix the permissions, then run again to resume'
    )

  def restore(self, step: int, abstract_state):
    """The TrainState saved at `step`, as numpy arrays shaped like `abstract_state`.

    `abstract_state` has `jax.ShapeDtypeStruct` leaves, e.g. from
    `jax.eval_shape(create_train_state, ...)`.
    """
    items = {
      'params': abstract_state.params,
      'train': {'step': abstract_state.step, 'opt_state': abstract_state.opt_state},
    }
    restored = self._restore(step, items, 'a training state of this model and optimizer')
    return abstract_state.replace(
      step=restored['train']['step'],
      params=restored['params'],
      opt_state=restored['train']['opt_state'],
    )

  def restore_params(self, step: int, abstract_params) -> Any:
    """The parameters saved at `step`, as numpy arrays shaped like `abstract_params`."""
    items = {'params': abstract_params}
    return self._restore(step, items, PARAMS_OF_CONFIG)['params']

  @contextlib.contextmanager
  def _reading(self, step: int) -> Iterator[None]:
    """Turns a failure while reading `step` into RotatedCheckpoint if a writer deleted it."""
    try:
      yield
    except Exception as error:
      # A step never listed is missing, not rotated (the listing is the one read at start).
      if step not in self.steps() or not self._rotated_away(step):
        raise
      newer = [s for s in self._steps_on_disk() if s > step]
      raise RotatedCheckpoint(
        f'{self.directory / str(step)}: checkpoint {step} was deleted while it was read '
        f'(rotated away by the training run writing there, which keeps its last '
        f'train.keep_checkpoints; not damaged); newer: {", ".join(map(str, newer)) or "none"}',
        step,
      ) from error

  def _rotated_away(self, step: int) -> bool:
    """Whether `step`'s directory is gone, or goes within _ROTATION_WAIT_S while a newer step
    exists (a writer's max_to_keep deleting it)."""
    deadline = time.monotonic() + _ROTATION_WAIT_S
    while (self.directory / str(step)).is_dir():
      if time.monotonic() > deadline or not any(s > step for s in self._steps_on_disk()):
        return False
      time.sleep(0.05)
    return True

  def _steps_on_disk(self) -> list[int]:
    """The finished steps in the directory now (orbax's listing is cached at start)."""
    try:
      return sorted(int(path.name) for path in self.directory.iterdir() if path.name.isdigit())
    except OSError:
      return []

  def _restore(self, step: int, abstract_items: dict[str, Any], what: str) -> dict[str, Any]:
    """The named items saved at `step`: files checked, then layout, then read."""
    where = self.directory / str(step)
    with self._reading(step):
      self._check_step(step)
      self.check_digests(step)
      for name, tree in abstract_items.items():
        check_layout(_item_metadata(where, name, step), tree, where, what)
      args = {
        name: ocp.args.StandardRestore(_host_target(tree)) for name, tree in abstract_items.items()
      }
      try:
        restored = self._manager.restore(step, args=ocp.args.Composite(**args))
      except (ValueError, KeyError, OSError, RuntimeError) as error:
        # The names and shapes fit (checked above): what cannot be read is damaged.
        raise _damaged(where, step, error) from error
    restored = {name: restored[name] for name in abstract_items}
    check_shapes(restored, abstract_items, where)
    return restored

  def check_digests(self, step: int) -> None:
    """Raises DamagedCheckpoint unless every file of `step` is one its recorded SHA-256s
    list, unchanged: a file missing, changed, or not listed, or no digests at all.

    A checkpoint without recorded digests (its process was killed before the save was
    confirmed, an older run, or the file deleted) cannot be verified, so it is damaged
    too, unless `on_unverified` was given: then it is loaded, and said so. Each step is
    hashed once.
    """
    if step in self._verified:
      return
    where = self.directory / str(step)
    try:
      digests = json.loads((where / DIGESTS_FILE).read_text())
    except FileNotFoundError:
      self._unverified(step, where)
      return
    except (OSError, ValueError) as error:
      raise DamagedCheckpoint(
        f'{where}: damaged checkpoint (step {step}): {DIGESTS_FILE} cannot be read ({error})',
        step,
        where / DIGESTS_FILE,
      ) from error
    if not isinstance(digests, dict):
      raise DamagedCheckpoint(
        f'{where}: damaged checkpoint (step {step}): {DIGESTS_FILE} is not '
        'a JSON object of file names and SHA-256s',
        step,
        where / DIGESTS_FILE,
      )
    unlisted = sorted(
      str(path.relative_to(where))
      for path in where.rglob('*')
      if path.is_file()
      and path.name not in (DIGESTS_FILE, f'.{DIGESTS_FILE}.tmp')
      and str(path.relative_to(where)) not in digests
    )
    if unlisted:
      raise DamagedCheckpoint(
        f'{where}: damaged checkpoint (step {step}): {unlisted[0]} is not '
        f'among the files written (not listed in {DIGESTS_FILE})',
        step,
        where / unlisted[0],
      )
    for name, digest in digests.items():
      path = where / name
      if not path.is_file():
        raise DamagedCheckpoint(
          f'{where}: damaged checkpoint (step {step}): {name} is missing', step, path
        )
      if file_digest(path) != digest:
        raise DamagedCheckpoint(
          f'{where}: damaged checkpoint (step {step}): {name} is not the '
          'file written (its SHA-256 differs from the one recorded in '
          f'{DIGESTS_FILE})',
          step,
          path,
        )
    self._verified.add(step)

  def _unverified(self, step: int, where: Path) -> None:
    """A checkpoint without digests: DamagedCheckpoint, or loaded and reported."""
    if self._on_unverified is None:
      raise DamagedCheckpoint(
        f'{where}: unverified checkpoint (step {step}): it has no {DIGESTS_FILE}, so its files '
        'cannot be checked against what was written; --allow-unverified loads it anyway',
        step,
        where / DIGESTS_FILE,
      )
    self._on_unverified(
      f'{where}: checkpoint {step} NOT VERIFIED (no {DIGESTS_FILE}); loaded '
      'as --allow-unverified asks'
    )
    self._verified.add(step)

  def check_layers(self, step: int, config: ModelConfig, what: str) -> None:
    """Raises CheckpointError if `step` saves other numbers of layers than `config` has.

    Read from the metadata alone, with the missing (or extra) layers named after
    the saved layer_0: cheaper than the model's abstract parameters, which trace
    every layer of a config.json that asks for thousands.
    """
    where = self.directory / str(step)
    with self._reading(step):
      self.check_digests(step)
      saved = shapes_by_name(_item_metadata(where, 'params', step))
    needed = {}
    for name, shape in saved.items():
      side, layer, rest = (name.split('/', 2) + ['', ''])[:3]
      if side not in ('encoder', 'decoder') or not re.fullmatch(r'layer_\d+', layer):
        needed[name] = shape
      elif layer == 'layer_0':
        for index in range(getattr(config, f'num_{side}_layers')):
          needed[f'{side}/layer_{index}/{rest}'] = shape
    if len(needed) != len(saved) or needed.keys() != saved.keys():
      check_layout(saved, needed, where, what, shaped=False)

  def set_aside(self, step: int) -> Path:
    """Moves checkpoint `step` to checkpoints/damaged-<step> (process 0); returns that path."""
    aside = self.directory / f'damaged-{step}'
    suffix = 1
    while aside.exists():
      suffix += 1
      aside = self.directory / f'damaged-{step}-{suffix}'
    if jax.process_index() == 0:
      (self.directory / str(step)).rename(aside)
    self._verified.discard(step)  # a later save may write this step afresh
    multihost_utils.sync_global_devices(f'checkpoint {step} set aside')
    self._manager.reload()
    return aside

  def save_params(self, step: int, params) -> None:
    self._save(step, ocp.args.Composite(params=ocp.args.StandardSave(params)))

  def close(self) -> None:
    """Waits for pending saves to finish and releases the manager; raises WriteError if one failed.

    Closing again does nothing.
    """
    if self._closed:
      return
    self._closed = True
    try:
      self._wait()
    finally:
      self._manager.close()

  def _check_step(self, step: int) -> None:
    steps = self.steps()
    if step not in steps:
      have = ', '.join(map(str, steps)) if steps else 'none'
      raise CheckpointError(f'{self.directory}: no checkpoint at step {step} (have: {have})')


# What orbax and tensorstore raise when a file cannot be written: OSError from Python's own
# file operations, ValueError (tensorstore's status codes) or RuntimeError from the rest.
_WRITE_ERRORS = (OSError, ValueError, RuntimeError)


def _item_metadata(where: Path, item: str, step: int):
  """orbax's metadata (names, shapes, dtypes) of an item, read without its arrays."""
  try:
    return ocp.StandardCheckpointHandler().metadata(where / item)
  except (ValueError, KeyError, OSError, TypeError) as error:
    raise DamagedCheckpoint(
      f'{where}: damaged checkpoint (step {step}): {item}/_METADATA cannot '
      f'be read ({_short(error)})',
      step,
      where / item / '_METADATA',
    ) from error


def _damaged(where: Path, step: int, error: Exception) -> DamagedCheckpoint:
  """A failed read as DamagedCheckpoint naming the array and item directory tensorstore names."""
  text = str(error)
  array = re.search(r'Error reading "([^"/]+)', text)
  item = re.search(r'local file "([^"]+)"', text)
  file = Path(item.group(1)) if item else where
  name = f'the array {array.group(1)} in {file}' if array else str(file)
  return DamagedCheckpoint(
    f'{where}: damaged checkpoint (step {step}): {name} cannot be read ({_short(error)})',
    step,
    file,
  )


def _short(error: Exception) -> str:
  """The end of a tensorstore message, after its (long) spec and file names: the cause."""
  text = str(error).splitlines()[0] if str(error) else type(error).__name__
  text = re.sub(r'^.*"[^"]*": ', '', text)  # after the last quoted name (file, array, spec)
  return text if len(text) <= 160 else text[:157] + '...'


def _host_target(tree):
  """ShapeDtypeStruct leaves -> zero numpy arrays: orbax then restores to host memory,
  which suits every device layout (the caller replicates) and any number of processes."""
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)
