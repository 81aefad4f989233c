"""The original encoder–decoder Transformer (Vaswani et al., 2017) in JAX/Flax.

Axis legend, the same letters in every module's shapes and einsums:

  B  batch: sentences, or rows of a training batch (per device inside a mapped step)
  S  source length            T  target length (queries)    L  output length (cache slots)
  N  attention heads          H  head dim                   D  model width (d_model)
  F  feed-forward width       V  vocabulary                 K  beams per sentence
  M  candidate lengths per sentence (mask-predict's length beam)
  R  candidate rows, B * M    W  mask-predict canvas width  C  length classes (cmlm)
  I  refinement iterations    O  cmlm's max_length_offset   G  devices
  P  processes                X  a dense layer's input features (contracted)
  Y  a dense layer's output features
  U  blocks of banded attention, J  positions in a block, E  keys a block scores

The public names below are the API; `Translator`, the decoding methods and
`build_model` load on first use, so that importing the package stays light.

The subpackages, each importing only from those before it (tests/test_layers.py):

  config       the three frozen settings classes and the presets
  nn           masks, attention, layers, the two models
  data         parallel text, tokenizers, batching, packing, the toy task
  pretrained   Marian (OPUS-MT) directories, read and written
  run          a run on disk: directory, lock, checkpoints, metrics log, memory estimate
  decode       autoregressive and mask-predict decoding, methods, Translator
  train        objectives, optimizer, the step, data parallelism, the loop, distillation
  cli          the four programs
  bench        benchmarking jit-compiled steps: step, decoding and peak reports, the command
"""

import importlib

from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig

__version__ = '0.1.0'

# Public names by the module that defines them, loaded on first use: `import flax_transformer`
# and `flax_transformer.config` load no JAX (the settings, --help), and the decoding side no
# orbax or sacreBLEU until asked.
_LAZY = {
  'KVCache': 'nn.attention',
  'MultiHeadAttention': 'nn.attention',
  'scaled_dot_product_attention': 'nn.attention',
  'sinusoidal_positions': 'nn.layers',
  'BeamDecodeCache': 'nn.model',
  'DecodeCache': 'nn.model',
  'Transformer': 'nn.model',
  'attention_weights': 'nn.model',
  'count_params': 'nn.model',
  'empty_self_cache': 'nn.model',
  'build_model': 'nn.build',
  'CMLMTransformer': 'nn.cmlm',
  'Translator': 'decode.translator',
  'DecodingMethod': 'decode.methods',
  'default_method': 'decode.methods',
}


def __getattr__(name: str):
  if name in _LAZY:
    return getattr(importlib.import_module(f'flax_transformer.{_LAZY[name]}'), name)
  if name in __all__:  # the rest are decoding methods: decode.METHODS' classes, by name
    from flax_transformer.decode import METHODS

    return next(cls for cls in METHODS.values() if cls.__name__ == name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
  'BeamDecodeCache',
  'BeamSearch',
  'CMLMTransformer',
  'ConfigError',
  'DataConfig',
  'DecodeCache',
  'DecodingMethod',
  'Greedy',
  'KVCache',
  'MaskPredict',
  'ModelConfig',
  'MultiHeadAttention',
  'Sampling',
  'TrainConfig',
  'Transformer',
  'Translator',
  'attention_weights',
  'build_model',
  'count_params',
  'default_method',
  'empty_self_cache',
  'scaled_dot_product_attention',
  'sinusoidal_positions',
]
