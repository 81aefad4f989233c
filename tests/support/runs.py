"""What a training run left in its run directory: checkpoints, training states, metrics."""

from pathlib import Path

import jax
import numpy as np

from flax_transformer.nn.model import Transformer
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import read_config
from flax_transformer.run.metrics_log import MetricsLog
from flax_transformer.train import create_train_state, make_optimizer


def saved_steps(workdir: Path) -> list[int]:
  checkpoints = Checkpoints(workdir, read_only=True)
  try:
    return checkpoints.steps()
  finally:
    checkpoints.close()


def train_state(workdir: Path, step: int):
  """The TrainState saved at `step`, for the model and optimizer of WORKDIR/config.json."""
  model_config, train_config, _ = read_config(workdir)
  model = Transformer(model_config)
  abstract = jax.eval_shape(
    lambda: create_train_state(model, make_optimizer(train_config, model_config), train_config.seed)
  )
  checkpoints = Checkpoints(workdir, read_only=True)
  try:
    return checkpoints.restore(step, abstract)
  finally:
    checkpoints.close()


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, e)


def read_metrics(workdir: Path) -> list[dict]:
  """WORKDIR/metrics.jsonl as MetricsLog reads it (a line cut short at the end is dropped)."""
  return MetricsLog.read(workdir / 'metrics.jsonl')


def finite(tree) -> bool:
  return all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(tree))
