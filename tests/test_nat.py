"""The non-autoregressive model (CMLM) and mask-predict: length classes, the masking of the
training inputs and its statistics, the loss against NumPy float64, the non-causal yet
padding-blind decoder, the length and re-masking schedules of decoding, independence of
batch padding, and a tiny model trained on a copy task decoding it exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_transformer import ConfigError, ModelConfig, Transformer, decoding, nat, nat_decoding
from flax_transformer.batching import Batch
from flax_transformer.nat import CMLMTransformer, CMLMInputs
from flax_transformer.nat_decoding import MaskPredictConfig

R = 4
CONFIG = ModelConfig.tiny(kind='cmlm', max_length_offset=R, dropout_rate=0.0)
PAD, BOS, EOS = CONFIG.pad_id, CONFIG.bos_id, CONFIG.eos_id
MASK = CONFIG.vocab_size
# EOS-terminated sources of different lengths, as the batcher builds them.
SOURCES = [[5, 9, 12, 7, 2], [30, 2], [4, 8, 15, 16, 23, 42, 11, 2], [6, 6, 6, 2], [40, 41, 2]]
LENGTH_BEAM = 3


def pad_rows(rows, width=None):
  width = width or max(map(len, rows))
  return np.array([list(row) + [PAD] * (width - len(row)) for row in rows], np.int32)


def source_lengths(src):
  return (np.asarray(src) != PAD).sum(axis=1)


def log_softmax64(logits):
  logits = np.asarray(logits, np.float64)
  top = logits.max(axis=-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


# --- fixtures: one tiny model, each jit compiled once ---------------------------------


@pytest.fixture(scope='module')
def model():
  return CMLMTransformer(CONFIG)


@pytest.fixture(scope='module')
def params(model):
  src = pad_rows(SOURCES)
  return jax.jit(model.init)(jax.random.key(0), src, src)['params']


@pytest.fixture(scope='module')
def forward(model):
  apply = jax.jit(lambda params, src, tokens: model.apply({'params': params}, src, tokens))
  return lambda params, src, tokens: jax.tree.map(np.asarray, apply(params, src, tokens))


@pytest.fixture(scope='module')
def src():
  return pad_rows(SOURCES)


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
  head['bias'] = 10.0 * jax.nn.one_hot(length_class, nat.num_length_classes(CONFIG))
  return params


# --- length classes ----------------------------------------------------------------------


def test_length_classes_are_the_clipped_offset():
  assert nat.length_classes(np.array([0, 3, 5, 6, 12]), np.array([5, 5, 5, 5, 5]), 2).tolist() \
      == [0, 0, 2, 3, 4]
  tgt, src = np.meshgrid(np.arange(0, 30), np.arange(1, 20))
  classes = np.asarray(nat.length_classes(tgt, src, R))
  assert classes.dtype == np.int32
  np.testing.assert_array_equal(classes, np.clip(tgt - src, -R, R) + R)
  assert classes.min() == 0 and classes.max() == 2 * R


def test_lengths_from_classes_invert_them_within_the_range_and_clip_to_the_table():
  src = np.arange(1, 20)[:, None]
  classes = np.arange(2 * R + 1)[None, :]
  lengths = np.asarray(nat.lengths_from_classes(classes, src, R, max_len=16))
  np.testing.assert_array_equal(lengths, np.clip(src + classes - R, 1, 16))
  inside = (src + classes - R >= 1) & (src + classes - R <= 16)
  back = np.asarray(nat.length_classes(lengths, src, R))
  np.testing.assert_array_equal(np.broadcast_to(classes, back.shape)[inside], back[inside])
  assert lengths.min() == 1 and lengths.max() == 16


# --- the training inputs ---------------------------------------------------------------


ROWS, WIDTH = 4000, 12


@pytest.fixture(scope='module')
def training_batch():
  """Rows of every length 1..WIDTH (EOS last), and every 10th row all PAD (batch padding)."""
  rng = np.random.default_rng(0)
  lengths = np.where(np.arange(ROWS) % 10 == 9, 0, np.arange(ROWS) % WIDTH + 1)
  tgt_out = np.zeros((ROWS, WIDTH), np.int32)
  for row, n in enumerate(lengths):
    if n:
      tgt_out[row, :n - 1] = rng.integers(4, CONFIG.vocab_size, n - 1)
      tgt_out[row, n - 1] = EOS
  src = np.where(lengths[:, None] > 0, pad_rows([[5, 6, 2]] * ROWS), PAD)
  return Batch(src=src, tgt_in=tgt_out, tgt_out=tgt_out, example_ids=np.arange(ROWS)), lengths


@pytest.fixture(scope='module')
def make_inputs():
  return jax.jit(nat.cmlm_inputs, static_argnames=('config', 'eos_fill_rate'))


@pytest.fixture(scope='module')
def inputs(training_batch, make_inputs):
  batch, _ = training_batch
  return jax.tree.map(np.asarray, make_inputs(jax.random.key(1), batch, config=CONFIG,
                                              eos_fill_rate=0.1))


def test_between_one_and_all_positions_of_each_row_are_masked(training_batch, inputs):
  _, lengths = training_batch
  row_lengths = (inputs.targets != PAD).sum(axis=1)
  counts = inputs.masked.sum(axis=1)
  assert (counts[lengths > 0] >= 1).all()
  assert (counts <= row_lengths).all()
  assert (counts[lengths == 0] == 0).all()
  assert not inputs.masked[inputs.targets == PAD].any()
  np.testing.assert_array_equal(inputs.tgt_lengths, lengths)


def test_only_masked_positions_become_mask_and_pad_stays_unless_filled(training_batch, inputs):
  batch, lengths = training_batch
  np.testing.assert_array_equal(inputs.tokens, np.where(inputs.masked, MASK, inputs.targets))
  real = batch.tgt_out != PAD
  np.testing.assert_array_equal(inputs.targets[real], batch.tgt_out[real])
  filled = (inputs.targets[:, -1] != PAD) & (lengths < WIDTH)
  # A filled row is EOS from its end to the batch width; any other row keeps its PAD.
  assert (inputs.targets[filled][~real[filled]] == EOS).all()
  np.testing.assert_array_equal(inputs.targets[~filled], batch.tgt_out[~filled])
  np.testing.assert_array_equal(inputs.src, batch.src)


@pytest.mark.parametrize('rate', [0.0, 0.1, 0.999])
def test_eos_fill_rate_is_the_fraction_of_filled_rows(training_batch, make_inputs, rate):
  batch, lengths = training_batch
  drawn = make_inputs(jax.random.key(2), batch, config=CONFIG, eos_fill_rate=rate)
  can_fill = (lengths > 0) & (lengths < WIDTH)     # a full row has no PAD to fill
  filled = np.asarray(drawn.targets)[:, -1] == EOS
  fraction = filled[can_fill].mean()
  assert not filled[lengths == 0].any()
  # Binomial standard error over ~3300 rows is at most 0.009; 4 of them.
  assert abs(fraction - rate) < 0.035, fraction
  if rate == 0.0:
    assert not filled[can_fill].any()


def test_inputs_are_a_function_of_the_key(training_batch, make_inputs, inputs):
  batch, _ = training_batch
  again = make_inputs(jax.random.key(1), batch, config=CONFIG, eos_fill_rate=0.1)
  other = make_inputs(jax.random.key(3), batch, config=CONFIG, eos_fill_rate=0.1)
  np.testing.assert_array_equal(np.asarray(again.tokens), inputs.tokens)
  assert (np.asarray(other.masked) != inputs.masked).any()


def test_masked_count_is_uniform_and_every_position_equally_likely(training_batch, make_inputs):
  """Rows of length n: k ~ Uniform{1..n} (mean (n + 1) / 2), each position masked w.p. E[k] / n."""
  batch, lengths = training_batch
  drawn = make_inputs(jax.random.key(4), batch, config=CONFIG, eos_fill_rate=0.0)
  masked = np.asarray(drawn.masked)
  n = WIDTH
  full = masked[lengths == n]                              # 300 rows of length 12
  counts = full.sum(axis=1)
  # Each of the 12 values has frequency 1/12 = 0.083; standard error 0.016.
  frequency = np.bincount(counts, minlength=n + 1)[1:] / len(counts)
  assert np.abs(frequency - 1 / n).max() < 0.065, frequency
  # Mean count 6.5, standard deviation sqrt((n^2 - 1) / 12) = 3.45, standard error 0.2.
  assert abs(counts.mean() - (n + 1) / 2) < 0.8, counts.mean()
  # Over all real rows: masked fraction k / n averages 0.5 + E[1 / (2n)] > 0.5.
  real = lengths > 0
  fraction = masked[real].sum(1) / lengths[real]
  expected = np.mean(0.5 + 0.5 / lengths[real])
  assert abs(fraction.mean() - expected) < 0.03, (fraction.mean(), expected)
  # Position i of a length-12 row is masked with probability 6.5 / 12 = 0.54; s.e. 0.029.
  assert np.abs(full.mean(axis=0) - (n + 1) / (2 * n)).max() < 0.12, full.mean(axis=0)


# --- the loss ---------------------------------------------------------------------------


def test_loss_sums_match_a_float64_reference():
  rng = np.random.default_rng(5)
  rows, width, vocab, classes = 6, 7, CONFIG.vocab_size, nat.num_length_classes(CONFIG)
  targets = rng.integers(4, vocab, (rows, width)).astype(np.int32)
  targets[:, 5:] = PAD
  targets[1, 2:] = PAD
  targets[4] = PAD                                                 # batch padding
  masked = (rng.random((rows, width)) < 0.5) & (targets != PAD)
  src = pad_rows([[5, 2], [7, 8, 9, 2], [2], [4] * 9 + [2], [], [6, 6, 2]], 10)
  inputs = CMLMInputs(src=src, tokens=np.where(masked, MASK, targets), targets=targets,
                      masked=masked, tgt_lengths=(targets != PAD).sum(1).astype(np.int32))
  token_logits = rng.normal(size=(rows, width, vocab)).astype(np.float32) * 3
  length_logits = rng.normal(size=(rows, classes)).astype(np.float32) * 3
  smoothing = 0.1
  sums = jax.tree.map(float, nat.cmlm_loss_sums(token_logits, length_logits, inputs, CONFIG,
                                                smoothing))

  log_p = log_softmax64(token_logits)
  nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
  smoothed = (1 - smoothing) * nll + smoothing * -log_p.mean(-1)
  correct = token_logits.argmax(-1) == targets
  true_class = np.clip(inputs.tgt_lengths - source_lengths(src), -R, R) + R
  length_nll = -log_softmax64(length_logits)[np.arange(rows), true_class]
  real = inputs.tgt_lengths > 0
  expected = {'loss_sum': smoothed[masked].sum(), 'nll_sum': nll[masked].sum(),
              'correct': correct[masked].sum(), 'tokens': masked.sum(),
              'length_loss_sum': length_nll[real].sum(),
              'length_correct': (length_logits.argmax(-1) == true_class)[real].sum(),
              'sentences': real.sum()}
  assert sums.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_allclose(sums[name], value, rtol=1e-5, err_msg=name)
  assert sums['tokens'] < (targets != PAD).sum()     # unmasked positions are left out


# --- the model -----------------------------------------------------------------------------


@pytest.fixture(scope='module')
def decoder_input(src):
  """Targets of five rows, the first two positions of each MASKed."""
  rng = np.random.default_rng(6)
  rows = [list(rng.integers(4, CONFIG.vocab_size, n)) + [EOS] for n in (4, 2, 6, 1, 3)]
  tokens = pad_rows(rows)
  tokens[:, :2] = np.where(tokens[:, :2] != PAD, MASK, PAD)
  return tokens


def test_outputs_cover_the_vocabulary_and_the_length_classes(forward, params, src, decoder_input):
  token_logits, length_logits = forward(params, src, decoder_input)
  assert token_logits.shape == (*decoder_input.shape, CONFIG.vocab_size)   # MASK is never predicted
  assert length_logits.shape == (len(SOURCES), 2 * R + 1)
  assert token_logits.dtype == length_logits.dtype == jnp.float32
  assert params['mask_embedding'].shape == (CONFIG.d_model,)


def test_the_decoder_sees_later_positions(forward, params, src, decoder_input):
  before, _ = forward(params, src, decoder_input)
  changed = decoder_input.copy()
  changed[2, 5] = 7 if changed[2, 5] != 7 else 8                 # row 2's last token before EOS
  after, _ = forward(params, src, changed)
  # Position 0 sits before the change: a causal decoder would not move.
  assert np.abs((after - before)[2, 0]).max() > 1e-3
  np.testing.assert_array_equal(after[[0, 1, 3, 4]], before[[0, 1, 3, 4]])


def test_the_mask_row_embeds_mask_tokens(forward, params, src, decoder_input):
  moved = {**params, 'mask_embedding': params['mask_embedding'] + 1.0}
  before, _ = forward(params, src, decoder_input)
  after, _ = forward(moved, src, decoder_input)
  assert np.abs((after - before)).max() > 1e-2
  unmasked = np.where(decoder_input == MASK, 9, decoder_input)
  np.testing.assert_array_equal(forward(moved, src, unmasked)[0], forward(params, src, unmasked)[0])


def test_extra_pad_columns_change_nothing(forward, params, src, decoder_input):
  token_logits, length_logits = forward(params, src, decoder_input)
  wide_logits, wide_length = forward(params, np.pad(src, ((0, 0), (0, 3))),
                                     np.pad(decoder_input, ((0, 0), (0, 4))))
  np.testing.assert_allclose(wide_logits[:, :decoder_input.shape[1]], token_logits, atol=1e-5)
  np.testing.assert_allclose(wide_length, length_logits, atol=1e-5)


# --- uniform copy of the source (nat_decoder_input='uniform_copy') ---------------------------

COPY_CONFIG = CONFIG.replace(nat_decoder_input='uniform_copy')


def test_uniform_copy_takes_the_source_token_at_the_same_relative_position():
  a, b, c = 10, 11, 12
  src = pad_rows([[a, b, c, EOS], [a, EOS], [a, b, c, EOS], [a, b, c, EOS], [], [a, b, EOS]],
                 width=6)
  tokens = pad_rows([[MASK] * 6, [MASK] * 3, [MASK, 20], [], [MASK] * 2, [MASK] * 2], width=7)
  np.testing.assert_array_equal(nat.uniform_copy(src, tokens, PAD), [
      [a, b, b, c, EOS, EOS, PAD],          # S = 4 over N = 6: round(0, .67, 1.33, 2, 2.67, 3.33)
      [a, EOS, EOS, PAD, PAD, PAD, PAD],    # S = 2 over N = 3: round(0, .67, 1.33)
      [a, c, PAD, PAD, PAD, PAD, PAD],      # S = 4 over N = 2
      [PAD] * 7,                            # N = 0
      [PAD] * 7,                            # an all-PAD source copies PAD
      [a, EOS, PAD, PAD, PAD, PAD, PAD]])   # S = 3 over N = 2: halves round up (1.5 -> 2)


@pytest.fixture(scope='module')
def copy_forward():
  model = CMLMTransformer(COPY_CONFIG)
  params = jax.jit(model.init)(jax.random.key(0), pad_rows(SOURCES), pad_rows(SOURCES))['params']
  apply = jax.jit(lambda src, tokens: model.apply({'params': params}, src, tokens)[0])
  return params, lambda src, tokens: np.asarray(apply(src, tokens))


def test_uniform_copy_feeds_masked_positions_the_copied_source_tokens(copy_forward, src,
                                                                       decoder_input):
  params, forward = copy_forward
  assert 'mask_embedding' not in params                     # nothing embeds MASK
  copied = np.asarray(nat.uniform_copy(src, decoder_input, PAD))
  spelled_out = np.where(decoder_input == MASK, copied, decoder_input)
  np.testing.assert_array_equal(forward(src, decoder_input), forward(src, spelled_out))


@pytest.mark.parametrize('config', [CONFIG, COPY_CONFIG], ids=['mask', 'uniform_copy'])
def test_only_uniform_copy_feeds_the_source_ids_to_the_decoder(config, src, decoder_input):
  """Same memory, different `src` ids: the decoder moves only when it copies them."""
  model = CMLMTransformer(config)
  params = model.init(jax.random.key(0), src, src)['params']
  memory = model.apply({'params': params}, src, method=CMLMTransformer.encode)
  src_mask = nat.masks.padding_mask(src, PAD)
  other_src = np.where(src != PAD, src + 1, PAD)
  logits = [np.asarray(model.apply({'params': params}, decoder_input, memory, src_mask, src=ids,
                                   method=CMLMTransformer.decode_parallel))
            for ids in (src, other_src)]
  moved = np.abs(logits[1] - logits[0]).max()
  assert moved > 1e-3 if config.nat_decoder_input == 'uniform_copy' else moved == 0.0


def test_uniform_copy_mask_predict_is_independent_of_batch_padding(copy_forward, src):
  params, _ = copy_forward
  model = CMLMTransformer(COPY_CONFIG)
  batch = np.asarray(nat_decoding.mask_predict(model, params, src, iterations=3, length_beam=2))
  wider = np.asarray(nat_decoding.mask_predict(model, params, np.pad(src, ((0, 0), (0, 5))),
                                               iterations=3, length_beam=2))
  np.testing.assert_array_equal(wider[:, :batch.shape[1]], batch)
  alone = np.asarray(nat_decoding.mask_predict(model, params, src[1:2, :len(SOURCES[1])],
                                               iterations=3, length_beam=2))[0]
  np.testing.assert_array_equal(alone, batch[1, :len(alone)])


def test_uniform_copy_needs_the_source_ids(copy_forward, src, decoder_input):
  params, _ = copy_forward
  model = CMLMTransformer(COPY_CONFIG)
  memory = model.apply({'params': params}, src, method=CMLMTransformer.encode)
  with pytest.raises(ValueError, match="'uniform_copy' needs the source ids"):
    model.apply({'params': params}, decoder_input, memory, nat.masks.padding_mask(src, PAD),
                method=CMLMTransformer.decode_parallel)
  with pytest.raises(ConfigError, match="nat_decoder_input must be 'mask' or 'uniform_copy'"):
    CONFIG.replace(nat_decoder_input='copy')
  with pytest.raises(ConfigError, match="'uniform_copy' is for model.kind='cmlm'"):
    CONFIG.replace(kind='autoregressive', nat_decoder_input='uniform_copy')


# --- mask-predict -----------------------------------------------------------------------------


def decode(model, params, src, **settings):
  return jax.tree.map(np.asarray, nat_decoding.mask_predict(model, params, src,
                                                            return_history=True, **settings))


def test_one_pass_rows_are_as_long_as_the_predicted_length(model, params, src):
  token, length_class = 7, R + 1                       # every position 7; lengths = source + 1
  tokens, history = decode(model, constant_model(params, token, length_class), src, iterations=1,
                           length_beam=LENGTH_BEAM)
  lengths = source_lengths(src) + 1
  # Room for the longest row and its EOS, rounded up to a multiple of 8.
  width = nat_decoding.canvas_width(lengths.max(), CONFIG.max_len)
  assert width % nat_decoding.WIDTH_MULTIPLE == 0 and lengths.max() < width
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
  canvases = history['tokens']                                    # [I, R, W]
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
    assert (out[end + 1:] == PAD).all()


def test_fixed_length_decodes_source_plus_r_positions_cut_at_the_first_eos(model, params):
  src = pad_rows(SOURCES[:3])
  lengths = source_lengths(src) + R
  width = nat_decoding.canvas_width(lengths.max(), CONFIG.max_len)
  tokens, history = decode(model, constant_model(params, 7, 0), src, iterations=1, length_beam=1,
                           length='fixed')
  np.testing.assert_array_equal(history['lengths'], lengths)
  assert tokens.shape == (3, width)
  for row, n in zip(tokens, lengths):
    np.testing.assert_array_equal(row, [7] * n + [EOS] + [PAD] * (width - n - 1))
  eos_only, _ = decode(model, constant_model(params, EOS, 0), src, iterations=1, length_beam=1,
                       length='fixed')
  np.testing.assert_array_equal(eos_only, np.where(np.arange(width) == 0, EOS, PAD)[None]
                                .repeat(3, 0))
  # A source within R of model.max_len fills the whole table: no room for EOS, as greedy.
  long = pad_rows([[5] * (CONFIG.max_len - R + 1) + [EOS]])
  tokens, history = decode(model, constant_model(params, 7, 0), long, iterations=1,
                           length_beam=1, length='fixed')
  assert history['lengths'][0] == CONFIG.max_len and tokens.shape == (1, CONFIG.max_len)
  assert (tokens == 7).all()


def test_canvas_width_leaves_room_for_eos_in_few_buckets():
  widths = [nat_decoding.canvas_width(n, 128) for n in range(1, 128)]
  assert all(n < w or w == 128 for n, w in zip(range(1, 128), widths))
  assert all(w % 8 == 0 for w in widths) and len(set(widths)) == 16
  assert nat_decoding.canvas_width(13, 128) == 16 and nat_decoding.canvas_width(16, 128) == 24


def test_a_sentence_decodes_alike_alone_and_in_any_padded_batch(model, params, src):
  settings = dict(iterations=4, length_beam=LENGTH_BEAM)
  batch = nat_decoding.mask_predict(model, params, src, **settings)
  # Reversed, wider rows, and a batch-padding row in the middle.
  shuffled = np.pad(src[::-1], ((0, 0), (0, 3)))
  shuffled = np.insert(shuffled, 2, PAD, axis=0)
  other = np.asarray(nat_decoding.mask_predict(model, params, shuffled, **settings))
  assert (other[2] == PAD).all()
  other = np.delete(other, 2, axis=0)[::-1]
  np.testing.assert_array_equal(other[:, :batch.shape[1]], batch)
  assert (other[:, batch.shape[1]:] == PAD).all()
  for i in (1, 2):                                                 # the shortest and longest alone
    alone = np.asarray(nat_decoding.mask_predict(model, params, src[i:i + 1, :len(SOURCES[i])],
                                                 **settings))[0]
    row = np.asarray(batch[i])
    np.testing.assert_array_equal(alone, row[:len(alone)])
    assert (row[len(alone):] == PAD).all()


def test_cut_at_eos_keeps_the_tokens_before_the_first_eos():
  tokens = jnp.array([[10, 11, EOS, 12, PAD, PAD], [10, 11, 12, 13, PAD, PAD],
                      [10, 11, 12, 13, 14, 15], [EOS, 11, EOS, 12, 13, PAD], [PAD] * 6])
  lengths = jnp.array([4, 4, 6, 5, 0])
  np.testing.assert_array_equal(nat_decoding._cut_at_eos(tokens, lengths, CONFIG), [
      [10, 11, EOS, PAD, PAD, PAD], [10, 11, 12, 13, EOS, PAD], [10, 11, 12, 13, 14, 15],
      [EOS, PAD, PAD, PAD, PAD, PAD], [PAD] * 6])


@pytest.mark.parametrize('settings, message', [
    (dict(iterations=0), 'iterations must be a positive integer, got 0'),
    (dict(length_beam=True), 'length_beam must be a positive integer, got True'),
    (dict(length='auto'), 'length must be one of predict, fixed'),
    (dict(length='fixed', length_beam=3), 'length_beam must be 1, got 3'),
])
def test_bad_settings_name_the_option(settings, message):
  with pytest.raises(ConfigError, match=message):
    MaskPredictConfig(**settings)


def test_bad_calls_are_refused_before_compiling(model, params, src):
  with pytest.raises(ConfigError, match=r'length_beam=10 exceeds the 9 length classes'):
    nat_decoding.mask_predict(model, params, src, length_beam=10)
  with pytest.raises(TypeError, match='needs a CMLMTransformer'):
    nat_decoding.mask_predict(Transformer(CONFIG), params, src)
  with pytest.raises(ValueError, match='outside'):
    nat_decoding.mask_predict(model, params, src + CONFIG.vocab_size)
  with pytest.raises(ValueError, match="model.kind='cmlm' decodes with nat_decoding.mask_predict"):
    decoding.greedy(model, params, src)


# --- a trained model ------------------------------------------------------------------------


@pytest.mark.parametrize('decoder_input, iterations', [('mask', 4), ('uniform_copy', 1)])
def test_a_model_trained_on_copying_decodes_it_exactly(decoder_input, iterations):
  """500 Adam steps on the CMLM objective (copy 2..7 tokens) -> mask-predict copies exactly;
  fed the source itself (uniform copy at the right length), in a single pass."""
  config = ModelConfig.tiny(kind='cmlm', max_length_offset=2, dropout_rate=0.0, max_len=16,
                            nat_decoder_input=decoder_input)
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
    inputs = nat.cmlm_inputs(key, batch, config, eos_fill_rate=0.0)

    def loss(params):
      token_logits, length_logits = model.apply({'params': params}, inputs.src, inputs.tokens)
      sums = nat.cmlm_loss_sums(token_logits, length_logits, inputs, config, smoothing=0.0)
      return sums['loss_sum'] / sums['tokens'] + 0.1 * sums['length_loss_sum'] / sums['sentences']

    updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state)
    return optax.apply_updates(params, updates), opt_state

  for i in range(500):
    params, opt_state = step(params, opt_state, copy_batch(64), jax.random.key(i))

  src = copy_batch(200)
  tokens = np.asarray(nat_decoding.mask_predict(model, params, src, iterations=iterations,
                                                length_beam=1))
  expected = np.pad(src, ((0, 0), (0, tokens.shape[1] - src.shape[1])))
  exact = (tokens == expected).all(axis=1).mean()
  assert exact >= 0.95, exact
