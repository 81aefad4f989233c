"""Whole-model properties: padding invariance, causality, parameter count, gradients, cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ConfigError, ModelConfig, Transformer, attention_weights, count_params
from support import numpy_transformer

CONFIG = ModelConfig.tiny(dropout_rate=0.0)
SENTENCE_SRC = [5, 9, 12, 7, 2]
SENTENCE_TGT_IN = [1, 8, 13, 6]


def pad_to(ids, length):
  return ids + [CONFIG.pad_id] * (length - len(ids))


@pytest.fixture(scope='module')
def model_and_variables():
  model = Transformer(CONFIG)
  src = jnp.array([pad_to(SENTENCE_SRC, 8)])
  variables = model.init(jax.random.key(0), src, jnp.array([SENTENCE_TGT_IN]))
  return model, variables


@pytest.fixture(scope='module')
def forward(model_and_variables):
  model, variables = model_and_variables
  return jax.jit(lambda src, tgt: model.apply(variables, src, tgt))


def test_logits_shape_and_dtype(model_and_variables, forward):
  logits = forward(jnp.array([SENTENCE_SRC]), jnp.array([SENTENCE_TGT_IN]))
  assert logits.shape == (1, 4, CONFIG.vocab_size) and logits.dtype == jnp.float32
  # The values: the paper's model written out in NumPy float64 (tests/test_model_reference.py
  # covers the other configurations). Logits are O(1); float32 stays within ~1e-6 of float64.
  _, variables = model_and_variables
  want = numpy_transformer.logits(
    CONFIG, variables['params'], np.array([SENTENCE_SRC]), np.array([SENTENCE_TGT_IN])
  )
  assert 0.5 < np.abs(want).max() < 20
  np.testing.assert_allclose(logits, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize('num_pads', [3, 10])
def test_source_padding_does_not_change_logits(forward, num_pads):
  alone = forward(jnp.array([SENTENCE_SRC]), jnp.array([SENTENCE_TGT_IN]))
  padded = forward(
    jnp.array([pad_to(SENTENCE_SRC, len(SENTENCE_SRC) + num_pads)]), jnp.array([SENTENCE_TGT_IN])
  )
  np.testing.assert_allclose(padded, alone, atol=1e-5, rtol=1e-5)


def test_batch_neighbours_do_not_change_logits(forward):
  alone = forward(jnp.array([SENTENCE_SRC]), jnp.array([SENTENCE_TGT_IN]))
  longer_src = [4, 5, 6, 7, 8, 9, 10, 11, 12, 2]
  longer_tgt = [1, 20, 21, 22, 23, 24, 25]
  src = jnp.array([pad_to(SENTENCE_SRC, 10), longer_src])
  tgt = jnp.array([pad_to(SENTENCE_TGT_IN, 7), longer_tgt])
  batched = forward(src, tgt)
  # Target positions past the sentence are PAD inputs; only the real ones are compared.
  np.testing.assert_allclose(batched[0, : len(SENTENCE_TGT_IN)], alone[0], atol=1e-5, rtol=1e-5)


def test_decoder_is_causal(forward):
  src = jnp.array([SENTENCE_SRC])
  tgt = jnp.array([[1, 8, 13, 6, 9, 10]])
  base = forward(src, tgt)
  for t in range(tgt.shape[1] - 1):
    changed = tgt.at[0, t + 1 :].set(jnp.array([30, 31, 32, 33, 34])[: tgt.shape[1] - t - 1])
    logits = forward(src, changed)
    np.testing.assert_allclose(logits[0, : t + 1], base[0, : t + 1], atol=1e-6)
    assert np.abs(np.asarray(logits[0, t + 1 :] - base[0, t + 1 :])).max() > 1e-4


def test_cached_decode_steps_equal_the_full_pass(model_and_variables, forward):
  model, variables = model_and_variables
  src = jnp.array([pad_to(SENTENCE_SRC, 7), [3, 4, 5, 6, 7, 8, 2]])
  tgt = jnp.array([[1, 8, 13, 6, 9], [1, 4, 4, 30, 31]])
  full = forward(src, tgt)
  cache = model.apply(variables, src, 8, method=Transformer.start_decoding)
  step = jax.jit(
    lambda tokens, cache, position: model.apply(
      variables, tokens, cache, position, method=Transformer.decode_step
    )
  )
  for position in range(tgt.shape[1]):
    logits, cache = step(tgt[:, position : position + 1], cache, position)
    np.testing.assert_allclose(logits[:, 0], full[:, position], atol=1e-5, rtol=1e-5)


def test_restricted_attention_cache_matches_full_pass():
  config = CONFIG.replace(attention_radius=1)
  model = Transformer(config)
  src = jnp.array([SENTENCE_SRC])
  tgt = jnp.array([[1, 8, 13, 6, 9]])
  variables = model.init(jax.random.key(1), src, tgt)
  full = model.apply(variables, src, tgt)
  unrestricted = Transformer(CONFIG).apply(variables, src, tgt)
  assert np.abs(np.asarray(full - unrestricted)).max() > 1e-4
  cache = model.apply(variables, src, 5, method=Transformer.start_decoding)
  for position in range(5):
    logits, cache = model.apply(
      variables, tgt[:, position : position + 1], cache, position, method=Transformer.decode_step
    )
    np.testing.assert_allclose(logits[:, 0], full[:, position], atol=1e-5, rtol=1e-5)


def test_base_parameter_count_is_within_3_percent_of_the_paper():
  config = ModelConfig.base(vocab_size=37_000)
  shapes = jax.eval_shape(
    lambda: Transformer(config).init(
      jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32)
    )
  )
  # 37,000 x 512 shared embedding + 6 encoder layers of 3,151,872 + 6 decoder layers of 4,203,008
  # (each attention: 4 projections of 512 x 512, biases on query, value and output only).
  assert count_params(shapes['params']) == 63_073_280
  assert abs(count_params(shapes['params']) - 65e6) / 65e6 < 0.03


def test_untied_embeddings_add_two_matrices():
  config = CONFIG.replace(share_embeddings=False)
  args = (jax.random.key(0), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
  tied = count_params(Transformer(CONFIG).init(*args)['params'])
  untied = count_params(Transformer(config).init(*args)['params'])
  assert untied - tied == 2 * CONFIG.vocab_size * CONFIG.d_model


@pytest.mark.parametrize('norm_placement', ['post', 'pre'])
def test_gradients_reach_every_parameter(norm_placement):
  config = CONFIG.replace(norm_placement=norm_placement, share_embeddings=norm_placement == 'pre')
  model = Transformer(config)
  src = jnp.array([[5, 9, 12, 7, 2, 0], [3, 4, 5, 6, 7, 2]])
  tgt_in = jnp.array([[1, 8, 13, 6, 0, 0], [1, 4, 4, 30, 31, 32]])
  tgt_out = jnp.array([[8, 13, 6, 2, 0, 0], [4, 4, 30, 31, 32, 2]])
  variables = model.init(jax.random.key(0), src, tgt_in)

  def loss(params):
    logits = model.apply(
      {'params': params}, src, tgt_in, train=True, rngs={'dropout': jax.random.key(1)}
    )
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), tgt_out[..., None], -1)[..., 0]
    return jnp.sum(nll * (tgt_out != 0))

  grads = jax.grad(loss)(variables['params'])
  flat = jax.tree_util.tree_leaves_with_path(grads)
  dead = [jax.tree_util.keystr(path) for path, g in flat if not np.any(np.asarray(g) != 0)]
  assert not dead, f'parameters with an all-zero gradient: {dead}'


def test_dropout_is_active_only_in_training(model_and_variables):
  model, variables = model_and_variables
  config = CONFIG.replace(dropout_rate=0.3)
  model = Transformer(config)
  src, tgt = jnp.array([SENTENCE_SRC]), jnp.array([SENTENCE_TGT_IN])
  eval_a = model.apply(variables, src, tgt)
  np.testing.assert_array_equal(eval_a, model.apply(variables, src, tgt))
  train_a = model.apply(variables, src, tgt, train=True, rngs={'dropout': jax.random.key(0)})
  train_b = model.apply(variables, src, tgt, train=True, rngs={'dropout': jax.random.key(1)})
  assert np.abs(np.asarray(train_a - train_b)).max() > 1e-3


def test_bfloat16_compute_keeps_float32_params_and_logits(model_and_variables, forward):
  model, variables = model_and_variables
  bf16 = Transformer(CONFIG.replace(dtype='bfloat16'))
  src, tgt = jnp.array([SENTENCE_SRC]), jnp.array([SENTENCE_TGT_IN])
  logits = bf16.apply(variables, src, tgt)
  assert logits.dtype == jnp.float32
  new_params = bf16.init(jax.random.key(0), src, tgt)['params']
  assert {x.dtype for x in jax.tree_util.tree_leaves(new_params)} == {jnp.dtype(jnp.float32)}
  # What bfloat16 justifies: 8 significant bits, a relative rounding error of up to 2^-9 =
  # 0.2% per operation, a half-ulp of 0.008 on logits of 2..4. A few such roundings per layer
  # through 2 + 2 layers put these logits (up to ~3) 0.02-0.035 off float32's across
  # initialisation seeds (0.0196 with this one), their RMS error 0.5-0.9% of the logits'
  # spread. 0.05 and 2% leave a margin for another CPU's order of summation.
  float32_logits = np.asarray(forward(src, tgt))
  np.testing.assert_allclose(logits, float32_logits, rtol=0, atol=0.05)
  error = np.abs(np.asarray(logits, np.float64) - float32_logits)
  assert np.sqrt((error**2).mean()) < 0.02 * float32_logits.std()
  assert error.max() > 1e-4, 'bfloat16 logits equal float32 ones: was bfloat16 used at all?'


def test_attention_weights_for_plotting(model_and_variables):
  model, variables = model_and_variables
  src = jnp.array([pad_to(SENTENCE_SRC, 7)])
  weights = attention_weights(model, variables, src, jnp.array([SENTENCE_TGT_IN]))
  assert set(weights) == {f'encoder/layer_{i}/self_attention' for i in range(2)} | {
    f'decoder/layer_{i}/{kind}' for i in range(2) for kind in ('self_attention', 'cross_attention')
  }
  cross = np.asarray(weights['decoder/layer_1/cross_attention'])
  assert cross.shape == (1, CONFIG.num_heads, 4, 7)
  np.testing.assert_array_equal(cross[..., len(SENTENCE_SRC) :], 0.0)  # PAD columns, every layer
  np.testing.assert_array_equal(
    weights['encoder/layer_1/self_attention'][..., len(SENTENCE_SRC) :], 0.0
  )
  np.testing.assert_allclose(cross.sum(-1), 1.0, rtol=1e-5)


def test_too_long_input_is_refused_with_a_clear_message(model_and_variables):
  model, variables = model_and_variables
  with pytest.raises(ValueError, match='max_len=64'):
    model.apply(variables, jnp.ones((1, 65), jnp.int32), jnp.ones((1, 3), jnp.int32))


@pytest.mark.parametrize(
  'overrides, option',
  [
    (dict(d_model=30, num_heads=4), 'num_heads'),
    (dict(vocab_size=3), 'vocab_size'),
    (dict(dropout_rate=1.5), 'dropout_rate'),
    (dict(num_encoder_layers=0), 'num_encoder_layers'),
    (dict(norm_placement='middle'), 'norm_placement'),
  ],
)
def test_invalid_config_names_the_option(overrides, option):
  with pytest.raises(ConfigError, match=option):
    ModelConfig.tiny(**overrides)


def test_presets_follow_table_3():
  base, big = ModelConfig.base(), ModelConfig.big()
  assert (base.num_encoder_layers, base.d_model, base.d_ff, base.num_heads, base.dropout_rate) == (
    6,
    512,
    2048,
    8,
    0.1,
  )
  assert (big.num_encoder_layers, big.d_model, big.d_ff, big.num_heads, big.dropout_rate) == (
    6,
    1024,
    4096,
    16,
    0.3,
  )
  assert base.head_dim == 64 and big.head_dim == 64


def test_a_decoder_may_start_from_pad_but_other_special_ids_stay_distinct():
  # Marian's decoder starts from PAD: bos_id == pad_id is allowed, for autoregressive models only.
  assert ModelConfig.tiny(bos_id=0).bos_id == ModelConfig.tiny().pad_id
  with pytest.raises(ConfigError, match='special token ids must be distinct'):
    ModelConfig.tiny(eos_id=0)
  with pytest.raises(ConfigError, match='model.bos_id equal to model.pad_id is for autoregressive'):
    ModelConfig.tiny(bos_id=0, kind='cmlm')


def test_a_decoder_starting_from_pad_sees_its_start_token():
  # With bos_id == pad_id the first query must attend to position 0 (not a fully masked row),
  # so the logits there depend on the source; the paper's config is unchanged.
  config = ModelConfig.tiny(bos_id=0, dropout_rate=0.0, logits_bias=True)
  model = Transformer(config)
  src = jnp.array([[5, 6, 7, 2], [8, 9, 2, 0]])
  tgt_in = jnp.zeros((2, 1), jnp.int32)  # the start token: PAD
  variables = model.init(jax.random.key(0), src, tgt_in)
  weights = attention_weights(model, variables, src, tgt_in)['decoder/layer_0/self_attention']
  np.testing.assert_allclose(np.asarray(weights)[:, :, 0, 0], 1.0, atol=1e-6)
  assert variables['params']['logits_bias'].shape == (config.vocab_size,)
