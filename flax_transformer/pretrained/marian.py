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
what cannot map is refused, naming the config field. Reading and mapping the weights
(`read_weights`, `marian_params`) is `marian_weights.py`'s; this module translates
config.json and loads a whole directory.

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

from flax_transformer.config import (
  NONNEGATIVE_INT,
  UNIT_INTERVAL,
  Bounds,
  ConfigError,
  ModelConfig,
  check_bounds,
  fields_where,
  parse_overrides,
)
from flax_transformer.errors import PretrainedError, TokenizerError
from flax_transformer.files import read_json_object
from flax_transformer.pretrained.marian_weights import WEIGHTS_FILE, marian_params, read_weights
from flax_transformer.tokenizer import load as load_tokenizer
from flax_transformer.tokenizer.marian import TOKENIZER_FILES as TOKENIZER_FILES
from flax_transformer.tokenizer.marian import MarianTokenizer

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
  'activation_dropout': UNIT_INTERVAL,
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
      activation_dropout_rate=hf.get('activation_dropout', 0.0),
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
  params = marian_params(read_weights(directory), config, str(directory / WEIGHTS_FILE))
  return config, params, tokenizer


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
  changeable = fields_where(ModelConfig, lambda lifetime: lifetime.fine_tunable)
  for name in overrides:
    if name not in changeable and getattr(config, name) != getattr(pretrained, name):
      raise ConfigError(
        f'--model.{name}={overrides[name]} contradicts the model in {directory} '
        f'({name}={getattr(pretrained, name)}); fine-tuning takes the '
        f'architecture from --init-from (it may change '
        f'{", ".join(sorted(changeable))})'
      )
  return config
