"""Tokenizers, in one room: what a tokenizer is, each kind, and which one a directory holds.

Layer 2 (above `config` and `nn`, below `data`). Modules:
`protocol` (`TextTokenizer`, what training, decoding and the run directory need of any
tokenizer, `digest()` included; the rule of a tokenizer fitting a model),
`subword` (`Tokenizer`: our shared subword vocabulary on Hugging Face `tokenizers`,
tokenizer.json), `word_memo` (its per-word memo: the same ids, several times faster on a
corpus), `bpe_dropout` (`BpeDropout`: its merges resampled at a rate, each draw a hash of a
key, so a resumed run draws the same pieces), `exported` (`ExportedTokenizer`: an export's
tokenizer.json read back), `marian` (`MarianTokenizer`: an OPUS-MT model's sentencepiece
files and vocab.json).

    tokenizer = load('runs/m30k')        # whichever kind the directory holds
    ids = tokenizer.encode(['A dog runs.'])
    key = tokenizer.digest()             # SHA-256 of its files: the corpus cache's key
"""

from __future__ import annotations

from pathlib import Path

from flax_transformer.files import files_digest
from flax_transformer.tokenizer.exported import ExportedTokenizer
from flax_transformer.tokenizer.marian import TOKENIZER_FILES, MarianTokenizer
from flax_transformer.tokenizer.protocol import (
  VOCABULARY_FIELDS,
  TextTokenizer,
  check_compatible,
  vocabulary_mismatches,
)
from flax_transformer.tokenizer.subword import FILE_NAME, SPECIAL_TOKENS, Tokenizer

__all__ = [
  'FILE_NAME',
  'SPECIAL_TOKENS',
  'TOKENIZER_FILES',
  'VOCABULARY_FIELDS',
  'ExportedTokenizer',
  'MarianTokenizer',
  'TextTokenizer',
  'Tokenizer',
  'check_compatible',
  'digest_of',
  'kind_in',
  'load',
  'vocabulary_mismatches',
]


def kind_in(directory: str | Path, default: type[TextTokenizer] = Tokenizer) -> type[TextTokenizer]:
  """The kind of tokenizer whose files `directory` holds: a Marian model's (source.spm, and
  the rest of `MarianTokenizer.FILES`), an export's (tokenizer.json beside
  tokenizer_config.json), else `default` (ours: tokenizer.json), whose `load` names what is
  missing."""
  directory = Path(directory)
  if (directory / MarianTokenizer.FILES[0]).is_file():
    return MarianTokenizer
  if all((directory / name).is_file() for name in ExportedTokenizer.FILES):
    return ExportedTokenizer
  return default


def digest_of(directory: str | Path) -> str:
  """The `digest()` of the tokenizer saved in `directory` (whichever its kind), from its files
  without loading it: what a run's config.json records as its tokenizer's identity, and what
  the corpus cache keys its encodings on."""
  directory = Path(directory)
  return files_digest([directory / name for name in kind_in(directory).FILES])


def load(directory: str | Path, default: type[TextTokenizer] = Tokenizer) -> TextTokenizer:
  """The tokenizer saved in `directory`, whichever its kind (`kind_in`); TokenizerError
  naming the file that is missing or damaged."""
  return kind_in(directory, default).load(directory)
