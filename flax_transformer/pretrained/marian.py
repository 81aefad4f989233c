"""Pretrained Marian (OPUS-MT) translation models from a local Hugging Face directory.

    config, params, tokenizer = load_marian('opus-mt-en-de')    # huggingface-cli download ...
    Translator(config, params, tokenizer).translate(['The cat sat on the mat.'])

A Marian directory holds config.json, model.safetensors and the tokenizer:
source.spm and target.spm (sentencepiece models) and vocab.json (piece -> id,
one vocabulary for both sides). Marian is the paper's post-LN Transformer with
these differences, each a `ModelConfig` option: SiLU ('swish') feed-forward
activation, a positional table with every sine before every cosine, a bias on
the output logits (final_logits_bias), LayerNorm epsilon 1e-5, and a decoder
that starts from PAD (bos_id = pad_id). Its key projections have a bias, which
is dropped: it adds q . b to a whole row of attention logits, which the softmax
cancels. The weights are read with `safetensors.numpy` (no torch, no pickle);
what cannot map is refused, naming the config field.

Needs `pip install -e .[pretrained]` (sentencepiece, safetensors), imported
only when a Marian directory is read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.data.tokenizer import TokenizerError, check_compatible

TOKENIZER_FILES = ('source.spm', 'target.spm', 'vocab.json')
WEIGHTS_FILE = 'model.safetensors'
# transformers' activation names -> ours ('gelu' there is the exact erf form; ours is tanh's).
ACTIVATIONS = {'swish': 'silu', 'silu': 'silu', 'relu': 'relu', 'gelu_new': 'gelu',
               'gelu_pytorch_tanh': 'gelu'}
# config.json fields whose other values our model has no counterpart for: field -> the value it needs.
REQUIRED = {'model_type': 'marian', 'normalize_before': False, 'add_final_layer_norm': False,
            'normalize_embedding': False, 'scale_embedding': True,
            'static_position_embeddings': True, 'separate_vocabs': False,
            'activation_dropout': 0.0, 'encoder_layerdrop': 0.0, 'decoder_layerdrop': 0.0}


class PretrainedError(ConfigError):
  """A directory is not a Marian model this library can load; the message says why.

  A ConfigError: the programs report it as they report a bad setting, in one line.
  """


def _import_optional(module: str):
  """Imports an optional dependency or says how to install it."""
  try:
    return __import__(module)
  except ImportError:
    raise PretrainedError(f'reading a Marian directory needs {module}: '
                          'pip install -e .[pretrained]') from None


def is_marian_directory(directory: str | Path) -> bool:
  """Whether `directory` holds a Hugging Face model: a config.json with a model_type (a run
  directory's config.json, even a fine-tuned Marian's, has sections model/train/data)."""
  path = Path(directory) / 'config.json'
  try:
    return 'model_type' in json.loads(path.read_text())
  except (OSError, ValueError):
    return False


class MarianTokenizer:
  """Marian's tokenizer: sentencepiece pieces (source.spm / target.spm) -> ids of vocab.json.

  The interface of `tokenizer.Tokenizer`: pad_id, bos_id (= pad_id: the decoder
  starts from PAD), eos_id, unk_id, vocab_size, encode (source side),
  encode_target, decode (target side), id_to_token, check_compatible, save.
  A piece missing from vocab.json becomes <unk>. Unlike transformers'
  MarianTokenizer, the text is not Moses-punctuation-normalised first
  (transformers does that only when sacremoses is installed).
  """

  FILES = TOKENIZER_FILES

  @classmethod
  def load(cls, directory: str | Path) -> MarianTokenizer:
    """Reads `FILES` from `directory` (as `Tokenizer.load` reads tokenizer.json)."""
    return cls(directory)

  def __init__(self, directory: str | Path):
    spm = _import_optional('sentencepiece')
    directory = Path(directory)
    for name in TOKENIZER_FILES:
      if not (directory / name).is_file():
        raise TokenizerError(f'{directory / name}: no such file; a Marian tokenizer needs '
                             f'{", ".join(TOKENIZER_FILES)}')
    self.directory = directory
    self._source = spm.SentencePieceProcessor(model_file=str(directory / 'source.spm'))
    self._target = spm.SentencePieceProcessor(model_file=str(directory / 'target.spm'))
    self._vocab = json.loads((directory / 'vocab.json').read_text(encoding='utf-8'))
    for token in ('</s>', '<unk>', '<pad>'):
      if token not in self._vocab:
        raise TokenizerError(f'{directory / "vocab.json"} has no {token} entry')
    self._pieces = {index: piece for piece, index in self._vocab.items()}
    self.pad_id = self.bos_id = self._vocab['<pad>']
    self.eos_id, self.unk_id = self._vocab['</s>'], self._vocab['<unk>']

  @property
  def vocab_size(self) -> int:
    return max(self._pieces) + 1

  def _encode(self, processor, texts: Sequence[str]) -> list[list[int]]:
    if isinstance(texts, str):
      raise TypeError('encode takes a sequence of texts; wrap a single one as [text]')
    rows = []
    for text in texts:
      # A leading '>>xx<<' language code is a token of its own (multilingual models).
      code = []
      if text.startswith('>>') and (end := text.find('<<')) != -1:
        code, text = [text[:end + 2]], text[end + 2:]
      pieces = code + processor.encode(text, out_type=str)
      rows.append([self._vocab.get(piece, self.unk_id) for piece in pieces])
    return rows

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Source-side ids per text (source.spm), without EOS."""
    return self._encode(self._source, texts)

  def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
    """Target-side ids per text (target.spm), without EOS: training targets."""
    return self._encode(self._target, texts)

  def decode(self, ids) -> list[str]:
    """Texts from rows of target ids: each row ends at its first EOS; PAD is dropped; <unk> shows."""
    texts = []
    for row in ids:
      row = [int(token) for token in row]
      if self.eos_id in row:
        row = row[:row.index(self.eos_id)]
      bad = [token for token in row if token not in self._pieces]
      if bad:
        raise TokenizerError(f'cannot decode ids {bad[:5]}: not in vocab.json')
      words, pieces = [], []
      for token in row:
        if token == self.unk_id:
          words += [self._target.decode_pieces(pieces), '<unk>']
          pieces = []
        elif token != self.pad_id:
          pieces.append(self._pieces[token])
      texts.append(' '.join(w for w in words + [self._target.decode_pieces(pieces)] if w))
    # As transformers: a piece the sentencepiece model lacks keeps its '▁', which becomes a space.
    return [' '.join(text.replace('▁', ' ').split()) for text in texts]

  def id_to_token(self, token_id: int) -> str:
    return self._pieces[int(token_id)]

  def check_compatible(self, config: ModelConfig) -> None:
    """Raises ConfigError unless the model's vocabulary and special ids match this tokenizer."""
    check_compatible(self, config, f'the Marian tokenizer in {self.directory}')

  def save(self, directory: str | Path) -> Path:
    """Copies source.spm, target.spm and vocab.json into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
      if (self.directory / name).resolve() != (directory / name).resolve():
        shutil.copyfile(self.directory / name, directory / name)
    return directory


def marian_config(hf: dict, vocab_size: int | None = None) -> ModelConfig:
  """Our `ModelConfig` for a Marian config.json, or PretrainedError naming the field that cannot map."""
  for field, needed in REQUIRED.items():
    if field in hf and hf[field] != needed:
      raise PretrainedError(f'config.json: {field}={json.dumps(hf[field])} is not supported '
                            f'(this library maps only {field}={json.dumps(needed)})')
  pairs = [('encoder_attention_heads', 'decoder_attention_heads'),
           ('encoder_ffn_dim', 'decoder_ffn_dim')]
  for encoder_field, decoder_field in pairs:
    if hf[encoder_field] != hf[decoder_field]:
      raise PretrainedError(f'config.json: {encoder_field}={hf[encoder_field]} differs from '
                            f'{decoder_field}={hf[decoder_field]}; both sides must match here')
  if hf.get('decoder_vocab_size') not in (None, hf['vocab_size']):
    raise PretrainedError(f'config.json: decoder_vocab_size={hf["decoder_vocab_size"]} differs '
                          f'from vocab_size={hf["vocab_size"]} (separate vocabularies are not '
                          'supported)')
  activation = hf.get('activation_function', 'gelu')
  if activation not in ACTIVATIONS:
    raise PretrainedError(f'config.json: activation_function={activation!r} is not supported '
                          f'(one of {", ".join(ACTIVATIONS)})')
  if hf.get('decoder_start_token_id') != hf['pad_token_id']:
    raise PretrainedError(f'config.json: decoder_start_token_id={hf.get("decoder_start_token_id")}'
                          f' must equal pad_token_id={hf["pad_token_id"]}')
  if vocab_size is not None and vocab_size != hf['vocab_size']:
    raise PretrainedError(f'config.json: vocab_size={hf["vocab_size"]} but vocab.json has '
                          f'{vocab_size} entries')
  shared = (hf.get('share_encoder_decoder_embeddings', True)
            and hf.get('tie_word_embeddings', True))
  return ModelConfig(
      vocab_size=hf['vocab_size'], d_model=hf['d_model'], num_heads=hf['encoder_attention_heads'],
      num_encoder_layers=hf['encoder_layers'], num_decoder_layers=hf['decoder_layers'],
      d_ff=hf['encoder_ffn_dim'], dropout_rate=hf.get('dropout', 0.1),
      attention_dropout_rate=hf.get('attention_dropout', 0.0),
      max_len=hf['max_position_embeddings'], activation=ACTIVATIONS[activation],
      share_embeddings=bool(shared), positions='concatenated', logits_bias=True,
      layer_norm_epsilon=1e-5, pad_id=hf['pad_token_id'], bos_id=hf['pad_token_id'],
      eos_id=_single(hf, 'eos_token_id'), unk_id=hf.get('unk_token_id', 1))


def _single(hf: dict, field: str) -> int:
  value = hf.get(field)
  if isinstance(value, list) and len(value) == 1:
    value = value[0]
  if not isinstance(value, int):
    raise PretrainedError(f'config.json: {field}={json.dumps(value)} must be one token id')
  return value


def _read_weights(directory: Path) -> dict[str, np.ndarray]:
  """model.safetensors as numpy arrays, names without transformers' 'model.' prefix."""
  path = directory / WEIGHTS_FILE
  if not path.is_file():
    if (directory / 'pytorch_model.bin').is_file():
      raise PretrainedError(
          f'{directory / "pytorch_model.bin"}: PyTorch pickles are not read (unpickling runs '
          'code); convert it once to safetensors: python -c "from transformers import '
          f"MarianMTModel; MarianMTModel.from_pretrained('{directory}')"
          f".save_pretrained('{directory}', safe_serialization=True)\"")
    raise PretrainedError(f'{path}: no such file; a Marian directory holds config.json, '
                          f'{WEIGHTS_FILE}, {", ".join(TOKENIZER_FILES)}')
  _import_optional('safetensors')
  from safetensors.numpy import load_file
  weights = load_file(str(path))
  return {name.removeprefix('model.'): value.astype(np.float32) for name, value in weights.items()}


def _linear(weights: dict, name: str, bias: bool = True) -> dict:
  """A torch Linear (weight `[out, in]`) as our Dense: kernel `[in, out]`, bias."""
  params = {'kernel': weights[f'{name}.weight'].T}
  if bias:
    params['bias'] = weights[f'{name}.bias']
  return params


def _attention(weights: dict, name: str) -> dict:
  # No key bias here: the softmax cancels it (see the module docstring).
  return {'query': _linear(weights, f'{name}.q_proj'), 'key': _linear(weights, f'{name}.k_proj', False),
          'value': _linear(weights, f'{name}.v_proj'), 'out': _linear(weights, f'{name}.out_proj')}


def _norm(weights: dict, name: str) -> dict:
  return {'norm': {'scale': weights[f'{name}.weight'], 'bias': weights[f'{name}.bias']}}


def _layers(weights: dict, config: ModelConfig) -> dict:
  """The encoder and decoder stacks' parameters in our tree."""
  ffn = lambda prefix: {'wi': _linear(weights, f'{prefix}.fc1'), 'wo': _linear(weights, f'{prefix}.fc2')}
  encoder, decoder = {}, {}
  for i in range(config.num_encoder_layers):
    p = f'encoder.layers.{i}'
    encoder[f'layer_{i}'] = {
        'self_attention': _attention(weights, f'{p}.self_attn'),
        'self_attention_sublayer': _norm(weights, f'{p}.self_attn_layer_norm'),
        'ffn': ffn(p), 'ffn_sublayer': _norm(weights, f'{p}.final_layer_norm')}
  for i in range(config.num_decoder_layers):
    p = f'decoder.layers.{i}'
    decoder[f'layer_{i}'] = {
        'self_attention': _attention(weights, f'{p}.self_attn'),
        'self_attention_sublayer': _norm(weights, f'{p}.self_attn_layer_norm'),
        'cross_attention': _attention(weights, f'{p}.encoder_attn'),
        'cross_attention_sublayer': _norm(weights, f'{p}.encoder_attn_layer_norm'),
        'ffn': ffn(p), 'ffn_sublayer': _norm(weights, f'{p}.final_layer_norm')}
  return {'encoder': encoder, 'decoder': decoder}


def _embeddings(weights: dict, config: ModelConfig) -> dict:
  """The token tables (and, unshared, the output projection) in our tree."""
  pick = lambda *names: next((weights[n] for n in names if n in weights), None)
  source = pick('shared.weight', 'encoder.embed_tokens.weight')
  target = pick('decoder.embed_tokens.weight', 'shared.weight')
  if source is None or target is None:
    raise PretrainedError(f'{WEIGHTS_FILE} has no token embeddings (shared.weight or '
                          'encoder/decoder.embed_tokens.weight)')
  if config.share_embeddings:
    return {'embedding': {'embedding': source}}
  output = pick('lm_head.weight', 'decoder.embed_tokens.weight', 'shared.weight')
  return {'source_embedding': {'embedding': pick('encoder.embed_tokens.weight', 'shared.weight')},
          'target_embedding': {'embedding': target}, 'output_projection': {'kernel': output.T}}


def _check_positions(weights: dict, config: ModelConfig) -> None:
  """Refuses a checkpoint whose stored positional table is not the sinusoids we compute."""
  from flax_transformer.nn.layers import sinusoidal_positions
  expected = np.asarray(sinusoidal_positions(config.max_len, config.d_model, config.positions))
  for side in ('encoder', 'decoder'):
    stored = weights.get(f'{side}.embed_positions.weight')
    if stored is not None and not np.allclose(stored, expected, atol=1e-4):
      raise PretrainedError(f'{WEIGHTS_FILE}: {side}.embed_positions.weight is not the '
                            'sinusoidal table (sines, then cosines) this library computes')


def marian_params(weights: dict[str, np.ndarray], config: ModelConfig) -> dict:
  """Our parameter tree from transformers' Marian weights (names without 'model.')."""
  _check_positions(weights, config)
  try:
    params = {**_embeddings(weights, config), **_layers(weights, config),
              'logits_bias': weights['final_logits_bias'].reshape(-1)}
  except KeyError as error:
    raise PretrainedError(f'{WEIGHTS_FILE} has no tensor {error.args[0]!r}; is it a '
                          'MarianMTModel saved by transformers?') from None
  return params


def load_marian(directory: str | Path) -> tuple[ModelConfig, dict, MarianTokenizer]:
  """(ModelConfig, params, MarianTokenizer) of a Hugging Face Marian directory.

  The parameters are float32 numpy arrays in our tree, checked against the
  shapes the config's model has.
  """
  directory = Path(directory)
  if not (directory / 'config.json').is_file():
    raise PretrainedError(f'{directory / "config.json"}: no such file; is {directory} a '
                          'Hugging Face Marian directory?')
  hf = json.loads((directory / 'config.json').read_text())
  tokenizer = MarianTokenizer(directory)
  config = marian_config(hf, tokenizer.vocab_size)
  params = marian_params(_read_weights(directory), config)
  _check_shapes(params, config)
  return config, params, tokenizer


def _check_shapes(params: dict, config: ModelConfig) -> None:
  import jax

  from flax_transformer.nn.build import abstract_params
  expected = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
  actual = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, shape in expected:
    if path not in actual or actual[path].shape != shape.shape:
      name = jax.tree_util.keystr(path)
      got = actual[path].shape if path in actual else 'missing'
      raise PretrainedError(f'{WEIGHTS_FILE}: parameter {name} should be {shape.shape}, got {got}')


# Model settings a fine-tuning run may change: how it trains, not what it computes.
FINE_TUNING_CHANGES = frozenset({'dropout_rate', 'attention_dropout_rate', 'dtype'})


def fine_tuning_config(directory: str | Path, overrides: dict[str, str]) -> ModelConfig:
  """The Marian model's config with train.py's `--model.NAME=VALUE` overrides applied.

  An override of another setting is refused unless it repeats the model's value:
  the architecture and the vocabulary come from the checkpoint.
  """
  from flax_transformer.config import parse_overrides
  directory = Path(directory)
  if not is_marian_directory(directory):
    raise PretrainedError(f'--init-from {directory}: not a Hugging Face Marian directory (it '
                          'needs config.json with a model_type, model.safetensors, source.spm, '
                          'target.spm, vocab.json)')
  pretrained = marian_config(json.loads((directory / 'config.json').read_text()))
  config = parse_overrides(pretrained, 'model', overrides)
  for name in overrides:
    if name not in FINE_TUNING_CHANGES and getattr(config, name) != getattr(pretrained, name):
      raise ConfigError(f'--model.{name}={overrides[name]} contradicts the model in {directory} '
                        f'({name}={getattr(pretrained, name)}); fine-tuning takes the '
                        f'architecture from --init-from (it may change '
                        f'{", ".join(sorted(FINE_TUNING_CHANGES))})')
  return config
