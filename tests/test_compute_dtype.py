"""model.dtype auto: bfloat16 on a GPU or TPU, float32 on a CPU; the dtype is the computation's,
chosen per run: a resumed run computes in what it asks for."""

import jax
import jax.numpy as jnp
import pytest

from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.errors import CheckpointError
from flax_transformer.nn.backend import compute_dtype, resolve_dtype
from flax_transformer.run.directory import RunDirectory, write_config


@pytest.mark.parametrize(
  'dtype, backend, expected',
  [
    ('auto', 'cpu', 'float32'),
    ('auto', 'gpu', 'bfloat16'),
    ('auto', 'tpu', 'bfloat16'),
    ('float32', 'gpu', 'float32'),
    ('bfloat16', 'cpu', 'bfloat16'),
  ],
)
def test_auto_resolves_by_backend_and_an_explicit_dtype_stays(dtype, backend, expected):
  assert resolve_dtype(dtype, backend) == expected


def test_the_default_is_auto_resolved_where_the_model_runs(monkeypatch):
  config = ModelConfig.tiny()
  assert config.dtype == 'auto'
  assert jax.default_backend() != 'cpu' or compute_dtype(config) == jnp.float32
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert compute_dtype(config) == jnp.bfloat16


@pytest.mark.parametrize(
  'saved, requested', [('float32', 'auto'), ('bfloat16', 'float32'), ('auto', 'bfloat16')]
)
def test_a_resumed_run_computes_in_the_dtype_it_asks_for(tmp_path, saved, requested):
  model, train, data = ModelConfig.tiny(), TrainConfig(), DataConfig(source='toy')
  write_config(tmp_path, model.replace(dtype=saved), train, data)
  RunDirectory(tmp_path).check_settings(model.replace(dtype=requested), train, data)  # no error
  with pytest.raises(CheckpointError, match='model.d_model: saved 32, requested 64'):
    RunDirectory(tmp_path).check_settings(model.replace(dtype=requested, d_model=64), train, data)
