"""model.dtype auto: bfloat16 on a GPU or TPU, float32 on a CPU, and a run keeps the explicit
dtype it began with."""

import jax
import jax.numpy as jnp
import pytest

from flax_transformer.config import DataConfig, ModelConfig, TrainConfig, resolve_dtype
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
  assert jax.default_backend() != 'cpu' or config.compute_dtype == jnp.float32
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  assert config.compute_dtype == jnp.bfloat16


@pytest.mark.parametrize(
  'saved, requested, kept',
  [
    ('float32', 'auto', 'float32'),  # begun explicitly (or before auto existed): kept
    ('bfloat16', 'auto', 'bfloat16'),
    ('auto', 'auto', 'auto'),  # begun with auto: resolved on each machine
    ('float32', 'bfloat16', 'bfloat16'),
  ],
)  # asked explicitly: check_settings decides
def test_a_resumed_run_keeps_the_dtype_it_began_with(tmp_path, saved, requested, kept):
  model, train, data = ModelConfig.tiny(), TrainConfig(), DataConfig(source='toy')
  write_config(tmp_path, model.replace(dtype=saved), train, data)
  assert RunDirectory(tmp_path).kept_dtype(model.replace(dtype=requested)).dtype == kept
  assert RunDirectory(tmp_path / 'new').kept_dtype(model).dtype == 'auto'  # a fresh run
