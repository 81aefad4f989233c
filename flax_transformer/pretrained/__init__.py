"""Pretrained models from elsewhere: Hugging Face Marian (OPUS-MT) directories.

Layer 4 (above `config`, `nn`, `tokenizer` and `data`): `marian` reads a Marian directory's
config.json, weights and tokenizer into this library's model; `export` writes our
model as one, which transformers and CTranslate2 load (the tokenizers, Marian's and an
export's, live in `flax_transformer.tokenizer`).
"""

from flax_transformer.errors import PretrainedError
from flax_transformer.pretrained.marian import (
  fine_tuning_config,
  is_marian_directory,
  load_marian,
  marian_config,
  read_marian_config,
)
from flax_transformer.pretrained.marian_weights import WEIGHTS_FILE
from flax_transformer.tokenizer.marian import TOKENIZER_FILES, MarianTokenizer

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
