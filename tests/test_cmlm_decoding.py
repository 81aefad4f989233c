"""Mask-predict (flax_transformer/decode/non_autoregressive.py) on the CMLM: the length and re-masking
schedules of decoding, independence of batch padding, refused settings and calls, and a
tiny model trained on a copy task decoding it exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_transformer import ConfigError, ModelConfig, Transformer
from flax_transformer.data.batching import Batch
from flax_transformer.decode import autoregressive, non_autoregressive
from flax_transformer.decode.methods import MaskPredict
from flax_transformer.nn import cmlm
from flax_transformer.nn.cmlm import CMLMTransformer
from flax_transformer.train import cmlm_objective
from support.tiny_cmlm import CONFIG, COPY_CONFIG, EOS, PAD, SOURCES, R, pad_rows, source_lengths

LENGTH_BEAM = 3


# --- fixtures: support.tiny_cmlm's model, whose parameters conftest.py initialises once --


@pytest.fixture(scope='module')
def model():
  return CMLMTransformer(CONFIG)


@pytest.fixture(scope='module')
def params(cmlm_params):
  return cmlm_params


@pytest.fixture(scope='module')
def src():
  return pad_rows(SOURCES)


@pytest.fixture(scope='module')
def copy_params(cmlm_copy_params):
  return cmlm_copy_params


def constant_model(params, token, length_class):
  """Parameters whose decoder predicts `token` at every position and whose classifier says `length_class`.

  The last post-LN LayerNorm of the decoder gets scale 0 and bias = 100 x the token's
  embedding row, so every position's output is that vector and the token's log-probability
  rounds to exactly 0 (every candidate then scores alike); the length head gets a zero
  kernel and a bias that is 10 at `length_class`.
  """
  params = jax.tree.map(lambda x: x, params)
  norm = params['decoder'][f'layer_{CONFIG.num_decoder_layers - 1}']['ffn_sublayer']['norm']
  norm['scale'] = jnp.zeros_like(norm['scale'])
  norm['bias'] = 100.0 * params['embedding']['embedding'][token]
  head = params['length_head']
  head['kernel'] = jnp.zeros_like(head['kernel'])
  head['bias'] = 10.0 * jax.nn.one_hot(length_class, cmlm.num_length_classes(CONFIG))
  return params


# --- mask-predict -----------------------------------------------------------------------------


def decode(model, params, src, **settings):
  return jax.tree.map(
    np.asarray, non_autoregressive.mask_predict(model, params, src, return_history=True, **settings)
  )


def test_one_pass_rows_are_as_long_as_the_predicted_length(model, params, src):
  token, length_class = 7, R + 1  # every position 7; lengths = source + 1
  tokens, history = decode(
    model, constant_model(params, token, length_class), src, iterations=1, length_beam=LENGTH_BEAM
  )
  lengths = source_lengths(src) + 1
  # Room for the longest row and its EOS, rounded up to a multiple of 8.
  width = non_autoregressive.canvas_width(lengths.max(), CONFIG.max_len)
  assert width % non_autoregressive.WIDTH_MULTIPLE == 0 and lengths.max() < width
  assert tokens.shape == (len(SOURCES), width)
  for row, n in zip(tokens, lengths):
    np.testing.assert_array_equal(row, [token] * n + [EOS] + [PAD] * (width - n - 1))
  # All candidates score alike, so the first (the most likely length) wins.
  np.testing.assert_array_equal(history['chosen'], 0)
  np.testing.assert_array_equal(history['lengths'][::LENGTH_BEAM], lengths)


def test_candidate_lengths_are_the_classifier_top_k(model, params, src):
  _, history = decode(model, params, src, iterations=1, length_beam=LENGTH_BEAM)
  _, length_logits = model.apply({'params': params}, src, src)
  top = np.argsort(-np.asarray(length_logits), axis=1, kind='stable')[:, :LENGTH_BEAM]
  expected = np.clip(source_lengths(src)[:, None] + top - R, 1, CONFIG.max_len)
  np.testing.assert_array_equal(history['lengths'].reshape(-1, LENGTH_BEAM), expected)
  best = history['scores'].argmax(axis=1)
  np.testing.assert_array_equal(history['chosen'], best)


@pytest.mark.parametrize('iterations', [1, 4, 10])
def test_remasked_counts_follow_the_schedule(model, params, src, iterations):
  tokens, history = decode(model, params, src, iterations=iterations, length_beam=LENGTH_BEAM)
  lengths = history['lengths']
  expected = np.array([lengths * (iterations - t) // iterations for t in range(iterations)])
  np.testing.assert_array_equal(history['masked_counts'], expected)
  np.testing.assert_array_equal(history['masked_counts'][0], lengths)
  canvases = history['tokens']  # [I, R, W]
  assert canvases.shape[:2] == (iterations, len(SOURCES) * LENGTH_BEAM)
  # Positions that were not re-masked keep their token.
  changed = (canvases[1:] != canvases[:-1]).sum(axis=2)
  assert (changed <= history['masked_counts'][1:]).all()
  inside = np.arange(canvases.shape[2]) < lengths[:, None]
  assert (canvases[:, ~inside] == PAD).all() and (canvases[:, inside] != PAD).all()
  # The output is the chosen candidate's last canvas, cut at its first EOS.
  rows = np.arange(len(SOURCES)) * LENGTH_BEAM + history['chosen']
  for out, canvas, n in zip(tokens, canvases[-1, rows], lengths[rows]):
    end = next((i for i in range(n) if canvas[i] == EOS), n)
    np.testing.assert_array_equal(out[:end], canvas[:end])
    assert end == len(out) or out[end] == EOS
    assert (out[end + 1 :] == PAD).all()


def test_fixed_length_decodes_source_plus_r_positions_cut_at_the_first_eos(model, params):
  src = pad_rows(SOURCES[:3])
  lengths = source_lengths(src) + R
  width = non_autoregressive.canvas_width(lengths.max(), CONFIG.max_len)
  tokens, history = decode(
    model, constant_model(params, 7, 0), src, iterations=1, length_beam=1, length='fixed'
  )
  np.testing.assert_array_equal(history['lengths'], lengths)
  assert tokens.shape == (3, width)
  for row, n in zip(tokens, lengths):
    np.testing.assert_array_equal(row, [7] * n + [EOS] + [PAD] * (width - n - 1))
  eos_only, _ = decode(
    model, constant_model(params, EOS, 0), src, iterations=1, length_beam=1, length='fixed'
  )
  np.testing.assert_array_equal(
    eos_only, np.where(np.arange(width) == 0, EOS, PAD)[None].repeat(3, 0)
  )
  # A source within R of model.max_len fills the whole table: no room for EOS, as greedy.
  long = pad_rows([[5] * (CONFIG.max_len - R + 1) + [EOS]])
  tokens, history = decode(
    model, constant_model(params, 7, 0), long, iterations=1, length_beam=1, length='fixed'
  )
  assert history['lengths'][0] == CONFIG.max_len and tokens.shape == (1, CONFIG.max_len)
  assert (tokens == 7).all()


# --- length control: length_ratio and length_offset ---------------------------------------


def test_adjust_lengths_rounds_halves_up_and_clips_to_the_table():
  lengths = np.arange(0, 70)
  for ratio, offset in [
    (1.0, 0),
    (0.5, 0),
    (1.0, 2),
    (1.25, -1),
    (0.3, 5),
    (2.0, 0),
    (1.0, -80),
    (1e30, 0),
    (1e-30, 0),
  ]:
    expected = np.clip(np.floor(lengths.astype(np.float64) * ratio + 0.5) + offset, 1, 64)
    got = np.asarray(non_autoregressive.adjust_lengths(jnp.asarray(lengths), ratio, offset, 64))
    np.testing.assert_array_equal(got, expected, err_msg=f'ratio {ratio}, offset {offset}')
    assert got.dtype == np.int32


@pytest.mark.parametrize(
  'adjustment, adjust',
  [
    (dict(length_offset=2), lambda n: n + 2),
    (dict(length_ratio=0.5), lambda n: np.floor(n * 0.5 + 0.5)),
    (dict(length_ratio=1.5, length_offset=-1), lambda n: np.floor(n * 1.5 + 0.5) - 1),
    (dict(length_offset=-100), lambda n: 1 + 0 * n),  # clipped to 1
    (dict(length_offset=100), lambda n: CONFIG.max_len + 0 * n),  # clipped to max_len
  ],
)
def test_length_adjustment_moves_every_candidate_and_the_output(
  model, params, src, adjustment, adjust
):
  # Lengths source + 1 (class R + 1), then source + 0 and source - 4 (the tied classes 0, 1
  # after it: top_k keeps the lower index first).
  constant = constant_model(params, 7, R + 1)
  tokens, history = decode(
    model, constant, src, iterations=1, length_beam=LENGTH_BEAM, **adjustment
  )
  n = source_lengths(src)[:, None]
  predicted = np.clip(n + np.array([R + 1, 0, 1]) - R, 1, CONFIG.max_len)  # [B, M]
  expected = np.clip(adjust(predicted), 1, CONFIG.max_len).astype(np.int32)
  np.testing.assert_array_equal(history['lengths'].reshape(-1, LENGTH_BEAM), expected)
  # Every candidate scores alike, so the first wins: its N tokens, EOS unless N = max_len.
  np.testing.assert_array_equal(history['chosen'], 0)
  for row, length in zip(tokens, expected[:, 0]):
    ending = [EOS] if length < CONFIG.max_len else []
    np.testing.assert_array_equal(row[: length + len(ending)], [7] * length + ending)
    assert (row[length + len(ending) :] == PAD).all()


def test_the_method_value_passes_its_length_adjustment_on(model, params, src):
  constant = constant_model(params, 7, R + 1)
  settings = dict(iterations=1, length_beam=LENGTH_BEAM, length_offset=2)
  np.testing.assert_array_equal(
    MaskPredict(**settings).run(model, constant, src), decode(model, constant, src, **settings)[0]
  )


def test_length_adjustment_resizes_the_fixed_canvas(model, params):
  src = pad_rows(SOURCES[:3])
  canvas = source_lengths(src) + R
  for adjustment, expected in [
    (dict(length_offset=2), canvas + 2),
    (dict(length_ratio=0.5), np.floor(canvas * 0.5 + 0.5)),
  ]:
    tokens, history = decode(
      model,
      constant_model(params, 7, 0),
      src,
      iterations=1,
      length_beam=1,
      length='fixed',
      **adjustment,
    )
    np.testing.assert_array_equal(history['lengths'], expected)
    for row, length in zip(tokens, expected.astype(int)):
      np.testing.assert_array_equal(row[: length + 1], [7] * length + [EOS])
  # The output is still cut at the model's first EOS, whatever the canvas.
  eos_only, _ = decode(
    model,
    constant_model(params, EOS, 0),
    src,
    iterations=1,
    length_beam=1,
    length='fixed',
    length_offset=2,
  )
  assert (eos_only[:, 0] == EOS).all() and (eos_only[:, 1:] == PAD).all()


def test_canvas_width_leaves_room_for_eos_in_few_buckets():
  widths = [non_autoregressive.canvas_width(n, 128) for n in range(1, 128)]
  assert all(n < w or w == 128 for n, w in zip(range(1, 128), widths))
  assert all(w % 8 == 0 for w in widths) and len(set(widths)) == 16
  assert (
    non_autoregressive.canvas_width(13, 128) == 16
    and non_autoregressive.canvas_width(16, 128) == 24
  )


def test_a_sentence_decodes_alike_alone_and_in_any_padded_batch(model, params, src):
  settings = dict(iterations=4, length_beam=LENGTH_BEAM)
  batch = non_autoregressive.mask_predict(model, params, src, **settings)
  # Reversed, wider rows, and a batch-padding row in the middle.
  shuffled = np.pad(src[::-1], ((0, 0), (0, 3)))
  shuffled = np.insert(shuffled, 2, PAD, axis=0)
  other = np.asarray(non_autoregressive.mask_predict(model, params, shuffled, **settings))
  assert (other[2] == PAD).all()
  other = np.delete(other, 2, axis=0)[::-1]
  np.testing.assert_array_equal(other[:, : batch.shape[1]], batch)
  assert (other[:, batch.shape[1] :] == PAD).all()
  for i in (1, 2):  # the shortest and longest alone
    alone = np.asarray(
      non_autoregressive.mask_predict(model, params, src[i : i + 1, : len(SOURCES[i])], **settings)
    )[0]
    row = np.asarray(batch[i])
    np.testing.assert_array_equal(alone, row[: len(alone)])
    assert (row[len(alone) :] == PAD).all()


def test_cut_at_eos_keeps_the_tokens_before_the_first_eos():
  tokens = jnp.array(
    [
      [10, 11, EOS, 12, PAD, PAD],
      [10, 11, 12, 13, PAD, PAD],
      [10, 11, 12, 13, 14, 15],
      [EOS, 11, EOS, 12, 13, PAD],
      [PAD] * 6,
    ]
  )
  lengths = jnp.array([4, 4, 6, 5, 0])
  np.testing.assert_array_equal(
    non_autoregressive._cut_at_eos(tokens, lengths, CONFIG),
    [
      [10, 11, EOS, PAD, PAD, PAD],
      [10, 11, 12, 13, EOS, PAD],
      [10, 11, 12, 13, 14, 15],
      [EOS, PAD, PAD, PAD, PAD, PAD],
      [PAD] * 6,
    ],
  )


@pytest.mark.parametrize(
  'settings, message',
  [
    (dict(iterations=0), 'iterations must be a positive integer, got 0'),
    (dict(length_beam=True), 'length_beam must be a positive integer, got True'),
    (dict(length='auto'), 'length must be one of predict, fixed'),
    (dict(length='fixed', length_beam=3), 'length_beam must be 1, got 3'),
    (dict(length_ratio=0), r'length_ratio must be in \(0, 65536\], got 0'),
    (dict(length_ratio=float('inf')), r'length_ratio must be in \(0, 65536\], got inf'),
    (dict(length_ratio=1e12), r'length_ratio must be in \(0, 65536\], got 1000000000000'),
    (dict(length_offset=1.5), r'length_offset must be an integer in \[-65536, 65536\], got 1.5'),
    (
      dict(length_offset=10**12),
      r'length_offset must be an integer in \[-65536, 65536\], got '
      '1000000000000',
    ),
  ],
)
def test_bad_settings_name_the_option(settings, message):
  with pytest.raises(ConfigError, match=message):
    MaskPredict(**settings)


def test_bad_calls_are_refused_before_compiling(model, params, src):
  with pytest.raises(ConfigError, match=r'length_beam=10 exceeds the 9 length classes'):
    non_autoregressive.mask_predict(model, params, src, length_beam=10)
  with pytest.raises(TypeError, match='needs a CMLMTransformer'):
    non_autoregressive.mask_predict(Transformer(CONFIG), params, src)
  with pytest.raises(ValueError, match='outside'):
    non_autoregressive.mask_predict(model, params, src + CONFIG.vocab_size)
  with pytest.raises(
    ValueError, match="model.kind='cmlm' decodes with non_autoregressive.mask_predict"
  ):
    autoregressive.greedy(model, params, src)


# --- uniform copy of the source (cmlm_decoder_input='uniform_copy') ---------------------------


def test_uniform_copy_mask_predict_is_independent_of_batch_padding(copy_params, src):
  params = copy_params
  model = CMLMTransformer(COPY_CONFIG)
  batch = np.asarray(
    non_autoregressive.mask_predict(model, params, src, iterations=3, length_beam=2)
  )
  wider = np.asarray(
    non_autoregressive.mask_predict(
      model, params, np.pad(src, ((0, 0), (0, 5))), iterations=3, length_beam=2
    )
  )
  np.testing.assert_array_equal(wider[:, : batch.shape[1]], batch)
  alone = np.asarray(
    non_autoregressive.mask_predict(
      model, params, src[1:2, : len(SOURCES[1])], iterations=3, length_beam=2
    )
  )[0]
  np.testing.assert_array_equal(alone, batch[1, : len(alone)])


# --- a trained model ------------------------------------------------------------------------


@pytest.mark.parametrize('decoder_input, iterations', [('mask', 4), ('uniform_copy', 1)])
def test_a_model_trained_on_copying_decodes_it_exactly(decoder_input, iterations):
  """500 Adam steps on the CMLM objective (copy 2..7 tokens) -> mask-predict copies exactly;
  fed the source itself (uniform copy at the right length), in a single pass."""
  config = ModelConfig.tiny(
    kind='cmlm', max_length_offset=2, dropout_rate=0.0, max_len=16, cmlm_decoder_input=decoder_input
  )
  model = CMLMTransformer(config)
  rng = np.random.default_rng(0)

  def copy_batch(rows, width=9):
    lengths = rng.integers(2, 8, rows)
    words = rng.integers(4, 20, (rows, width))
    position = np.arange(width)
    ids = np.where(position < lengths[:, None], words, PAD)
    ids = np.where(position == lengths[:, None], EOS, ids).astype(np.int32)
    return ids

  optimizer = optax.adam(3e-3)
  params = model.init(jax.random.key(0), copy_batch(1), copy_batch(1))['params']
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, ids, key):
    batch = Batch(src=ids, tgt_in=ids, tgt_out=ids, example_ids=jnp.zeros(ids.shape[0]))
    inputs = cmlm_objective.cmlm_inputs(key, batch, config, eos_fill_rate=0.0)

    def loss(params):
      token_logits, length_logits = model.apply({'params': params}, inputs.src, inputs.tokens)
      sums = cmlm_objective.cmlm_loss_sums(
        token_logits, length_logits, inputs, config, smoothing=0.0
      )
      return sums['loss_sum'] / sums['tokens'] + 0.1 * sums['length_loss_sum'] / sums['sentences']

    updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  for i in range(500):
    params, opt_state = step(params, opt_state, copy_batch(64), jax.random.key(i))

  src = copy_batch(200)
  tokens = np.asarray(
    non_autoregressive.mask_predict(model, params, src, iterations=iterations, length_beam=1)
  )
  expected = np.pad(src, ((0, 0), (0, tokens.shape[1] - src.shape[1])))
  exact = (tokens == expected).all(axis=1).mean()
  assert exact >= 0.95, exact
