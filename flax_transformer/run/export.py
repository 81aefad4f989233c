"""A run directory written as a Hugging Face Marian model (`pretrained.export`).

export_run('runs/m30k', 'export/m30k', average_last=5)
# transformers: MarianMTModel.from_pretrained('export/m30k'); CTranslate2:
# ct2-transformers-converter --model export/m30k --output_dir export/m30k-ct2
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from flax_transformer.errors import CheckpointError
from flax_transformer.pretrained import export
from flax_transformer.pretrained.marian import is_export, is_marian_directory
from flax_transformer.run.config_file import read_config
from flax_transformer.run.loading import check_run_output, load_for_inference


def export_run(
  workdir: str | Path,
  output: str | Path,
  step: int | None = None,
  average_last: int = 0,
  on_unverified: Callable[[str], object] | None = None,
) -> Path:
  """Writes WORKDIR's model (the latest checkpoint, `step`, or the mean of the last
  `average_last` up to it) into OUTPUT as a Marian directory; returns OUTPUT.
  on_unverified: as `load_for_inference`'s (None: a checkpoint without digests is refused).

  Refused before anything is read or written, each in one line (ExportError or
  CheckpointError, status 2 in the command): a model Marian cannot express
  (`export.check_exportable`); an OUTPUT that is, holds or lies inside the run's own
  entries (an entry of its own inside WORKDIR, e.g. WORKDIR/export, is fine), or that
  holds anything but an earlier export. An earlier export is replaced whole.
  """
  workdir, output = Path(workdir), Path(output)
  if is_marian_directory(workdir):
    raise CheckpointError(
      f'{workdir} is a Hugging Face model already (config.json has a '
      'model_type); export reads a run directory written by train.py'
    )
  _check_output(workdir, output)
  model_config = read_config(workdir)[0]
  export.check_exportable(model_config)
  config, params, tokenizer = load_for_inference(
    workdir, step=step, average_last=average_last, on_unverified=on_unverified
  )
  which = (
    f'the mean of its last {average_last} checkpoints'
    if average_last
    else (f'step {step}' if step is not None else 'its latest checkpoint')
  )
  return export.export_marian(config, params, tokenizer, output, source=f'{workdir}, {which}')


def _check_output(workdir: Path, output: Path) -> None:
  check_run_output(
    workdir,
    output,
    'export output',
    export.FILES,
    occupied='holds other files than an earlier export; choose another directory',
    advice='choose another directory (e.g. WORKDIR/export)',
    ours=is_export,
    not_ours='export did not write',
  )
