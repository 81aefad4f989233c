"""An output directory that a program replaces: never one that would take its inputs with it.

    check_output(output, [Protected(workdir, f'the run directory {workdir}', may_hold=True)],
                 'averaging output', CheckpointError, replaceable=AVERAGE_ENTRIES, ...)

One rule for every program that writes an output (train.py its --workdir,
checkpoint averaging, distillation and export a directory, decode.py a file):
files are known by identity, whatever names reach them (`same_file`): the same
path, `..` segments, a relative and an absolute name, a trailing slash, a
symbolic link to the file or to a folder above it (resolved), a hard link or a
bind mount (the same device and inode). An output that is a protected input,
holds one, or lies inside one (unless the input may hold outputs, as a run
directory holds its average-lastK) is refused in one line naming both. An existing output is replaced only if it holds only what
the program writes, or with the user's explicit consent (`replaceable=None`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Protected:
  """A path an output must not replace.

  path: the input, as the user named it.
  described: how a message names it, e.g. 'the run directory runs/m30k' or
    'data/m30k, an input of the distillation'.
  may_hold: whether an output may lie inside it, in an entry of its own
    (WORKDIR/average-last5); else an output inside it is refused too.
  """

  path: Path
  described: str
  may_hold: bool = False


def same_file(a: Path, b: Path) -> bool:
  """Whether two resolved paths name one file or directory: equal, or both existing with the
  same device and inode (a hard link, a bind mount, a path through another mount)."""
  if a == b:
    return True
  try:
    return os.path.samefile(a, b)
  except OSError:  # either does not exist (yet): only equal names are the same
    return False


def check_output(
  output: Path,
  protected: Sequence[Protected],
  label: str,
  error: type[Exception],
  replaceable: Collection[str] | None = None,
  occupied: str = '',
  advice: str = 'choose another directory',
  is_file: bool = False,
) -> None:
  """Raises `error`, in one line starting '{label} {output}', for an output that the
  program must not (re)write.

  Refused: an output that is, holds or lies inside a `protected` path (resolved).
  For an output directory (`is_file` False) also: an output that is a file; an
  existing directory that holds entries other than the names in `replaceable`
  (None: any entry may be replaced), with the message tail `occupied`. `advice`
  ends the message of a protected path.
  """
  target = output.resolve()
  for item in protected:
    path = item.path.resolve()
    if same_file(target, path) or any(same_file(target, above) for above in path.parents):
      raise error(f'{label} {output} would replace {item.described}; {advice}')
    if not item.may_hold and any(same_file(above, path) for above in target.parents):
      raise error(f'{label} {output} would write inside {item.described}; {advice}')
  if is_file:
    return
  if target.exists() and not target.is_dir():
    raise error(f'{label} {output} is a file; give a directory')
  if (
    replaceable is not None
    and target.is_dir()
    and not {entry.name for entry in target.iterdir()} <= set(replaceable)
  ):
    raise error(f'{label} {output} {occupied}')
