"""Where `Tokenizer` and the `TextTokenizer` protocol lived; they are in the tokenizers' room
now (`flax_transformer.tokenizer`: `subword`, `protocol`), and these names still lead there."""

from flax_transformer.errors import TokenizerError
from flax_transformer.tokenizer.protocol import (
  VOCABULARY_FIELDS,
  TextTokenizer,
  check_compatible,
  vocabulary_mismatches,
)
from flax_transformer.tokenizer.subword import (
  FILE_NAME,
  SPECIAL_TOKENS,
  Tokenizer,
  special_tokens_as_text,
)

__all__ = [
  'FILE_NAME',
  'SPECIAL_TOKENS',
  'VOCABULARY_FIELDS',
  'TextTokenizer',
  'Tokenizer',
  'TokenizerError',
  'check_compatible',
  'special_tokens_as_text',
  'vocabulary_mismatches',
]
