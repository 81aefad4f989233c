"""The input side: parallel text, the subword vocabulary, batches and the embedded toy task.

Layer 2 (above `config` and `nn`). Modules: `corpus` (parallel text through
Hugging Face `datasets`), `tokenizer` (the shared vocabulary and the
`TextTokenizer` protocol every tokenizer meets), `batching` (token-count batches
in a few fixed shapes, a pure function of the step), `packing` (several pairs
per row), `toy_task` (number words, English -> German, offline).
"""

from flax_transformer.data.batching import Batch, Batcher, EncodedCorpus, encode_corpus, shard
from flax_transformer.data.corpus import DataError, describe, load_parallel
from flax_transformer.data.packing import PackingBatcher, padding_share
from flax_transformer.data.tokenizer import (
  TextTokenizer,
  Tokenizer,
  TokenizerError,
  check_compatible,
)
from flax_transformer.data.toy_task import number_translation

__all__ = [
  'Batch',
  'Batcher',
  'DataError',
  'EncodedCorpus',
  'PackingBatcher',
  'TextTokenizer',
  'Tokenizer',
  'TokenizerError',
  'check_compatible',
  'describe',
  'encode_corpus',
  'load_parallel',
  'number_translation',
  'padding_share',
  'shard',
]
