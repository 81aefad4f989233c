"""The data's settings: `DataConfig`, where the parallel text comes from and how its shared
vocabulary is built."""

from __future__ import annotations

import dataclasses
from typing import Literal

from flax_transformer.config.settings import (
  CORPUS,
  LOCATION,
  NONNEGATIVE_INT,
  POSITIVE_INT,
  REGULARISATION,
  UNIT_INTERVAL,
  check_fields,
  setting,
)
from flax_transformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the parallel text comes from and how its shared vocabulary is built."""

  # The corpus: the parallel text and how it becomes token ids.
  source: str = setting(
    'toy',
    'toy (English -> German number words, generated in code, '
    'offline), a directory or table file of parallel text, or a Hub '
    'dataset (see data.load_parallel)',
    lifetime=CORPUS,
  )
  src_lang: str = setting('en', 'source language code (file suffix or column)', lifetime=CORPUS)
  tgt_lang: str = setting('de', 'target language code (file suffix or column)', lifetime=CORPUS)
  vocab_size: int = setting(
    8000,
    'size of the shared subword vocabulary to train; '
    "model.vocab_size becomes the trained tokenizer's size, which "
    'a small corpus may leave below this',
    bounds=POSITIVE_INT,
    lifetime=CORPUS,
  )
  tokenizer: Literal['bpe', 'unigram'] = setting(
    'bpe', 'subword model of the tokenizer', lifetime=CORPUS
  )
  valid_split: str | None = setting(
    None,
    'file stem (or Hub split) to validate on; none: the first of val, valid, validation, dev',
    lifetime=CORPUS,
  )
  test_split: str | None = setting(
    None,
    'file stem (or Hub split) to test on, e.g. '
    "test_2016_flickr; none: 'test', or the only test* one",
    lifetime=CORPUS,
  )
  tokenizer_sample: int = setting(
    500_000,
    'training pairs (both sides) the tokenizer is trained '
    'on, drawn at random when the split has more, so '
    'that training it takes minutes at any corpus size; '
    '0: every pair',
    bounds=NONNEGATIVE_INT,
    lifetime=CORPUS,
  )
  normalize_punctuation: bool = setting(
    False,
    "Moses' punctuation normalisation of every text "
    "the tokenizer sees (Multi30k's standard "
    'preprocessing; true/false)',
    lifetime=CORPUS,
  )
  lowercase: bool = setting(
    False,
    'lowercase every text the tokenizer sees, so outputs are lowercase (true/false)',
    lifetime=CORPUS,
  )
  pretokenize: Literal['none', 'moses'] = setting(
    'none',
    "moses: split punctuation from words with the Moses tokenizer of each side's "
    'language before the subword model (training, validation and decoding input alike); none: '
    'the subword model sees text as written',
    lifetime=CORPUS,
  )
  detokenize: bool = setting(
    True,
    'with data.pretokenize=moses: Moses-detokenize outputs into '
    'text; false: leave them tokenized (true/false)',
    lifetime=CORPUS,
  )

  # How training sees the ids (the batches only; validation and decoding see plain ones).
  bpe_dropout: float = setting(
    0.0,
    'BPE-dropout: each merge skipped at this rate when a training pair is resegmented, '
    'every epoch (a pure function of train.seed, the epoch and the pair, so a resumed run '
    'draws the same); 0: none. Needs a BPE tokenizer and unpacked rows',
    bounds=UNIT_INTERVAL,
    lifetime=REGULARISATION,
  )

  # Where derived files are kept (a resumed run may move it).
  cache_dir: str | None = setting(
    None,
    'where the tokenized training split is cached, one '
    'subdirectory per data content and tokenizer (share it '
    'between runs of one corpus); none: WORKDIR/encoded',
    lifetime=LOCATION,
  )

  def __post_init__(self):
    check_fields(self, 'data')
    for name in ('valid_split', 'test_split', 'cache_dir'):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f'data.{name} must be a non-empty string or None, got {value!r}')
    for name in ('source', 'src_lang', 'tgt_lang'):
      value = getattr(self, name)
      if not isinstance(value, str) or not value:
        raise ConfigError(f'data.{name} must be a non-empty string, got {value!r}')
    if self.src_lang == self.tgt_lang:
      raise ConfigError(f'data.src_lang and data.tgt_lang are both {self.src_lang!r}')
    if not self.detokenize and self.pretokenize != 'moses':
      raise ConfigError(
        'data.detokenize=false is read only with data.pretokenize=moses (there '
        'is nothing to detokenize)'
      )

  def replace(self, **overrides) -> DataConfig:
    return dataclasses.replace(self, **overrides)
