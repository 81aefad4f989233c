"""The run directory's own files, beside the checkpoints: config.json written and read back,
refused when corrupt or when it does not fit the tokenizer, and the resume check that
compares it with the settings of a new run; the lock that keeps a second writer out
(run_lock.py), held by a real process and killed with SIGKILL.

train.py's checks of the tokenizer's digest and of a writable run directory, seen from
its command line, are tests/test_train_cli.py's.
"""

import json
import os
import signal
import socket

import pytest

from flax_transformer.config import DataConfig
from flax_transformer.files import file_digest
from flax_transformer.run.directory import (
  CheckpointError,
  check_resumable,
  read_config,
)
from flax_transformer.run.loading import load_for_inference
from flax_transformer.run.lock import LOCK_FILE, RunDirectoryInUse, RunLock
from support.checkpointed_run import TRAIN_CONFIG
from support.lock_holder import lock_holder

# The run directory of conftest.py's checkpointed_run, which tests/test_checkpoint.py shares.


@pytest.fixture(scope='module')
def setup(checkpointed_run):
  """(model config, optimizer, abstract state, a host state with non-trivial optimizer state)."""
  return checkpointed_run.setup


@pytest.fixture(scope='module')
def run_dir(checkpointed_run):
  """A run directory with checkpoints at steps 2, 4, 6, 8, 10 (the last 3 kept)."""
  return checkpointed_run.run_dir


def test_config_round_trip(run_dir, setup):
  config, _, _, _ = setup
  assert read_config(run_dir) == (config, TRAIN_CONFIG, DataConfig())


def test_a_config_from_before_layer_norm_epsilon_was_recorded_reads_as_trained(tmp_path, run_dir):
  """config.json files written before the epsilon was a setting (a run of 1e-6, the default
  then) read back as 1e-6, not as today's default 1e-5; a recorded epsilon stays as recorded."""
  content = json.loads((run_dir / 'config.json').read_text())
  assert content['model']['layer_norm_epsilon'] == 1e-5  # today's runs record it
  del content['model']['layer_norm_epsilon']
  (tmp_path / 'config.json').write_text(json.dumps(content))
  assert read_config(tmp_path)[0].layer_norm_epsilon == 1e-6
  content['model']['layer_norm_epsilon'] = 3e-5
  (tmp_path / 'config.json').write_text(json.dumps(content))
  assert read_config(tmp_path)[0].layer_norm_epsilon == 3e-5


def test_corrupt_config_and_incompatible_tokenizer(tmp_path, run_dir, setup):
  (tmp_path / 'config.json').write_text('{"model": {"d_model": 32')
  with pytest.raises(CheckpointError, match='not a valid run configuration'):
    read_config(tmp_path)
  config, _, _, _ = setup
  content = json.loads((run_dir / 'config.json').read_text())
  content['model']['vocab_size'] = config.vocab_size + 1
  content['tokenizer_sha256'] = file_digest(run_dir / 'tokenizer.json')
  other = tmp_path / 'other'
  other.mkdir()
  (other / 'config.json').write_text(json.dumps(content))
  (other / 'checkpoints').symlink_to(run_dir / 'checkpoints')
  (other / 'tokenizer.json').symlink_to(run_dir / 'tokenizer.json')
  # tokenizer.json is the file config.json records (its digest): config.json is what changed.
  with pytest.raises(
    CheckpointError,
    match=rf'other/config.json: model.vocab_size='
    rf'{config.vocab_size + 1} is not what this run was trained with: its '
    rf'tokenizer.json, the file config.json records \(same digest\), has '
    rf'vocab_size {config.vocab_size}; config.json was edited: set '
    rf'model.vocab_size back to {config.vocab_size}',
  ):
    load_for_inference(other)
  # Without a recorded digest, which file changed cannot be told; the tokenizer is named.
  content.pop('tokenizer_sha256')
  content.pop('tokenizer_digest')
  (other / 'config.json').write_text(json.dumps(content))
  with pytest.raises(
    CheckpointError,
    match=r'other/tokenizer.json does not belong to this run: it '
    rf'has vocab_size {config.vocab_size}, the model in .*other/config.json and '
    rf"its checkpoints were trained with {config.vocab_size + 1}. Put the run's "
    'own tokenizer.json back, or start a new run',
  ):
    load_for_inference(other)


def test_check_resumable_allows_run_length_changes_only(run_dir, setup):
  config, _, _, _ = setup
  check_resumable(run_dir, config, TRAIN_CONFIG.replace(steps=99, log_every=7), DataConfig())
  # The initialisation is not what a resumed run continues from: runs begun with gain 1 resume
  # under today's multi30k_fairseq preset, which initialises with fairseq's 1/sqrt(2).
  check_resumable(run_dir, config.replace(qkv_init_gain=2**-0.5), TRAIN_CONFIG, DataConfig())
  with pytest.raises(CheckpointError) as error:
    check_resumable(
      run_dir, config.replace(d_model=64), TRAIN_CONFIG.replace(seed=1), DataConfig(vocab_size=100)
    )
  message = str(error.value)
  assert 'model.d_model: saved 32, requested 64' in message
  assert 'train.seed: saved 0, requested 1' in message
  assert 'data.vocab_size: saved 8000, requested 100' in message
  assert '--no-resume' in message


# --- the run directory's lock (run_lock.py) ------------------------------------------------


def test_a_second_writer_is_refused_naming_the_holder_and_kill_9_leaves_no_stale_lock(tmp_path):
  workdir = tmp_path / 'run'
  with lock_holder(workdir) as holder:
    with pytest.raises(RunDirectoryInUse) as error:
      RunLock(workdir).acquire()
    assert str(error.value).startswith(
      f'{workdir}: another training run is writing this run directory (pid {holder.pid} on '
      f'host {socket.gethostname()} since '
    )
    assert str(error.value).endswith('wait for it to end or stop it, or choose another --workdir')
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The kernel released the dead process's lock; the file names the new holder.
  with RunLock(workdir):
    assert json.loads((workdir / LOCK_FILE).read_text())['pid'] == os.getpid()
    with pytest.raises(RunDirectoryInUse, match=f'pid {os.getpid()} on host'):
      RunLock(workdir).acquire()  # another open file of the same process is refused too
  with RunLock(workdir):  # released at the end of the block
    pass


def test_config_json_records_the_tokenizers_own_digest_and_reads_a_former_sha256(
  run_dir, checkpointed_run, tmp_path
):
  import shutil

  from flax_transformer.run.directory import check_tokenizer
  from flax_transformer.tokenizer import Tokenizer

  content = json.loads((run_dir / 'config.json').read_text())
  assert content['tokenizer_digest'] == Tokenizer.load(run_dir).digest()
  assert 'tokenizer_sha256' not in content
  other = Tokenizer.train(['ganz andere Wörter', 'other words entirely'], 40)
  for key, value in (
    ('tokenizer_digest', content['tokenizer_digest']),
    ('tokenizer_sha256', file_digest(run_dir / 'tokenizer.json')),  # as runs before it wrote
  ):
    copy = tmp_path / key
    shutil.copytree(run_dir, copy)
    written = {k: v for k, v in content.items() if k != 'tokenizer_digest'}
    (copy / 'config.json').write_text(json.dumps({**written, key: value}))
    check_tokenizer(copy)  # its own tokenizer passes
    other.save(copy)
    with pytest.raises(CheckpointError, match='is not the tokenizer this run was trained with'):
      check_tokenizer(copy)
