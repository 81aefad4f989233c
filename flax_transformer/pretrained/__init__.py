"""Pretrained models from elsewhere: Hugging Face Marian (OPUS-MT) directories.

Layer 3 (above `config`, `nn` and `data`): `marian` reads a Marian directory's
config.json, weights and tokenizer into this library's model; `export` writes our
model as one, which transformers and CTranslate2 load (`fast_tokenizer` reads its
tokenizer back).
"""

from flax_transformer.pretrained.marian import (
  TOKENIZER_FILES,
  WEIGHTS_FILE,
  MarianTokenizer,
  PretrainedError,
  fine_tuning_config,
  is_marian_directory,
  load_marian,
  marian_config,
  read_marian_config,
)

__all__ = [
  'MarianTokenizer',
  'PretrainedError',
  'TOKENIZER_FILES',
  'WEIGHTS_FILE',
  'fine_tuning_config',
  'is_marian_directory',
  'load_marian',
  'marian_config',
  'read_marian_config',
]
