"""Checkpoints (orbax): bit-exact round trips, retention, inference loading, averaging, clear
errors. config.json and the resume checks are tests/test_run_directory.py's."""

import re
import shutil

import jax
import numpy as np
import pytest

from flax_transformer.config import DataConfig
from flax_transformer.nn.model import Transformer
from flax_transformer.run import (
  CheckpointError,
  Checkpoints,
  DamagedCheckpoint,
  average_checkpoints,
  load_for_inference,
)
from flax_transformer.run.directory import read_config, write_config
from flax_transformer.train import create_train_state, make_optimizer
from support.checkpointed_run import TEXTS, TRAIN_CONFIG, shifted

# The run directory of conftest.py's checkpointed_run, which tests/test_run_directory.py shares.


@pytest.fixture(scope='module')
def tokenizer(checkpointed_run):
  return checkpointed_run.tokenizer


@pytest.fixture(scope='module')
def setup(checkpointed_run):
  """(model config, optimizer, abstract state, a host state with non-trivial optimizer state)."""
  return checkpointed_run.setup


@pytest.fixture(scope='module')
def run_dir(checkpointed_run):
  """A run directory with checkpoints at steps 2, 4, 6, 8, 10 (the last 3 kept)."""
  return checkpointed_run.run_dir


def assert_trees_equal(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert np.asarray(a).dtype == np.asarray(e).dtype
    np.testing.assert_array_equal(a, e)


def test_keeps_the_last_k(run_dir):
  checkpoints = Checkpoints(run_dir)
  assert checkpoints.steps() == [6, 8, 10]
  assert checkpoints.latest_step() == 10
  checkpoints.close()


def test_round_trip_is_bit_exact(run_dir, setup):
  _, _, abstract, state = setup
  checkpoints = Checkpoints(run_dir)
  restored = checkpoints.restore(8, abstract)
  checkpoints.close()
  assert_trees_equal(restored, shifted(state, 8))
  assert int(restored.step) == 8


def test_load_for_inference_latest_and_given_step(run_dir, setup, tokenizer):
  config, _, _, state = setup
  loaded_config, params, loaded_tokenizer = load_for_inference(run_dir)
  assert loaded_config == config
  assert loaded_tokenizer.encode(TEXTS) == tokenizer.encode(TEXTS)
  assert_trees_equal(jax.device_get(params), shifted(state, 10).params)
  _, params, _ = load_for_inference(run_dir, step=6)
  assert_trees_equal(jax.device_get(params), shifted(state, 6).params)


def test_average_last_is_the_float64_mean(run_dir, setup):
  _, _, _, state = setup
  _, params, _ = load_for_inference(run_dir, average_last=3)
  want = jax.tree.map(lambda p: (np.float64(p) * 3 + 6 + 8 + 10) / 3, state.params)
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert got.dtype == np.float32
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
  _, params, _ = load_for_inference(run_dir, step=8, average_last=2)
  want = jax.tree.map(lambda p: p + 7.0, state.params)
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)


def test_average_checkpoints_writes_a_loadable_run_directory(run_dir, setup):
  _, _, _, state = setup
  output = average_checkpoints(run_dir, 3)
  assert output == run_dir / 'average-last3'
  assert Checkpoints(output).steps() == [10]
  config, params, _ = load_for_inference(output)
  assert config == read_config(run_dir)[0]
  want = jax.tree.map(lambda p: p + 8.0, state.params)
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-6, atol=1e-6)
  # Averaging again replaces the output rather than adding to it.
  assert average_checkpoints(run_dir, 2) == run_dir / 'average-last2'
  assert Checkpoints(run_dir / 'average-last2').steps() == [10]


def test_averaging_refuses_an_output_that_would_delete_the_run(run_dir, tmp_path):
  run = tmp_path / 'run'
  shutil.copytree(run_dir, run, ignore=shutil.ignore_patterns('average-last*'))
  (run / 'metrics.jsonl').write_text('{}\n')
  (tmp_path / 'link').symlink_to(run)
  (tmp_path / 'notes').mkdir()
  (tmp_path / 'notes' / 'todo.txt').write_text('keep me')
  files = sorted(path.relative_to(tmp_path) for path in tmp_path.rglob('*'))
  for output, message in [
    (run, f'averaging output {run} would replace the run directory {run}'),
    (tmp_path / 'link', 'would replace the run directory'),  # the run, by a symlink
    (run / '..', 'would replace the run directory'),  # holds the run
    (tmp_path, 'would replace the run directory'),
    (run / 'checkpoints', f'would replace {run / "checkpoints"}, part of the run'),
    (tmp_path / 'link' / 'checkpoints' / '10', 'part of the run'),
    (run / 'metrics.jsonl', f'would replace {run / "metrics.jsonl"}, part of the run'),
    (tmp_path / 'notes', 'holds other files than an earlier average'),
    (tmp_path / 'notes' / 'todo.txt', 'is a file; give a directory'),
  ]:
    with pytest.raises(CheckpointError, match=re.escape(message)):
      average_checkpoints(run, 2, output=output)
  assert sorted(path.relative_to(tmp_path) for path in tmp_path.rglob('*')) == files
  # Beside the run or inside it under a new name, and again over that earlier average: fine.
  for output in (tmp_path / 'averaged', run / 'mine', tmp_path / 'averaged'):
    assert average_checkpoints(run, 2, output=output) == output
    assert Checkpoints(output).steps() == [10]
  assert Checkpoints(run).steps() == [6, 8, 10]


def test_errors_name_the_problem(run_dir, tmp_path, setup, tokenizer):
  config, _, abstract, _ = setup
  with pytest.raises(CheckpointError, match='no such directory'):
    load_for_inference(tmp_path / 'missing')
  with pytest.raises(CheckpointError, match='config.json: no such file'):
    load_for_inference(tmp_path)
  write_config(tmp_path, config, TRAIN_CONFIG, DataConfig())
  with pytest.raises(CheckpointError, match='saved no checkpoint yet'):
    load_for_inference(tmp_path)
  with pytest.raises(CheckpointError, match=r'no checkpoint at step 7 \(have: 6, 8, 10\)'):
    load_for_inference(run_dir, step=7)
  with pytest.raises(CheckpointError, match='cannot average the last 4 checkpoints'):
    load_for_inference(run_dir, average_last=4)

  bigger = Transformer(config.replace(d_model=64))
  wrong = jax.eval_shape(
    lambda: create_train_state(bigger, make_optimizer(TRAIN_CONFIG, bigger.config), seed=0)
  )
  checkpoints = Checkpoints(run_dir)
  # Compared with orbax's metadata before any array is read: the first differences, counted.
  with pytest.raises(CheckpointError) as error:
    checkpoints.restore(10, wrong)
  assert not isinstance(error.value, DamagedCheckpoint)
  assert str(error.value).startswith(
    f'{run_dir / "checkpoints" / "10"} does not hold a training state of this model and '
    'optimizer: 38 arrays differ, decoder/layer_0/cross_attention/key/kernel is saved as '
    '(32, 32), the model needs (64, 64); '
  )
  assert str(error.value).endswith(
    ' (and 35 more). The checkpoint belongs to another model: use '
    'the config.json it was written with'
  )
  checkpoints.close()


# --- a reader beside a writer: checkpoints rotated away while being read ------------------


def _rotating_restore(monkeypatch, rotate):
  """Checkpoints.restore_params that calls rotate(checkpoints, step) before its first read, as
  a training run's max_to_keep would delete the checkpoint under a reader."""
  original, calls = Checkpoints.restore_params, []

  def restore_params(self, step, abstract_params):
    calls.append(step)
    if len(calls) == 1:
      rotate(self.directory, step)
    return original(self, step, abstract_params)

  monkeypatch.setattr(Checkpoints, 'restore_params', restore_params)
  return calls


def test_a_checkpoint_rotated_away_while_read_gives_way_to_the_newest(
  run_dir, setup, tmp_path, monkeypatch
):
  # The writer saves step 12 (here: step 8's files, so that its parameters tell) and deletes
  # step 10, the one being read; decoding reads 12 instead, and nothing is called damaged.
  _, _, _, state = setup
  run = tmp_path / 'run'
  shutil.copytree(run_dir, run)

  def rotate(directory, step):
    (directory / '8').rename(directory / '12')
    shutil.rmtree(directory / str(step))

  calls = _rotating_restore(monkeypatch, rotate)
  _, params, _ = load_for_inference(run)
  assert calls == [10, 12]
  assert_trees_equal(jax.device_get(params), shifted(state, 8).params)


def test_a_given_step_rotated_away_is_reported_as_rotated_not_damaged(
  run_dir, tmp_path, monkeypatch
):
  from flax_transformer.run import RotatedCheckpoint

  run = tmp_path / 'run'
  shutil.copytree(run_dir, run)
  _rotating_restore(monkeypatch, lambda directory, step: shutil.rmtree(directory / str(step)))
  with pytest.raises(RotatedCheckpoint, match='checkpoint 8 was deleted while it was read') as info:
    load_for_inference(run, step=8)
  assert 'damaged' not in str(info.value).replace('not damaged', '')
  # Files present but wrong are still damage.
  (run / 'checkpoints' / '6' / 'params' / '_METADATA').write_text('{')
  with pytest.raises(DamagedCheckpoint, match='damaged checkpoint'):
    load_for_inference(run, step=6)
