"""A Marian model imported from transformers computes what transformers computes.

The reference is transformers' own `MarianMTModel` (PyTorch), built with random
weights by `support.marian_directory.make_marian_directory` and saved with
`save_pretrained`, beside sentencepiece models trained on the spot: nothing is
downloaded. Skipped without torch, transformers and sentencepiece
(`pip install -e .[pretrained-test]`).
"""

import copy
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip('torch', reason='needs torch: pip install -e .[pretrained-test]')
transformers = pytest.importorskip(
  'transformers', reason='needs transformers: pip install -e .[pretrained-test]'
)
pytest.importorskip('sentencepiece', reason='needs sentencepiece: pip install -e .[pretrained]')
pytest.importorskip('safetensors', reason='needs safetensors: pip install -e .[pretrained]')

from flax_transformer.cli import decode as decode_cli  # noqa: E402
from flax_transformer.config import ConfigError  # noqa: E402
from flax_transformer.decode import autoregressive  # noqa: E402
from flax_transformer.decode.methods import Greedy  # noqa: E402
from flax_transformer.decode.translator import Translator  # noqa: E402
from flax_transformer.nn.build import build_model  # noqa: E402
from flax_transformer.pretrained.marian import (  # noqa: E402
  PretrainedError,
  fine_tuning_config,
  load_marian,
  marian_config,
)
from support.marian_directory import MarianShape, make_marian_directory  # noqa: E402
from support.script_calls import call  # noqa: E402

SENTENCES = [
  'The animal did not cross the street because it was too tired.',
  'A man',
  'She sings a song about the sea.',
  'Several people are sitting on a bench.',
]
NEW_TOKENS = 12


@pytest.fixture(scope='module')
def marian_dir(tmp_path_factory):
  return make_marian_directory(tmp_path_factory.mktemp('marian') / 'tiny')


@pytest.fixture(scope='module')
def loaded(marian_dir):
  return load_marian(marian_dir)


@pytest.fixture(scope='module')
def reference(marian_dir):
  return transformers.MarianMTModel.from_pretrained(marian_dir).eval()


def _pad(rows, pad_id, start=()):
  rows = [list(start) + list(row) for row in rows]
  width = max(map(len, rows))
  return np.array([row + [pad_id] * (width - len(row)) for row in rows], np.int32)


def _sources(tokenizer):
  """The SENTENCES as a PAD-padded, EOS-terminated batch `[B, S]`."""
  return _pad([ids + [tokenizer.eos_id] for ids in tokenizer.encode(SENTENCES)], tokenizer.pad_id)


def _generate(model, src, pad_id, **settings):
  """transformers' output tokens `[B, NEW_TOKENS]` without the start token, PAD-padded."""
  with torch.no_grad():
    out = model.generate(
      input_ids=torch.tensor(src),
      attention_mask=torch.tensor(src != pad_id),
      max_new_tokens=NEW_TOKENS,
      do_sample=False,
      forced_eos_token_id=None,
      bad_words_ids=[[pad_id]],
      **settings,
    ).numpy()[:, 1:]
  return np.pad(out, ((0, 0), (0, NEW_TOKENS - out.shape[1])), constant_values=pad_id)


@pytest.mark.parametrize('shared', [True, False], ids=['shared', 'separate_embeddings'])
def test_logits_equal_transformers_on_padded_batches(shared, marian_dir, loaded, tmp_path):
  directory = (
    marian_dir
    if shared
    else make_marian_directory(
      tmp_path, MarianShape(share_encoder_decoder_embeddings=False), seed=1
    )
  )
  config, params, tokenizer = loaded if shared else load_marian(directory)
  assert config.share_embeddings == shared
  src = _sources(tokenizer)
  tgt_in = _pad(tokenizer.encode_target(SENTENCES[::-1]), tokenizer.pad_id, [tokenizer.pad_id])
  # transformers in float64: its own float32 run is 1.4e-5 from this, ours 8e-6.
  model = transformers.MarianMTModel.from_pretrained(directory).eval().double()
  with torch.no_grad():
    expected = model(
      input_ids=torch.tensor(src),
      attention_mask=torch.tensor(src != config.pad_id),
      decoder_input_ids=torch.tensor(tgt_in),
    ).logits.numpy()
  logits = np.asarray(build_model(config).apply({'params': params}, src, tgt_in))
  # Positions after a target's end differ by design: ours mask PAD keys there, transformers'
  # (without a decoder_attention_mask) attend to them; nothing reads those logits.
  real = (tgt_in != config.pad_id) | (np.arange(tgt_in.shape[1]) == 0)
  assert real.sum() < real.size and np.abs(expected).max() > 1.0
  np.testing.assert_allclose(logits[real], expected[real], rtol=1e-5, atol=1e-5)


def _boost_eos(params, reference, eos_id, boost):
  """Both models with `boost` added to EOS's logit bias: a random model then ends some rows early."""
  params = {**params, 'logits_bias': params['logits_bias'].copy()}
  params['logits_bias'][eos_id] += boost
  reference = copy.deepcopy(reference)
  with torch.no_grad():
    reference.final_logits_bias[0, eos_id] += boost
  return params, reference


def test_greedy_equals_generate(loaded, reference):
  config, params, tokenizer = loaded
  src = _sources(tokenizer)
  for boost in (0.0, 3.0):
    boosted, model = _boost_eos(params, reference, config.eos_id, boost)
    tokens = np.asarray(
      autoregressive.greedy(build_model(config), boosted, src, max_len=NEW_TOKENS)
    )
    np.testing.assert_array_equal(tokens, _generate(model, src, config.pad_id, num_beams=1))
  # With the boost, some rows end with EOS and some run to the limit: both endings compared.
  ended = (tokens == config.eos_id).any(axis=1)
  assert ended.any() and not ended.all()


def test_beam_search_equals_generate_when_every_hypothesis_runs_to_the_limit(loaded, reference):
  # alpha 0 and length_penalty 0 both rank by the sum of log-probabilities.
  config, params, tokenizer = loaded
  src = _sources(tokenizer)
  tokens, _ = autoregressive.beam_search(
    build_model(config), params, src, beam_size=4, alpha=0.0, max_len=NEW_TOKENS, min_len=NEW_TOKENS
  )
  expected = _generate(
    reference, src, config.pad_id, num_beams=4, length_penalty=0.0, min_new_tokens=NEW_TOKENS
  )
  np.testing.assert_array_equal(np.asarray(tokens), expected)


def _log_probability(config, params, src, tokens):
  """Sum of log P(token | prefix) over each row's tokens up to its EOS, `[B]`, in float64."""
  tgt_in = np.concatenate([np.full((len(tokens), 1), config.pad_id), tokens[:, :-1]], axis=1)
  logits = np.asarray(build_model(config).apply({'params': params}, src, tgt_in), np.float64)
  logits[..., config.pad_id] = -np.inf  # neither search emits PAD
  log_probs = (
    logits
    - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
    - logits.max(-1, keepdims=True)
  )
  picked = np.take_along_axis(log_probs, tokens[..., None], axis=-1)[..., 0]
  return np.where(tokens != config.pad_id, picked, 0.0).sum(axis=1)


def test_beam_search_finds_hypotheses_at_least_as_probable_as_generate(loaded, reference):
  # Where hypotheses may end: transformers keeps a hypothesis ending in EOS only if it ranks
  # among the best beam_size of the 2 * beam_size candidates; ours keeps every one of the 2K,
  # so it can find a more probable, shorter translation (docs/pretrained.md).
  config, params, tokenizer = loaded
  src = _sources(tokenizer)
  tokens, _ = autoregressive.beam_search(
    build_model(config), params, src, beam_size=4, alpha=0.0, max_len=NEW_TOKENS
  )
  expected = _generate(reference, src, config.pad_id, num_beams=4, length_penalty=0.0)
  ours = _log_probability(config, params, src, np.asarray(tokens))
  theirs = _log_probability(config, params, src, expected)
  assert np.all(ours >= theirs - 1e-4)
  same = (np.asarray(tokens) == expected).all(axis=1)
  assert same.any()


def test_translator_and_decode_py_translate_a_marian_directory(marian_dir, loaded, reference):
  config, _, tokenizer = loaded
  translator = Translator.from_pretrained(marian_dir)
  translations = translator.translate(SENTENCES, Greedy(max_len=NEW_TOKENS))
  expected = transformers.MarianTokenizer.from_pretrained(marian_dir).batch_decode(
    _generate(reference, _sources(tokenizer), config.pad_id, num_beams=1), skip_special_tokens=True
  )
  assert translations == expected and any(translations)
  status, out, err = call(
    decode_cli.main,
    ['--checkpoint', marian_dir, '--method', 'greedy', '--max-len', NEW_TOKENS, *SENTENCES],
  )
  assert status == 0, err
  assert out.splitlines() == translations
  with pytest.raises(ConfigError, match='step and average_last apply to run directories'):
    Translator.from_directory(marian_dir, average_last=2)


def test_the_tokenizer_reads_sentencepiece_pieces_through_vocab_json(loaded, marian_dir):
  _, _, tokenizer = loaded
  vocab = json.loads((marian_dir / 'vocab.json').read_text())
  text = 'Ein Mann fährt mit dem Fahrrad.'
  ids = tokenizer.encode_target([text])[0]
  assert tokenizer.decode([ids + [tokenizer.eos_id, 5, 6]]) == [text]
  assert [tokenizer.id_to_token(i) for i in ids] == [
    piece if piece in vocab else '<unk>'
    for piece in __import__('sentencepiece')
    .SentencePieceProcessor(model_file=str(marian_dir / 'target.spm'))
    .encode(text, out_type=str)
  ]
  assert tokenizer.encode(['☃'])[0][-1] == tokenizer.unk_id  # no piece of vocab.json
  assert (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id) == (len(vocab) - 1,) * 2 + (0,)


def test_a_pytorch_pickle_is_refused_with_how_to_convert(marian_dir, tmp_path):
  for name in ('config.json', 'source.spm', 'target.spm', 'vocab.json'):
    shutil.copy(marian_dir / name, tmp_path / name)
  (tmp_path / 'pytorch_model.bin').write_bytes(b'not read')
  with pytest.raises(
    PretrainedError,
    match=r'pickles are not read.*save_pretrained\(.*'
    r'safe_serialization=True\)',
  ):
    load_marian(tmp_path)


def test_marians_three_dropouts_map_to_ours(marian_dir):
  hf = json.loads((marian_dir / 'config.json').read_text())
  rates = {'dropout': 0.3, 'attention_dropout': 0.2, 'activation_dropout': 0.1}
  config = marian_config({**hf, **rates})
  ours = (config.dropout_rate, config.attention_dropout_rate, config.activation_dropout_rate)
  assert ours == (0.3, 0.2, 0.1)
  # An export writes them back where transformers reads them.
  from flax_transformer.pretrained.export import marian_config_json

  written = marian_config_json(config.replace(positions='interleaved', logits_bias=False))
  assert {name: written[name] for name in rates} == rates


@pytest.mark.parametrize(
  'field, value',
  [
    ('normalize_before', True),
    ('add_final_layer_norm', True),
    ('scale_embedding', False),
    ('static_position_embeddings', False),
    ('activation_function', 'gelu'),
    ('decoder_vocab_size', 7),
    ('decoder_ffn_dim', 32),
  ],
)
def test_a_field_that_cannot_map_is_refused_by_name(field, value, marian_dir):
  hf = json.loads((marian_dir / 'config.json').read_text())
  marian_config(hf)  # maps as it is
  with pytest.raises(PretrainedError, match=rf'^config.json: .*\b{field}='):
    marian_config({**hf, field: value})


# --- fine-tuning with train.py --init-from ------------------------------------------------

FINE_TUNING = [
  '--train.max_tokens=256',
  '--train.warmup_steps=2',
  '--train.log_every=1',
  '--train.eval_every=2',
  '--train.checkpoint_every=2',
  '--model.dropout_rate=0',
]


def test_train_py_fine_tunes_a_marian_model_into_a_run_that_decodes(marian_dir, loaded, tmp_path):
  from flax_transformer.cli import train as train_program
  from support.marian_directory import SAMPLE_TEXT

  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  # A training split only: no validation or BLEU passes to compile.
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[0::2]))
  (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[1::2]))
  workdir = tmp_path / 'run'
  status, out, err = call(
    train_program.main,
    ['--init-from', marian_dir, '--data', corpus, '--workdir', workdir, '--steps', 2, *FINE_TUNING],
  )
  assert status == 0, err
  assert f'fine-tuning {marian_dir}' in out
  config, params, _ = loaded
  translator = Translator.from_checkpoint(workdir)
  assert translator.config == config.replace(dropout_rate=0.0)
  assert {p.name for p in workdir.iterdir()} >= {'source.spm', 'target.spm', 'vocab.json'}
  # Training started from the pretrained values: Adam's first update moves a parameter by at
  # most its learning rate, the second by at most sqrt(sum a_i^2 / b_i) times it (Cauchy-Schwarz
  # on the bias-corrected moments, weights a of the first and b of the second); the rates are
  # d^-0.5 * min(n^-0.5, n * warmup^-1.5), n = 1, 2.
  rates = [32**-0.5 * min(n**-0.5, n * 2**-1.5) for n in (1, 2)]
  b1, b2 = 0.9, 0.98
  a, b = np.array([b1, 1]) * (1 - b1) / (1 - b1**2), np.array([b2, 1]) * (1 - b2) / (1 - b2**2)
  bound = rates[0] + rates[1] * np.sqrt(np.sum(a**2 / b))
  moved = np.abs(
    np.asarray(translator.variables['params']['embedding']['embedding'])
    - params['embedding']['embedding']
  )
  assert 0.9 * bound < moved.max() <= bound * (1 + 1e-5)
  status, out, err = call(
    decode_cli.main,
    ['--checkpoint', workdir, '--method', 'greedy', '--max-len', NEW_TOKENS, SENTENCES[0]],
  )
  assert status == 0 and out.splitlines() == translator.translate(
    SENTENCES[:1], Greedy(max_len=NEW_TOKENS)
  )


def test_averaging_a_fine_tuned_marian_run_keeps_its_tokenizer(marian_dir, loaded, tmp_path):
  # --average-last copied only tokenizer.json, which a Marian run does not have: training
  # finished, then failed on WORKDIR/tokenizer.json. The average is a run directory that loads
  # and decodes with the Marian tokenizer, as the run itself does.
  from flax_transformer.cli import train as train_program
  from flax_transformer.pretrained.marian import MarianTokenizer
  from flax_transformer.run.loading import load_for_inference
  from support.marian_directory import SAMPLE_TEXT

  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[0::2]))
  (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[1::2]))
  workdir = tmp_path / 'run'
  status, out, err = call(
    train_program.main,
    [
      '--init-from',
      marian_dir,
      '--data',
      corpus,
      '--workdir',
      workdir,
      '--steps',
      4,
      '--average-last',
      2,
      *FINE_TUNING,
    ],
  )
  assert status == 0, err
  averaged = workdir / 'average-last2'
  assert f'wrote {averaged}' in out
  assert {p.name for p in averaged.iterdir()} == {
    'config.json',
    'checkpoints',
    *MarianTokenizer.FILES,
  }
  for name in MarianTokenizer.FILES:
    assert (averaged / name).read_bytes() == (workdir / name).read_bytes()
  config, params, tokenizer = load_for_inference(averaged)
  assert isinstance(tokenizer, MarianTokenizer)
  assert config == loaded[0].replace(dropout_rate=0.0)
  assert tokenizer.encode(SENTENCES[:2]) == loaded[2].encode(SENTENCES[:2])
  _, mean, _ = load_for_inference(workdir, average_last=2)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(mean)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  translator = Translator.from_checkpoint(averaged)
  status, out, err = call(
    decode_cli.main,
    ['--checkpoint', averaged, '--method', 'greedy', '--max-len', NEW_TOKENS, SENTENCES[0]],
  )
  assert status == 0, err
  assert out.splitlines() == translator.translate(SENTENCES[:1], Greedy(max_len=NEW_TOKENS))


def test_train_py_refuses_a_model_setting_that_contradicts_the_pretrained_model(marian_dir):
  from flax_transformer.cli import train as train_program
  from support.script_calls import usage_error

  err = usage_error(train_program.main, ['--init-from', str(marian_dir), '--model.d_model=64'])
  assert f'--model.d_model=64 contradicts the model in {marian_dir} (d_model=32)' in err
  assert (
    '(it may change activation_dropout_rate, attention_dropout_rate, attention_kernel, '
    'dropout_rate, dtype, loss_chunk, remat)'
  ) in err
  # How it computes is the run's to choose.
  config = fine_tuning_config(marian_dir, {'remat': 'dots', 'dtype': 'bfloat16'})
  assert (config.remat, config.dtype) == ('dots', 'bfloat16')


# --- a damaged Marian directory: refused naming the file and what is wrong -------------------

MISSING = object()


@pytest.mark.parametrize(
  'field, value, shown',
  [
    ('encoder_ffn_dim', MISSING, 'no field encoder_ffn_dim'),
    ('d_model', None, 'd_model must be an integer in [1, 65536], got None'),
    ('vocab_size', '300', "vocab_size must be an integer in [1, 16777216], got '300'"),
    ('encoder_layers', 2.0, 'encoder_layers must be an integer in [1, 1024], got 2.0'),
    ('decoder_layers', True, 'decoder_layers must be an integer in [1, 1024], got True'),
    (
      'max_position_embeddings',
      1e9,
      'max_position_embeddings must be an integer in [1, 1048576], got 1000000000.0',
    ),
    ('d_model', 10**12, 'd_model must be an integer in [1, 65536], got 1000000000000'),
    ('encoder_layers', 10**6, 'encoder_layers must be an integer in [1, 1024], got 1000000'),
    ('vocab_size', 0, 'vocab_size must be an integer in [1, 16777216], got 0'),
    ('vocab_size', -5, 'vocab_size must be an integer in [1, 16777216], got -5'),
    ('pad_token_id', 300, 'pad_token_id=300 is outside the vocabulary (vocab_size=300)'),
    ('eos_token_id', 'x', 'eos_token_id="x" must be one token id'),
    ('dropout', 2, 'dropout must be in [0, 1), got 2'),
    ('activation_dropout', 1.5, 'activation_dropout must be in [0, 1), got 1.5'),
    ('tie_word_embeddings', 'yes', 'tie_word_embeddings must be true or false, got "yes"'),
    ('activation_function', None, 'activation_function=null is not supported'),
  ],
)
def test_a_bad_config_json_field_is_refused_naming_file_field_and_value(
  field, value, shown, marian_dir, tmp_path
):
  from flax_transformer.pretrained.marian import read_marian_config

  hf = json.loads((marian_dir / 'config.json').read_text())
  hf = {name: given for name, given in {**hf, field: value}.items() if given is not MISSING}
  (tmp_path / 'config.json').write_text(json.dumps(hf))
  with pytest.raises(PretrainedError) as refusal:
    read_marian_config(tmp_path)
  assert str(refusal.value).startswith(f'{tmp_path / "config.json"}: ')
  assert shown in str(refusal.value)


@pytest.mark.parametrize(
  'text, shown',
  [
    ('{"d_model": 32,', 'not valid JSON'),
    ('[1, 2]', 'holds an array, not a JSON object'),
    ('null', 'holds null, not a JSON object'),
    ('"d_model"', 'holds a string, not a JSON object'),
    (b'\xff\xfe', 'not UTF-8 text'),
  ],
)
def test_a_config_json_that_is_no_json_object_is_refused_naming_it(text, shown, tmp_path):
  from flax_transformer.pretrained.marian import read_marian_config

  path = tmp_path / 'config.json'
  path.write_bytes(text if isinstance(text, bytes) else text.encode())
  with pytest.raises(PretrainedError, match=rf'^{path}: {shown}'):
    read_marian_config(tmp_path)


def _damaged_copy(marian_dir, tmp_path, name: str, damage) -> Path:
  """A copy of the Marian directory whose file `name` becomes damage(its bytes)."""
  damaged = tmp_path / 'damaged'
  shutil.copytree(marian_dir, damaged)
  (damaged / name).write_bytes(damage((damaged / name).read_bytes()))
  return damaged


def _without_tensor(data: bytes) -> bytes:
  from safetensors.numpy import load, save

  weights = load(data)
  del weights['model.encoder.layers.1.fc2.bias']
  return save(weights)


def _reshaped_tensor(data: bytes) -> bytes:
  from safetensors.numpy import load, save

  weights = load(data)
  weights['model.decoder.layers.0.fc1.weight'] = np.zeros((64, 16), np.float32)
  return save(weights)


@pytest.mark.parametrize(
  'name, damage, shown',
  [
    ('model.safetensors', lambda data: data[: len(data) // 2], 'truncated: tensor '),
    (
      'model.safetensors',
      lambda data: (10**15).to_bytes(8, 'little') + data[8:],
      'damaged: its header length field says 1,000,000,000,000,000 bytes',
    ),
    (
      'model.safetensors',
      lambda data: (2**62).to_bytes(8, 'little') + data[8:],
      'damaged: its header length field says 4,611,686,018,427,387,904 bytes',
    ),
    (
      'model.safetensors',
      lambda data: data[:8] + b'#' + data[9:],
      'damaged: its header is not JSON',
    ),
    ('model.safetensors', lambda data: data[:5], 'damaged: its header length field'),
    ('model.safetensors', _without_tensor, "has no tensor 'encoder.layers.1.fc2.bias'"),
    (
      'model.safetensors',
      _reshaped_tensor,
      "parameter ['decoder']['layer_0']['ffn']['wi']['kernel'] should be (32, 64)",
    ),
    ('source.spm', lambda data: b'not a model', 'not a readable sentencepiece model'),
    ('target.spm', lambda data: data[:1000], 'not a readable sentencepiece model'),
    ('vocab.json', lambda data: data[:100], 'not valid JSON'),
    ('vocab.json', lambda data: b'["</s>"]', 'holds an array, not a JSON object'),
    (
      'vocab.json',
      lambda data: b'{"</s>": 0, "<unk>": "one"}',
      'the id of \'<unk>\' must be a non-negative integer, got "one"',
    ),
  ],
  ids=[
    'weights_truncated',
    'weights_header_length',
    'weights_header_2_62',
    'weights_header_not_json',
    'weights_five_bytes',
    'weights_missing_tensor',
    'weights_wrong_shape',
    'source_spm',
    'target_spm_truncated',
    'vocab_truncated',
    'vocab_list',
    'vocab_id_not_int',
  ],
)
def test_a_damaged_weights_or_tokenizer_file_is_refused_naming_it(
  name, damage, shown, marian_dir, tmp_path
):
  damaged = _damaged_copy(marian_dir, tmp_path, name, damage)
  with pytest.raises(PretrainedError) as refusal:
    load_marian(damaged)
  assert str(refusal.value).startswith(str(damaged / name))
  assert shown in str(refusal.value)
  # One fault, one wording: the file named once, a length fault never called 'not JSON'.
  assert str(refusal.value).count(str(damaged / name)) == 1
  assert 'length field' not in shown or 'not JSON' not in str(refusal.value)


def test_a_model_too_large_for_the_machine_is_refused_before_its_weights_are_read(
  marian_dir, tmp_path
):
  # Each size within its field's limits, together far beyond any machine's memory.
  hf = json.loads((marian_dir / 'config.json').read_text())
  wide = {
    'd_model': 2**16,
    'encoder_ffn_dim': 2**18,
    'decoder_ffn_dim': 2**18,
    'encoder_layers': 1024,
    'decoder_layers': 1024,
  }
  damaged = _damaged_copy(
    marian_dir, tmp_path, 'config.json', lambda data: json.dumps({**hf, **wide}).encode()
  )
  (damaged / 'model.safetensors').unlink()  # never reached
  with pytest.raises(PretrainedError, match=rf'^{damaged / "config.json"}: the model is too large'):
    Translator.from_pretrained(damaged)


def test_decode_py_and_train_py_answer_a_damaged_marian_directory_with_status_2(
  marian_dir, tmp_path
):
  from support.script_calls import error_line

  damaged = _damaged_copy(marian_dir, tmp_path, 'model.safetensors', lambda data: data[:-100])
  status, out, err = call(decode_cli.main, ['--checkpoint', damaged, 'A man'])
  assert status == 2 and not out
  assert err.strip() == error_line(err, 'decode.py')
  assert f'{damaged / "model.safetensors"}: truncated' in err
  assert 'unexpected' not in err and 'Traceback' not in err
  # train.py --init-from reads the weights after the data, before compiling anything.
  from flax_transformer.cli import train as train_program
  from support.marian_directory import SAMPLE_TEXT

  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[0::2]))
  (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[1::2]))
  status, _, err = call(
    train_program.main,
    [
      '--init-from',
      damaged,
      '--data',
      corpus,
      '--workdir',
      tmp_path / 'run',
      '--steps',
      1,
      *FINE_TUNING,
    ],
  )
  assert status == 2
  assert error_line(err, 'train.py').startswith(
    f'train.py: error: {damaged / "model.safetensors"}: truncated: tensor '
  )
