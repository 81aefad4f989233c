"""The literature's text preprocessing, as data settings: normalise, lowercase, Moses-tokenise.

Multi30k's standard preprocessing (the dataset's `task1-tokenize.sh`, and most published
small-model scores on it) is Moses' `normalize-punctuation.perl`, lowercasing and
`tokenizer.perl`, here through `sacremoses`. A run that sets any of `data.normalize_punctuation`,
`data.lowercase` or `data.pretokenize=moses` applies them to every text its tokenizer sees,
through `PreprocessingTokenizer`: the tokenizer's training sample, the training and
validation pairs (each side in its own language), and every decoding input; its outputs are
Moses-detokenized back into text (`data.detokenize`).

    steps = TextPreprocessing(normalize_punctuation=True, lowercase=True, pretokenize='moses')
    steps.prepare(['A man, in a "blue" shirt.'], 'en')   # ['a man , in a " blue " shirt .']
    steps.finish(['ein mann , in einem blauen hemd .'], 'de')  # ['ein mann, in einem blauen hemd.']

`moses_tokenized` is the same normalise + lowercase + tokenise for scoring: the "tokenized
BLEU" that fairseq-era papers report (`evaluation.tokenized_bleu`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from flax_transformer.config import ConfigError, DataConfig, ModelConfig


@dataclasses.dataclass(frozen=True)
class TextPreprocessing:
  """What is done to text before the tokenizer and to its outputs after (module docstring).

  normalize_punctuation: Moses' punctuation normalisation (quotes, dashes, spaces).
  lowercase: `str.lower` of every text (a model that never sees case never outputs it).
  pretokenize: 'moses' splits punctuation from words (`tokenizer.perl`, escape off);
    'none' leaves words as written.
  detokenize: outputs of a Moses-pretokenized model are Moses-detokenized into text.
  """

  normalize_punctuation: bool = False
  lowercase: bool = False
  pretokenize: Literal['none', 'moses'] = 'none'
  detokenize: bool = True

  @classmethod
  def of(cls, data_config: DataConfig) -> TextPreprocessing:
    return cls(
      normalize_punctuation=data_config.normalize_punctuation,
      lowercase=data_config.lowercase,
      pretokenize=data_config.pretokenize,
      detokenize=data_config.detokenize,
    )

  @property
  def active(self) -> bool:
    """Whether any text is changed (the paper's default: none)."""
    return self.normalize_punctuation or self.lowercase or self.pretokenize != 'none'

  def describe(self) -> str:
    """'punctuation normalised, lowercased, Moses-tokenized (outputs detokenized)', or 'none'."""
    steps = [
      name
      for name, on in (
        ('punctuation normalised', self.normalize_punctuation),
        ('lowercased', self.lowercase),
        ('Moses-tokenized', self.pretokenize == 'moses'),
      )
      if on
    ]
    if self.pretokenize == 'moses':
      steps[-1] += ' (outputs detokenized)' if self.detokenize else ' (outputs left tokenized)'
    return ', '.join(steps) or 'none'

  def prepare(self, texts: Sequence[str], lang: str) -> list[str]:
    """`texts` as the tokenizer sees them: normalised, lowercased, pretokenized as set."""
    if not self.active:
      return list(texts)
    return [_prepared(self, text, lang) for text in texts]

  def prepare_one(self, text: str, lang: str) -> str:
    """One text as the tokenizer sees it (`prepare`, without the memo)."""
    if self.normalize_punctuation:
      text = _normalizer(lang).normalize(text)
    if self.lowercase:
      text = text.lower()
    if self.pretokenize == 'moses':
      text = _tokenizer(lang).tokenize(text, escape=False, return_str=True)
    return text

  def finish(self, texts: Sequence[str], lang: str) -> list[str]:
    """Outputs as text: Moses-detokenized when the model was trained on Moses tokens."""
    if self.pretokenize != 'moses' or not self.detokenize:
      return list(texts)
    detokenizer = _detokenizer(lang)
    return [detokenizer.detokenize(text.split(), return_str=True) for text in texts]


def moses_tokenized(texts: Sequence[str], lang: str) -> list[str]:
  """Punctuation-normalised, lowercased, Moses-tokenized `texts`: what the literature's
  "tokenized BLEU" compares (fairseq's BLEU4 on Multi30k's `*.lc.norm.tok.*` files)."""
  return TextPreprocessing(True, True, 'moses').prepare(texts, lang)


# A run prepares the same sentences more than once: its training text for the tokenizer's
# sample and again for the corpus encoding, its references at every evaluation. Moses takes
# about 0.2 ms a sentence (12 s for Multi30k's 58,000), a repeat is a lookup. The size bounds
# the memory (about 100 MB of strings at most); a corpus larger than it gains nothing and
# loses little (a lookup and an insertion a sentence).
PREPARED_SENTENCES = 2**18


@functools.lru_cache(maxsize=PREPARED_SENTENCES)
def _prepared(steps: TextPreprocessing, text: str, lang: str) -> str:
  return steps.prepare_one(text, lang)


# sacremoses objects load their language's tables once: cached per language.
@functools.cache
def _normalizer(lang: str):
  import sacremoses

  return sacremoses.MosesPunctNormalizer(lang=lang)


@functools.cache
def _tokenizer(lang: str):
  import sacremoses

  return sacremoses.MosesTokenizer(lang=lang)


@functools.cache
def _detokenizer(lang: str):
  import sacremoses

  return sacremoses.MosesDetokenizer(lang=lang)


def moses_available() -> bool:
  """Whether sacremoses is installed (tokenized BLEU is reported only then)."""
  try:
    import sacremoses  # noqa: F401
  except ImportError:
    return False
  return True


def check_available(preprocessing: TextPreprocessing) -> None:
  """Raises ConfigError, before any work, when sacremoses is needed and not installed."""
  needed = preprocessing.normalize_punctuation or preprocessing.pretokenize == 'moses'
  if needed and not moses_available():
    raise ConfigError(
      'data.normalize_punctuation and data.pretokenize=moses need sacremoses: '
      'pip install sacremoses'
    )


class PreprocessingTokenizer:
  """A tokenizer that sees text through `TextPreprocessing`: sources prepared in `src_lang`,
  targets in `tgt_lang`, outputs finished in `tgt_lang`. Everything else is the wrapped
  tokenizer's (its files, ids and vocabulary), so the run directory saves and loads the inner
  one, and the wrapping comes from the run's data settings."""

  def __init__(self, inner, preprocessing: TextPreprocessing, src_lang: str, tgt_lang: str):
    self.inner, self.preprocessing = inner, preprocessing
    self.src_lang, self.tgt_lang = src_lang, tgt_lang
    self.FILES = inner.FILES
    self.pad_id, self.bos_id = inner.pad_id, inner.bos_id
    self.eos_id, self.unk_id = inner.eos_id, inner.unk_id

  def __reduce__(self):
    return type(self), (self.inner, self.preprocessing, self.src_lang, self.tgt_lang)

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    return self.inner.encode(self.preprocessing.prepare(_texts(texts), self.src_lang))

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    return self.inner.encode_flat(self.preprocessing.prepare(_texts(texts), self.src_lang))

  def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
    return self.inner.encode_target(self.preprocessing.prepare(_texts(texts), self.tgt_lang))

  def decode(self, ids) -> list[str]:
    return self.preprocessing.finish(self.inner.decode(ids), self.tgt_lang)

  def id_to_token(self, token_id: int) -> str:
    return self.inner.id_to_token(token_id)

  def check_compatible(self, config: ModelConfig) -> None:
    self.inner.check_compatible(config)

  def save(self, directory: str | Path) -> Path:
    return self.inner.save(directory)

  def digest(self) -> str:
    """The digest of what turns text into ids: the inner tokenizer's files, with the
    preprocessing and the languages (the corpus cache's key)."""
    recipe = json.dumps(
      {
        'tokenizer': self.inner.digest(),
        'src_lang': self.src_lang,
        'tgt_lang': self.tgt_lang,
        'preprocessing': dataclasses.asdict(self.preprocessing),
      },
      sort_keys=True,
    )
    return hashlib.sha256(recipe.encode()).hexdigest()


def _texts(texts: Sequence[str]) -> Sequence[str]:
  if isinstance(texts, str):
    raise TypeError('encode takes a sequence of texts; wrap a single one as [text]')
  return texts


def wrap(tokenizer, data_config: DataConfig):
  """`tokenizer` seeing text through `data_config`'s preprocessing, or itself when there is none."""
  preprocessing = TextPreprocessing.of(data_config)
  if not preprocessing.active:
    return tokenizer
  return PreprocessingTokenizer(
    tokenizer, preprocessing, data_config.src_lang, data_config.tgt_lang
  )


def unwrap(tokenizer):
  """The tokenizer inside a `PreprocessingTokenizer`, or `tokenizer` itself."""
  return tokenizer.inner if isinstance(tokenizer, PreprocessingTokenizer) else tokenizer
