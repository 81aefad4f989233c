"""Configuration as frozen dataclasses: the model, the training run and its data.

Every default and every setting's help is written in this package, once: each field is a
`setting(default, help)`, and train.py's `--help` is generated from the help.
Presets are classmethods that take overrides, e.g. `ModelConfig.base(vocab_size=8000)`,
`TrainConfig.toy(steps=500)`; `parse_overrides` turns command-line strings like
`--model.d_model=256` into values. Choices (`Literal` fields) are checked from
their annotations, so a new choice is added in one place.

The bottom layer of the package (above `errors` only). Modules: `settings` (the machinery:
`setting`, `Bounds`, `check_fields`, `check_bounds`, `parse_overrides`, `RENAMED`), `model`
(`ModelConfig`; `resolve_dtype`, `resolve_attention_kernel`), `train` (`TrainConfig`),
`data` (`DataConfig`), `presets` (`SECTIONS`, `RUN_PRESETS`, `run_preset`). Every name is
imported from here: `from flax_transformer.config import ModelConfig`.
"""

from flax_transformer.config.data import DataConfig
from flax_transformer.config.model import (
  AUTO_CUDNN_MAX_HEAD_DIM,
  CUDNN_DTYPES,
  CUDNN_MAX_HEAD_DIM,
  ModelConfig,
  resolve_attention_kernel,
  resolve_dtype,
)
from flax_transformer.config.presets import RUN_PRESETS, SECTIONS, run_preset
from flax_transformer.config.settings import (
  NONNEGATIVE,
  NONNEGATIVE_INT,
  NUMBER,
  POSITIVE,
  POSITIVE_INT,
  RENAMED,
  SEED,
  UNIT_INTERVAL,
  Bounds,
  check_bounds,
  check_fields,
  field_types,
  help_of,
  parse_overrides,
  setting,
)
from flax_transformer.config.train import MULTI30K_FAIRSEQ_EPOCH, TrainConfig
from flax_transformer.errors import ConfigError

__all__ = [
  'AUTO_CUDNN_MAX_HEAD_DIM',
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
  'resolve_attention_kernel',
  'resolve_dtype',
  'run_preset',
  'setting',
]
