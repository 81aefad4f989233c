"""model.remat: rematerialisation changes what training keeps for the backward pass, never
the gradients nor the parameters' names.

With remat, training runs the layers as one `lax.scan` over their stacked parameters, each
step under `jax.checkpoint` (`layers.scanned_layers`). Gradients are compared in float32
against the unrolled model without remat, with dropout off: two computations of one
quantity on this machine, whose sums differ only in the order XLA takes them. (With
dropout on, the scan draws each layer's mask from its own split key: other masks.)
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ModelConfig, Transformer
from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.run.directory import CheckpointError, check_resumable, write_config

CONFIG = ModelConfig.tiny(num_encoder_layers=2, num_decoder_layers=2)
SRC = jnp.array([[5, 9, 12, 7, 2, 0, 0], [4, 4, 8, 2, 0, 0, 0]])
TGT = jnp.array([[1, 8, 13, 6, 2], [1, 7, 2, 0, 0]])


@functools.cache
def loss_and_gradients(remat: str, radius=None, norm='post', dropout=0.0):
  model = Transformer(
    CONFIG.replace(
      remat=remat,
      attention_radius=radius,
      norm_placement=norm,
      dropout_rate=dropout,
      attention_dropout_rate=dropout,
    )
  )
  params = model.init(jax.random.key(0), SRC, TGT)['params']

  def loss(params):
    logits = model.apply(
      {'params': params}, SRC, TGT, train=True, rngs={'dropout': jax.random.key(1)}
    )
    return -jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(TGT, logits.shape[-1]))

  return params, *jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize('remat', ['layer', 'dots'])
@pytest.mark.parametrize(
  'radius, norm', [(None, 'post'), (2, 'post'), (None, 'pre')], ids=['full', 'banded', 'pre_ln']
)
def test_remat_gives_the_gradients_of_no_remat_under_the_same_names(remat, radius, norm):
  params, loss, expected = loss_and_gradients('none', radius, norm)
  remat_params, remat_loss, got = loss_and_gradients(remat, radius, norm)
  assert jax.tree.structure(remat_params) == jax.tree.structure(params)
  jax.tree.map(np.testing.assert_array_equal, remat_params, params)  # the same init
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale), got, expected
  )


def test_a_cmlm_model_takes_remat_too():
  from flax_transformer.nn.cmlm import CMLMTransformer

  tokens = jnp.array([[4, 8, 13, 6, 2], [5, 7, 2, 0, 0]])

  def loss_and_gradients(remat):
    model = CMLMTransformer(
      CONFIG.replace(remat=remat, kind='cmlm', dropout_rate=0.0, max_length_offset=4)
    )
    params = model.init(jax.random.key(0), SRC, tokens)['params']

    def loss(params):
      token_logits, length_logits = model.apply(
        {'params': params}, SRC, tokens, train=True, rngs={'dropout': jax.random.key(1)}
      )
      return jnp.mean(token_logits**2) + jnp.mean(length_logits**2)

    return jax.jit(jax.value_and_grad(loss))(params)

  (loss, expected), (remat_loss, got) = loss_and_gradients('none'), loss_and_gradients('layer')
  np.testing.assert_allclose(remat_loss, loss, rtol=1e-6)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(expected))
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale), got, expected
  )


def test_remat_runs_dropout_in_every_layer():
  """With dropout the scanned layers draw masks (the loss moves) from the run's key alone."""
  _, without, _ = loss_and_gradients('layer')
  _, with_dropout, _ = loss_and_gradients('layer', dropout=0.3)
  assert abs(float(with_dropout) - float(without)) > 1e-3 * abs(float(without))
  loss_and_gradients.cache_clear()
  _, again, _ = loss_and_gradients('layer', dropout=0.3)
  np.testing.assert_allclose(again, with_dropout, rtol=1e-6)


def test_remat_keeps_less_for_the_backward_pass():
  """XLA's own account of the compiled gradient: a scanned, rematerialised stack keeps each
  layer's input, not its activations (docs/training_step.md measures the base model)."""
  src = jnp.ones((16, 64), jnp.int32)

  def temporaries(remat: str) -> int:
    model = Transformer(
      ModelConfig.tiny(
        remat=remat, d_model=64, d_ff=512, num_heads=4, num_encoder_layers=4, num_decoder_layers=4
      )
    )
    params = jax.eval_shape(model.init, jax.random.key(0), src, src)['params']
    loss = lambda p: model.apply(
      {'params': p}, src, src, train=True, rngs={'dropout': jax.random.key(1)}
    ).sum()
    return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes

  none, layer, dots = temporaries('none'), temporaries('layer'), temporaries('dots')
  assert layer < 0.5 * none and layer < dots < none, (none, layer, dots)


def test_a_run_may_change_remat_when_resumed_but_not_the_model(tmp_path):
  model, train, data = CONFIG, TrainConfig(), DataConfig(source='toy')
  write_config(tmp_path, model, train, data)
  check_resumable(tmp_path, model.replace(remat='dots'), train, data)  # allowed
  with pytest.raises(CheckpointError, match='model.d_ff: saved 64, requested 128'):
    check_resumable(tmp_path, model.replace(d_ff=128), train, data)


def test_remat_is_checked_as_a_choice():
  with pytest.raises(ValueError, match='model.remat must be one of none, layer, dots'):
    ModelConfig.tiny(remat='all')
