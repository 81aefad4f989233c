"""A training run on disk: its directory, lock, checkpoints, metrics log and memory estimate.

Layer 5 (above `config`, `nn`, `tokenizer`, `data` and `pretrained`). Modules: `directory`
(config.json, the tokenizer, resume rules), `lock` (one writer at a time),
`checkpoints` (the orbax store, digests, damage), `loading` (a finished run for
decoding; checkpoint averaging), `metrics_log` (metrics.jsonl), `sizes` (memory
estimates checked before allocating).
"""

from flax_transformer.errors import (
  CheckpointError,
  DamagedCheckpoint,
  RotatedCheckpoint,
  RunDirectoryInUse,
  WriteError,
)
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.config_file import read_config, write_config
from flax_transformer.run.directory import RunDirectory
from flax_transformer.run.loading import average_checkpoints, load_for_inference
from flax_transformer.run.lock import RunLock
from flax_transformer.run.metrics_log import MetricsLog
from flax_transformer.run.sizes import check_fits, parameter_count

# The tokenizer a run directory holds, whichever its kind (the tokenizers' room decides).
from flax_transformer.tokenizer import load as load_tokenizer

__all__ = [
  'CheckpointError',
  'Checkpoints',
  'DamagedCheckpoint',
  'MetricsLog',
  'RotatedCheckpoint',
  'RunDirectory',
  'RunDirectoryInUse',
  'RunLock',
  'WriteError',
  'average_checkpoints',
  'check_fits',
  'load_for_inference',
  'load_tokenizer',
  'parameter_count',
  'read_config',
  'write_config',
]
