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

Faults are PretrainedError (a ConfigError: the programs' status 2), each naming
the file: a config.json field missing, null, of the wrong type or absurd
(`NEEDED_FIELDS`), checked with the memory estimate before anything is
allocated; a weights file truncated or with a damaged header (checked before it
is read), missing tensors or wrong shapes; a tokenizer file that cannot be read.

Needs `pip install -e .[pretrained]` (sentencepiece, safetensors), imported
only when a Marian directory is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from flax_transformer.config import (
  NONNEGATIVE_INT,
  UNIT_INTERVAL,
  Bounds,
  ConfigError,
  ModelConfig,
  check_bounds,
)
from flax_transformer.errors import PretrainedError, TokenizerError
from flax_transformer.files import read_json_object
from flax_transformer.tokenizer import load as load_tokenizer
from flax_transformer.tokenizer.marian import TOKENIZER_FILES, MarianTokenizer, import_optional

WEIGHTS_FILE = 'model.safetensors'
# transformers' activation names -> ours ('gelu' there is the exact erf form; ours is tanh's).
ACTIVATIONS = {
  'swish': 'silu',
  'silu': 'silu',
  'relu': 'relu',
  'gelu_new': 'gelu',
  'gelu_pytorch_tanh': 'gelu',
}
# config.json fields whose other values our model has no counterpart for: field -> the value it needs.
REQUIRED = {
  'model_type': 'marian',
  'normalize_before': False,
  'add_final_layer_norm': False,
  'normalize_embedding': False,
  'scale_embedding': True,
  'static_position_embeddings': True,
  'separate_vocabs': False,
  'activation_dropout': 0.0,
  'encoder_layerdrop': 0.0,
  'decoder_layerdrop': 0.0,
}
# config.json's numeric fields and the values each admits. The upper limits lie far beyond any
# translation model, so that a slip (max_position_embeddings 1e9, a million layers) is named
# here; the memory estimate (`load_marian`'s check_config) judges what is within them.
_LAYERS, _WIDTH = Bounds(low=1, high=1024, integer=True), Bounds(low=1, high=2**16, integer=True)
NEEDED_FIELDS = {
  'vocab_size': Bounds(low=1, high=2**24, integer=True),
  'd_model': _WIDTH,
  'encoder_layers': _LAYERS,
  'decoder_layers': _LAYERS,
  'encoder_attention_heads': _WIDTH,
  'decoder_attention_heads': _WIDTH,
  'encoder_ffn_dim': Bounds(low=1, high=2**18, integer=True),
  'decoder_ffn_dim': Bounds(low=1, high=2**18, integer=True),
  'max_position_embeddings': Bounds(low=1, high=2**20, integer=True),
  'pad_token_id': NONNEGATIVE_INT,
  'decoder_start_token_id': NONNEGATIVE_INT,
}
# layer_norm_eps: not transformers' (it fixes 1e-5); `pretrained.export` records the model's own.
OPTIONAL_FIELDS = {
  'dropout': UNIT_INTERVAL,
  'attention_dropout': UNIT_INTERVAL,
  'unk_token_id': NONNEGATIVE_INT,
  'layer_norm_eps': Bounds(low=0, high=1, low_open=True),
}
# Written as true/false when present.
FLAG_FIELDS = ('share_encoder_decoder_embeddings', 'tie_word_embeddings')


def is_marian_directory(directory: str | Path) -> bool:
  """Whether `directory` holds a Hugging Face model: a config.json with a model_type (a run
  directory's config.json, even a fine-tuned Marian's, has sections model/train/data), or a
  model.safetensors (so that a damaged config.json beside one is reported as a Marian's)."""
  directory = Path(directory)
  if (directory / WEIGHTS_FILE).is_file():
    return True
  try:
    return 'model_type' in json.loads((directory / 'config.json').read_text())
  except (OSError, ValueError, TypeError):
    return False


def read_marian_config(directory: str | Path) -> ModelConfig:
  """The `ModelConfig` of DIRECTORY/config.json, each field checked before anything is built.

  A missing file, text that is not a JSON object, a missing or null field, a value of the
  wrong type or outside `NEEDED_FIELDS`' bounds: PretrainedError naming the file, the field
  and the value.
  """
  path = Path(directory) / 'config.json'
  if not path.is_file():
    raise PretrainedError(
      f'{path}: no such file; is {path.parent} a Hugging Face Marian directory?'
    )
  return marian_config(read_json_object(path, PretrainedError), where=str(path))


def _check_config_fields(hf: dict, where: str) -> None:
  """Refuses a missing, null, mistyped or absurd field of a config.json, naming it."""
  for field, bounds in NEEDED_FIELDS.items():
    if field not in hf:
      raise PretrainedError(
        f'{where}: no field {field}; a Marian config.json gives it ({bounds.describe()})'
      )
  for field, bounds in {**NEEDED_FIELDS, **OPTIONAL_FIELDS}.items():
    if field in hf:
      check_bounds(hf[field], bounds, f'{where}: {field}', PretrainedError)
  for field in FLAG_FIELDS:
    if field in hf and not isinstance(hf[field], bool):
      raise PretrainedError(f'{where}: {field} must be true or false, got {json.dumps(hf[field])}')
  activation = hf.get('activation_function', 'gelu')
  if not isinstance(activation, str) or activation not in ACTIVATIONS:
    raise PretrainedError(
      f'{where}: activation_function={json.dumps(activation)} is not '
      f'supported (one of {", ".join(ACTIVATIONS)})'
    )
  if hf['d_model'] % hf['encoder_attention_heads']:
    raise PretrainedError(
      f'{where}: d_model={hf["d_model"]} is not divisible by '
      f'encoder_attention_heads={hf["encoder_attention_heads"]}'
    )
  for field in ('pad_token_id', 'eos_token_id', 'unk_token_id'):
    if isinstance(hf.get(field), int) and hf[field] >= hf['vocab_size']:
      raise PretrainedError(
        f'{where}: {field}={hf[field]} is outside the vocabulary (vocab_size={hf["vocab_size"]})'
      )


def marian_config(hf: dict, where: str = 'config.json') -> ModelConfig:
  """Our `ModelConfig` for a Marian config.json, or PretrainedError naming the field that is
  missing, mistyped or absurd (`where`: the file, for the messages), or cannot map."""
  _check_config_fields(hf, where)
  for field, needed in REQUIRED.items():
    if field in hf and hf[field] != needed:
      raise PretrainedError(
        f'{where}: {field}={json.dumps(hf[field])} is not supported '
        f'(this library maps only {field}={json.dumps(needed)})'
      )
  pairs = [
    ('encoder_attention_heads', 'decoder_attention_heads'),
    ('encoder_ffn_dim', 'decoder_ffn_dim'),
  ]
  for encoder_field, decoder_field in pairs:
    if hf[encoder_field] != hf[decoder_field]:
      raise PretrainedError(
        f'{where}: {encoder_field}={hf[encoder_field]} differs from '
        f'{decoder_field}={hf[decoder_field]}; both sides must match here'
      )
  if hf.get('decoder_vocab_size') not in (None, hf['vocab_size']):
    raise PretrainedError(
      f'{where}: decoder_vocab_size={json.dumps(hf["decoder_vocab_size"])} '
      f'differs from vocab_size={hf["vocab_size"]} (separate vocabularies '
      'are not supported)'
    )
  if hf['decoder_start_token_id'] != hf['pad_token_id']:
    raise PretrainedError(
      f'{where}: decoder_start_token_id={hf["decoder_start_token_id"]}'
      f' must equal pad_token_id={hf["pad_token_id"]}'
    )
  shared = hf.get('share_encoder_decoder_embeddings', True) and hf.get('tie_word_embeddings', True)
  try:
    return ModelConfig(
      vocab_size=hf['vocab_size'],
      d_model=hf['d_model'],
      num_heads=hf['encoder_attention_heads'],
      num_encoder_layers=hf['encoder_layers'],
      num_decoder_layers=hf['decoder_layers'],
      d_ff=hf['encoder_ffn_dim'],
      dropout_rate=hf.get('dropout', 0.1),
      attention_dropout_rate=hf.get('attention_dropout', 0.0),
      max_len=hf['max_position_embeddings'],
      activation=ACTIVATIONS[hf.get('activation_function', 'gelu')],
      share_embeddings=bool(shared),
      positions='concatenated',
      logits_bias=True,
      layer_norm_epsilon=hf.get('layer_norm_eps', 1e-5),
      pad_id=hf['pad_token_id'],
      bos_id=hf['pad_token_id'],
      eos_id=_single(hf, 'eos_token_id', where),
      unk_id=hf.get('unk_token_id', 1),
    )
  except PretrainedError:
    raise
  except ConfigError as error:  # e.g. special ids that coincide: named in our settings' terms
    raise PretrainedError(f'{where}: {error}') from None


def _single(hf: dict, field: str, where: str) -> int:
  value = hf.get(field)
  if isinstance(value, list) and len(value) == 1:
    value = value[0]
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise PretrainedError(f'{where}: {field}={json.dumps(value)} must be one token id')
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
        f".save_pretrained('{directory}', safe_serialization=True)\""
      )
    raise PretrainedError(
      f'{path}: no such file; a Marian directory holds config.json, '
      f'{WEIGHTS_FILE}, {", ".join(TOKENIZER_FILES)}'
    )
  _check_safetensors(path)
  safetensors = import_optional('safetensors')
  from safetensors.numpy import load_file

  try:
    weights = load_file(str(path))
  except (safetensors.SafetensorError, OSError, ValueError, TypeError) as error:
    raise PretrainedError(f'{path}: damaged, not readable as safetensors ({error})') from None
  return {name.removeprefix('model.'): value.astype(np.float32) for name, value in weights.items()}


# The safetensors format caps its JSON header (the names, dtypes, shapes and offsets) at 100 MB.
_MAX_HEADER = 100_000_000


def _check_safetensors(path: Path) -> None:
  """Refuses a safetensors file whose header is damaged or whose tensors end past its end
  (a truncated download), naming it, before anything is read into memory.

  The format: an 8-byte little-endian header length N, N bytes of JSON
  {name: {dtype, shape, data_offsets: [begin, end]}}, then the data.
  """
  try:
    size = path.stat().st_size
    with path.open('rb') as file:
      head = file.read(8)
      length = int.from_bytes(head, 'little')
      fits = len(head) == 8 and length <= min(size - 8, _MAX_HEADER)
      header = json.loads(file.read(length)) if fits else None
  except OSError as error:
    raise PretrainedError(f'{path}: cannot be read ({error.strerror or error})') from None
  except ValueError as error:
    raise PretrainedError(f'{path}: damaged: its header is not JSON ({error})') from None
  if not fits:
    raise PretrainedError(
      f'{path}: damaged: its header length field says {length:,} bytes, but '
      f'{max(size - 8, 0):,} follow it (a safetensors header has at most {_MAX_HEADER:,}); '
      'the file is truncated or not a safetensors file'
    )
  if not isinstance(header, dict):
    raise PretrainedError(f'{path}: damaged: its header is not a JSON object')
  data = size - 8 - length
  for name, entry in header.items():
    if name == '__metadata__':
      continue
    offsets = entry.get('data_offsets') if isinstance(entry, dict) else None
    if not (
      isinstance(offsets, list)
      and len(offsets) == 2
      and all(NONNEGATIVE_INT.admits(offset) for offset in offsets)
    ):
      raise PretrainedError(
        f'{path}: damaged: tensor {name} has no valid data_offsets ({json.dumps(entry)[:100]})'
      )
    if offsets[1] > data:
      raise PretrainedError(
        f'{path}: truncated: tensor {name} ends at byte {offsets[1]:,} of the '
        f'data, which has {data:,} bytes; download the file again'
      )


def _linear(weights: dict, name: str, bias: bool = True) -> dict:
  """A torch Linear (weight `[out, in]`) as our Dense: kernel `[in, out]`, bias."""
  params = {'kernel': weights[f'{name}.weight'].T}
  if bias:
    params['bias'] = weights[f'{name}.bias']
  return params


def _attention(weights: dict, name: str) -> dict:
  # No key bias here: the softmax cancels it (see the module docstring).
  return {
    'query': _linear(weights, f'{name}.q_proj'),
    'key': _linear(weights, f'{name}.k_proj', False),
    'value': _linear(weights, f'{name}.v_proj'),
    'out': _linear(weights, f'{name}.out_proj'),
  }


def _norm(weights: dict, name: str) -> dict:
  return {'norm': {'scale': weights[f'{name}.weight'], 'bias': weights[f'{name}.bias']}}


def _layers(weights: dict, config: ModelConfig) -> dict:
  """The encoder and decoder stacks' parameters in our tree."""
  ffn = lambda prefix: {
    'wi': _linear(weights, f'{prefix}.fc1'),
    'wo': _linear(weights, f'{prefix}.fc2'),
  }
  encoder, decoder = {}, {}
  for i in range(config.num_encoder_layers):
    p = f'encoder.layers.{i}'
    encoder[f'layer_{i}'] = {
      'self_attention': _attention(weights, f'{p}.self_attn'),
      'self_attention_sublayer': _norm(weights, f'{p}.self_attn_layer_norm'),
      'ffn': ffn(p),
      'ffn_sublayer': _norm(weights, f'{p}.final_layer_norm'),
    }
  for i in range(config.num_decoder_layers):
    p = f'decoder.layers.{i}'
    decoder[f'layer_{i}'] = {
      'self_attention': _attention(weights, f'{p}.self_attn'),
      'self_attention_sublayer': _norm(weights, f'{p}.self_attn_layer_norm'),
      'cross_attention': _attention(weights, f'{p}.encoder_attn'),
      'cross_attention_sublayer': _norm(weights, f'{p}.encoder_attn_layer_norm'),
      'ffn': ffn(p),
      'ffn_sublayer': _norm(weights, f'{p}.final_layer_norm'),
    }
  return {'encoder': encoder, 'decoder': decoder}


def _embeddings(weights: dict, config: ModelConfig, where: str) -> dict:
  """The token tables (and, unshared, the output projection) in our tree."""
  pick = lambda *names: next((weights[n] for n in names if n in weights), None)
  source = pick('shared.weight', 'encoder.embed_tokens.weight')
  target = pick('decoder.embed_tokens.weight', 'shared.weight')
  if source is None or target is None:
    raise PretrainedError(
      f'{where} has no token embeddings (shared.weight or encoder/decoder.embed_tokens.weight)'
    )
  if config.share_embeddings:
    return {'embedding': {'embedding': source}}
  output = pick('lm_head.weight', 'decoder.embed_tokens.weight', 'shared.weight')
  return {
    'source_embedding': {'embedding': pick('encoder.embed_tokens.weight', 'shared.weight')},
    'target_embedding': {'embedding': target},
    'output_projection': {'kernel': output.T},
  }


def _start_offset(weights: dict, config: ModelConfig, where: str) -> np.ndarray:
  """`[D]`: what the decoder's stored position 0 adds to the sinusoid (zero in OPUS-MT models;
  an exported model's start embedding, `pretrained.export`). Refuses a checkpoint whose stored
  positional tables are otherwise not the sinusoids we compute."""
  from flax_transformer.nn.layers import sinusoidal_positions

  expected = np.asarray(sinusoidal_positions(config.max_len, config.d_model, config.positions))
  offset = np.zeros(config.d_model, np.float32)
  for side in ('encoder', 'decoder'):
    name = f'{side}.embed_positions.weight'
    stored = weights.get(name)
    if stored is None:
      continue
    if stored.shape != expected.shape:
      raise PretrainedError(
        f'{where}: tensor {name} should be {expected.shape} (config.json: '
        f'max_position_embeddings, d_model), got {stored.shape}'
      )
    first = 1 if side == 'decoder' else 0  # only the start token sits at decoder position 0
    if not np.allclose(stored[first:], expected[first:], atol=1e-4):
      raise PretrainedError(
        f'{where}: {name} is not the sinusoidal table (sines, then cosines) this library computes'
      )
    if side == 'decoder':
      offset = stored[0] - expected[0]
  return offset


def marian_params(
  weights: dict[str, np.ndarray], config: ModelConfig, where: str = WEIGHTS_FILE
) -> dict:
  """Our parameter tree from transformers' Marian weights (names without 'model.'), its shapes
  checked against `config`'s model; `where` names the weights file in the messages."""
  try:
    params = {
      **_embeddings(weights, config, where),
      **_layers(weights, config),
      'logits_bias': weights['final_logits_bias'].reshape(-1),
    }
  except KeyError as error:
    raise PretrainedError(
      f'{where} has no tensor {error.args[0]!r}; is it a MarianMTModel saved by transformers?'
    ) from None
  _check_shapes(params, config, where)
  offset = _start_offset(weights, config, where)
  if np.any(offset):
    # The decoder's first input, start token * sqrt(D) + position 0, kept whole: its excess
    # over the sinusoid goes into the start token's embedding (only the decoder starts from it).
    table = params['embedding' if config.share_embeddings else 'target_embedding']
    table['embedding'] = table['embedding'].copy()
    table['embedding'][config.bos_id] += offset / np.sqrt(config.d_model)
  return params


def load_marian(
  directory: str | Path, check_config: Callable[[ModelConfig], None] | None = None
) -> tuple[ModelConfig, dict, MarianTokenizer]:
  """(ModelConfig, params, MarianTokenizer) of a Hugging Face Marian directory.

  config.json is checked field by field, then `check_config(config)` (e.g. the
  memory estimate, `run.sizes.check_fits`; its ConfigError is reported as the
  file's) before the tokenizer and the weights are read. The parameters are
  float32 numpy arrays in our tree, checked against the shapes the config's
  model has. Any fault is a PretrainedError naming the file and what is wrong.
  """
  directory = Path(directory)
  config = read_marian_config(directory)
  if check_config is not None:
    try:
      check_config(config)
    except ConfigError as error:
      raise PretrainedError(f'{directory / "config.json"}: {error}') from None
  try:
    tokenizer = load_tokenizer(directory, default=MarianTokenizer)
  except TokenizerError as error:  # a part of the pretrained directory, reported as one
    raise PretrainedError(str(error)) from None
  if tokenizer.vocab_size != config.vocab_size:
    raise PretrainedError(
      f'{directory / "config.json"}: vocab_size={config.vocab_size} but '
      f'{directory / "vocab.json"} has {tokenizer.vocab_size} entries'
    )
  params = marian_params(_read_weights(directory), config, str(directory / WEIGHTS_FILE))
  return config, params, tokenizer


def _check_shapes(params: dict, config: ModelConfig, where: str) -> None:
  import jax

  from flax_transformer.nn.build import abstract_params

  expected = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
  actual = dict(jax.tree_util.tree_flatten_with_path(params)[0])
  for path, shape in expected:
    if path not in actual or actual[path].shape != shape.shape:
      name = jax.tree_util.keystr(path)
      got = actual[path].shape if path in actual else 'missing'
      raise PretrainedError(
        f"{where}: parameter {name} should be {shape.shape} (config.json's model), got {got}"
      )


# Model settings a fine-tuning run may change: how it trains, not what it computes.
FINE_TUNING_CHANGES = frozenset(
  {'dropout_rate', 'attention_dropout_rate', 'dtype', 'remat', 'attention_kernel'}
)


def is_export(directory: str | Path) -> bool:
  """Whether DIRECTORY/config.json was written by `pretrained.export`."""
  try:
    return (
      json.loads((Path(directory) / 'config.json').read_text()).get('exported_by')
      == 'flax_transformer'
    )
  except (OSError, ValueError, AttributeError):
    return False


def fine_tuning_config(directory: str | Path, overrides: dict[str, str]) -> ModelConfig:
  """The Marian model's config with train.py's `--model.NAME=VALUE` overrides applied.

  An override of another setting is refused unless it repeats the model's value:
  the architecture and the vocabulary come from the checkpoint.
  """
  from flax_transformer.config import parse_overrides

  directory = Path(directory)
  if not is_marian_directory(directory):
    raise PretrainedError(
      f'--init-from {directory}: not a Hugging Face Marian directory (it '
      'needs config.json with a model_type, model.safetensors, source.spm, '
      'target.spm, vocab.json)'
    )
  if is_export(directory):
    raise PretrainedError(
      f'--init-from {directory}: an export of a flax_transformer run (its '
      'config.json says exported_by); fine-tune the run it came from '
      '(train.py --workdir RUN --steps N continues it)'
    )
  pretrained = read_marian_config(directory)
  config = parse_overrides(pretrained, 'model', overrides)
  for name in overrides:
    if name not in FINE_TUNING_CHANGES and getattr(config, name) != getattr(pretrained, name):
      raise ConfigError(
        f'--model.{name}={overrides[name]} contradicts the model in {directory} '
        f'({name}={getattr(pretrained, name)}); fine-tuning takes the '
        f'architecture from --init-from (it may change '
        f'{", ".join(sorted(FINE_TUNING_CHANGES))})'
      )
  return config
