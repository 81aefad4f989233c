"""A finished run read back: its parameters for decoding, or the mean of its last checkpoints.

model_config, params, tokenizer = load_for_inference('runs/multi30k', average_last=5)
average_checkpoints('runs/multi30k', 5)       # -> runs/multi30k/average-last5, decodable
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from flax_transformer.config import NONNEGATIVE, Bounds, ModelConfig, check_bounds
from flax_transformer.data import preprocessing
from flax_transformer.errors import CheckpointError, RotatedCheckpoint
from flax_transformer.nn.build import abstract_params
from flax_transformer.run.checkpoints import PARAMS_OF_CONFIG, Checkpoints
from flax_transformer.run.config_file import (
  CONFIG_FILE,
  read_config,
  read_marker,
  write_averaged_config,
)
from flax_transformer.run.directory import (
  CHECKPOINT_DIR,
  ENCODED_DIR,
  METRICS_FILE,
  TENSORBOARD_DIR,
  check_tokenizer,
  check_tokenizer_fits,
)
from flax_transformer.run.lock import LOCK_FILE
from flax_transformer.run.outputs import Protected, check_output
from flax_transformer.run.sizes import check_fits
from flax_transformer.tokenizer import TextTokenizer, Tokenizer
from flax_transformer.tokenizer import kind_in as tokenizer_kind_in
from flax_transformer.tokenizer import load as load_tokenizer
from flax_transformer.tokenizer.marian import MarianTokenizer

# Reads of the newest checkpoint that a training run may rotate away before decoding gives up.
_ROTATION_TRIES = 10
# A run directory's own entries, which an output inside it must not replace.
_RUN_ENTRIES = frozenset(
  {
    CONFIG_FILE,
    CHECKPOINT_DIR,
    METRICS_FILE,
    TENSORBOARD_DIR,
    ENCODED_DIR,
    LOCK_FILE,
    *Tokenizer.FILES,
    *MarianTokenizer.FILES,
  }
)
# What averaging writes: an existing output holding only these is an earlier average.
_AVERAGE_ENTRIES = frozenset(
  {CONFIG_FILE, CHECKPOINT_DIR, *Tokenizer.FILES, *MarianTokenizer.FILES}
)


def check_run_output(
  workdir: Path,
  output: Path,
  label: str,
  replaceable: Collection[str],
  occupied: str,
  advice: str,
  ours: Callable[[Path], bool],
  not_ours: str,
) -> None:
  """Refuses an output made from WORKDIR whose replacement would delete the run or anything
  else (`outputs.check_output`): WORKDIR/average-last5 or WORKDIR/export is fine; WORKDIR
  itself, a directory above it, or WORKDIR/checkpoints/... are not, whatever their names.
  An output holding only `replaceable` names may be replaced, and only if its config.json,
  if any, is the writer's own (`ours(output)`; else '... holds a config.json that
  {not_ours}')."""
  run = Protected(workdir, f'the run directory {workdir}', may_hold=True)
  parts = [
    Protected(workdir / name, f'{workdir / name}, part of the run {workdir}')
    for name in sorted(_RUN_ENTRIES)
  ]
  check_output(
    output,
    [run, *parts],
    label,
    CheckpointError,
    replaceable=replaceable,
    occupied=occupied,
    advice=advice,
  )
  if (output / CONFIG_FILE).exists() and not ours(output):
    # Only what the writer wrote may go: a config.json of another program is not its output.
    raise CheckpointError(
      f'{label} {output} holds a config.json that {not_ours}; choose another directory'
    )


def _check_output(workdir: Path, output: Path, last_k: int) -> None:
  """`check_run_output` for an average of WORKDIR's last `last_k` checkpoints."""
  check_run_output(
    workdir,
    output,
    'averaging output',
    _AVERAGE_ENTRIES,
    occupied='holds other files than an earlier average (config.json, the '
    'tokenizer, checkpoints/); choose another directory',
    advice=f'choose another directory (default: {workdir}/average-last{last_k})',
    ours=lambda directory: read_marker(directory) is not None,
    not_ours='train.py did not write: it is not an earlier average',
  )


def _open_checkpoints(
  workdir: str | Path, on_unverified: Callable[[str], object] | None = None
) -> tuple[ModelConfig, Checkpoints, list[int]]:
  """A finished run's model config, its checkpoints opened read-only, and their steps."""
  workdir = Path(workdir)
  if not workdir.is_dir():
    raise CheckpointError(f'{workdir}: no such directory')
  model_config, _, _ = read_config(workdir)
  check_fits(model_config, training=False)
  if not (workdir / CHECKPOINT_DIR).is_dir():
    raise CheckpointError(
      f'{workdir / CHECKPOINT_DIR}: no such directory; the run saved no checkpoint yet'
    )
  checkpoints = Checkpoints(workdir, read_only=True, on_unverified=on_unverified)
  steps = checkpoints.steps()
  if not steps:
    raise CheckpointError(f'{workdir / CHECKPOINT_DIR}: holds no finished checkpoint')
  return model_config, checkpoints, steps


def _select_steps(steps: Sequence[int], step: int | None, last: int, where: Path) -> list[int]:
  """The `last` saved steps up to `step` (or the latest), oldest first."""
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise CheckpointError(
      f'{where}: no checkpoint at step {step} (have: {", ".join(map(str, steps))})'
    )
  eligible = [s for s in steps if s <= step]
  if len(eligible) < last:
    raise CheckpointError(
      f'{where}: cannot average the last {last} checkpoints up to step {step}, '
      f'only {len(eligible)} exist ({", ".join(map(str, eligible))}); keep '
      'more with --train.keep_checkpoints or average fewer'
    )
  return eligible[-last:]


def _mean_params(checkpoints: Checkpoints, steps: Sequence[int], target):
  """Element-wise mean of the parameters saved at `steps`, accumulated in float64."""
  total = None
  for step in steps:
    params = checkpoints.restore_params(step, target)
    params = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
    total = params if total is None else jax.tree.map(np.add, total, params)
  return jax.tree.map(lambda t, x: (t / len(steps)).astype(x.dtype), total, target)


def load_for_inference(
  workdir: str | Path,
  step: int | None = None,
  average_last: int = 0,
  on_unverified: Callable[[str], object] | None = None,
) -> tuple[ModelConfig, Any, TextTokenizer]:
  """(ModelConfig, params, Tokenizer) of a run directory, ready for decoding.

  Args:
    workdir: a run directory written by training (or by `average_checkpoints`).
    step: the checkpoint to load; None loads the latest.
    average_last: if > 0, the element-wise mean of the parameters of the last
      `average_last` checkpoints up to `step` (paper §6.1 averages 5).
    on_unverified: None refuses a checkpoint without recorded SHA-256s (DamagedCheckpoint);
      a function loads it and is given the line saying it was not verified.

  Returns:
    The model config, the parameters (the 'params' collection, device arrays)
    and the tokenizer saved with them, checked to agree with the config.
  """
  check_bounds(average_last, NONNEGATIVE, 'average_last', CheckpointError)
  model_config, checkpoints, steps = _open_checkpoints(workdir, on_unverified)
  try:
    check_tokenizer(workdir)
    tokenizer = load_tokenizer(workdir)
    check_tokenizer_fits(workdir, tokenizer)
    # The run's text preprocessing (data.lowercase, data.pretokenize, ...) comes with it.
    tokenizer = preprocessing.wrap(tokenizer, read_config(workdir)[2])
    target = functools.cache(lambda: abstract_params(model_config))  # traced once, if at all
    for attempt in range(1, _ROTATION_TRIES + 1):
      try:
        params = _read_params(checkpoints, steps, step, average_last, model_config, target)
        break
      except RotatedCheckpoint as error:
        # A training run beside us deleted the checkpoint (keep_checkpoints): read the newest
        # again, unless the step was asked for (nothing newer can stand in for it).
        if step is not None:
          raise
        if attempt == _ROTATION_TRIES:
          raise CheckpointError(
            f'{checkpoints.directory}: the newest checkpoint was rotated away (deleted by the '
            f'training run writing there) while being read, {attempt} times in a row; run '
            'again, or decode once that run has stopped'
          ) from error
        steps = checkpoints.reload()
  finally:
    checkpoints.close()
  return model_config, jax.device_put(params), tokenizer


def _read_params(
  checkpoints: Checkpoints,
  steps: Sequence[int],
  step: int | None,
  average_last: int,
  model_config: ModelConfig,
  target: Callable[[], Any],
):
  """The parameters of `step` (None: the latest of `steps`), or the mean of the last
  `average_last` up to it; `target()`: the model's abstract parameters."""
  if not steps:
    raise CheckpointError(f'{checkpoints.directory}: holds no finished checkpoint')
  selected = _select_steps(steps, step, max(average_last, 1), checkpoints.directory)
  # Before tracing the layers of a config.json that asks for thousands.
  checkpoints.check_layers(selected[-1], model_config, PARAMS_OF_CONFIG)
  if average_last:
    return _mean_params(checkpoints, selected, target())
  return checkpoints.restore_params(selected[-1], target())


def average_checkpoints(workdir: str | Path, last_k: int, output: str | Path | None = None) -> Path:
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
  check_bounds(last_k, Bounds(low=1), 'average_last', CheckpointError)
  workdir = Path(workdir)
  output = Path(output) if output is not None else workdir / f'average-last{last_k}'
  _check_output(workdir, output, last_k)
  model_config, checkpoints, steps = _open_checkpoints(workdir)
  try:
    selected = _select_steps(steps, None, last_k, checkpoints.directory)
    params = _mean_params(checkpoints, selected, abstract_params(model_config))
  finally:
    checkpoints.close()
  write_params_run(workdir, output, selected, params)
  return output


def write_params_run(
  workdir: Path, output: Path, steps: Sequence[int], params, extra: dict | None = None
) -> None:
  """OUTPUT as a decodable copy of WORKDIR holding `params` alone: its tokenizer, its
  config.json marked as made from `steps` (plus `extra`'s keys), one params-only checkpoint
  numbered as the last of `steps`. An existing OUTPUT is replaced (the caller checked it)."""
  if jax.process_index() == 0:
    if output.exists():
      shutil.rmtree(output)
    output.mkdir(parents=True)
    for name in tokenizer_kind_in(workdir).FILES:
      shutil.copy2(workdir / name, output / name)
    write_averaged_config(workdir, output, steps, extra)
  # Every process takes part in the orbax save, after process 0 has prepared the directory.
  multihost_utils.sync_global_devices('write_params_run: output directory ready')
  written = Checkpoints(output)
  written.save_params(steps[-1], params)
  written.close()
