"""The non-autoregressive model (CMLM, flax_transformer/nn/cmlm.py): length classes, the masking
of the training inputs and its statistics, the loss against NumPy float64, the non-causal
yet padding-blind decoder, and uniform copy of the source into the decoder's input.

Mask-predict, which decodes it, is tests/test_cmlm_decoding.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ConfigError
from flax_transformer.data.batching import Batch
from flax_transformer.nn import cmlm
from flax_transformer.nn.cmlm import CMLMTransformer
from flax_transformer.train import cmlm_objective
from flax_transformer.train.cmlm_objective import CMLMInputs
from support import numpy_transformer
from support.tiny_cmlm import (
  CONFIG,
  COPY_CONFIG,
  EOS,
  MASK,
  PAD,
  SOURCES,
  R,
  pad_rows,
  source_lengths,
)


def log_softmax64(logits):
  logits = np.asarray(logits, np.float64)
  top = logits.max(axis=-1, keepdims=True)
  return logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))


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
def forward(model):
  apply = jax.jit(lambda params, src, tokens: model.apply({'params': params}, src, tokens))
  return lambda params, src, tokens: jax.tree.map(np.asarray, apply(params, src, tokens))


# --- length classes ----------------------------------------------------------------------


def test_length_classes_are_the_clipped_offset():
  assert cmlm.length_classes(np.array([0, 3, 5, 6, 12]), np.array([5, 5, 5, 5, 5]), 2).tolist() == [
    0,
    0,
    2,
    3,
    4,
  ]
  tgt, src = np.meshgrid(np.arange(0, 30), np.arange(1, 20))
  classes = np.asarray(cmlm.length_classes(tgt, src, R))
  assert classes.dtype == np.int32
  np.testing.assert_array_equal(classes, np.clip(tgt - src, -R, R) + R)
  assert classes.min() == 0 and classes.max() == 2 * R


def test_lengths_from_classes_invert_them_within_the_range_and_clip_to_the_table():
  src = np.arange(1, 20)[:, None]
  classes = np.arange(2 * R + 1)[None, :]
  lengths = np.asarray(cmlm.lengths_from_classes(classes, src, R, max_len=16))
  np.testing.assert_array_equal(lengths, np.clip(src + classes - R, 1, 16))
  inside = (src + classes - R >= 1) & (src + classes - R <= 16)
  back = np.asarray(cmlm.length_classes(lengths, src, R))
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
      tgt_out[row, : n - 1] = rng.integers(4, CONFIG.vocab_size, n - 1)
      tgt_out[row, n - 1] = EOS
  src = np.where(lengths[:, None] > 0, pad_rows([[5, 6, 2]] * ROWS), PAD)
  return Batch(src=src, tgt_in=tgt_out, tgt_out=tgt_out, example_ids=np.arange(ROWS)), lengths


@pytest.fixture(scope='module')
def make_inputs():
  return jax.jit(cmlm_objective.cmlm_inputs, static_argnames=('config', 'eos_fill_rate'))


@pytest.fixture(scope='module')
def inputs(training_batch, make_inputs):
  batch, _ = training_batch
  return jax.tree.map(
    np.asarray, make_inputs(jax.random.key(1), batch, config=CONFIG, eos_fill_rate=0.1)
  )


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
  can_fill = (lengths > 0) & (lengths < WIDTH)  # a full row has no PAD to fill
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
  full = masked[lengths == n]  # 300 rows of length 12
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
  rows, width, vocab, classes = 6, 7, CONFIG.vocab_size, cmlm.num_length_classes(CONFIG)
  targets = rng.integers(4, vocab, (rows, width)).astype(np.int32)
  targets[:, 5:] = PAD
  targets[1, 2:] = PAD
  targets[4] = PAD  # batch padding
  masked = (rng.random((rows, width)) < 0.5) & (targets != PAD)
  src = pad_rows([[5, 2], [7, 8, 9, 2], [2], [4] * 9 + [2], [], [6, 6, 2]], 10)
  inputs = CMLMInputs(
    src=src,
    tokens=np.where(masked, MASK, targets),
    targets=targets,
    masked=masked,
    tgt_lengths=(targets != PAD).sum(1).astype(np.int32),
  )
  token_logits = rng.normal(size=(rows, width, vocab)).astype(np.float32) * 3
  length_logits = rng.normal(size=(rows, classes)).astype(np.float32) * 3
  smoothing = 0.1
  sums = jax.tree.map(
    float, cmlm_objective.cmlm_loss_sums(token_logits, length_logits, inputs, CONFIG, smoothing)
  )

  log_p = log_softmax64(token_logits)
  nll = -np.take_along_axis(log_p, targets[..., None], -1)[..., 0]
  smoothed = (1 - smoothing) * nll + smoothing * -log_p.mean(-1)
  correct = token_logits.argmax(-1) == targets
  true_class = np.clip(inputs.tgt_lengths - source_lengths(src), -R, R) + R
  length_nll = -log_softmax64(length_logits)[np.arange(rows), true_class]
  real = inputs.tgt_lengths > 0
  expected = {
    'loss_sum': smoothed[masked].sum(),
    'nll_sum': nll[masked].sum(),
    'correct': correct[masked].sum(),
    'tokens': masked.sum(),
    'length_loss_sum': length_nll[real].sum(),
    'length_correct': (length_logits.argmax(-1) == true_class)[real].sum(),
    'sentences': real.sum(),
  }
  assert sums.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_allclose(sums[name], value, rtol=1e-5, err_msg=name)
  assert sums['tokens'] < (targets != PAD).sum()  # unmasked positions are left out


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
  assert token_logits.shape == (*decoder_input.shape, CONFIG.vocab_size)  # MASK is never predicted
  assert length_logits.shape == (len(SOURCES), 2 * R + 1)
  assert token_logits.dtype == length_logits.dtype == jnp.float32
  assert params['mask_embedding'].shape == (CONFIG.d_model,)
  # The values: the non-causal decoder with its MASK row, and the length head over the mean
  # of the memory at real source positions, in NumPy float64 (tests/test_model_reference.py
  # has more configurations). Both are O(1); float32 stays within ~1e-6 of float64.
  want_tokens, want_lengths = numpy_transformer.cmlm_outputs(CONFIG, params, src, decoder_input)
  for got, want in ((token_logits, want_tokens), (length_logits, want_lengths)):
    assert 0.1 < np.abs(want).max() < 20
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
  # Each sentence's length scores differ: the head reads the source, not a constant.
  assert np.abs(length_logits - length_logits[:1]).max() > 1e-3


def test_the_decoder_sees_later_positions(forward, params, src, decoder_input):
  before, _ = forward(params, src, decoder_input)
  changed = decoder_input.copy()
  changed[2, 5] = 7 if changed[2, 5] != 7 else 8  # row 2's last token before EOS
  after, _ = forward(params, src, changed)
  # Position 0 sits before the change: a causal decoder would not move.
  assert np.abs((after - before)[2, 0]).max() > 1e-3
  np.testing.assert_array_equal(after[[0, 1, 3, 4]], before[[0, 1, 3, 4]])


def test_the_mask_row_embeds_mask_tokens(forward, params, src, decoder_input):
  moved = {**params, 'mask_embedding': params['mask_embedding'] + 1.0}
  before, _ = forward(params, src, decoder_input)
  after, _ = forward(moved, src, decoder_input)
  assert np.abs(after - before).max() > 1e-2
  unmasked = np.where(decoder_input == MASK, 9, decoder_input)
  np.testing.assert_array_equal(forward(moved, src, unmasked)[0], forward(params, src, unmasked)[0])


def test_extra_pad_columns_change_nothing(forward, params, src, decoder_input):
  token_logits, length_logits = forward(params, src, decoder_input)
  wide_logits, wide_length = forward(
    params, np.pad(src, ((0, 0), (0, 3))), np.pad(decoder_input, ((0, 0), (0, 4)))
  )
  np.testing.assert_allclose(wide_logits[:, : decoder_input.shape[1]], token_logits, atol=1e-5)
  np.testing.assert_allclose(wide_length, length_logits, atol=1e-5)


# --- uniform copy of the source (cmlm_decoder_input='uniform_copy') ---------------------------


def test_uniform_copy_takes_the_source_token_at_the_same_relative_position():
  a, b, c = 10, 11, 12
  src = pad_rows(
    [[a, b, c, EOS], [a, EOS], [a, b, c, EOS], [a, b, c, EOS], [], [a, b, EOS]], width=6
  )
  tokens = pad_rows([[MASK] * 6, [MASK] * 3, [MASK, 20], [], [MASK] * 2, [MASK] * 2], width=7)
  np.testing.assert_array_equal(
    cmlm.uniform_copy(src, tokens, PAD),
    [
      [a, b, b, c, EOS, EOS, PAD],  # S = 4 over N = 6: round(0, .67, 1.33, 2, 2.67, 3.33)
      [a, EOS, EOS, PAD, PAD, PAD, PAD],  # S = 2 over N = 3: round(0, .67, 1.33)
      [a, c, PAD, PAD, PAD, PAD, PAD],  # S = 4 over N = 2
      [PAD] * 7,  # N = 0
      [PAD] * 7,  # an all-PAD source copies PAD
      [a, EOS, PAD, PAD, PAD, PAD, PAD],
    ],
  )  # S = 3 over N = 2: halves round up (1.5 -> 2)


@pytest.fixture(scope='module')
def copy_forward(cmlm_copy_params):
  model = CMLMTransformer(COPY_CONFIG)
  params = cmlm_copy_params
  apply = jax.jit(lambda src, tokens: model.apply({'params': params}, src, tokens)[0])
  return params, lambda src, tokens: np.asarray(apply(src, tokens))


def test_uniform_copy_feeds_masked_positions_the_copied_source_tokens(
  copy_forward, src, decoder_input
):
  params, forward = copy_forward
  assert 'mask_embedding' not in params  # nothing embeds MASK
  copied = np.asarray(cmlm.uniform_copy(src, decoder_input, PAD))
  spelled_out = np.where(decoder_input == MASK, copied, decoder_input)
  np.testing.assert_array_equal(forward(src, decoder_input), forward(src, spelled_out))


@pytest.mark.parametrize('config', [CONFIG, COPY_CONFIG], ids=['mask', 'uniform_copy'])
def test_only_uniform_copy_feeds_the_source_ids_to_the_decoder(config, src, decoder_input):
  """Same memory, different `src` ids: the decoder moves only when it copies them."""
  model = CMLMTransformer(config)
  params = model.init(jax.random.key(0), src, src)['params']
  memory = model.apply({'params': params}, src, method=CMLMTransformer.encode)
  src_mask = cmlm.masks.padding_mask(src, PAD)
  other_src = np.where(src != PAD, src + 1, PAD)
  logits = [
    np.asarray(
      model.apply(
        {'params': params},
        decoder_input,
        memory,
        src_mask,
        src=ids,
        method=CMLMTransformer.decode_parallel,
      )
    )
    for ids in (src, other_src)
  ]
  moved = np.abs(logits[1] - logits[0]).max()
  assert moved > 1e-3 if config.cmlm_decoder_input == 'uniform_copy' else moved == 0.0


def test_uniform_copy_needs_the_source_ids(copy_forward, src, decoder_input):
  params, _ = copy_forward
  model = CMLMTransformer(COPY_CONFIG)
  memory = model.apply({'params': params}, src, method=CMLMTransformer.encode)
  with pytest.raises(ValueError, match="'uniform_copy' needs the source ids"):
    model.apply(
      {'params': params},
      decoder_input,
      memory,
      cmlm.masks.padding_mask(src, PAD),
      method=CMLMTransformer.decode_parallel,
    )
  with pytest.raises(ConfigError, match='cmlm_decoder_input must be one of mask, uniform_copy'):
    CONFIG.replace(cmlm_decoder_input='copy')
  with pytest.raises(ConfigError, match="'uniform_copy' is for model.kind='cmlm'"):
    CONFIG.replace(kind='autoregressive', cmlm_decoder_input='uniform_copy')
