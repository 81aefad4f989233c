"""Configuration as frozen dataclasses: the model, the training run and its data.

Every default and every setting's help is written in this package, once: each field is a
`setting(default, help, lifetime=...)`, and train.py's `--help` is generated from the help.
Each field's `Lifetime` says what changing it means for a saved run (the architecture and
vocabulary are what a checkpoint means; the computation is chosen per run; the cadence may
change on resume): the resume and fine-tuning rules are read from them (`fields_where`).
Presets are classmethods that take overrides, e.g. `ModelConfig.base(vocab_size=8000)`,
`TrainConfig.toy(steps=500)`; `parse_overrides` turns command-line strings like
`--model.d_model=256` into values. Choices (`Literal` fields) are checked from
their annotations, so a new choice is added in one place.

The bottom layer of the package (above `errors` only; no JAX). Modules: `settings` (the
machinery: `setting`, `Lifetime` and the lifetimes, `fields_where`, `Bounds`, `check_fields`,
`check_bounds`, `parse_overrides`, `RENAMED`), `model` (`ModelConfig`; what auto resolves to
is `nn.backend`'s), `train` (`TrainConfig`), `data` (`DataConfig`), `presets` (`SECTIONS`,
`RUN_PRESETS`, `run_preset`). Every name is imported from here:
`from flax_transformer.config import ModelConfig`.
"""

from flax_transformer.config.data import DataConfig
from flax_transformer.config.model import (
  CUDNN_DTYPES,
  CUDNN_MAX_HEAD_DIM,
  ModelConfig,
)
from flax_transformer.config.presets import RUN_PRESETS, SECTIONS, run_preset
from flax_transformer.config.settings import (
  ARCHITECTURE,
  CADENCE,
  COMPUTATION,
  CORPUS,
  INITIALISATION,
  LIFETIMES,
  LOCATION,
  NONNEGATIVE,
  NONNEGATIVE_INT,
  NUMBER,
  OBJECTIVE,
  OPTIMIZER,
  POSITIVE,
  POSITIVE_INT,
  REGULARISATION,
  RENAMED,
  SEED,
  UNIT_INTERVAL,
  VOCABULARY,
  Bounds,
  Lifetime,
  check_bounds,
  check_fields,
  field_types,
  fields_where,
  help_of,
  lifetime_of,
  parse_overrides,
  setting,
)
from flax_transformer.config.train import MULTI30K_FAIRSEQ_EPOCH, TrainConfig
from flax_transformer.errors import ConfigError

__all__ = [
  'ARCHITECTURE',
  'CADENCE',
  'COMPUTATION',
  'CORPUS',
  'INITIALISATION',
  'LIFETIMES',
  'LOCATION',
  'OBJECTIVE',
  'OPTIMIZER',
  'REGULARISATION',
  'VOCABULARY',
  'Lifetime',
  'fields_where',
  'lifetime_of',
  'CUDNN_DTYPES',
  'CUDNN_MAX_HEAD_DIM',
  'MULTI30K_FAIRSEQ_EPOCH',
  'NONNEGATIVE',
  'NONNEGATIVE_INT',
  'NUMBER',
  'POSITIVE',
  'POSITIVE_INT',
  'RENAMED',
  'RUN_PRESETS',
  'SECTIONS',
  'SEED',
  'UNIT_INTERVAL',
  'Bounds',
  'ConfigError',
  'DataConfig',
  'ModelConfig',
  'TrainConfig',
  'check_bounds',
  'check_fields',
  'field_types',
  'help_of',
  'parse_overrides',
  'run_preset',
  'setting',
]
