"""model.remat: rematerialisation changes what training keeps for the backward pass, never
the gradients nor the parameters' names.

Gradients are compared in float32 with dropout on (nn.remat replays each layer with the
same dropout keys), against the model without remat: two computations of one quantity on
this machine, whose sums differ only in the order XLA takes them.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ModelConfig, Transformer
from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.run.directory import CheckpointError, check_resumable, write_config

CONFIG = ModelConfig.tiny(num_encoder_layers=2, num_decoder_layers=2, dropout_rate=0.1,
                          attention_dropout_rate=0.1)
SRC = jnp.array([[5, 9, 12, 7, 2, 0, 0], [4, 4, 8, 2, 0, 0, 0]])
TGT = jnp.array([[1, 8, 13, 6, 2], [1, 7, 2, 0, 0]])


@functools.cache
def gradients(remat: str, radius=None, train=True):
  model = Transformer(CONFIG.replace(remat=remat, attention_radius=radius))
  params = model.init(jax.random.key(0), SRC, TGT)['params']

  def loss(params):
    logits = model.apply({'params': params}, SRC, TGT, train=train,
                         rngs={'dropout': jax.random.key(1)})
    return jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(TGT, logits.shape[-1]))

  return params, jax.jit(jax.grad(loss))(params)


@pytest.mark.parametrize('remat', ['layer', 'dots'])
@pytest.mark.parametrize('radius', [None, 2], ids=['full', 'banded'])
def test_remat_gives_the_gradients_of_no_remat_under_the_same_names(remat, radius):
  params, expected = gradients('none', radius)
  remat_params, got = gradients(remat, radius)
  assert jax.tree.structure(remat_params) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, remat_params, params)  # the same init
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale),
               got, expected)
  # Dropout ran: replayed with other keys, the comparison above would fail.
  _, deterministic = gradients('none', radius, train=False)
  assert not all(np.allclose(a, b, atol=1e-3 * scale) for a, b in zip(
      jax.tree.leaves(expected), jax.tree.leaves(deterministic)))


def test_a_run_may_change_remat_when_resumed_but_not_the_model(tmp_path):
  model, train, data = CONFIG, TrainConfig(), DataConfig(source='toy')
  write_config(tmp_path, model, train, data)
  check_resumable(tmp_path, model.replace(remat='dots'), train, data)  # allowed
  with pytest.raises(CheckpointError, match="model.d_ff: saved 64, requested 128"):
    check_resumable(tmp_path, model.replace(d_ff=128), train, data)


def test_remat_is_checked_as_a_choice():
  with pytest.raises(ValueError, match='model.remat must be one of none, layer, dots'):
    ModelConfig.tiny(remat='all')
