"""What the test files share: import paths, and the fixtures more than one file needs.

Import paths, set here once, before any test file is imported:
  * the repository root, first: this checkout's `flax_transformer` (ahead of any
    installed copy), `benchmarks`, and the scripts train.py and decode.py, which
    the tests import as `import train as train_cli`, `import decode as decode_cli`;
  * tests/, for the helpers of tests/support/: `from support.<module> import ...`.
"""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (TESTS, ROOT):  # ROOT ends up first
  if str(path) in sys.path:
    sys.path.remove(str(path))
  sys.path.insert(0, str(path))


# --- data -----------------------------------------------------------------------------

MULTI30K = ROOT.parent / 'shared' / 'data' / 'multi30k'


@pytest.fixture(scope='session')
def multi30k_dir() -> Path:
  """The Multi30k corpus as <split>.<lang> files beside the checkout; skips the test without it."""
  if not MULTI30K.is_dir():
    pytest.skip(f'Multi30k not found at {MULTI30K}')
  return MULTI30K


def write_numbers_corpus(directory: Path) -> Path:
  """Number words, English to German, as train/val/test .en/.de files of 64/8/8 lines."""
  from flax_transformer.toy_task import number_translation
  numbers = number_translation(num_train=64, num_validation=8, num_test=8)
  stems = {'train': 'train', 'validation': 'val', 'test': 'test'}
  directory.mkdir(parents=True)
  for split, stem in stems.items():
    for column, lang in (('source', 'en'), ('target', 'de')):
      (directory / f'{stem}.{lang}').write_text(''.join(f'{line}\n'
                                                        for line in numbers[split][column]))
  return directory


@pytest.fixture(scope='session')
def numbers_corpus(tmp_path_factory) -> Path:
  """The corpus of cmlm_run and teacher."""
  return write_numbers_corpus(tmp_path_factory.mktemp('data') / 'numbers')


# --- run directories ---------------------------------------------------------------------

# The model of tests/test_train_cli.py: one layer each side, 16 positions.
CMLM_OPTIONS = ['--model.d_model=32', '--model.num_heads=4', '--model.num_encoder_layers=1',
                '--model.num_decoder_layers=1', '--model.d_ff=64', '--model.max_len=16',
                '--model.max_length_offset=4', '--data.vocab_size=256', '--train.max_tokens=256',
                '--train.warmup_steps=4', '--train.log_every=2', '--train.eval_every=2',
                '--train.checkpoint_every=2']


@pytest.fixture(scope='session')
def cmlm_run(tmp_path_factory, numbers_corpus) -> dict:
  """train.py --objective cmlm for 4 steps with --average-last 2, then resumed to 6.

  {'workdir': the run directory, 'first', 'resumed': each call's (status, stdout, stderr)}.
  """
  import train as train_cli
  from support.script_calls import call
  corpus = numbers_corpus
  workdir = tmp_path_factory.mktemp('cmlm') / 'run'
  first = call(train_cli.main, ['--objective', 'cmlm', *CMLM_OPTIONS, '--data', corpus,
                                '--steps=4', '--average-last', '2', '--workdir', workdir])
  resumed = call(train_cli.main, ['--objective', 'cmlm', *CMLM_OPTIONS, '--data', corpus,
                                  '--steps=6', '--workdir', workdir])
  return {'workdir': workdir, 'first': first, 'resumed': resumed}


@pytest.fixture(scope='session')
def random_run(tmp_path_factory):
  """support.random_run: a run directory of a random tiny model, its Translator, and its
  greedy translations of support.random_run.SENTENCES."""
  from support import random_run
  return random_run.build(tmp_path_factory.mktemp('run'))
