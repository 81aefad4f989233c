"""What every tokenizer of the library is: the `TextTokenizer` protocol, and the one rule of
a tokenizer fitting a model (its vocabulary size and special ids are the model's).

Satisfied by `subword.Tokenizer` (trained here, tokenizer.json), `exported.ExportedTokenizer`
(an export's tokenizer.json read back) and `marian.MarianTokenizer` (a Marian model's
source.spm, target.spm, vocab.json).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

import numpy as np

from flax_transformer.config import VOCABULARY, ModelConfig, fields_where
from flax_transformer.errors import ConfigError


@runtime_checkable
class TextTokenizer(Protocol):
  """What training, decoding and the run directory need of a tokenizer.

  Satisfied by `Tokenizer` (trained here, tokenizer.json), `ExportedTokenizer` and
  `MarianTokenizer` (a Marian model's source.spm, target.spm, vocab.json).
  """

  FILES: ClassVar[tuple[str, ...]]  # what `save` writes into a directory and `load` reads
  pad_id: int
  bos_id: int
  eos_id: int
  unk_id: int

  @property
  def vocab_size(self) -> int: ...

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Source-side ids per text, without BOS/EOS."""

  def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
    """Target-side ids per text, without BOS/EOS."""

  def decode(self, ids: Sequence[Sequence[int]] | np.ndarray) -> list[str]:
    """Texts from rows of target ids, each row cut at its first EOS."""

  def id_to_token(self, token_id: int) -> str: ...

  def check_compatible(self, config: ModelConfig) -> None:
    """Raises ConfigError unless `config`'s vocabulary and special ids are this tokenizer's."""

  def save(self, directory: str | Path) -> Path:
    """Writes `FILES` into `directory`."""

  def digest(self) -> str:
    """The SHA-256 of `FILES` where the tokenizer was loaded from or last saved to (names
    and contents: `files.files_digest`): what the corpus cache keys its encodings on."""


# The model's settings the tokenizer decides: those of the vocabulary lifetime (config).
VOCABULARY_FIELDS = fields_where(ModelConfig, lambda lifetime: lifetime is VOCABULARY)


def vocabulary_mismatches(
  tokenizer: TextTokenizer, config: ModelConfig
) -> list[tuple[str, int, int]]:
  """(field, the model's value, the tokenizer's) for each of `VOCABULARY_FIELDS` that differs:
  the one rule of a tokenizer fitting a model."""
  return [
    (name, getattr(config, name), getattr(tokenizer, name))
    for name in VOCABULARY_FIELDS
    if getattr(config, name) != getattr(tokenizer, name)
  ]


def check_compatible(
  tokenizer: TextTokenizer, config: ModelConfig, what: str = 'the tokenizer'
) -> None:
  """Raises ConfigError naming the first of `vocabulary_mismatches` and the setting to change."""
  for name, model_value, tokenizer_value in vocabulary_mismatches(tokenizer, config):
    raise ConfigError(
      f'model.{name}={model_value} but {what} has {tokenizer_value}; set '
      f'model.{name}={tokenizer_value}'
    )
