"""A run directory with checkpoints at steps 2, 4, 6, 8, 10 (the last 3 kept) of a tiny model
with a non-trivial optimizer state: tests/test_checkpoint.py and tests/test_run_directory.py.

conftest.py builds it once per session (the fixture `checkpointed_run`).
"""

import dataclasses
from pathlib import Path

import jax
import numpy as np

from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.nn.model import Transformer
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import write_config
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train import create_train_state, make_optimizer

TEXTS = [
  'ein kleiner Hund läuft',
  'a small dog runs',
  'zwei Männer spielen Fußball',
  'two men play football',
  'eine Frau liest ein Buch',
  'a woman reads a book',
]
# Accumulation and clipping give the optimizer state nested named tuples to restore.
TRAIN_CONFIG = TrainConfig(steps=10, grad_accum_steps=2, max_grad_norm=1.0, keep_checkpoints=3)


def shifted(state, step):
  """`state` at `step`, every parameter shifted by `step` so checkpoints differ."""
  return state.replace(step=np.int32(step), params=jax.tree.map(lambda p: p + step, state.params))


@dataclasses.dataclass(frozen=True)
class CheckpointedRun:
  tokenizer: Tokenizer
  # (model config, optimizer, abstract state, a host state with non-trivial optimizer state)
  setup: tuple
  run_dir: Path


def build(workdir: Path) -> CheckpointedRun:
  tokenizer = Tokenizer.train(TEXTS, 64)

  config = ModelConfig.tiny(
    vocab_size=tokenizer.vocab_size, num_encoder_layers=1, num_decoder_layers=1
  )
  model = Transformer(config)
  optimizer = make_optimizer(TRAIN_CONFIG, config)
  abstract = jax.eval_shape(lambda: create_train_state(model, optimizer, seed=0))
  state = jax.device_get(create_train_state(model, optimizer, seed=0))
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(p.dtype), state.params)
  _, opt_state = optimizer.update(grads, state.opt_state, state.params)
  setup = config, optimizer, abstract, state.replace(opt_state=jax.device_get(opt_state))

  config, _, _, state = setup
  tokenizer.save(workdir)  # first, as a run does: config.json records its digest
  write_config(workdir, config, TRAIN_CONFIG, DataConfig())
  checkpoints = Checkpoints(workdir, keep=TRAIN_CONFIG.keep_checkpoints)
  for step in range(2, 11, 2):
    checkpoints.save(shifted(state, step))
  checkpoints.close()
  return CheckpointedRun(tokenizer=tokenizer, setup=setup, run_dir=workdir)
