"""What the test files share: import paths, and the fixtures more than one file needs.

Import paths, set here once, before any test file is imported:
  * the repository root, first: this checkout's `flax_transformer` (ahead of any
    installed copy), `benchmarks`, and the scripts train.py and decode.py, which
    the tests import as `import train as train_cli`, `import decode as decode_cli`;
  * tests/, for the helpers of tests/support/: `from support.<module> import ...`.

Fixtures, all session-scoped: each is built once, by the first test that asks for it,
whichever file that test is in. Tests read what they return and leave the directories
as they found them.
  multi30k_dir        the Multi30k corpus beside the checkout; skips the test without it
  numbers_corpus      number words as train/val/test files
  cmlm_run            train.py --objective cmlm on numbers_corpus, then resumed
  teacher             an autoregressive run directory of random parameters
  random_run          support/random_run.py: a random tiny model's run directory
  checkpointed_run    support/checkpointed_run.py: five checkpoints of a tiny model
  cmlm_params         the parameters of support/tiny_cmlm.py's model,
  cmlm_copy_params    and of its uniform-copy variant

Speed (docs/contributing.md, "Tests"): pyproject's addopts run the files in parallel
(pytest-xdist, one file per worker at a time, the slowest files first: see
`pytest_collection_modifyitems`), and every JAX process of the session (the workers,
the scripts and notebook kernels that tests start) shares one persistent compilation
cache, so a program that several files or processes compile is compiled once.
"""

import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

# JAX's persistent compilation cache, in a temporary directory made by the first process of
# the session (the xdist controller, or pytest itself with -n 0) and removed by it at the end
# (`pytest_unconfigure`). The variables are set before jax is imported: the xdist workers and
# every process a test starts inherit them. A test that wants a cache of its own (as
# test_interruption's processes do) sets JAX_COMPILATION_CACHE_DIR in its child's environment.
_SESSION_CACHE = 'FLAX_TRANSFORMER_TEST_COMPILATION_CACHE'
_CACHE_MADE_HERE = not os.environ.get(_SESSION_CACHE)
if _CACHE_MADE_HERE:
  os.environ[_SESSION_CACHE] = tempfile.mkdtemp(prefix='flax-transformer-test-jax-cache-')
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.environ[_SESSION_CACHE]
# Every program, however quick to compile: the tests' programs are small, and most are
# compiled again by another file or process.
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0'
os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES'] = '0'

# One OpenMP thread for PyTorch and CTranslate2 (test_export, test_pretrained, notebook 04):
# the files run in parallel, a worker per core, and OpenMP's threads spin while they wait, so
# two of them on a core busy with the other worker's JAX made test_export's transformers test
# take 82 s instead of 17 s. The benchmarks' workers set their own thread counts.
os.environ.setdefault('OMP_NUM_THREADS', '1')

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (TESTS, ROOT):  # ROOT ends up first
  if str(path) in sys.path:
    sys.path.remove(str(path))
  sys.path.insert(0, str(path))

# After the paths above: this checkout's package and scripts.
import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import train as train_cli  # noqa: E402
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig  # noqa: E402
from flax_transformer.data.corpus import load_parallel  # noqa: E402
from flax_transformer.data.toy_task import number_translation  # noqa: E402
from flax_transformer.nn.cmlm import CMLMTransformer  # noqa: E402
from flax_transformer.nn.model import Transformer  # noqa: E402
from flax_transformer.run.checkpoints import Checkpoints  # noqa: E402
from flax_transformer.run.directory import write_config  # noqa: E402
from flax_transformer.tokenizer import Tokenizer  # noqa: E402
from support import checkpointed_run as checkpointed_run_lib  # noqa: E402
from support import random_run as random_run_lib  # noqa: E402
from support import tiny_cmlm  # noqa: E402
from support.script_calls import call  # noqa: E402

# --- corpora ------------------------------------------------------------------------------

MULTI30K = ROOT.parent / 'shared' / 'data' / 'multi30k'


@pytest.fixture(scope='session')
def multi30k_dir() -> Path:
  """The Multi30k corpus as <split>.<lang> files beside the checkout; skips the test without it."""
  if not MULTI30K.is_dir():
    pytest.skip(f'Multi30k not found at {MULTI30K}')
  return MULTI30K


@pytest.fixture(scope='session')
def numbers_corpus(tmp_path_factory) -> Path:
  """Number words, English to German, as train/val/test .en/.de files of 64/8/8 lines:
  the corpus of cmlm_run and teacher (test_train_cli, test_decode_cli, test_translate,
  test_distill)."""
  numbers = number_translation(num_train=64, num_validation=8, num_test=8)
  stems = {'train': 'train', 'validation': 'val', 'test': 'test'}
  directory = tmp_path_factory.mktemp('data') / 'numbers'
  directory.mkdir(parents=True)
  for split, stem in stems.items():
    for column, lang in (('source', 'en'), ('target', 'de')):
      (directory / f'{stem}.{lang}').write_text(
        ''.join(f'{line}\n' for line in numbers[split][column])
      )
  return directory


# --- run directories ----------------------------------------------------------------------

# The model of tests/test_train_cli.py: one layer each side, 16 positions.
CMLM_OPTIONS = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--model.max_len=16',
  '--model.max_length_offset=4',
  '--data.vocab_size=256',
  '--train.max_tokens=256',
  '--train.warmup_steps=4',
  '--train.log_every=2',
  '--train.eval_every=2',
  '--train.checkpoint_every=2',
]


@pytest.fixture(scope='session')
def cmlm_run(tmp_path_factory, numbers_corpus) -> dict:
  """train.py --objective cmlm for 4 steps with --average-last 2, then resumed to 6
  (test_train_cli, test_decode_cli, test_translate, test_distill).

  {'workdir': the run directory, 'first', 'resumed': each call's (status, stdout, stderr)}.
  """
  corpus = numbers_corpus
  workdir = tmp_path_factory.mktemp('cmlm') / 'run'
  first = call(
    train_cli.main,
    [
      '--objective',
      'cmlm',
      *CMLM_OPTIONS,
      '--data',
      corpus,
      '--steps=4',
      '--average-last',
      '2',
      '--workdir',
      workdir,
    ],
  )
  resumed = call(
    train_cli.main,
    ['--objective', 'cmlm', *CMLM_OPTIONS, '--data', corpus, '--steps=6', '--workdir', workdir],
  )
  return {'workdir': workdir, 'first': first, 'resumed': resumed}


@pytest.fixture(scope='session')
def teacher(tmp_path_factory, numbers_corpus) -> Path:
  """An autoregressive run directory with random parameters (no training needed), on
  numbers_corpus: the teacher of test_distill, the other model kind of test_translate."""
  corpus = numbers_corpus
  workdir = tmp_path_factory.mktemp('teacher') / 'run'
  dataset = load_parallel(str(corpus), 'en', 'de')
  tokenizer = Tokenizer.train(
    list(dataset['train']['source']) + list(dataset['train']['target']), vocab_size=256
  )
  config = ModelConfig.tiny(
    vocab_size=tokenizer.vocab_size,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=16,
    dropout_rate=0.0,
  )
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  # A longer EOS embedding, so that random-weight translations end at different lengths.
  params['embedding']['embedding'] = params['embedding']['embedding'].at[config.eos_id].multiply(8)
  workdir.mkdir()
  tokenizer.save(workdir)
  write_config(workdir, config, TrainConfig.toy(), DataConfig(source=str(corpus), vocab_size=256))
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(3, jax.device_get(params))
  checkpoints.close()
  return workdir


@pytest.fixture(scope='session')
def random_run(tmp_path_factory) -> random_run_lib.RandomRun:
  """support.random_run: a run directory of a random tiny model, its Translator, and its
  greedy translations of support.random_run.SENTENCES (test_translate, test_decode_cli)."""
  return random_run_lib.build(tmp_path_factory.mktemp('run'))


@pytest.fixture(scope='session')
def checkpointed_run(tmp_path_factory) -> checkpointed_run_lib.CheckpointedRun:
  """support.checkpointed_run: a run directory with checkpoints at steps 2, 4, 6, 8, 10 (the
  last 3 kept), its tokenizer and training state (test_checkpoint, test_run_directory)."""
  return checkpointed_run_lib.build(tmp_path_factory.mktemp('run'))


# --- the tiny cmlm model of support.tiny_cmlm ----------------------------------------------


@pytest.fixture(scope='session')
def cmlm_params():
  """Initial parameters of CMLMTransformer(tiny_cmlm.CONFIG) (test_cmlm, test_cmlm_decoding)."""
  model = CMLMTransformer(tiny_cmlm.CONFIG)
  src = tiny_cmlm.pad_rows(tiny_cmlm.SOURCES)
  return jax.jit(model.init)(jax.random.key(0), src, src)['params']


@pytest.fixture(scope='session')
def cmlm_copy_params():
  """Initial parameters of CMLMTransformer(tiny_cmlm.COPY_CONFIG), which copies the source
  into the decoder's input (test_cmlm, test_cmlm_decoding)."""
  model = CMLMTransformer(tiny_cmlm.COPY_CONFIG)
  src = tiny_cmlm.pad_rows(tiny_cmlm.SOURCES)
  return jax.jit(model.init)(jax.random.key(0), src, src)['params']


# --- the order of the files --------------------------------------------------------------

# The files that take longest, slowest first (`python -m pytest --durations=0`, summed per
# file; docs/contributing.md's durations table). xdist hands each worker the next file when it
# finishes one; a long file handed out last would run alone at the end while the other worker
# idles. Files not named here keep their order, after these.
SLOWEST_FILES = (
  'test_notebooks.py',
  'test_export.py',
  'test_readme.py',
  'test_cmlm_decoding.py',
  'test_decoding.py',
  'test_decode_cli.py',
  'test_multi30k.py',
  'test_packing.py',
  'test_benchmarks.py',
  'test_multihost.py',
  'test_pretrained.py',
  'test_model.py',
  'test_interruption.py',
  'test_signals.py',
  'test_training.py',
  'test_scheduled_sampling.py',
  'test_banded_attention.py',
  'test_cmlm_training.py',
  'test_train_step.py',
  'test_multidevice.py',
  'test_cmlm.py',
  'test_train_cli.py',
  'test_attention.py',
  'test_faults.py',
  'test_nothing_lost.py',
)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  rank = {name: index for index, name in enumerate(SLOWEST_FILES)}
  # A stable sort: each file's tests keep their order.
  items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# --- garbage collection -------------------------------------------------------------------

# The programs' failure path runs a full collection (flax_transformer/cli/failures.py), which in
# a test process walks every object of the session: 0.4 s a call, a minute over the CLI tests.
# Objects older than the test are frozen (left out of collections) while it runs, and collected
# once its file is done.


@pytest.fixture(autouse=True, scope='module')
def _garbage_collected_per_file():
  yield
  gc.unfreeze()
  gc.collect()


@pytest.fixture(autouse=True)
def _older_objects_frozen(_garbage_collected_per_file):
  gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  # After the last test: pytest's unraisable-exception plugin then collects garbage several
  # times, each a walk over the whole session's objects. An xdist worker still busy 5 s after
  # its controller finished gets SIGINT from execnet, which landed in JAX's gc callback and
  # printed a KeyboardInterrupt warning. The process is ending: nothing is left to collect.
  gc.freeze()


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: a worker per core, but no more workers than the test files asked for, and none
  (this process) for one file, where starting workers would only add their start-up."""
  if os.environ.get('PYTEST_XDIST_AUTO_NUM_WORKERS'):
    return None  # xdist's own rule reads it
  files = set()
  for argument in config.args:
    path = Path(argument.split('::')[0])
    if not path.is_file():
      return None  # a directory (the whole suite): one worker per core
    files.add(path.resolve())
  cores = len(os.sched_getaffinity(0))
  return 0 if len(files) < 2 else min(cores, len(files))


def pytest_unconfigure(config):
  if _CACHE_MADE_HERE:
    shutil.rmtree(os.environ[_SESSION_CACHE], ignore_errors=True)
