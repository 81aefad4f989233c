"""dropout: the rate (to 2^-16), exact rescaling, one mask shared by forward and backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer.nn.dropout import Dropout, dropout, keep_threshold

RATE = 0.1
X = jnp.asarray(np.random.default_rng(0).uniform(1.0, 2.0, size=(64, 32, 64)), jnp.float32)


def test_keep_threshold_rounds_to_sixteen_bits():
  assert keep_threshold(0.1) == 58982  # 0.9 * 65536 = 58982.4
  assert keep_threshold(0.0) == 65536
  for bad in (1.0, -0.1, 1.0 - 2**-18):
    with pytest.raises(ValueError, match='dropout rate'):
      keep_threshold(bad)


def test_drop_rate_and_exact_scale():
  y = np.asarray(dropout(X, RATE, jax.random.key(0)))
  dropped = y == 0
  n = dropped.size
  # Binomial(n, 0.1): 5 standard deviations.
  assert abs(dropped.mean() - RATE) < 5 * np.sqrt(RATE * (1 - RATE) / n)
  np.testing.assert_array_equal(y[~dropped], np.asarray(X)[~dropped] * np.float32(65536 / 58982))


def test_backward_uses_the_forward_mask():
  key = jax.random.key(1)
  y, pullback = jax.vjp(lambda x: dropout(x, RATE, key), X)
  (grad,) = pullback(jnp.ones_like(X))
  np.testing.assert_array_equal(np.asarray(grad) == 0, np.asarray(y) == 0)
  np.testing.assert_allclose(np.asarray(grad)[np.asarray(y) != 0], 65536 / 58982, rtol=1e-6)


def test_keys_give_different_masks_and_bfloat16_stays_bfloat16():
  a, b = (np.asarray(dropout(X, RATE, jax.random.key(k))) == 0 for k in (2, 3))
  assert (a != b).mean() > 0.1
  assert dropout(X.astype(jnp.bfloat16), RATE, jax.random.key(2)).dtype == jnp.bfloat16


def test_module_is_identity_when_deterministic_and_draws_from_dropout_rngs():
  module = Dropout(RATE)
  assert module.apply({}, X, deterministic=True) is X
  run = lambda seed: np.asarray(
    module.apply({}, X, deterministic=False, rngs={'dropout': jax.random.key(seed)})
  )
  np.testing.assert_array_equal(run(4), run(4))
  assert ((run(4) == 0) != (run(5) == 0)).any()
  assert abs((run(4) == 0).mean() - RATE) < 0.01


@pytest.mark.parametrize('shape', [(64, 32, 64), (3, 5, 7)])
def test_both_halves_of_each_random_word_drop_independently(shape):
  """Each 32-bit word serves two elements, one per half of the flattened array."""
  x = jnp.ones(shape, jnp.float32)
  dropped = np.concatenate(
    [
      np.asarray(dropout(x, RATE, jax.random.key(k))).ravel() == 0
      for k in range(200 if x.size < 1000 else 1)
    ]
  )
  dropped = dropped.reshape(-1, x.size)
  pairs, offset = x.size // 2, (x.size + 1) // 2  # word i feeds elements i and offset + i
  low, high = dropped[:, :pairs].ravel(), dropped[:, offset : offset + pairs].ravel()
  bound = 5 * np.sqrt(RATE * (1 - RATE) / low.size)
  assert abs(low.mean() - RATE) < bound and abs(high.mean() - RATE) < bound
  # Independent halves: P(both dropped) = RATE^2 (to 5 sd); equal halves would give RATE.
  both = (low & high).mean()
  assert abs(both - RATE**2) < 5 * np.sqrt(RATE**2 * (1 - RATE**2) / low.size)


def test_activation_dropout_drops_the_feed_forwards_hidden_units_in_training_only():
  """FFN(x) = W_2 Dropout(act(W_1 x + b_1)) + b_2: with d_model >= d_ff the hidden units are
  recovered from the output (a float64 least-squares solve) and compared with a float64
  reference: each is dropped (0) or kept and rescaled, at the rate; at evaluation none is."""
  from flax_transformer.config import ModelConfig
  from flax_transformer.nn.layers import FeedForward

  config = ModelConfig.tiny().replace(
    d_model=32, d_ff=8, activation='silu', activation_dropout_rate=0.25
  )
  ffn = FeedForward(config)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(4096, 32)), jnp.float32)  # [tokens, d]
  params = ffn.init(jax.random.key(0), x)['params']
  w1, b1 = (np.asarray(params['wi'][n], np.float64) for n in ('kernel', 'bias'))
  w2, b2 = (np.asarray(params['wo'][n], np.float64) for n in ('kernel', 'bias'))
  z = np.asarray(x, np.float64) @ w1 + b1
  hidden = z / (1 + np.exp(-z))  # silu, [tokens, d_ff]
  evaluated = ffn.apply({'params': params}, x)
  np.testing.assert_allclose(np.asarray(evaluated), hidden @ w2 + b2, rtol=1e-4, atol=1e-4)
  trained = ffn.apply({'params': params}, x, True, rngs={'dropout': jax.random.key(2)})
  # [tokens, d_ff]: what reached W_2, solved from the output.
  reached = np.linalg.lstsq(w2.T, (np.asarray(trained, np.float64) - b2).T, rcond=None)[0].T
  dropped = np.abs(reached) < 1e-3 * np.abs(hidden).max()
  scale = 65536 / keep_threshold(0.25)
  np.testing.assert_allclose(reached[~dropped], hidden[~dropped] * scale, rtol=1e-3, atol=1e-3)
  n = dropped.size
  assert abs(dropped.mean() - 0.25) < 5 * np.sqrt(0.25 * 0.75 / n)
  # Without the setting (the paper's model) training leaves the hidden units whole.
  plain = FeedForward(config.replace(activation_dropout_rate=0.0))
  np.testing.assert_allclose(
    np.asarray(plain.apply({'params': params}, x, True, rngs={'dropout': jax.random.key(2)})),
    np.asarray(evaluated),
    rtol=1e-6,
    atol=1e-6,
  )
