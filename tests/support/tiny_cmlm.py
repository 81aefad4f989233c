"""The tiny cmlm model of tests/test_cmlm.py and tests/test_cmlm_decoding.py, and their sources.

conftest.py initialises its parameters once per session: cmlm_params, cmlm_copy_params.
"""

import numpy as np

from flax_transformer import ModelConfig

R = 4
CONFIG = ModelConfig.tiny(kind='cmlm', max_length_offset=R, dropout_rate=0.0)
PAD, BOS, EOS = CONFIG.pad_id, CONFIG.bos_id, CONFIG.eos_id
MASK = CONFIG.vocab_size
# EOS-terminated sources of different lengths, as the batcher builds them.
SOURCES = [[5, 9, 12, 7, 2], [30, 2], [4, 8, 15, 16, 23, 42, 11, 2], [6, 6, 6, 2], [40, 41, 2]]
# The same model fed copies of the source at its masked positions.
COPY_CONFIG = CONFIG.replace(cmlm_decoder_input='uniform_copy')


def pad_rows(rows, width=None):
  width = width or max(map(len, rows))
  return np.array([list(row) + [PAD] * (width - len(row)) for row in rows], np.int32)


def source_lengths(src):
  return (np.asarray(src) != PAD).sum(axis=1)
