"""A run directory's config.json: what the run was trained with, written, read back and compared.

    WORKDIR/config.json      {"written_by": WRITTEN_BY, "run_format": RUN_FORMAT,
                              "model": ModelConfig, "train": TrainConfig, "data": DataConfig,
                              "tokenizer_files": [its files],
                              "tokenizer_digest": the tokenizer's digest(),
                              "packing_plan": how packed rows are planned}

`write_config` writes it (with the tokenizer's files and digest), `read_config` reads it back
into the three configs (keys of earlier versions renamed, `FORMER_DEFAULTS` for settings they
lacked), `check_resumable` refuses settings that differ from the saved run's. The marker
(`written_by`, `run_format`) tells train.py's directories from any other program's
(`read_marker`, `run_format`); an averaged output's config.json is the run's, marked as made
from its checkpoints (`write_averaged_config`). What else a run directory holds, and the
rules for it, are `directory.py`'s.

Crash safety: config.json is written to a temporary file and renamed over the old one, so a
process killed at any moment leaves it either as it was or complete.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from flax_transformer.config import (
  RENAMED,
  SECTIONS,
  ConfigError,
  DataConfig,
  ModelConfig,
  TrainConfig,
  fields_where,
)
from flax_transformer.errors import CheckpointError
from flax_transformer.files import write_atomically
from flax_transformer.tokenizer import digest_of, kind_in

CONFIG_FILE = 'config.json'
# config.json's key for the tokenizer's identity: its digest() (`tokenizer.digest_of`), the
# corpus cache's key too. Runs written before it record the SHA-256 of tokenizer.json alone,
# under FORMER_TOKENIZER_DIGEST, still checked as such.
TOKENIZER_DIGEST = 'tokenizer_digest'
FORMER_TOKENIZER_DIGEST = 'tokenizer_sha256'
# config.json's key for how packed rows are planned (data.assembly): 'best_fit' since it was
# recorded; a run whose config.json lacks it packed its rows by 'first_fit'.
PACKING_PLAN_KEY = 'packing_plan'
PACKING_PLAN = 'best_fit'
# config.json's marker: which program wrote the directory, and the layout it follows (1: the
# runs before the marker, which have no such keys).
WRITTEN_BY = 'flax_transformer train.py'
RUN_FORMAT = 2
# config.json's key for the tokenizer files the run holds (tokenizer.json, or a fine-tuned
# Marian model's, copied by --init-from).
TOKENIZER_FILES_KEY = 'tokenizer_files'
# What averaging adds to the config.json it copies: the run and the steps averaged.
AVERAGED_KEY = 'averaged_from'


def write_config(
  workdir: str | Path,
  model_config: ModelConfig,
  train_config: TrainConfig,
  data_config: DataConfig,
  packing_plan: str = PACKING_PLAN,
) -> Path:
  """Writes WORKDIR/config.json (creating WORKDIR) and returns its path.

  When WORKDIR holds its tokenizer's files, the tokenizer's digest is recorded too, so that
  `check_tokenizer` can tell the run's tokenizer from another one of the same size.
  """
  workdir = Path(workdir)
  path = workdir / CONFIG_FILE
  path.parent.mkdir(parents=True, exist_ok=True)
  content = {
    'written_by': WRITTEN_BY,
    'run_format': RUN_FORMAT,
    'model': dataclasses.asdict(model_config),
    'train': dataclasses.asdict(train_config),
    'data': dataclasses.asdict(data_config),
    PACKING_PLAN_KEY: packing_plan,
    TOKENIZER_FILES_KEY: list(kind_in(workdir).FILES),
  }
  if all((workdir / name).is_file() for name in kind_in(workdir).FILES):
    content[TOKENIZER_DIGEST] = digest_of(workdir)
  write_atomically(path, json.dumps(content, indent=2) + '\n')
  return path


def write_averaged_config(
  workdir: Path, output: Path, steps: Sequence[int], extra: dict | None = None
) -> None:
  """OUTPUT/config.json: WORKDIR's, marked as the average of its checkpoints `steps` (plus
  `extra`'s keys, e.g. the best checkpoint's score), so that OUTPUT is never taken for a run
  (`averaged_run`)."""
  content = json.loads((workdir / CONFIG_FILE).read_text())
  content[AVERAGED_KEY] = {'run': str(workdir.resolve()), 'steps': [int(s) for s in steps]}
  content.update(extra or {})
  write_atomically(output / CONFIG_FILE, json.dumps(content, indent=2) + '\n')


# Settings whose default has changed, at the default of the config.json files written before
# they were recorded (a run read back means what it meant when trained): LayerNorm epsilon was
# 1e-6 (tensor2tensor's) until it became a setting; its default is 1e-5 now.
FORMER_DEFAULTS = {'model': {'layer_norm_epsilon': 1e-6}}


def read_config(workdir: str | Path) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """Reads WORKDIR/config.json back into the three configs."""
  path = Path(workdir) / CONFIG_FILE
  if not path.is_file():
    raise CheckpointError(
      f'{path}: no such file; {workdir} is not a run directory written by '
      'train.py (it needs config.json, tokenizer.json and checkpoints/)'
    )
  try:
    content = json.loads(path.read_text())
    for old, new in RENAMED.items():  # config.json keys of earlier versions, read as the new
      section, key = old.split('.', 1)
      if section in SECTIONS and key in content[section]:
        content[section][new.split('.', 1)[1]] = content[section].pop(key)
    for section, fields in FORMER_DEFAULTS.items():  # what a config.json without them meant
      for key, value in fields.items():
        content[section].setdefault(key, value)
    return tuple(cls(**content[section]) for section, cls in SECTIONS.items())
  except (json.JSONDecodeError, KeyError, TypeError, ConfigError) as error:
    raise CheckpointError(f'{path}: not a valid run configuration ({error})') from error


def check_resumable(
  workdir: str | Path, model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig
) -> None:
  """Raises CheckpointError unless WORKDIR's run can continue with these configs.

  A run's identity must be equal: every setting whose `Lifetime` is not resumable. The
  computation, the initialisation, the cadence and the cache's location may change.
  """
  saved = dict(zip(SECTIONS, read_config(workdir)))
  requested = dict(zip(SECTIONS, (model_config, train_config, data_config)))
  differences = [
    f'{section}.{name}: saved {getattr(saved[section], name)!r}, '
    f'requested {getattr(requested[section], name)!r}'
    for section, cls in SECTIONS.items()
    for name in fields_where(cls, lambda lifetime: not lifetime.resumable)
    if getattr(saved[section], name) != getattr(requested[section], name)
  ]
  # A schedule that ends is a function of train.steps: a resume that moves the last step
  # would bend the learning rate it has already followed.
  saved_train, train = saved['train'], requested['train']
  if saved_train.schedule != 'inverse_sqrt' and saved_train.steps != train.steps:
    differences.append(
      f'train.steps: saved {saved_train.steps}, requested {train.steps} (train.schedule='
      f'{saved_train.schedule} reaches zero at the last step, so the run keeps its steps)'
    )
  if differences:
    raise CheckpointError(
      f'{Path(workdir) / CONFIG_FILE} was written with other settings than this run asks for: '
      + '; '.join(differences)
      + '. Resume with the saved settings, or start a new run in '
      'another --workdir (or pass --no-resume to overwrite this one).'
    )


def read_marker(directory: str | Path) -> dict | None:
  """DIRECTORY/config.json's content if train.py wrote it (marked, or an older run with the
  three sections), else None (no such file, unreadable, or another program's)."""
  try:
    content = json.loads((Path(directory) / CONFIG_FILE).read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError):
    return None
  if not isinstance(content, dict):
    return None
  if content.get('written_by') == WRITTEN_BY or (
    'written_by' not in content and all(isinstance(content.get(s), dict) for s in SECTIONS)
  ):
    return content
  return None


def run_format(directory: str | Path) -> int | None:
  """The layout of the run in DIRECTORY (RUN_FORMAT; 1 for runs before the marker), or None
  when its config.json is missing or not train.py's."""
  content = read_marker(directory)
  return None if content is None else content.get('run_format', 1)
