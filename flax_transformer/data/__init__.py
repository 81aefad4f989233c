"""The input side: parallel text, batches and the embedded toy task (the tokenizers have a
room of their own, `flax_transformer.tokenizer`; `Tokenizer` is also here, where it was).

Layer 3 (above `config`, `nn` and `tokenizer`). Modules: `corpus` (parallel text through
Hugging Face `datasets`), `batching` (`Batch`, the encoded corpus, length buckets), `plans`
(which pairs share a row: `Bucketed`, `FirstFit`, `BestFit`), `assembly` (a batch from a plan
entry, with array operations), `batcher` (`Batcher`: token-count batches in a few fixed
shapes, a pure function of the step), `resegmenting` (BPE-dropout in the training batches),
`packing` (what packing asks of the settings), `toy_task` (number words, English -> German,
offline).
"""

from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import Batch, EncodedCorpus, encode_corpus, shard
from flax_transformer.data.corpus import describe, load_parallel
from flax_transformer.data.packing import padding_share
from flax_transformer.data.plans import BestFit, Bucketed, FirstFit, row_plan
from flax_transformer.data.toy_task import number_translation
from flax_transformer.errors import DataError, TokenizerError
from flax_transformer.tokenizer import TextTokenizer, Tokenizer, check_compatible

__all__ = [
  'Batch',
  'Batcher',
  'BestFit',
  'Bucketed',
  'DataError',
  'EncodedCorpus',
  'FirstFit',
  'TextTokenizer',
  'Tokenizer',
  'TokenizerError',
  'check_compatible',
  'describe',
  'encode_corpus',
  'load_parallel',
  'number_translation',
  'padding_share',
  'row_plan',
  'shard',
]
