"""Orbax checkpoints of a run directory: save, restore, load for decoding, average.

    WORKDIR/checkpoints/<step>/     item 'params', item 'train' (step + optimizer state)

`load_for_inference(workdir)` gives (ModelConfig, params, Tokenizer) for decoding;
`average_checkpoints(workdir, 5)` writes WORKDIR/average-last5/, itself a run
directory whose one checkpoint holds the mean of the last 5 parameter sets, so
decoding reads it like any other. The rest of the run directory (config.json,
tokenizer.json) is `run_directory.py`'s.

Damage: once a save is known to be complete, the SHA-256 of each of its files
is recorded in `<step>/sha256sums.json`; a restore checks them, then compares
the saved arrays' names and shapes (orbax's metadata) with the model's before
reading any array. A file that changed, is missing or cannot be read raises
`DamagedCheckpoint` naming the step and the file; arrays that do not fit the
model of config.json raise `CheckpointError` listing the first differences.
Training resumes from the newest intact checkpoint and moves damaged ones to
`checkpoints/damaged-<step>` (`set_aside`), outside orbax's step listing.

Crash safety: orbax writes each checkpoint to `<step>.orbax-checkpoint-tmp` and
renames it when complete, so a process killed at any moment leaves every
checkpoint either absent or complete. A training run's `Checkpoints` deletes
such leftover temporary directories when it starts.

Nothing here imports the training step or optax: decoding loads checkpoints
without them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from flax_transformer.build import abstract_params
from flax_transformer.config import ModelConfig
from flax_transformer.run_directory import (CHECKPOINT_DIR, CONFIG_FILE, METRICS_FILE,
                                            TENSORBOARD_DIR, CheckpointError, WriteError,
                                            check_tokenizer, check_tokenizer_fits, file_digest,
                                            read_config)
from flax_transformer.sizes import check_fits
from flax_transformer.tokenizer import FILE_NAME as TOKENIZER_FILE
from flax_transformer.tokenizer import Tokenizer, load_tokenizer

__all__ = ['CheckpointError', 'Checkpoints', 'DamagedCheckpoint', 'WriteError',
           'average_checkpoints', 'load_for_inference']

# In each step's directory: {path relative to it: SHA-256} of the files orbax wrote.
DIGESTS_FILE = 'sha256sums.json'
_PARAMS_OF_CONFIG = 'parameters of the model in config.json'
# At most this many differing arrays are named when a checkpoint does not fit the model.
_SHOWN_DIFFERENCES = 3


class DamagedCheckpoint(CheckpointError):
  """A checkpoint's files cannot be read or changed after they were written.

  step: the checkpoint's step; file: the damaged file (or item directory).
  """

  def __init__(self, message: str, step: int, file: Path):
    super().__init__(message)
    self.step = step
    self.file = file


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

  def __init__(self, workdir: str | Path, keep: int | None = None, read_only: bool = False):
    self.directory = (Path(workdir) / CHECKPOINT_DIR).resolve()
    # The caller decides when to save: orbax's own interval policy also saves the
    # first step of every run, which would then count among the last K averaged.
    # Not orbax's own read_only option, which logs three warnings on every use.
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                           cleanup_tmp_directories=not read_only)
    try:
      self._manager = ocp.CheckpointManager(self.directory, options=options)
    except OSError as error:
      raise WriteError(f'{self.directory}: cannot create the checkpoint directory '
                       f'({error.strerror or error})') from error
    self._unconfirmed_step: int | None = None  # a save not yet known to have succeeded
    self._closed = False
    # Steps whose files matched their digests: a complete checkpoint does not change under
    # us, so decoding's layer check and its restore hash the files once, not twice.
    self._verified: set[int] = set()

  def steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, state) -> None:
    """Saves a host (numpy) or fully replicated `TrainState` at its own `step`.

    Raises WriteError if this save cannot start or an earlier one failed.
    """
    self._save(int(state.step), ocp.args.Composite(
        params=ocp.args.StandardSave(state.params),
        train=ocp.args.StandardSave({'step': state.step, 'opt_state': state.opt_state})))

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
    digests = {str(path.relative_to(directory)): file_digest(path)
               for path in sorted(directory.rglob('*')) if path.is_file()}
    temporary = directory / f'.{DIGESTS_FILE}.tmp'
    temporary.write_text(json.dumps(digests, indent=0))
    temporary.replace(directory / DIGESTS_FILE)

  def _write_error(self, step: int, error: Exception) -> WriteError:
    kept = [s for s in self._manager.all_steps() if s != step]
    previous = (f'the previous checkpoint, {self.directory / str(max(kept))}, is intact' if kept
                else 'no earlier checkpoint exists')
    return WriteError(f'{self.directory / str(step)}: the checkpoint could not be written '
                      f'({type(error).__name__}: {_short(error)}); {previous}. Free disk space or '
                      'fix the permissions, then run again to resume')

  def restore(self, step: int, abstract_state):
    """The TrainState saved at `step`, as numpy arrays shaped like `abstract_state`.

    `abstract_state` has `jax.ShapeDtypeStruct` leaves, e.g. from
    `jax.eval_shape(create_train_state, ...)`.
    """
    items = {'params': abstract_state.params,
             'train': {'step': abstract_state.step, 'opt_state': abstract_state.opt_state}}
    restored = self._restore(step, items, 'a training state of this model and optimizer')
    return abstract_state.replace(step=restored['train']['step'], params=restored['params'],
                                  opt_state=restored['train']['opt_state'])

  def restore_params(self, step: int, abstract_params) -> Any:
    """The parameters saved at `step`, as numpy arrays shaped like `abstract_params`."""
    items = {'params': abstract_params}
    return self._restore(step, items, _PARAMS_OF_CONFIG)['params']

  def _restore(self, step: int, abstract_items: dict[str, Any], what: str) -> dict[str, Any]:
    """The named items saved at `step`: files checked, then layout, then read."""
    self._check_step(step)
    where = self.directory / str(step)
    self.verify(step)
    for name, tree in abstract_items.items():
      _check_layout(_item_metadata(where, name, step), tree, where, what)
    args = {name: ocp.args.StandardRestore(_host_target(tree))
            for name, tree in abstract_items.items()}
    try:
      restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    except (ValueError, KeyError, OSError, RuntimeError) as error:
      # The names and shapes fit (checked above): what cannot be read is damaged.
      raise _damaged(where, step, error) from error
    restored = {name: restored[name] for name in abstract_items}
    _check_shapes(restored, abstract_items, where)
    return restored

  def verify(self, step: int) -> None:
    """Raises DamagedCheckpoint if a file of `step` differs from its recorded SHA-256.

    A checkpoint without recorded digests (its process was killed before the save
    was confirmed, or an older run) is not checked here. Each step is hashed once.
    """
    if step in self._verified:
      return
    where = self.directory / str(step)
    try:
      digests = json.loads((where / DIGESTS_FILE).read_text())
    except FileNotFoundError:
      return
    except (OSError, ValueError) as error:
      raise DamagedCheckpoint(f'{where}: damaged checkpoint (step {step}): {DIGESTS_FILE} cannot '
                              f'be read ({error})', step, where / DIGESTS_FILE) from error
    for name, digest in digests.items():
      path = where / name
      if not path.is_file():
        raise DamagedCheckpoint(f'{where}: damaged checkpoint (step {step}): {name} is missing',
                                step, path)
      if file_digest(path) != digest:
        raise DamagedCheckpoint(f'{where}: damaged checkpoint (step {step}): {name} is not the '
                                'file written (its SHA-256 differs from the one recorded in '
                                f'{DIGESTS_FILE})', step, path)
    self._verified.add(step)

  def check_layers(self, step: int, config: ModelConfig, what: str) -> None:
    """Raises CheckpointError if `step` saves other numbers of layers than `config` has.

    Read from the metadata alone, with the missing (or extra) layers named after
    the saved layer_0: cheaper than the model's abstract parameters, which trace
    every layer of a config.json that asks for thousands.
    """
    where = self.directory / str(step)
    self.verify(step)
    saved = _shapes_by_name(_item_metadata(where, 'params', step))
    needed = {}
    for name, shape in saved.items():
      side, layer, rest = (name.split('/', 2) + ['', ''])[:3]
      if side not in ('encoder', 'decoder') or not re.fullmatch(r'layer_\d+', layer):
        needed[name] = shape
      elif layer == 'layer_0':
        for index in range(getattr(config, f'num_{side}_layers')):
          needed[f'{side}/layer_{index}/{rest}'] = shape
    if len(needed) != len(saved) or needed.keys() != saved.keys():
      _check_layout(saved, needed, where, what, shaped=False)

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
    raise DamagedCheckpoint(f'{where}: damaged checkpoint (step {step}): {item}/_METADATA cannot '
                            f'be read ({_short(error)})', step, where / item / '_METADATA'
                            ) from error


def _key_name(entry) -> str:
  for attribute in ('key', 'name', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def _shapes_by_name(tree) -> dict[str, tuple[int, ...]]:
  """{'encoder/layer_0/.../kernel': shape}; namedtuples and dicts alike (orbax saves dicts)."""
  return {'/'.join(map(_key_name, path)): tuple(leaf.shape)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _check_layout(metadata, abstract, where: Path, what: str, shaped: bool = True) -> None:
  """Raises CheckpointError naming the first arrays whose names or shapes differ.

  `metadata` and `abstract` are trees of arrays, or (shaped=False) their `_shapes_by_name`.
  """
  saved, needed = ((_shapes_by_name(metadata), _shapes_by_name(abstract)) if shaped
                   else (metadata, abstract))
  differences = []
  for name in sorted(set(saved) | set(needed)):
    if name not in saved:
      differences.append(f'{name} {needed[name]} is not saved')
    elif name not in needed:
      differences.append(f'{name} {saved[name]} is saved but not in the model')
    elif saved[name] != needed[name]:
      differences.append(f'{name} is saved as {saved[name]}, the model needs {needed[name]}')
  if differences:
    shown = '; '.join(differences[:_SHOWN_DIFFERENCES])
    more = (f' (and {len(differences) - _SHOWN_DIFFERENCES} more)'
            if len(differences) > _SHOWN_DIFFERENCES else '')
    raise CheckpointError(f'{where} does not hold {what}: {len(differences)} arrays differ, '
                          f'{shown}{more}. The checkpoint belongs to another model: use the '
                          'config.json it was written with')


def _damaged(where: Path, step: int, error: Exception) -> DamagedCheckpoint:
  """A failed read as DamagedCheckpoint naming the array and item directory tensorstore names."""
  text = str(error)
  array = re.search(r'Error reading "([^"/]+)', text)
  item = re.search(r'local file "([^"]+)"', text)
  file = Path(item.group(1)) if item else where
  name = f'the array {array.group(1)} in {file}' if array else str(file)
  return DamagedCheckpoint(f'{where}: damaged checkpoint (step {step}): {name} cannot be read '
                           f'({_short(error)})', step, file)


def _short(error: Exception) -> str:
  """The end of a tensorstore message, after its (long) spec and file names: the cause."""
  text = str(error).splitlines()[0] if str(error) else type(error).__name__
  text = re.sub(r'^.*"[^"]*": ', '', text)  # after the last quoted name (file, array, spec)
  return text if len(text) <= 160 else text[:157] + '...'


def _check_shapes(restored, abstract, where: Path) -> None:
  """orbax restores numpy leaves with their saved shapes whatever the target's: check them."""
  expected = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])
  for path, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
    want = expected[path].shape
    if np.shape(value) != want:
      raise CheckpointError(f'{where}: {jax.tree_util.keystr(path)} has shape {np.shape(value)}, '
                            f'the model of config.json needs {want}; the checkpoint belongs to '
                            'another model')


def _host_target(tree):
  """ShapeDtypeStruct leaves -> zero numpy arrays: orbax then restores to host memory,
  which suits every device layout (the caller replicates) and any number of processes."""
  return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), tree)


# A run directory's own entries, which an output inside it must not replace.
_RUN_ENTRIES = frozenset({CONFIG_FILE, TOKENIZER_FILE, CHECKPOINT_DIR, METRICS_FILE,
                          TENSORBOARD_DIR})
# What averaging writes: an existing output holding only these is an earlier average.
_AVERAGE_ENTRIES = frozenset({CONFIG_FILE, TOKENIZER_FILE, CHECKPOINT_DIR})


def _check_output(workdir: Path, output: Path) -> None:
  """Refuses an output whose replacement would delete the run or anything else.

  Paths are compared resolved (symlinks followed): WORKDIR/average-last5 is fine;
  WORKDIR itself, a directory above it, or WORKDIR/checkpoints/... are not.
  """
  run, target = workdir.resolve(), output.resolve()
  if target == run or target in run.parents:
    raise CheckpointError(f'averaging output {output} would replace the run directory '
                          f'{workdir}; choose another directory (default: '
                          f'{workdir}/average-lastK)')
  if run in target.parents and target.relative_to(run).parts[0] in _RUN_ENTRIES:
    part = run / target.relative_to(run).parts[0]
    raise CheckpointError(f'averaging output {output} would replace {part}, part of the run '
                          f'{workdir}; choose another directory')
  if target.exists() and not target.is_dir():
    raise CheckpointError(f'averaging output {output} is a file; give a directory')
  if target.is_dir() and not {entry.name for entry in target.iterdir()} <= _AVERAGE_ENTRIES:
    raise CheckpointError(f'averaging output {output} holds other files than an earlier '
                          'average (config.json, tokenizer.json, checkpoints/); choose another '
                          'directory')


def _open_run(workdir: str | Path) -> tuple[ModelConfig, Checkpoints, list[int]]:
  workdir = Path(workdir)
  if not workdir.is_dir():
    raise CheckpointError(f'{workdir}: no such directory')
  model_config, _, _ = read_config(workdir)
  check_fits(model_config, training=False)
  if not (workdir / CHECKPOINT_DIR).is_dir():
    raise CheckpointError(f'{workdir / CHECKPOINT_DIR}: no such directory; the run saved no '
                          'checkpoint yet')
  checkpoints = Checkpoints(workdir, read_only=True)
  steps = checkpoints.steps()
  if not steps:
    raise CheckpointError(f'{workdir / CHECKPOINT_DIR}: holds no finished checkpoint')
  return model_config, checkpoints, steps


def _select_steps(steps: Sequence[int], step: int | None, last: int, where: Path) -> list[int]:
  """The `last` saved steps up to `step` (or the latest), oldest first."""
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise CheckpointError(f'{where}: no checkpoint at step {step} (have: '
                          f'{", ".join(map(str, steps))})')
  eligible = [s for s in steps if s <= step]
  if len(eligible) < last:
    raise CheckpointError(f'{where}: cannot average the last {last} checkpoints up to step {step}, '
                          f'only {len(eligible)} exist ({", ".join(map(str, eligible))}); keep '
                          'more with --train.keep_checkpoints or average fewer')
  return eligible[-last:]


def _mean_params(checkpoints: Checkpoints, steps: Sequence[int], target):
  """Element-wise mean of the parameters saved at `steps`, accumulated in float64."""
  total = None
  for step in steps:
    params = checkpoints.restore_params(step, target)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    total = params if total is None else jax.tree.map(np.add, total, params)
  return jax.tree.map(lambda t, x: (t / len(steps)).astype(x.dtype), total, target)


def load_for_inference(workdir: str | Path, step: int | None = None, average_last: int = 0
                       ) -> tuple[ModelConfig, Any, Tokenizer]:
  """(ModelConfig, params, Tokenizer) of a run directory, ready for decoding.

  Args:
    workdir: a run directory written by training (or by `average_checkpoints`).
    step: the checkpoint to load; None loads the latest.
    average_last: if > 0, the element-wise mean of the parameters of the last
      `average_last` checkpoints up to `step` (paper §6.1 averages 5).

  Returns:
    The model config, the parameters (the 'params' collection, device arrays)
    and the tokenizer saved with them, checked to agree with the config.
  """
  if average_last < 0:
    raise CheckpointError(f'average_last must be >= 0, got {average_last}')
  model_config, checkpoints, steps = _open_run(workdir)
  try:
    check_tokenizer(workdir)
    tokenizer = load_tokenizer(workdir)
    check_tokenizer_fits(workdir, tokenizer)
    selected = _select_steps(steps, step, max(average_last, 1), checkpoints.directory)
    # Before tracing the layers of a config.json that asks for thousands.
    checkpoints.check_layers(selected[-1], model_config, _PARAMS_OF_CONFIG)
    target = abstract_params(model_config)
    if average_last:
      params = _mean_params(checkpoints, selected, target)
    else:
      params = checkpoints.restore_params(selected[-1], target)
  finally:
    checkpoints.close()
  return model_config, jax.device_put(params), tokenizer


def average_checkpoints(workdir: str | Path, last_k: int, output: str | Path | None = None
                        ) -> Path:
  """Writes the mean parameters of WORKDIR's last `last_k` checkpoints as a run directory.

  The output (default WORKDIR/average-last{K}) gets WORKDIR's config.json and
  tokenizer.json and one checkpoint, numbered as the latest averaged step,
  holding only 'params': `load_for_inference(output)` and decode.py read it; it
  cannot be resumed for training. An existing output directory is replaced if it
  is empty or an earlier average; an output that is the run directory, holds it,
  or is part of it (checkpoints/, config.json, ...) is refused (`_check_output`).
  With several processes, every process calls this (as it calls the training
  step). Returns the output directory.
  """
  if last_k < 1:
    raise CheckpointError(f'average_last must be >= 1, got {last_k}')
  workdir = Path(workdir)
  output = Path(output) if output is not None else workdir / f'average-last{last_k}'
  _check_output(workdir, output)
  model_config, checkpoints, steps = _open_run(workdir)
  try:
    selected = _select_steps(steps, None, last_k, checkpoints.directory)
    params = _mean_params(checkpoints, selected, abstract_params(model_config))
  finally:
    checkpoints.close()
  if jax.process_index() == 0:
    if output.exists():
      shutil.rmtree(output)
    output.mkdir(parents=True)
    for name in (CONFIG_FILE, TOKENIZER_FILE):
      shutil.copy2(workdir / name, output / name)
  # Every process takes part in the orbax save, after process 0 has prepared the directory.
  multihost_utils.sync_global_devices('average_checkpoints: output directory ready')
  averaged = Checkpoints(output)
  averaged.save_params(selected[-1], params)
  averaged.close()
  return output
