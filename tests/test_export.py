"""A run exported as a Hugging Face Marian directory computes what the run computes.

Three readers of the export, each against the run itself: our own Marian loader
(logits to 1e-5 of the largest, the same beam output), transformers' MarianMTModel
(logits to 1e-4 on 20 sentences, `generate`'s greedy strings equal to ours) and
CTranslate2 (its transformers converter, then greedy strings equal to ours), for
the toy run (`python train.py`) and a short Multi30k run. The feature permutation
that turns our interleaved positional table into Marian's is proven on its own,
with a permutation of the parameter tree written here, independently of the
exporter. Without torch and transformers (`pip install -e .[pretrained-test]`)
or ctranslate2 those comparisons skip; the rest needs safetensors.
"""

import hashlib
import itertools
import json
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip('safetensors', reason='needs safetensors: pip install -e .[pretrained]')

from flax_transformer.cli import export as export_cli  # noqa: E402
from flax_transformer.cli import train as train_cli  # noqa: E402
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig  # noqa: E402
from flax_transformer.decode.methods import (  # noqa: E402
  EXTRA_OUTPUT_TOKENS,  # noqa: E402
  BeamSearch,
  Greedy,
)
from flax_transformer.decode.translator import Translator  # noqa: E402
from flax_transformer.nn.layers import sinusoidal_positions  # noqa: E402
from flax_transformer.nn.model import Transformer  # noqa: E402
from flax_transformer.pretrained import export  # noqa: E402
from flax_transformer.pretrained.marian import load_marian  # noqa: E402
from flax_transformer.run.checkpoints import Checkpoints  # noqa: E402
from flax_transformer.run.directory import write_config  # noqa: E402
from flax_transformer.run.loading import load_for_inference  # noqa: E402
from flax_transformer.tokenizer import Tokenizer  # noqa: E402
from support.script_calls import call, error_line  # noqa: E402

TOY_SENTENCES = [
  'one hundred one',
  'forty-two',
  'seven thousand five hundred ninety-four',
  'six thousand eight',
  'nine',
  'three hundred twelve',
  'eighty-eight',
  'two thousand',
  'five hundred fifty-five',
  'nineteen',
  'one thousand one',
  'sixty',
  'four hundred four',
  'eight thousand three',
  'seventy-one',
  'nine hundred ninety-nine',
  'thirteen',
  'three thousand thirty',
  'fifty',
  'eighty </s> two',
]
MULTI30K_LINES = {'train': 3000, 'val': 20, 'test_2016_flickr': 20}
TINY = [
  '--model.d_model=64',
  '--model.num_heads=4',
  '--model.num_encoder_layers=2',
  '--model.num_decoder_layers=2',
  '--model.d_ff=128',
  '--model.max_len=64',
  '--train.warmup_steps=40',
  '--train.max_tokens=1024',
  '--train.log_every=50',
  '--train.eval_every=1000',
  '--train.checkpoint_every=1000',
]


@pytest.fixture(scope='module')
def toy_run(tmp_path_factory) -> Path:
  """The first run a user makes: `python train.py`, the embedded number-words task, its model
  and settings, for 150 of its 400 steps (enough for confident predictions; the suite's time)."""
  workdir = tmp_path_factory.mktemp('toy') / 'run'
  status, _, err = call(train_cli.main, ['--workdir', workdir, '--steps=150'])
  assert status == 0, err[-2000:]
  return workdir


@pytest.fixture(scope='module')
def multi30k_run(tmp_path_factory, multi30k_dir) -> Path:
  """A short Multi30k run: a small model, 150 steps on the first 3,000 pairs."""
  data = tmp_path_factory.mktemp('multi30k-head')
  for stem, lines in MULTI30K_LINES.items():
    for lang in ('en', 'de'):
      with open(multi30k_dir / f'{stem}.{lang}', encoding='utf-8') as source:
        (data / f'{stem}.{lang}').write_text(
          ''.join(itertools.islice(source, lines)), encoding='utf-8'
        )
  workdir = tmp_path_factory.mktemp('m30k') / 'run'
  status, _, err = call(
    train_cli.main,
    [
      '--data',
      data,
      '--data.test_split=test_2016_flickr',
      '--data.vocab_size=2000',
      *TINY,
      '--steps=150',
      '--workdir',
      workdir,
    ],
  )
  assert status == 0, err[-2000:]
  return workdir


@pytest.fixture(scope='module')
def runs(request) -> dict:
  return {
    'toy': (request.getfixturevalue('toy_run'), TOY_SENTENCES),
    'multi30k': (
      request.getfixturevalue('multi30k_run'),
      _multi30k_sentences(request.getfixturevalue('multi30k_dir')),
    ),
  }


def _multi30k_sentences(directory: Path) -> list[str]:
  return (directory / 'val.en').read_text(encoding='utf-8').splitlines()[:20]


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
  """Exports a run once per module: run directory -> export directory."""
  done = {}

  def get(workdir: Path) -> Path:
    if workdir not in done:
      output = tmp_path_factory.mktemp('export') / 'marian'
      status, _, err = call(export_cli.main, [workdir, '--to', output])
      assert status == 0, err
      done[workdir] = output
    return done[workdir]

  return get


def _pad(rows, pad_id: int) -> np.ndarray:
  width = max(map(len, rows))
  return np.array([list(row) + [pad_id] * (width - len(row)) for row in rows], np.int32)


def _our_logits(workdir: Path, sentences: list[str]):
  """(logits `[B, T, V]` teacher-forced on our greedy output, sources with EOS, targets with
  EOS, greedy strings), all from the run itself."""
  config, params, tokenizer = load_for_inference(workdir)
  translator = Translator(config, params, tokenizer)
  greedy = translator.translate(sentences, Greedy())
  sources = [row[: config.max_len - 1] + [config.eos_id] for row in tokenizer.encode(sentences)]
  # Any target prefix will do for comparing logits: the greedy output, within max_len.
  targets = [(row + [config.eos_id])[: config.max_len] for row in tokenizer.encode(greedy)]
  tgt_in = _pad([[config.bos_id] + row[:-1] for row in targets], config.pad_id)
  logits = Transformer(config).apply({'params': params}, _pad(sources, config.pad_id), tgt_in)
  return np.asarray(logits), sources, targets, greedy, config


def _budget(source_length: int, config: ModelConfig) -> int:
  """decode.py's output budget for a source of this many tokens (EOS included)."""
  return min(source_length + EXTRA_OUTPUT_TOKENS, config.max_len)


def _allowed(config: ModelConfig) -> np.ndarray:
  """`[V]` the tokens a search may output: the logits an export keeps as they are."""
  allowed = np.ones(config.vocab_size, bool)
  allowed[[config.pad_id, config.bos_id]] = False
  return allowed


# --- the permutation, on its own -----------------------------------------------------------


def _permute_features(params: dict, order: np.ndarray) -> dict:
  """Our parameter tree with the model dimension reordered: feature j of the result is
  feature order[j] of `params`. Which axis is the model dimension, from each leaf's name."""

  def permute(path, x):
    names = [getattr(key, 'key', '') for key in path]
    x = np.asarray(x)
    if names[-2:] in (
      ['embedding', 'embedding'],
      ['source_embedding', 'embedding'],
      ['target_embedding', 'embedding'],
    ):
      return x[:, order]  # [V, D]: features are columns
    if 'norm' in names:
      return x[order]  # [D] scale, bias
    if names[-2] in ('query', 'key', 'value', 'wi') and names[-1] == 'kernel':
      return x[order]  # [D, Y]: reads the stream
    if names[-2] in ('out', 'wo'):
      return x[..., order]  # [X, D] kernel, [D] bias: writes it
    if names[-2] == 'output_projection':
      return x[order]  # [D, V]
    return x  # [F] biases, query/value [D] biases

  return jax.tree_util.tree_map_with_path(permute, params)


@pytest.mark.parametrize('share_embeddings', [True, False])
def test_the_feature_permutation_maps_our_positions_onto_marians_exactly(share_embeddings):
  d_model = 32
  order = export.residual_permutation(d_model, 'interleaved')
  ours = np.asarray(sinusoidal_positions(50, d_model, 'interleaved'))
  marian = np.asarray(sinusoidal_positions(50, d_model, 'concatenated'))
  # Marian's (transformers') table, written out: sin of every even feature's wavelength, then cos.
  angle = np.arange(50)[:, None] / np.power(10_000.0, np.arange(0, d_model, 2) / d_model)
  np.testing.assert_allclose(marian, np.concatenate([np.sin(angle), np.cos(angle)], 1), atol=1e-6)
  np.testing.assert_allclose(ours[:, order], marian, rtol=0, atol=1e-7)
  # The same network on permuted features: our model with the permuted tree and Marian's
  # table gives the logits of the original.
  config = ModelConfig.tiny(
    vocab_size=40,
    d_model=d_model,
    num_encoder_layers=2,
    num_decoder_layers=2,
    dropout_rate=0.0,
    share_embeddings=share_embeddings,
  )
  src = np.array([[5, 9, 12, 30, 2], [7, 8, 2, 0, 0]], np.int32)
  tgt = np.array([[1, 6, 13, 21], [1, 19, 0, 0]], np.int32)
  params = Transformer(config).init(jax.random.key(0), src, tgt)['params']
  noise = lambda x: x + 0.1 * jax.random.normal(jax.random.key(x.size), x.shape)
  params = jax.tree.map(noise, params)  # LayerNorm scales and biases far from 1 and 0
  logits = np.asarray(Transformer(config).apply({'params': params}, src, tgt))
  permuted = np.asarray(
    Transformer(config.replace(positions='concatenated')).apply(
      {'params': _permute_features(params, order)}, src, tgt
    )
  )
  scale = np.abs(logits).max()
  np.testing.assert_allclose(permuted, logits, rtol=0, atol=1e-6 * scale)
  # The permutation is not the identity: without it the outputs differ.
  unpermuted = np.asarray(
    Transformer(config.replace(positions='concatenated')).apply({'params': params}, src, tgt)
  )
  assert np.abs(unpermuted - logits).max() > 1e-2 * scale


# --- round trip through our own loader -----------------------------------------------------


def test_an_export_read_back_by_our_marian_loader_is_the_run(toy_run, exported):
  logits, sources, targets, greedy, config = _our_logits(toy_run, TOY_SENTENCES)
  marian_config, params, tokenizer = load_marian(exported(toy_run))
  assert marian_config.layer_norm_epsilon == config.layer_norm_epsilon
  assert marian_config.positions == 'concatenated' and config.positions == 'interleaved'
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  # The exported tokenizer gives the run's ids, PAD's and the last id traded.
  assert [row + [tokenizer.eos_id] for row in tokenizer.encode(TOY_SENTENCES)] == [
    [int(order[i]) for i in row] for row in sources
  ]
  tgt_in = _pad(
    [[marian_config.bos_id] + [int(order[i]) for i in row[:-1]] for row in targets],
    marian_config.pad_id,
  )
  theirs = np.asarray(
    Transformer(marian_config).apply(
      {'params': params},
      _pad([[int(order[i]) for i in row] for row in sources], marian_config.pad_id),
      tgt_in,
    )
  )[..., order]
  allowed = _allowed(config)
  for row, target in enumerate(targets):
    ours_row, theirs_row = logits[row, : len(target)], theirs[row, : len(target)]
    np.testing.assert_allclose(
      theirs_row[:, allowed], ours_row[:, allowed], rtol=0, atol=1e-5 * np.abs(ours_row).max()
    )
    assert (theirs_row[:, ~allowed] < -1e8).all()  # PAD and BOS: never output
  beam = BeamSearch(beam_size=4, alpha=0.6)
  run_translator = Translator.from_directory(toy_run)
  export_translator = Translator.from_directory(exported(toy_run))
  assert export_translator.translate(TOY_SENTENCES, beam) == run_translator.translate(
    TOY_SENTENCES, beam
  )
  assert export_translator.translate(TOY_SENTENCES, Greedy()) == greedy


def test_decode_py_reads_an_export(toy_run, exported):
  from flax_transformer.cli import decode as decode_cli

  status, out, err = call(
    decode_cli.main,
    ['--checkpoint', exported(toy_run), '--method', 'greedy', 'one hundred one', 'forty-two'],
  )
  assert status == 0, err
  assert out.splitlines() == Translator.from_directory(toy_run).translate(
    ['one hundred one', 'forty-two'], Greedy()
  )


# --- refusals ------------------------------------------------------------------------------


def _random_run(workdir: Path, **model) -> Path:
  """A run directory of a random tiny model with these settings (no training)."""
  texts = ['one two three four', 'eins zwei drei vier'] * 10
  tokenizer = Tokenizer.train(texts, 40)
  config = ModelConfig.tiny(
    vocab_size=tokenizer.vocab_size, num_encoder_layers=1, num_decoder_layers=1, max_len=16, **model
  )
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  workdir.mkdir(parents=True)
  tokenizer.save(workdir)
  write_config(workdir, config, TrainConfig.toy(), DataConfig())
  checkpoints = Checkpoints(workdir)
  for step in (2, 4):
    checkpoints.save_params(step, jax.tree.map(lambda x, s=step: np.asarray(x) * s, params))
  checkpoints.close()
  return workdir


def _tree_digest(directory: Path) -> dict[str, str]:
  return {
    str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
    for path in sorted(directory.rglob('*'))
    if path.is_file()
  }


@pytest.mark.parametrize(
  'model, field',
  [
    ({'norm_placement': 'pre'}, 'model.norm_placement'),
    ({'attention_radius': 3}, 'model.attention_radius'),
  ],
)
def test_what_marian_cannot_express_is_refused_naming_the_setting(tmp_path, model, field):
  workdir = _random_run(tmp_path / 'run', **model)
  before = _tree_digest(workdir)
  status, out, err = call(export_cli.main, [workdir, '--to', tmp_path / 'out'])
  assert status == 2
  assert error_line(err, 'export.py').startswith(f'export.py: error: cannot export {field}=')
  assert not (tmp_path / 'out').exists() and _tree_digest(workdir) == before
  assert [p.name for p in tmp_path.iterdir()] == ['run']  # no staging directory left


def test_a_cmlm_run_is_refused(cmlm_run, tmp_path):
  status, _, err = call(export_cli.main, [cmlm_run['workdir'], '--to', tmp_path / 'out'])
  assert status == 2 and 'cannot export model.kind=' in error_line(err, 'export.py')
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize(
  'target, message',
  [
    ('{run}', 'would replace the run directory'),
    ('{run}/checkpoints', 'would replace {run}/checkpoints, part of the run'),
    ('{run}/..', 'would replace the run directory'),
    ('{run}/config.json', 'would replace {run}/config.json, part of the run'),
    ('{tmp}/occupied', 'holds other files than an earlier export'),
    ('{tmp}/a-file', 'is a file'),
  ],
)
def test_an_output_over_the_run_or_foreign_files_is_refused(tmp_path, target, message):
  workdir = _random_run(tmp_path / 'run')
  (tmp_path / 'occupied').mkdir()
  (tmp_path / 'occupied' / 'notes.txt').write_text('mine')
  (tmp_path / 'a-file').write_text('mine')
  before = _tree_digest(tmp_path)
  status, _, err = call(
    export_cli.main, [workdir, '--to', target.format(run=workdir, tmp=tmp_path)]
  )
  assert status == 2
  assert message.format(run=workdir) in error_line(err, 'export.py')
  assert _tree_digest(tmp_path) == before


def test_an_earlier_export_is_replaced_and_step_and_average_choose_the_weights(tmp_path):
  from safetensors.numpy import load_file

  workdir = _random_run(tmp_path / 'run')
  output = workdir / 'export'  # an entry of its own inside the run is allowed
  weights = {}
  for options in ([], ['--step', '2'], ['--average-last', '2']):
    status, out, err = call(export_cli.main, [workdir, '--to', output, *options])
    assert status == 0, err
    assert sorted(p.name for p in output.iterdir()) == sorted(
      export.MODEL_FILES + export.FAST_TOKENIZER_FILES
    )
    weights[' '.join(options)] = load_file(output / 'model.safetensors')
  name = 'model.encoder.layers.0.fc1.weight'  # steps 2 and 4 saved params * 2 and * 4
  np.testing.assert_allclose(weights[''][name], 2 * weights['--step 2'][name], rtol=1e-6)
  np.testing.assert_allclose(
    weights['--average-last 2'][name], 1.5 * weights['--step 2'][name], rtol=1e-6
  )
  card = (output / 'README.md').read_text()
  assert 'mean of its last 2 checkpoints' in card and 'length ** 0.6' in card
  # The export inside the run is the run's own: train.py resumes it (it refused, naming
  # 'export', before), while a foreign folder beside it is still refused.
  from flax_transformer.run.directory import NotARun, check_workdir, foreign_entries

  assert foreign_entries(workdir) == []
  check_workdir(workdir)
  (workdir / 'notes').mkdir()
  with pytest.raises(NotARun, match='holds what no run of train.py wrote: notes'):
    check_workdir(workdir)


def test_a_default_model_shares_the_peers_layer_norm_epsilon_and_the_card_says_which():
  """transformers and CTranslate2 fix LayerNorm epsilon at 1e-5: the default model uses it, so an
  export of a default run computes as it does there, and the README of a model trained with
  another epsilon (1e-6 before 2026-12-05) names the difference."""
  assert ModelConfig().layer_norm_epsilon == export.MARIAN_EPSILON == 1e-5
  assert ModelConfig.tiny().layer_norm_epsilon == export.MARIAN_EPSILON
  same = export.model_card(ModelConfig.tiny(), 'runs/toy')
  older = export.model_card(ModelConfig.tiny(layer_norm_epsilon=1e-6), 'runs/old')
  assert 'LayerNorm epsilon is 1e-05 here as in both peers' in same
  assert 'trained with' not in same
  assert 'this model was trained with 1e-06' in older and 'as in both peers' not in older


def test_a_bad_option_is_refused_by_the_parser(tmp_path):
  for argv, message in (
    (['run'], 'the following arguments are required: --to'),
    (['run', '--to', 'x', '--step', '-1'], '--step: must be >= 0'),
  ):
    status, _, err = call(export_cli.main, argv)
    assert status == 2 and message in err


def test_a_directory_that_is_not_a_run_is_refused(tmp_path, exported, toy_run):
  status, _, err = call(export_cli.main, [exported(toy_run), '--to', tmp_path / 'again'])
  assert status == 2 and 'is a Hugging Face model already' in error_line(err, 'export.py')
  status, _, err = call(export_cli.main, [tmp_path / 'nothing', '--to', tmp_path / 'out'])
  assert status == 2 and 'no such file' in error_line(err, 'export.py')


@pytest.mark.parametrize('kind', ['bpe', 'unigram'])
def test_the_exported_tokenizer_gives_our_ids_traded_as_the_export_trades_them(kind):
  tokenizers = pytest.importorskip('tokenizers')
  texts = ['one two three four five', 'eins zwei drei vier fünf', 'a b c </s> <pad> x'] * 10
  tokenizer = Tokenizer.train(texts, 50, kind)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size)
  files = export.fast_tokenizer_files(tokenizer, config)
  backend = tokenizers.Tokenizer.from_str(json.dumps(files['tokenizer.json']))
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  sentences = ['one two three', 'fünf vier', 'zwei one c', 'x a b']
  ours = [[int(order[i]) for i in row] + [config.eos_id] for row in tokenizer.encode(sentences)]
  assert [e.ids for e in backend.encode_batch(sentences)] == ours
  assert backend.token_to_id('<pad>') == config.vocab_size - 1
  assert files['tokenizer_config.json']['split_special_tokens'] is True


# --- transformers and CTranslate2 ----------------------------------------------------------


def _transformers():
  torch = pytest.importorskip('torch', reason='needs torch: pip install -e .[pretrained-test]')
  transformers = pytest.importorskip(
    'transformers', reason='needs transformers: pip install -e .[pretrained-test]'
  )
  return torch, transformers


@pytest.mark.parametrize('name', ['toy', 'multi30k'])
def test_transformers_computes_the_runs_logits_and_greedy_strings(runs, exported, name):
  torch, transformers = _transformers()
  workdir, sentences = runs[name]
  logits, sources, targets, greedy, config = _our_logits(workdir, sentences)
  directory = exported(workdir)
  model = transformers.MarianMTModel.from_pretrained(directory).eval()
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  batch = tokenizer(sentences, return_tensors='pt', padding=True)
  # transformers' tokenizer gives our source ids (+ EOS), traded as the export trades them.
  assert [
    row[: mask.sum()]
    for row, mask in zip(batch['input_ids'].tolist(), batch['attention_mask'].numpy())
  ] == [[int(order[i]) for i in row] for row in sources]
  start = model.config.decoder_start_token_id
  decoder_input = torch.tensor(
    _pad([[start] + [int(order[i]) for i in row[:-1]] for row in targets], start)
  )
  with torch.no_grad():
    theirs = model(**batch, decoder_input_ids=decoder_input).logits.numpy()[..., order]
    # decode.py's budget, each sentence's own: source tokens (EOS included) + 50, up to max_len.
    generated = [
      model.generate(
        **tokenizer([sentence], return_tensors='pt'), max_new_tokens=_budget(len(source), config)
      )[0]
      for sentence, source in zip(sentences, sources)
    ]
  allowed = _allowed(config)
  worst = max(
    np.abs(theirs[row, : len(t)][:, allowed] - logits[row, : len(t)][:, allowed]).max()
    for row, t in enumerate(targets)
  )
  assert worst <= 1e-4, f'{name}: logits differ by {worst:.2e}'
  assert tokenizer.batch_decode(generated, skip_special_tokens=True) == greedy


def test_transformers_reads_a_special_tokens_string_in_text_as_text(tmp_path):
  _, transformers = _transformers()
  # A vocabulary that knows '<', '/', 's', '>': trained on text holding the special strings.
  texts = ['one two </s> three', 'eins <pad> zwei', 'a <unk> b <s> c', 'x</s>y'] * 20
  tokenizer = Tokenizer.train(texts, 60)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size)
  for name, content in export.fast_tokenizer_files(tokenizer, config).items():
    (tmp_path / name).write_text(json.dumps(content), encoding='utf-8')
  theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  special = {theirs.pad_token_id, theirs.bos_token_id, theirs.eos_token_id}
  for text in ['one </s> two', '<pad>', 'one <unk> two', '<s>one</s>', 'x</s>y']:
    ids = theirs(text)['input_ids']
    assert ids == [int(order[i]) for i in tokenizer.encode([text])[0]] + [theirs.eos_token_id]
    assert not special & set(ids[:-1]) and theirs.unk_token_id not in ids, (text, ids)
    assert theirs.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize('name', ['toy', 'multi30k'])
def test_ctranslate2_converts_the_export_and_decodes_our_greedy_strings(
  runs, exported, name, tmp_path
):
  _, transformers = _transformers()
  ctranslate2 = pytest.importorskip(
    'ctranslate2', reason='needs ctranslate2: pip install -e .[pretrained-test]'
  )
  workdir, sentences = runs[name]
  directory = exported(workdir)
  converted = ctranslate2.converters.TransformersConverter(str(directory)).convert(
    str(tmp_path / 'ct2')
  )
  tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  translator = ctranslate2.Translator(converted, device='cpu')
  config, params, run_tokenizer = load_for_inference(workdir)
  strings = []
  for sentence in sentences:
    source = tokenizer.convert_ids_to_tokens(tokenizer.encode(sentence))  # EOS last
    (result,) = translator.translate_batch(
      [source], beam_size=1, max_decoding_length=_budget(len(source), config)
    )
    strings.append(
      tokenizer.decode(
        tokenizer.convert_tokens_to_ids(result.hypotheses[0]), skip_special_tokens=True
      )
    )
  assert strings == Translator(config, params, run_tokenizer).translate(sentences, Greedy())


def test_separate_embeddings_and_a_logits_bias_export_too(tmp_path):
  """A model without shared embeddings (and with a logits bias, as a fine-tuned Marian has)
  exports with separate encoder, decoder and output tables; transformers and our loader
  compute its logits."""
  # Their LayerNorm epsilon: random weights make LayerNorm inputs large, and what is compared
  # here is the mapping.
  workdir = _random_run(
    tmp_path / 'run', share_embeddings=False, logits_bias=True, layer_norm_epsilon=1e-5
  )
  output = tmp_path / 'out'
  status, _, err = call(export_cli.main, [workdir, '--to', output])
  assert status == 0, err
  config, params, tokenizer = load_for_inference(workdir)
  src, tgt_in = _pad([[5, 9, 12, 2], [7, 2]], 0), _pad([[1, 6, 13], [1, 19]], 0)
  ours = np.asarray(Transformer(config).apply({'params': params}, src, tgt_in))
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  marian_config, marian_params, _ = load_marian(output)
  exported_in = order[tgt_in]
  exported_in[:, 0] = marian_config.bos_id
  allowed = _allowed(config)
  back = np.asarray(
    Transformer(marian_config).apply({'params': marian_params}, order[src], exported_in)
  )[..., order]
  mask = np.array([[1, 1, 1], [1, 1, 0]], bool)  # positions the targets hold
  np.testing.assert_allclose(
    back[mask][:, allowed], ours[mask][:, allowed], rtol=0, atol=1e-5 * np.abs(ours).max()
  )
  torch, transformers = _transformers()
  model = transformers.MarianMTModel.from_pretrained(output).eval()
  assert not model.config.share_encoder_decoder_embeddings
  with torch.no_grad():
    theirs = model(
      input_ids=torch.tensor(order[src]),
      attention_mask=torch.tensor(src != 0),
      decoder_input_ids=torch.tensor(exported_in),
    ).logits.numpy()[..., order]
  np.testing.assert_allclose(
    theirs[mask][:, allowed], ours[mask][:, allowed], rtol=0, atol=1e-5 * np.abs(ours).max()
  )


def test_a_run_fine_tuned_from_an_opus_mt_model_exports_with_its_sentencepiece_files(tmp_path):
  """A run made by train.py --init-from a Marian directory exports as a Marian directory with
  source.spm, target.spm and vocab.json: transformers' MarianTokenizer and model, and
  CTranslate2, give our greedy strings."""
  torch, transformers = _transformers()
  pytest.importorskip('sentencepiece', reason='needs sentencepiece: pip install -e .[pretrained]')
  ctranslate2 = pytest.importorskip(
    'ctranslate2', reason="needs ctranslate2: pip install -e '.[pretrained-test]'"
  )
  from support.marian_directory import SAMPLE_TEXT, make_marian_directory

  marian = make_marian_directory(tmp_path / 'opus-mt')
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[0::2]))
  (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in SAMPLE_TEXT[1::2]))
  workdir, output = tmp_path / 'run', tmp_path / 'export'
  status, _, err = call(
    train_cli.main,
    [
      '--init-from',
      marian,
      '--data',
      corpus,
      '--workdir',
      workdir,
      '--steps',
      2,
      '--train.max_tokens=256',
      '--train.warmup_steps=2',
      '--model.dropout_rate=0',
    ],
  )
  assert status == 0, err
  status, _, err = call(export_cli.main, [workdir, '--to', output])
  assert status == 0, err
  assert {'source.spm', 'target.spm', 'vocab.json'} <= {p.name for p in output.iterdir()}
  sentences = SAMPLE_TEXT[0::2][:6]
  config, params, tokenizer = load_for_inference(workdir)
  greedy = Translator(config, params, tokenizer).translate(sentences, Greedy(max_len=12))
  theirs_tokenizer = transformers.AutoTokenizer.from_pretrained(output)
  assert type(theirs_tokenizer).__name__ == 'MarianTokenizer'
  model = transformers.MarianMTModel.from_pretrained(output).eval()
  with torch.no_grad():
    generated = model.generate(
      **theirs_tokenizer(sentences, return_tensors='pt', padding=True), max_new_tokens=12
    )
  assert theirs_tokenizer.batch_decode(generated, skip_special_tokens=True) == greedy
  translator = ctranslate2.Translator(
    ctranslate2.converters.TransformersConverter(str(output)).convert(str(tmp_path / 'ct2')),
    device='cpu',
  )
  results = translator.translate_batch(
    [theirs_tokenizer.convert_ids_to_tokens(theirs_tokenizer.encode(s)) for s in sentences],
    beam_size=1,
    max_decoding_length=12,
  )
  assert [theirs_tokenizer.convert_tokens_to_string(r.hypotheses[0]) for r in results] == greedy


def test_fine_tuning_an_export_is_refused_pointing_to_its_run(toy_run, exported, tmp_path):
  status, _, err = call(
    train_cli.main, ['--init-from', exported(toy_run), '--workdir', tmp_path / 'ft']
  )
  assert status == 2 and 'an export of a flax_transformer run' in err
  assert not (tmp_path / 'ft').exists()


def test_an_odd_width_is_refused_naming_it():
  config = ModelConfig.tiny(d_model=33, num_heads=3)
  with pytest.raises(export.ExportError, match=r'^cannot export model.d_model=33: an odd width'):
    export.check_exportable(config)
  export.check_exportable(ModelConfig.tiny())  # the paper's kind of model passes
