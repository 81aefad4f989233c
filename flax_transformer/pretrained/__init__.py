"""Pretrained models from elsewhere: Hugging Face Marian (OPUS-MT) directories.

Layer 3 (above `config`, `nn` and `data`): `marian` reads a Marian directory's
config.json, weights and sentencepiece tokenizer into this library's model.
"""

from flax_transformer.pretrained.marian import (TOKENIZER_FILES, WEIGHTS_FILE, MarianTokenizer,
                                                PretrainedError, fine_tuning_config,
                                                is_marian_directory, load_marian, marian_config,
                                                read_marian_config)

__all__ = [
    'MarianTokenizer', 'PretrainedError', 'TOKENIZER_FILES', 'WEIGHTS_FILE', 'fine_tuning_config',
    'is_marian_directory', 'load_marian', 'marian_config', 'read_marian_config',
]
