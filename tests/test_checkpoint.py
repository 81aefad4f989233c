"""The run directory: bit-exact round trips, retention, inference loading, averaging, clear errors."""

import json

import jax
import numpy as np
import pytest

from flax_transformer.checkpoint import (CheckpointError, Checkpoints, average_checkpoints,
                                         check_resumable, load_for_inference, read_config,
                                         write_config)
from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.model import Transformer
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train_step import create_train_state, make_optimizer

TEXTS = ['ein kleiner Hund läuft', 'a small dog runs', 'zwei Männer spielen Fußball',
         'two men play football', 'eine Frau liest ein Buch', 'a woman reads a book']
# Accumulation and clipping give the optimizer state nested named tuples to restore.
TRAIN_CONFIG = TrainConfig(steps=10, grad_accum_steps=2, max_grad_norm=1.0, keep_checkpoints=3)


@pytest.fixture(scope='module')
def tokenizer():
  return Tokenizer.train(TEXTS, 64)


@pytest.fixture(scope='module')
def setup(tokenizer):
  """(model config, optimizer, abstract state, a host state with non-trivial optimizer state)."""
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, num_encoder_layers=1,
                            num_decoder_layers=1)
  model = Transformer(config)
  optimizer = make_optimizer(TRAIN_CONFIG, config)
  abstract = jax.eval_shape(lambda: create_train_state(model, optimizer, seed=0))
  state = jax.device_get(create_train_state(model, optimizer, seed=0))
  rng = np.random.default_rng(0)
  grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(p.dtype), state.params)
  _, opt_state = optimizer.update(grads, state.opt_state, state.params)
  return config, optimizer, abstract, state.replace(opt_state=jax.device_get(opt_state))


def shifted(state, step):
  """`state` at `step`, every parameter shifted by `step` so checkpoints differ."""
  return state.replace(step=np.int32(step), params=jax.tree.map(lambda p: p + step, state.params))


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory, setup, tokenizer):
  """A run directory with checkpoints at steps 2, 4, 6, 8, 10 (the last 3 kept)."""
  config, _, _, state = setup
  workdir = tmp_path_factory.mktemp('run')
  write_config(workdir, config, TRAIN_CONFIG, DataConfig())
  tokenizer.save(workdir)
  checkpoints = Checkpoints(workdir, keep=TRAIN_CONFIG.keep_checkpoints)
  for step in range(2, 11, 2):
    checkpoints.save(shifted(state, step))
  checkpoints.close()
  return workdir


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


def test_config_round_trip(run_dir, setup):
  config, _, _, _ = setup
  assert read_config(run_dir) == (config, TRAIN_CONFIG, DataConfig())


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
  wrong = jax.eval_shape(lambda: create_train_state(
      bigger, make_optimizer(TRAIN_CONFIG, bigger.config), seed=0))
  checkpoints = Checkpoints(run_dir)
  with pytest.raises(CheckpointError, match=r"\['kernel'\] has shape \(32, 32\), the model of "
                                             r'config.json needs \(64, 64\); the checkpoint belongs '
                                             r'to another model'):
    checkpoints.restore(10, wrong)
  checkpoints.close()


def test_corrupt_config_and_incompatible_tokenizer(tmp_path, run_dir, setup):
  (tmp_path / 'config.json').write_text('{"model": {"d_model": 32')
  with pytest.raises(CheckpointError, match='not a valid run configuration'):
    read_config(tmp_path)
  config, _, _, _ = setup
  content = json.loads((run_dir / 'config.json').read_text())
  content['model']['vocab_size'] = config.vocab_size + 1
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'config.json').write_text(json.dumps(content))
  (other / 'checkpoints').symlink_to(run_dir / 'checkpoints')
  (other / 'tokenizer.json').symlink_to(run_dir / 'tokenizer.json')
  with pytest.raises(ConfigError, match='model.vocab_size=.* but the tokenizer has'):
    load_for_inference(other)


def test_check_resumable_allows_run_length_changes_only(run_dir, setup):
  config, _, _, _ = setup
  check_resumable(run_dir, config, TRAIN_CONFIG.replace(steps=99, log_every=7), DataConfig())
  with pytest.raises(CheckpointError) as error:
    check_resumable(run_dir, config.replace(d_model=64), TRAIN_CONFIG.replace(seed=1),
                    DataConfig(vocab_size=100))
  message = str(error.value)
  assert 'model.d_model: saved 32, requested 64' in message
  assert 'train.seed: saved 0, requested 1' in message
  assert 'data.vocab_size: saved 8000, requested 100' in message
  assert '--no-resume' in message
