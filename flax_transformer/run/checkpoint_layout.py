"""A checkpoint's arrays compared with the model's, by name and shape, before any is used.

    check_layout(metadata, abstract_params, where, 'parameters of the model in config.json')
    check_shapes(restored, abstract_items, where)

`shapes_by_name` names each array by its path ('encoder/layer_0/.../kernel'), whether the tree
holds namedtuples (the model's) or dicts (what orbax saves); `check_layout` compares orbax's
metadata of a saved item with the model's abstract tree and raises CheckpointError naming the
first arrays missing, extra or of another shape; `check_shapes` checks what orbax restored
(numpy leaves with their saved shapes, whatever the target's). `checkpoints.py` calls them
before and after reading a checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from flax_transformer.errors import CheckpointError

# At most this many differing arrays are named when a checkpoint does not fit the model.
_SHOWN_DIFFERENCES = 3


def _key_name(entry) -> str:
  for attribute in ('key', 'name', 'idx'):
    if hasattr(entry, attribute):
      return str(getattr(entry, attribute))
  return str(entry)


def shapes_by_name(tree) -> dict[str, tuple[int, ...]]:
  """{'encoder/layer_0/.../kernel': shape}; namedtuples and dicts alike (orbax saves dicts)."""
  return {
    '/'.join(map(_key_name, path)): tuple(leaf.shape)
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
  }


def check_layout(metadata, abstract, where: Path, what: str, shaped: bool = True) -> None:
  """Raises CheckpointError naming the first arrays whose names or shapes differ.

  `metadata` and `abstract` are trees of arrays, or (shaped=False) their `shapes_by_name`.
  """
  saved, needed = (
    (shapes_by_name(metadata), shapes_by_name(abstract)) if shaped else (metadata, abstract)
  )
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
    more = (
      f' (and {len(differences) - _SHOWN_DIFFERENCES} more)'
      if len(differences) > _SHOWN_DIFFERENCES
      else ''
    )
    raise CheckpointError(
      f'{where} does not hold {what}: {len(differences)} arrays differ, '
      f'{shown}{more}. The checkpoint belongs to another model: use the '
      'config.json it was written with'
    )


def check_shapes(restored, abstract, where: Path) -> None:
  """orbax restores numpy leaves with their saved shapes whatever the target's: check them."""
  expected = dict(jax.tree_util.tree_flatten_with_path(abstract)[0])
  for path, value in jax.tree_util.tree_flatten_with_path(restored)[0]:
    want = expected[path].shape
    if np.shape(value) != want:
      raise CheckpointError(
        f'{where}: {jax.tree_util.keystr(path)} has shape {np.shape(value)}, '
        f'the model of config.json needs {want}; the checkpoint belongs to '
        'another model'
      )
