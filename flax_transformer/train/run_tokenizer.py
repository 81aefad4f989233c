"""The run's tokenizer, set up before training: the one saved in WORKDIR, or one trained on
the training text by process 0 and saved there (the run directory itself only records and
checks it: run/directory.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from jax.experimental import multihost_utils

from flax_transformer.config import DataConfig
from flax_transformer.errors import CheckpointError
from flax_transformer.run.config_file import CONFIG_FILE
from flax_transformer.run.directory import RunDirectory, check_tokenizer, check_tokenizer_fits
from flax_transformer.tokenizer import MarianTokenizer, TextTokenizer, Tokenizer, kind_in
from flax_transformer.tokenizer.subword import FILE_NAME as TOKENIZER_FILE


def run_tokenizer(
  directory: RunDirectory,
  texts: Callable[[], list[str]],
  data_config: DataConfig,
  has_checkpoints: bool,
  say: Callable[[str], None],
) -> TextTokenizer:
  """WORKDIR/tokenizer.json, trained on `texts()` (training text, source and target) if absent.

  With checkpoints on disk the file must be there and be the one config.json
  records. Process 0 alone trains, so every process loads one vocabulary
  ('unigram' training is not bit-exact across runs), and no process can see the
  file half-written and skip the barrier that the others wait at. `texts` is
  called only to train.
  """
  path = directory.path / TOKENIZER_FILE
  kind = kind_in(directory.path)
  if kind is not Tokenizer:  # a Marian model's or an export's, copied by --init-from
    tokenizer = kind.load(directory.path)
    origin = 'Marian' if kind is MarianTokenizer else 'exported'
    say(f'tokenizer: {directory.path} ({origin}, {tokenizer.vocab_size:,} tokens)')
    return tokenizer
  if has_checkpoints and not path.is_file():
    raise CheckpointError(
      f'{directory.path} has checkpoints but no {TOKENIZER_FILE}; the token ids '
      'in them mean nothing without it'
    )
  if has_checkpoints:
    check_tokenizer(directory.path)
  trained = directory.is_main and not path.is_file()
  if trained:
    sample = texts()
    say(f'tokenizer: training {data_config.tokenizer} on {len(sample):,} sentences')
    # The trainer's bars draw on a terminal only; in a log they would be blank lines.
    tokenizer = Tokenizer.train(
      sample, data_config.vocab_size, data_config.tokenizer, progress=sys.stderr.isatty()
    )
    tokenizer.save(directory.path)
    say(
      f'tokenizer: trained {data_config.tokenizer} on {len(sample):,} sentences, '
      f'{tokenizer.vocab_size:,} tokens (asked for {data_config.vocab_size:,}), saved to '
      f'{path}'
    )
  multihost_utils.sync_global_devices('tokenizer ready')
  tokenizer = Tokenizer.load(directory.path)
  if has_checkpoints and (directory.path / CONFIG_FILE).is_file():
    check_tokenizer_fits(directory.path, tokenizer)
  if not trained:
    say(f'tokenizer: {path} ({tokenizer.vocab_size:,} tokens)')
  return tokenizer
