"""Text-level decoding: Translator (batching, order, truncation, alignment, the model kinds).
The method values it takes are tests/test_methods.py's.

decode.py, the command line over Translator, is tests/test_decode_cli.py's.
"""

import numpy as np
import pytest

from flax_transformer import ConfigError, Transformer
from flax_transformer.decode import autoregressive
from flax_transformer.decode.methods import BeamSearch, Greedy, MaskPredict, Sampling
from flax_transformer.decode.translator import Translator
from flax_transformer.nn.cmlm import CMLMTransformer
from support.random_run import MAX_LEN, SENTENCES

# The tiny model's max_len caps the source + 50 budget of the longest sentences;
# test_decoding.py checks that warning.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* exceeds model.max_len')


# The random tiny model of conftest.py's random_run, which tests/test_decode_cli.py shares.


@pytest.fixture(scope='module')
def tokenizer(random_run):
  return random_run.tokenizer


@pytest.fixture(scope='module')
def config(random_run):
  return random_run.config


@pytest.fixture(scope='module')
def params(random_run):
  return random_run.params


@pytest.fixture(scope='module')
def translator(random_run):
  return random_run.translator


@pytest.fixture(scope='module')
def run_dir(random_run):
  return random_run.run_dir


@pytest.fixture(scope='module')
def greedy_translations(random_run):
  return random_run.greedy_translations


def test_batches_come_back_in_input_order(
  translator, config, params, tokenizer, greedy_translations
):
  # Reference: all non-empty sentences in one batch, in input order.
  present = [s for s in SENTENCES if s]
  rows = [ids + [config.eos_id] for ids in tokenizer.encode(present)]
  src = np.array([row + [config.pad_id] * (MAX_LEN - len(row)) for row in rows], np.int32)
  expected = tokenizer.decode(np.asarray(autoregressive.greedy(Transformer(config), params, src)))
  assert [t for s, t in zip(SENTENCES, greedy_translations) if s] == expected
  assert len(set(expected)) > 1, 'the fixture should give different translations'


def test_empty_sentences_translate_to_empty_lines(greedy_translations):
  assert len(greedy_translations) == len(SENTENCES)
  assert greedy_translations[SENTENCES.index('')] == ''
  assert all(t for s, t in zip(SENTENCES, greedy_translations) if s)


def test_sources_are_encoded_like_training_and_truncated(translator, tokenizer):
  long = ' '.join(['Hund'] * 80)
  sources = translator.encode(['Ein Hund.', long, ' '])
  np.testing.assert_array_equal(sources.ids[0], tokenizer.encode(['Ein Hund.'])[0] + [2])
  assert len(sources.ids[1]) == MAX_LEN and sources.ids[1][-1] == 2
  assert sources.ids[2] is None
  assert sources.truncated == [(1, len(tokenizer.encode([long])[0]))]
  with pytest.warns(UserWarning, match=f'sentence 0: .* exceed model.max_len={MAX_LEN}; truncated'):
    translator.translate([long], Greedy())


def test_from_checkpoint_translates_like_the_saved_model(run_dir, greedy_translations):
  loaded = Translator.from_checkpoint(run_dir)
  assert loaded.translate(SENTENCES, Greedy(), batch_size=2) == greedy_translations


def test_alignment_is_the_cross_attention_of_the_output(translator, config, tokenizer):
  alignment = translator.alignment('Ein Hund spielt.', 'A dog plays.')
  source = tokenizer.encode(['Ein Hund spielt.'])[0] + [config.eos_id]
  target = tokenizer.encode(['A dog plays.'])[0] + [config.eos_id]
  assert alignment.source_tokens == [tokenizer.id_to_token(i) for i in source]
  assert alignment.target_tokens == [tokenizer.id_to_token(i) for i in target]
  assert alignment.weights.shape == (
    config.num_decoder_layers,
    config.num_heads,
    len(target),
    len(source),
  )
  np.testing.assert_allclose(alignment.weights.sum(axis=-1), 1.0, rtol=1e-5)

  # Without a translation, the one decoded from the same source ids.
  decoded = translator.alignment('Ein Hund spielt.', method=Greedy())
  output = np.asarray(
    autoregressive.greedy(translator.model, translator.variables, np.array([source]))
  )[0]
  assert decoded.target_tokens == [tokenizer.id_to_token(i) for i in output if i != 0]
  assert decoded.weights.shape[2] == len(decoded.target_tokens)


# --- the model kinds: an autoregressive run and a cmlm run (conftest.py) ---------------------


def test_translator_refuses_methods_of_the_other_kind(teacher, cmlm_run):
  autoregressive = Translator.from_checkpoint(teacher)
  with pytest.raises(
    ConfigError,
    match="method 'mask_predict' decodes cmlm models, but this "
    "model is model.kind='autoregressive'; use method "
    "'beam', 'greedy' or 'sample'",
  ):
    autoregressive.translate(['one'], MaskPredict())
  cmlm = Translator.from_checkpoint(cmlm_run['workdir'])
  assert isinstance(cmlm.model, CMLMTransformer)
  for method in (Greedy(), BeamSearch(), Sampling()):
    with pytest.raises(ConfigError, match=f"method '{method.name}' decodes autoregressive models"):
      cmlm.translate(['one'], method)
  with pytest.raises(TypeError, match='method must be a decoding method value'):
    cmlm.translate(['one'], 'greedy')
  with pytest.raises(
    ConfigError, match="alignment needs an autoregressive model; this one is model.kind='cmlm'"
  ):
    cmlm.alignment('one')


def test_translator_decodes_in_the_dtype_asked_for(config, params, tokenizer):
  translator = Translator(config, params, tokenizer, dtype='bfloat16')
  assert translator.config.dtype == 'bfloat16'
  # Matrices cast once here; vectors (biases, LayerNorm) stay float32.
  layer = translator.variables['params']['decoder']['layer_0']['ffn']['wi']
  assert (layer['kernel'].dtype.name, layer['bias'].dtype.name) == ('bfloat16', 'float32')
  with pytest.raises(ConfigError, match='model.dtype must be one of auto, float32, bfloat16'):
    Translator(config, params, tokenizer, dtype='float16')
