"""Failure handling in-process: non-finite steps, messy data, bad options, decode robustness.

train.py and decode.py are called through their `main` here (exit status and
standard error as a user sees them); tests/test_interruption.py runs real
processes for signals, kill -9 and a full disk. Each case asserts the message
a user gets and what is left on disk.

Non-finite steps are injected two ways, neither through a test-only hook:
  * a learning rate 1e30 times the schedule's: step 1's update overflows the
    parameters, so step 2's loss is NaN (the divergence of a too-high rate);
  * batches holding a token id outside the vocabulary, whose embedding lookup
    (`jnp.take` fills out-of-range rows with NaN) makes that one step's loss
    NaN, as a corrupt batch would.
"""

import os
import re
import shutil
from pathlib import Path

import datasets
import jax
import numpy as np
import pytest

from flax_transformer.batching import Batcher
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.metrics_log import MetricsLog
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.toy_task import number_translation
from flax_transformer.training import NonFiniteError, train
import decode as decode_cli  # the scripts at the repository root
import train as train_cli
from support.runs import assert_trees_equal, saved_steps, train_state
from support.script_calls import call, error_line

# A random model's translations run to the output budget, which max_len caps.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')


# The tiny model of tests/test_interruption.py: one training-step shape per corpus.
OPTIONS = ['--model.d_model=32', '--model.num_heads=4', '--model.num_encoder_layers=1',
           '--model.num_decoder_layers=1', '--model.d_ff=64', '--model.max_len=16',
           '--data.vocab_size=256', '--train.max_tokens=256', '--train.warmup_steps=4',
           '--train.log_every=1']
# Three usable pairs (fewer than one batch's 32 rows), one pair with an empty side, and
# one longer than model.max_len=16 tokens.
MESSY_EN = ['one', 'two hundred', 'three', 'four', ' '.join(['seven'] * 40)]
MESSY_DE = ['eins', 'zweihundert', 'drei', '   ', ' '.join(['sieben'] * 40)]


def write_corpus(directory: Path, en: list[str], de: list[str]) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'train.en').write_text(''.join(f'{line}\n' for line in en))
  (directory / 'train.de').write_text(''.join(f'{line}\n' for line in de))
  return directory


def metrics_lines(workdir: Path) -> list[dict]:
  return MetricsLog.read(workdir / 'metrics.jsonl')


def finite(tree) -> bool:
  return all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(tree))


# --- a diverging run on a messy corpus, through train.py --------------------------------

@pytest.fixture(scope='module')
def diverged(tmp_path_factory):
  base = tmp_path_factory.mktemp('diverged')
  corpus = write_corpus(base / 'corpus', MESSY_EN, MESSY_DE)
  workdir = base / 'run'
  status, out, err = call(train_cli.main, [
      *OPTIONS, '--data', corpus, '--steps=6', '--train.lr_scale=1e30',
      '--train.checkpoint_every=1', '--workdir', workdir])
  return {'status': status, 'out': out, 'err': err, 'workdir': workdir, 'corpus': corpus}


def test_messy_corpus_is_filtered_and_counted(diverged):
  out = diverged['out']
  # The empty side and the over-long pair are dropped and counted; three pairs, fewer than
  # one batch holds, make one batch topped up with padding rows.
  assert 'train: 4 pairs (train.en/train.de, 1 dropped with an empty side)' in out
  assert re.search(r'train: 3 pairs in 1 batches per epoch of <= 256 tokens, shapes '
                   r'\[B x L\]: 32x8; .*; 1 pairs dropped \(a side longer than '
                   r'model.max_len=16 tokens with EOS\)', out)
  first = metrics_lines(diverged['workdir'])[0]
  assert first['step'] == 1 and np.isfinite(first['loss'])


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(diverged):
  workdir = diverged['workdir']
  assert diverged['status'] == 3
  message = error_line(diverged['err'], 'train.py')
  assert re.fullmatch(
      r'train.py: error: step 2: the loss or the gradient is not finite \(loss sum (nan|inf), '
      r'gradient norm (nan|inf)\); its update was not applied\. Training stopped; the last '
      + re.escape(f'checkpoint, {workdir}/checkpoints/1, holds the last good parameters. ')
      + r'Usual causes: .*To skip such steps and go on, pass --skip-nonfinite N\.', message)
  assert saved_steps(workdir) == [1]
  state = train_state(workdir, 1)
  assert int(state.step) == 1 and finite(state)
  # The failing step is logged, counted and kept out of the averages.
  assert [line['step'] for line in metrics_lines(workdir)] == [1, 2]
  second = metrics_lines(workdir)[1]
  assert second['nonfinite_steps'] == 1 and 'loss' not in second


def test_a_tokenizer_that_does_not_match_the_checkpoint_is_refused(diverged, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(diverged['workdir'], workdir)
  size = Tokenizer.load(workdir).vocab_size
  numbers = number_translation(num_train=200, num_validation=1, num_test=1)['train']
  other = Tokenizer.train(numbers['source'][:] + numbers['target'][:], size)
  assert other.vocab_size == size  # the same size: only the recorded digest tells them apart
  other.save(workdir)
  expected = f'{workdir}/tokenizer.json is not the tokenizer this run was trained with'
  status, _, err = call(train_cli.main, [*OPTIONS, '--data', diverged['corpus'], '--steps=6',
                                         '--train.lr_scale=1e30', '--train.checkpoint_every=1',
                                         '--workdir', workdir])
  assert status == 1 and error_line(err, 'train.py').startswith(f'train.py: error: {expected}')
  status, _, err = call(decode_cli.main, ['--checkpoint', workdir, 'one'])
  assert status == 2 and error_line(err, 'decode.py').startswith(f'decode.py: error: {expected}')


# --- skipping non-finite steps, with the library ----------------------------------------

def test_skip_nonfinite_goes_on_after_a_bad_batch_and_stops_past_its_bound(tmp_path,
                                                                         monkeypatch):
  corrupt = {2, 4}  # batch indices: steps 3 and 5
  original = Batcher.batch_at

  def batch_at(self, step):
    batch = original(self, step)
    if step in corrupt:
      src = batch.src.copy()
      src[0, 0] = 10**6  # outside any vocabulary
      batch = batch.replace(src=src)
    return batch

  monkeypatch.setattr(Batcher, 'batch_at', batch_at)
  dataset = datasets.DatasetDict(
      {'train': number_translation(num_train=200, num_validation=1, num_test=1)['train']})
  model = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=16)
  config = TrainConfig(steps=6, max_tokens=256, warmup_steps=4, log_every=1,
                       checkpoint_every=1)
  messages = []
  with pytest.raises(NonFiniteError) as error:
    train(model, config, DataConfig(vocab_size=256), tmp_path, dataset=dataset,
          skip_nonfinite=1, print_fn=messages.append)
  assert error.value.step == 5
  assert re.fullmatch(
      r'step 5: the loss or the gradient is not finite \(loss sum nan, gradient norm nan\); its '
      r'update was not applied; 2 such steps \(3, 5\), more than --skip-nonfinite=1 allows\. '
      + re.escape(f'Training stopped; the last checkpoint, {tmp_path}/checkpoints/4, holds the '
                  'last good parameters.') + ' .*', str(error.value))
  assert any(m.startswith('step 3: the loss or the gradient is not finite') and
             m.endswith('skipped (1 of at most 1, --skip-nonfinite)') for m in messages)
  # Step 3 applied no update: its checkpoint holds step 2's parameters and Adam moments.
  assert saved_steps(tmp_path) == [1, 2, 3, 4]
  two, three, four = (train_state(tmp_path, step) for step in (2, 3, 4))
  assert int(three.step) == 3
  assert_trees_equal((three.params, three.opt_state), (two.params, two.opt_state))
  # ... and step 4 trained on from there.
  assert finite(four) and not np.array_equal(jax.tree.leaves(four.params)[0],
                                             jax.tree.leaves(three.params)[0])
  lines = {line['step']: line for line in metrics_lines(tmp_path)}
  assert lines[3]['nonfinite_steps'] == 1 and 'loss' not in lines[3]
  assert np.isfinite(lines[4]['loss']) and 'nonfinite_steps' not in lines[4]


# --- bad data and bad options: refused before any compilation -------------------------

@pytest.mark.parametrize('name, en, de, expected', [
    ('missing', ['one'], None, r"train.de: no such file, but split 'train' needs one file "
                               r'per language'),
    ('counts', ['one', 'two', 'three'], ['eins', 'zwei'],
     r'train.en has 3 lines but .*train.de has 2; line N of one must translate line N'),
    ('utf8', ['one', 'two'], b'eins\nzw\xe4i\n',
     r'train.de, line 2: invalid UTF-8 \(invalid continuation byte at byte 7\)'),
    ('empty', ['one', ''], ['', 'zwei'], r'no sentence pairs \(2 read, all with an empty side\)'),
    ('long', [' '.join(['one'] * 20)], [' '.join(['eins'] * 20)],
     r'the corpus holds no pairs \(1 were longer than max_len=16\); raise max_len'),
])
def test_bad_data_gives_one_line_naming_file_and_line(tmp_path, name, en, de, expected):
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in en))
  if isinstance(de, bytes):
    (corpus / 'train.de').write_bytes(de)
  elif de is not None:
    (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in de))
  status, _, err = call(train_cli.main, [*OPTIONS, '--data', corpus, '--workdir',
                                         tmp_path / 'run'])
  assert status == 1 and 'Traceback' not in err
  assert re.search(expected, error_line(err, 'train.py')), err


@pytest.mark.parametrize('argv, expected', [
    (['--data.vocab_size=4'], 'data.vocab_size=4 leaves no room for text: the 4 special tokens'),
    (['--model.max_len=1'], 'model.max_len=1 cannot hold a token and EOS'),
    (['--average-last', '9'], '--average-last=9 needs that many checkpoints on disk, but '
                              'train.keep_checkpoints=5 keeps fewer'),
    (['--skip-nonfinite', '-1'], "argument --skip-nonfinite: expected a non-negative integer, "
                                 "got '-1'"),
    (['--steps', '0'], 'train.steps must be a positive integer, got 0'),
])
def test_train_refuses_settings_that_cannot_make_a_run(argv, expected, tmp_path):
  status, _, err = call(train_cli.main, [*argv, '--workdir', tmp_path / 'run'])
  assert status == 2 and expected in err
  assert not (tmp_path / 'run').exists()  # refused before anything was written


def test_unwritable_workdir_is_refused_before_loading_data(tmp_path):
  (tmp_path / 'file').write_text('')
  status, out, err = call(train_cli.main, ['--workdir', tmp_path / 'file' / 'run'])
  assert status == 1 and 'data:' not in out
  assert error_line(err, 'train.py') == (
      f'train.py: error: {tmp_path}/file/run: cannot write the run directory (Not a '
      'directory); choose another --workdir or make this one writable')


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into read-only directories')
def test_read_only_workdir_is_refused_before_loading_data(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir(mode=0o555)
  status, _, err = call(train_cli.main, ['--workdir', workdir])
  assert status == 1 and 'cannot write the run directory (Permission denied)' in err
