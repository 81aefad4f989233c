"""This library's model as a Hugging Face Marian directory, which transformers and CTranslate2 load.

    config, params, tokenizer = load_for_inference('runs/m30k', average_last=5)
    export_marian(config, params, tokenizer, 'export/m30k')
    # transformers.MarianMTModel.from_pretrained('export/m30k'),
    # AutoTokenizer.from_pretrained('export/m30k'), pipeline('translation', model='export/m30k');
    # ct2-transformers-converter --model export/m30k --output_dir export/m30k-ct2

The directory is laid out as an OPUS-MT model is, because both peers rely on that
layout: transformers starts the decoder from PAD, and CTranslate2's Marian converter
takes the last vocabulary entry for PAD, drops it, and starts the decoder from a
zero embedding. Our network maps onto that exactly:

- The feature axis. Marian's positional table puts every sine before every cosine;
  ours interleaves them (paper §3.5). Permuting the model dimension D by
  `residual_permutation` (sines' features first) in every weight that reads or
  writes the residual stream (embeddings, projections' input rows or output
  columns, LayerNorm scales and biases) gives a network that computes the same
  function on permuted features; LayerNorm, attention and the logits (a dot
  product over D) are indifferent to the order.
- The vocabulary. Our PAD (id 0) trades ids with the last entry, so that PAD is
  last (`vocabulary_order`); the tokenizer's ids trade the same way.
- The decoder's first input. Ours is BOS's embedding * sqrt(D) plus position 0;
  theirs is PAD's, zero. BOS's embedding * sqrt(D) is added to row 0 of the
  decoder's stored positional table, which only the first position reads.
- The tokens our search never outputs (PAD and BOS) get a logits bias of -1e9,
  so that no search in transformers or CTranslate2 outputs them either; every
  other logit is the run's own.
- LayerNorm epsilon: transformers and CTranslate2 fix 1e-5, our default too. A run
  trained with another (`--model.layer_norm_epsilon`, or 1e-6 before 2026-12-05) is
  exported as it is, its README saying so: the difference is in the logits' fifth
  decimal, enough to change a close greedy choice now and then (docs/benchmarks.md
  measures it); config.json records ours as `layer_norm_eps`, which our loader reads
  back exactly.

What Marian cannot express is refused before anything is written (ExportError, a
ConfigError: status 2): pre-LN, the cmlm model, restricted attention, an odd d_model.
A run fine-tuned from an OPUS-MT model keeps its sentencepiece tokenizer (vocab.json
with the exported ids); any other run's tokenizer.json becomes a fast tokenizer.
Weights are written as float32 with safetensors' NumPy API (no torch).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from flax_transformer.config import ModelConfig
from flax_transformer.errors import ExportError
from flax_transformer.pretrained.marian_weights import WEIGHTS_FILE
from flax_transformer.tokenizer import SPECIAL_TOKENS, TextTokenizer, Tokenizer
from flax_transformer.tokenizer.marian import TOKENIZER_FILES, MarianTokenizer
from flax_transformer.tokenizer.subword import special_tokens_as_text

# Our activation names -> transformers' (our 'gelu' is the tanh form: transformers' gelu_new).
ACTIVATIONS = {'relu': 'relu', 'gelu': 'gelu_new', 'silu': 'swish'}
# transformers' and CTranslate2's LayerNorm epsilon (both fixed; Marian's config has no field).
MARIAN_EPSILON = 1e-5
# The logits bias that keeps a token out of any search: exp(-1e9) is 0 in float32.
NEVER = -1e9
# What an export holds: these, and the tokenizer's files (`tokenizer_files`).
MODEL_FILES = ('config.json', WEIGHTS_FILE, 'generation_config.json', 'README.md')
FAST_TOKENIZER_FILES = ('tokenizer.json', 'tokenizer_config.json')
MARIAN_TOKENIZER_FILES = (*TOKENIZER_FILES, 'tokenizer_config.json')
# Every name an export may hold (an output holding only these is an earlier export).
FILES = tuple(dict.fromkeys(MODEL_FILES + FAST_TOKENIZER_FILES + MARIAN_TOKENIZER_FILES))


def check_exportable(config: ModelConfig) -> None:
  """Raises ExportError naming the first setting a Marian model has no counterpart for."""
  refusals = [
    (
      config.kind != 'autoregressive',
      'model.kind',
      "Marian is autoregressive; a cmlm model's length classifier and mask-predict decoding "
      'have no counterpart in transformers or CTranslate2',
    ),
    (
      config.norm_placement != 'post',
      'model.norm_placement',
      "transformers' Marian is post-LN only (it ignores normalize_before)",
    ),
    (
      config.attention_radius is not None,
      'model.attention_radius',
      'Marian attends to every position; restricted attention cannot be expressed',
    ),
    (
      config.d_model % 2,
      'model.d_model',
      "an odd width's positional table has no exact counterpart in Marian's",
    ),
  ]
  for refused, field, why in refusals:
    if refused:
      raise ExportError(f'cannot export {field}={getattr(config, field.split(".")[1])!r}: {why}')


def residual_permutation(d_model: int, positions: str) -> np.ndarray:
  """`[D]` feature indices: Marian's feature j is our feature `order[j]`.

  Our interleaved table holds sin at even features and cos at odd ones, each pair one
  wavelength; Marian's holds the sines (even features) first, then the cosines.
  """
  if positions == 'concatenated':
    return np.arange(d_model)
  return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def vocabulary_order(vocab_size: int, pad_id: int) -> np.ndarray:
  """`[V]` ids: the exported id i is our id `order[i]`; PAD trades places with the last id.

  Its own inverse (a transposition), so it also maps our ids to exported ones.
  """
  order = np.arange(vocab_size)
  order[[pad_id, vocab_size - 1]] = order[[vocab_size - 1, pad_id]]
  return order


def marian_config_json(config: ModelConfig) -> dict:
  """config.json of the exported model (transformers' MarianConfig fields)."""
  check_exportable(config)
  order = vocabulary_order(config.vocab_size, config.pad_id)
  exported = lambda token_id: int(order[token_id])  # an involution: our id -> exported id
  pad = config.vocab_size - 1
  return {
    'architectures': ['MarianMTModel'],
    'model_type': 'marian',
    'vocab_size': config.vocab_size,
    'decoder_vocab_size': config.vocab_size,
    'd_model': config.d_model,
    'encoder_layers': config.num_encoder_layers,
    'decoder_layers': config.num_decoder_layers,
    'encoder_attention_heads': config.num_heads,
    'decoder_attention_heads': config.num_heads,
    'encoder_ffn_dim': config.d_ff,
    'decoder_ffn_dim': config.d_ff,
    'activation_function': ACTIVATIONS[config.activation],
    'dropout': config.dropout_rate,
    'attention_dropout': config.attention_dropout_rate,
    'activation_dropout': config.activation_dropout_rate,
    'encoder_layerdrop': 0.0,
    'decoder_layerdrop': 0.0,
    'max_position_embeddings': config.max_len,
    'scale_embedding': True,
    'static_position_embeddings': True,
    'normalize_before': False,
    'normalize_embedding': False,
    'add_final_layer_norm': False,
    'share_encoder_decoder_embeddings': config.share_embeddings,
    'tie_word_embeddings': config.share_embeddings,
    'pad_token_id': pad,
    'decoder_start_token_id': pad,
    'eos_token_id': exported(config.eos_id),
    'forced_eos_token_id': None,
    'bos_token_id': exported(config.bos_id),
    'unk_token_id': exported(config.unk_id),
    'is_encoder_decoder': True,
    'use_cache': True,
    'init_std': 0.02,
    # Read back by this library's loader; transformers keeps it as an unused attribute.
    'layer_norm_eps': config.layer_norm_epsilon,
    'exported_by': 'flax_transformer',
  }


def marian_weights(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
  """transformers' MarianMTModel tensors (float32, torch's `[out, in]` Linear layout) for our
  parameters, permuted and adjusted as the module docstring says."""
  check_exportable(config)
  params = _np_tree(params)
  features = residual_permutation(config.d_model, config.positions)
  vocabulary = vocabulary_order(config.vocab_size, config.pad_id)
  if config.share_embeddings:
    source = target = params['embedding']['embedding']  # [V, D]
    output = None
  else:
    source = params['source_embedding']['embedding']
    target = params['target_embedding']['embedding']
    output = params['output_projection']['kernel'].T  # [V, D]
  weights = {}
  for side in ('encoder', 'decoder'):
    layers = config.num_encoder_layers if side == 'encoder' else config.num_decoder_layers
    for i in range(layers):
      weights.update(
        _layer_weights(params[side][f'layer_{i}'], f'model.{side}.layers.{i}', features)
      )
  from flax_transformer.nn.layers import sinusoidal_positions

  table = np.asarray(sinusoidal_positions(config.max_len, config.d_model, 'concatenated'))
  decoder_table = table.copy()
  # The decoder starts from PAD's zero embedding; BOS's (scaled) moves into position 0.
  decoder_table[0] += np.sqrt(config.d_model) * target[config.bos_id, features]
  weights['model.encoder.embed_positions.weight'] = table
  weights['model.decoder.embed_positions.weight'] = decoder_table
  rows = lambda table: _zero_last(table[vocabulary][:, features])  # [V, D]
  if config.share_embeddings:
    weights['model.shared.weight'] = rows(source)
  else:
    weights['model.encoder.embed_tokens.weight'] = rows(source)
    weights['model.decoder.embed_tokens.weight'] = rows(target)
    weights['lm_head.weight'] = output[vocabulary][:, features]
  bias = params.get('logits_bias', np.zeros(config.vocab_size, np.float32))[vocabulary].copy()
  bias[vocabulary[[config.pad_id, config.bos_id]]] = NEVER
  weights['final_logits_bias'] = bias[None, :]  # [1, V]
  return {name: np.ascontiguousarray(value, np.float32) for name, value in weights.items()}


def _np_tree(params) -> dict:
  import jax

  return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


def _zero_last(table: np.ndarray) -> np.ndarray:
  """The exported PAD row (the last) as zeros: Marian's decoder starts from it, and CTranslate2
  starts from zeros instead of reading it; as a source token it is padding, masked."""
  table = table.copy()
  table[-1] = 0.0
  return table


def _layer_weights(layer: dict, prefix: str, features: np.ndarray) -> dict[str, np.ndarray]:
  """One encoder or decoder layer's tensors, named as transformers names them."""
  weights = {}
  blocks = [('self_attention', 'self_attn'), ('cross_attention', 'encoder_attn')]
  for ours, theirs in blocks:
    if ours not in layer:
      continue
    attention = layer[ours]
    for projection, name in (('query', 'q_proj'), ('key', 'k_proj'), ('value', 'v_proj')):
      kernel = attention[projection]['kernel']  # [D, D] in, out
      weights[f'{prefix}.{theirs}.{name}.weight'] = kernel[features].T
      # Our keys have no bias (the softmax cancels one); Marian's are zero.
      weights[f'{prefix}.{theirs}.{name}.bias'] = attention[projection].get(
        'bias', np.zeros(kernel.shape[1], np.float32)
      )
    weights[f'{prefix}.{theirs}.out_proj.weight'] = attention['out']['kernel'][:, features].T
    weights[f'{prefix}.{theirs}.out_proj.bias'] = attention['out']['bias'][features]
    norm = layer[f'{ours}_sublayer']['norm']
    weights[f'{prefix}.{theirs}_layer_norm.weight'] = norm['scale'][features]
    weights[f'{prefix}.{theirs}_layer_norm.bias'] = norm['bias'][features]
  weights[f'{prefix}.fc1.weight'] = layer['ffn']['wi']['kernel'][features].T  # [F, D]
  weights[f'{prefix}.fc1.bias'] = layer['ffn']['wi']['bias']
  weights[f'{prefix}.fc2.weight'] = layer['ffn']['wo']['kernel'][:, features].T
  weights[f'{prefix}.fc2.bias'] = layer['ffn']['wo']['bias'][features]
  norm = layer['ffn_sublayer']['norm']
  weights[f'{prefix}.final_layer_norm.weight'] = norm['scale'][features]
  weights[f'{prefix}.final_layer_norm.bias'] = norm['bias'][features]
  return weights


def fast_tokenizer_files(tokenizer: Tokenizer, config: ModelConfig) -> dict[str, dict]:
  """{'tokenizer.json': ..., 'tokenizer_config.json': ...}: the run's tokenizer as a
  transformers fast tokenizer with the exported ids, encoding text as ours does.

  Ours encodes a special token's string as text (`special_tokens_as_text`). For BPE (the
  default) so does the export: its merges that spell a special token are dropped, and
  `split_special_tokens` turns off transformers' matching of them. A unigram model keeps
  its special pieces: `tokenizers` gives an added token the id of the model's piece of that
  name, so renamed pieces would renumber the special tokens; such an export reads a
  special token's string in text as that token. A source gets EOS appended (the
  post-processor), as our sources do.
  """
  backend_json = json.loads(tokenizer._backend.to_str())
  if backend_json['model']['type'] == 'BPE':
    special_tokens_as_text(tokenizer._backend, backend_json)
  order = vocabulary_order(config.vocab_size, config.pad_id)  # an involution: our id <-> exported
  model = backend_json['model']
  if model['type'] == 'BPE':
    model['vocab'] = {piece: int(order[index]) for piece, index in model['vocab'].items()}
  elif model['type'] == 'Unigram':
    model['vocab'] = [model['vocab'][index] for index in order]
    model['unk_id'] = int(order[model['unk_id']]) if model.get('unk_id') is not None else None
  else:
    raise ExportError(f'cannot export a {model["type"]} tokenizer (only BPE and unigram)')
  for token in backend_json['added_tokens']:
    token['id'] = int(order[token['id']])
  eos = int(order[config.eos_id])
  sequence = lambda name: {'Sequence': {'id': name, 'type_id': 0}}
  end = {'SpecialToken': {'id': '</s>', 'type_id': 0}}
  backend_json['post_processor'] = {
    'type': 'TemplateProcessing',
    'single': [sequence('A'), end],
    'pair': [sequence('A'), sequence('B'), end],
    'special_tokens': {'</s>': {'id': '</s>', 'ids': [eos], 'tokens': ['</s>']}},
  }
  backend_json['truncation'] = backend_json['padding'] = None
  names = dict(zip(('pad_token', 'bos_token', 'eos_token', 'unk_token'), SPECIAL_TOKENS))
  tokenizer_config = {
    'tokenizer_class': 'PreTrainedTokenizerFast',
    **names,
    'model_max_length': config.max_len,
    'padding_side': 'right',
    # Text is text, and decoding adds no spaces of its own (our decode's strings).
    'split_special_tokens': True,
    'clean_up_tokenization_spaces': False,
    'model_input_names': ['input_ids', 'attention_mask'],
  }
  return {'tokenizer.json': backend_json, 'tokenizer_config.json': tokenizer_config}


def generation_config_json(config: ModelConfig) -> dict:
  """generation_config.json: greedy, as the pipeline's default (`model_card` says how each
  search of decode.py reads in transformers and CTranslate2)."""
  pad = config.vocab_size - 1
  eos = int(vocabulary_order(config.vocab_size, config.pad_id)[config.eos_id])
  # max_length counts the start token: max_len output tokens, as decode.py's cap.
  return {
    'decoder_start_token_id': pad,
    'pad_token_id': pad,
    'eos_token_id': eos,
    'max_length': config.max_len + 1,
    'num_beams': 1,
    'do_sample': False,
  }


def model_card(config: ModelConfig, source: str) -> str:
  """README.md of the exported directory: what it is and how each search carries over."""
  return f"""# A Transformer exported by flax_transformer

From `{source}`: {config.num_encoder_layers}+{config.num_decoder_layers} layers, d_model \
{config.d_model}, {config.num_heads} heads, d_ff {config.d_ff}, {config.vocab_size:,} tokens.

```python
from transformers import AutoTokenizer, MarianMTModel
tokenizer, model = AutoTokenizer.from_pretrained('.'), MarianMTModel.from_pretrained('.')
batch = tokenizer(['A sentence.'], return_tensors='pt', padding=True)
tokenizer.batch_decode(model.generate(**batch), skip_special_tokens=True)   # greedy
# transformers < 5: pipeline('translation', model='.')(texts, num_beams=1) (its default is beam 4)
```

```sh
ct2-transformers-converter --model . --output_dir ct2
```

Greedy search gives decode.py's `--method greedy` output in transformers and in
CTranslate2 (`beam_size=1`). Output length: decode.py stops a sentence at EOS or at
its source's token count (EOS included) + 50, at most {config.max_len}; generation_config.json
caps every sentence at {config.max_len}, so for the same cap on a sentence that never
ends pass `max_new_tokens` (transformers) or `max_decoding_length` (CTranslate2).
Beam search does not carry over exactly: decode.py
(`--method beam --beam-size 4 --alpha 0.6`, the paper's) divides a hypothesis's
log-probability by GNMT's ((5 + length) / 6) ** alpha; transformers' `num_beams=4,
length_penalty=0.6` and CTranslate2's `beam_size=4, length_penalty=0.6` divide it
by length ** 0.6, so long and short hypotheses are weighed a little differently;
decode.py's `--penalty-form fairseq` divides by length ** alpha as they do.
{_epsilon_note(config)}
"""


def _epsilon_note(config: ModelConfig) -> str:
  """The export README's line on LayerNorm epsilon: the same as the peers', or how it differs."""
  if config.layer_norm_epsilon == MARIAN_EPSILON:
    return (
      f'LayerNorm epsilon is {MARIAN_EPSILON:g} here as in both peers, so greedy output is '
      "decode.py's up to float rounding."
    )
  return (
    f'Both peers use LayerNorm epsilon {MARIAN_EPSILON:g}; this model was trained with '
    f'{config.layer_norm_epsilon:g}, so the logits differ in their fifth decimal and a close '
    'greedy choice can differ now and then.'
  )


def tokenizer_files(
  tokenizer: TextTokenizer, config: ModelConfig
) -> tuple[dict[str, dict], dict[str, Path]]:
  """({name: JSON content}, {name: file to copy}): the tokenizer's files in the export.

  Ours becomes a fast tokenizer (`fast_tokenizer_files`); a Marian tokenizer (a run
  fine-tuned from an OPUS-MT model) stays one: its sentencepiece models are copied and
  vocab.json gets the exported ids.
  """
  from flax_transformer.data.preprocessing import PreprocessingTokenizer

  if isinstance(tokenizer, PreprocessingTokenizer):
    raise ExportError(
      f'this run was trained on preprocessed text ({tokenizer.preprocessing.describe()}: '
      'data.normalize_punctuation, data.lowercase, data.pretokenize), which a Marian '
      "model's tokenizer cannot reproduce: transformers and CTranslate2 would feed "
      'it text it never saw; export a run trained on text as written'
    )
  if isinstance(tokenizer, Tokenizer):
    return fast_tokenizer_files(tokenizer, config), {}
  if not isinstance(tokenizer, MarianTokenizer):
    raise ExportError(
      f"cannot export a {type(tokenizer).__name__}: only this library's "
      "tokenizer.json and a Marian directory's sentencepiece files are written"
    )
  order = vocabulary_order(config.vocab_size, config.pad_id)
  vocab = json.loads((tokenizer.directory / 'vocab.json').read_text(encoding='utf-8'))
  vocab = {piece: int(order[index]) for piece, index in vocab.items()}
  tokenizer_config = {
    'tokenizer_class': 'MarianTokenizer',
    'model_max_length': config.max_len,
    'eos_token': '</s>',
    'unk_token': '<unk>',
    'pad_token': '<pad>',
    'separate_vocabs': False,
  }
  copies = {name: tokenizer.directory / name for name in ('source.spm', 'target.spm')}
  return {'vocab.json': vocab, 'tokenizer_config.json': tokenizer_config}, copies


def export_marian(
  config: ModelConfig,
  params,
  tokenizer: TextTokenizer,
  directory: str | Path,
  source: str = 'a flax_transformer model',
) -> Path:
  """Writes `MODEL_FILES` and the tokenizer's into `directory` (created; replaced whole if it exists, so the caller
  checks it may be) through a temporary directory beside it: a failure leaves nothing
  half-written. Returns the directory."""
  from safetensors.numpy import save_file

  directory = Path(directory)
  tokenizer_json, copies = tokenizer_files(tokenizer, config)
  files = {
    'config.json': marian_config_json(config),
    **tokenizer_json,
    'generation_config.json': generation_config_json(config),
  }
  weights = marian_weights(config, params)
  directory.parent.mkdir(parents=True, exist_ok=True)
  staging = Path(tempfile.mkdtemp(prefix=f'.{directory.name}.', dir=directory.parent))
  try:
    umask = os.umask(0o22)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp's 0o700 would hide the export from others
    for name, content in files.items():
      (staging / name).write_text(
        json.dumps(content, indent=2, ensure_ascii=False) + '\n', encoding='utf-8'
      )
    for name, path in copies.items():
      shutil.copyfile(path, staging / name)
    (staging / 'README.md').write_text(model_card(config, source), encoding='utf-8')
    save_file(weights, str(staging / WEIGHTS_FILE), metadata={'format': 'pt'})
    os.chmod(staging / WEIGHTS_FILE, 0o666 & ~umask)  # safetensors writes it 0o600
    if directory.exists():
      shutil.rmtree(directory)
    os.replace(staging, directory)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return directory
