"""A Marian (OPUS-MT) directory's weights as this library's parameter tree.

    params = marian_params(read_weights(directory), config, str(directory / WEIGHTS_FILE))

`read_weights` reads model.safetensors with `safetensors.numpy` (no torch, no pickle: a
pytorch_model.bin is refused with the command that converts it), after checking its header
and that no tensor ends past the file's end (a truncated download). `marian_params` maps
transformers' names onto our tree (torch Linear weights transposed into Dense kernels, the
LayerNorms, the embeddings shared or not, final_logits_bias), checks every shape against the
config's model, and checks the stored positional tables against the sinusoids we compute;
a decoder position 0 that differs from ours (an export's start embedding) is folded into the
start token's embedding. Marian's key projections have a bias, which is dropped: it adds
q . b to a whole row of attention logits, which the softmax cancels.

Every fault is a PretrainedError naming the file: a weights file missing, truncated or with a
damaged header, a missing tensor, a wrong shape. `marian.load_marian` reads a whole directory
(config.json and the tokenizer too).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from flax_transformer.config import NONNEGATIVE_INT, ModelConfig
from flax_transformer.errors import PretrainedError
from flax_transformer.tokenizer.marian import TOKENIZER_FILES, import_optional

WEIGHTS_FILE = 'model.safetensors'


def read_weights(directory: Path) -> dict[str, np.ndarray]:
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
