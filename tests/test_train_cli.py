"""train.py, the command line: options, presets and help; what it refuses before any
compilation; the one-line errors of bad data and of a diverging run; a cmlm run.

train.py is called through its `main` here (exit status and standard error as a user
sees them); tests/test_interruption.py runs real train.py processes for signals,
kill -9 and a full disk, and tests/test_multihost.py several processes of one job.
Each case asserts the message a user gets and what is left on disk.
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from flax_transformer.cli import decode as decode_cli  # the programs of decode.py, train.py
from flax_transformer.cli import options
from flax_transformer.cli import train as train_cli
from flax_transformer.config import SECTIONS, VOCABULARY, TrainConfig, lifetime_of
from flax_transformer.data.toy_task import number_translation
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train import distributed
from flax_transformer.train.loop import load_data
from support.runs import finite, read_metrics, saved_steps, train_state
from support.script_calls import call, error_line, usage_error

# A random model's translations run to the output budget, which max_len caps.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')

# The tiny model of tests/test_interruption.py: one training-step shape per corpus.
OPTIONS = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--model.max_len=16',
  '--data.vocab_size=256',
  '--train.max_tokens=256',
  '--train.warmup_steps=4',
  '--train.log_every=1',
]
# Three usable pairs (fewer than one batch's 32 rows), one pair with an empty side, and
# one longer than model.max_len=16 tokens.
MESSY_EN = ['one', 'two hundred', 'three', 'four', ' '.join(['seven'] * 40)]
MESSY_DE = ['eins', 'zweihundert', 'drei', '   ', ' '.join(['sieben'] * 40)]


def write_corpus(directory: Path, en: list[str], de: list[str]) -> Path:
  directory.mkdir(parents=True, exist_ok=True)
  (directory / 'train.en').write_text(''.join(f'{line}\n' for line in en))
  (directory / 'train.de').write_text(''.join(f'{line}\n' for line in de))
  return directory


# --- options, presets and help -------------------------------------------------------


@pytest.mark.parametrize(
  'argv,message',
  [
    (['--bogus'], 'unrecognized arguments: --bogus'),
    (['--model.d_model=abc'], "model.d_model must be an integer, got 'abc'"),
    (['--steps', '-1'], 'train.steps must be a positive integer, got -1'),
    (['--model.num_heads=3'], 'model.d_model=128 is not divisible by model.num_heads=3'),
    (['--model.activation=tanh'], "model.activation must be one of relu, gelu, silu, got 'tanh'"),
    (['--train.label_smoothing=1.5'], r'train.label_smoothing must be in [0, 1), got 1.5'),
    (['--model.vocab_size=100'], 'unrecognized arguments: --model.vocab_size=100'),
    (['--devices', '0'], "argument --devices: expected a positive integer, got '0'"),
    (['--preset', 'huge'], "argument --preset: invalid choice: 'huge'"),
    (
      ['--process-id', '1'],
      '--num-processes, --process-id and --coordinator-timeout need --coordinator',
    ),
    # Integer limits in full, not 9.22337e+18; an empty --workdir named as given, not as '.'.
    (
      ['--train.seed=9223372036854775808'],
      'train.seed must be an integer in [0, 9223372036854775807], got 9223372036854775808',
    ),
  ],
)
def test_cli_refuses_bad_options_up_front(argv, message):
  assert message in usage_error(train_cli.main, argv)


def test_an_empty_workdir_is_named_as_given(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  status, _, err = call(train_cli.main, ['--workdir', '', '--steps=1'])
  assert status == 2 and err.strip().splitlines() == [
    "train.py: error: --workdir '' names no directory; name a new one (default: runs/PRESET)"
  ]
  assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
  'argv,message,status',
  [
    (['--data', './nowhere'], 'nowhere: no such file or directory', 1),
    (['--devices', '64'], '--devices=64: this process has', 2),  # a bad option: refused
  ],
)
def test_cli_reports_run_errors_without_a_traceback(
  argv, message, status, tmp_path, monkeypatch, capsys
):
  monkeypatch.chdir(tmp_path)
  assert train_cli.main([*argv, '--workdir', str(tmp_path / 'run')]) == status
  error = capsys.readouterr().err
  assert message in error and 'Traceback' not in error


def test_cli_help_documents_every_setting(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_cli.main(['--help'])
  assert exit_info.value.code == 0
  help_text = capsys.readouterr().out
  for option in (
    '--model.d_model',
    '--train.warmup_steps',
    '--train.grad_accum_steps',
    '--data.vocab_size',
    '--bf16',
    '--average-last',
    '--parallel',
    '--no-resume',
    '--coordinator',
  ):
    assert option in help_text, option


def test_cli_offers_every_setting_with_the_help_written_on_its_field():
  parser = train_cli.build_parser()
  options = {action.dest: action for action in parser._actions}
  for section, cls in SECTIONS.items():
    for field in dataclasses.fields(cls):
      option = f'{section}.{field.name}'
      assert field.metadata['help'].strip(), f'{option} has no help'
      if lifetime_of(cls, field.name) is VOCABULARY:
        assert option not in options  # the tokenizer decides them
      else:
        assert options[option].help.startswith(field.metadata['help']), option


def test_a_renamed_setting_is_refused_naming_its_new_name():
  assert 'model.nat_decoder_input is now called model.cmlm_decoder_input' in usage_error(
    train_cli.main, ['--model.nat_decoder_input=mask']
  )


def test_cli_presets_and_overrides():
  args = train_cli.build_parser().parse_args(
    [
      '--preset',
      'multi30k',
      '--model.d_model=512',
      '--steps',
      '10',
      '--bf16',
      '--src',
      'de',
      '--tgt',
      'en',
    ]
  )
  model, training, data = options.configs_from_args(args)
  assert (model.d_model, model.num_encoder_layers, model.dtype) == (512, 4, 'bfloat16')
  assert (training.steps, training.warmup_steps) == (10, TrainConfig.multi30k().warmup_steps)
  assert (data.source, data.src_lang, data.tgt_lang) == ('bentrevett/multi30k', 'de', 'en')


# --- settings and run directories that cannot make a run: refused before compiling --


@pytest.mark.parametrize(
  'argv, expected',
  [
    (['--data.vocab_size=4'], 'data.vocab_size=4 leaves no room for text: the 4 special tokens'),
    (['--model.max_len=1'], 'model.max_len=1 cannot hold a token and EOS'),
    (
      ['--average-last', '9'],
      '--average-last=9 needs that many checkpoints on disk, but '
      'train.keep_checkpoints=5 keeps fewer',
    ),
    (
      ['--skip-nonfinite', '-1'],
      "argument --skip-nonfinite: expected a non-negative integer, got '-1'",
    ),
    (['--steps', '0'], 'train.steps must be a positive integer, got 0'),
    (
      ['--data.test_split=test_2017'],
      'data.test_split picks a split of a data directory or Hub '
      'dataset; the toy task (data.source=toy) has its own',
    ),
  ],
)
def test_train_refuses_settings_that_cannot_make_a_run(argv, expected, tmp_path):
  status, _, err = call(train_cli.main, [*argv, '--workdir', tmp_path / 'run'])
  assert status == 2 and expected in err
  assert not (tmp_path / 'run').exists()  # refused before anything was written


def test_data_split_options_pick_one_of_several_test_sets(tmp_path):
  data = tmp_path / 'multi30k'
  data.mkdir()
  for stem in ('train', 'val', 'dev', 'test_2016_flickr', 'test_2017_mscoco'):
    (data / f'{stem}.en').write_text(f'{stem} en\n')
    (data / f'{stem}.de').write_text(f'{stem} de\n')
  status, _, err = call(train_cli.main, ['--data', data, '--workdir', tmp_path / 'run'])
  assert status == 1 and error_line(err, 'train.py') == (
    f"train.py: error: {data}: several test sets ['test_2016_flickr', 'test_2017_mscoco']; "
    'choose one with data.test_split (train.py --data.test_split=test_2016_flickr)'
  )
  args = train_cli.build_parser().parse_args(
    ['--data', str(data), '--data.valid_split=dev', '--data.test_split=test_2017_mscoco']
  )
  dataset = load_data(options.configs_from_args(args)[2])
  assert dataset['validation']['source'][:] == ['dev en']
  assert dataset['test']['source'][:] == ['test_2017_mscoco en']


def test_unwritable_workdir_is_refused_before_loading_data(tmp_path):
  (tmp_path / 'file').write_text('')
  status, out, err = call(train_cli.main, ['--workdir', tmp_path / 'file' / 'run'])
  assert status == 1 and 'data:' not in out
  assert error_line(err, 'train.py') == (
    f'train.py: error: {tmp_path}/file/run: cannot write the run directory (Not a '
    'directory); choose another --workdir or make this one writable'
  )


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into read-only directories')
def test_read_only_workdir_is_refused_before_loading_data(tmp_path):
  workdir = tmp_path / 'run'
  workdir.mkdir(mode=0o555)
  status, _, err = call(train_cli.main, ['--workdir', workdir])
  assert status == 1 and 'cannot write the run directory (Permission denied)' in err


# --- the options of a multi-process job ----------------------------------------------


@pytest.mark.parametrize(
  'flags, message',
  [
    (['--coordinator=node0'], '--coordinator must be HOST:PORT (the address of process 0)'),
    (
      ['--coordinator=10.0.0.1:1234', '--num-processes=2', '--process-id=2'],
      '--process-id=2 is outside 0 .. 1 (--num-processes=2)',
    ),
    (['--num-processes=2', '--process-id=0'], 'need --coordinator (or --distributed)'),
    (['--coordinator-timeout=5'], 'need --coordinator (or --distributed)'),
    (
      ['--coordinator=10.0.0.1:1234', '--coordinator-timeout=0'],
      "argument --coordinator-timeout: expected a positive integer, got '0'",
    ),
  ],
)
def test_distributed_flags_are_checked_before_joining(flags, message):
  assert message in usage_error(train_cli.main, flags)


@pytest.mark.parametrize(
  'process_id, expected',
  [
    (
      1,
      'no coordinator answered at 127.0.0.1:{port} with all the processes joined within '
      '--coordinator-timeout=1 s; check that process 0 runs there',
    ),
    (
      0,
      'not every process joined the coordinator (process 0, at 127.0.0.1:{port}) within '
      '--coordinator-timeout=1 s; check that all 2 were started',
    ),
  ],
)
def test_a_coordinator_nobody_joins_ends_in_one_line_at_the_timeout(process_id, expected):
  # JAX itself would abort with a C++ stack trace after its timeout (5 minutes by default).
  import subprocess
  import sys

  from support.processes import free_ports

  (port,) = free_ports(1)  # free: nothing listens there
  root = Path(__file__).resolve().parents[1]
  done = subprocess.run(
    [
      sys.executable,
      str(root / 'train.py'),
      f'--coordinator=127.0.0.1:{port}',
      '--num-processes=2',
      f'--process-id={process_id}',
      '--coordinator-timeout=1',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    cwd=root,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(root)},
  )
  assert done.returncode == 1 and not done.stdout
  # First what it waits for and until when, then, at the timeout, the one error line.
  waiting, error = done.stderr.splitlines()
  assert re.fullmatch(
    (
      r'train\.py: coordinator at 127\.0\.0\.1:{port}: waiting for all 2 processes to join, '
      if process_id == 0
      else r'train\.py: process 1: joining the coordinator at 127\.0\.0\.1:{port}, '
    ).format(port=port)
    + r'until \d\d:\d\d:\d\d UTC \(--coordinator-timeout=1 s\)',
    waiting,
  ), waiting
  assert error.startswith(f'train.py: error: {expected.format(port=port)}')
  assert done.stderr.count('\n') == 2 and 'stack trace' not in done.stderr


@pytest.mark.parametrize(
  'coordinator, bound',
  [
    ('127.0.0.1:1234', '127.0.0.1:1234'),
    ('localhost:1234', 'localhost:1234'),
    ('[::1]:1234', '[::1]:1234'),
    ('10.0.0.1:1234', None),
    ('node0:1234', None),
    (None, None),
  ],
)
def test_a_loopback_coordinator_listens_on_loopback_only(coordinator, bound):
  assert distributed.loopback_bind_address(coordinator) == bound


# --- bad data: one line naming the file and the line --------------------------------


@pytest.mark.parametrize(
  'name, en, de, expected',
  [
    (
      'missing',
      ['one'],
      None,
      r"train.de: no such file, but split 'train' needs one file "
      r'per language',
    ),
    (
      'counts',
      ['one', 'two', 'three'],
      ['eins', 'zwei'],
      r'train.en has 3 lines but .*train.de has 2; line N of one must translate line N',
    ),
    (
      'utf8',
      ['one', 'two'],
      b'eins\nzw\xe4i\n',
      r'train.de, line 2: invalid UTF-8 \(invalid continuation byte at byte 2 of the line\)',
    ),
    ('empty', ['one', ''], ['', 'zwei'], r'no sentence pairs \(2 read, all with an empty side\)'),
    (
      'long',
      [' '.join(['one'] * 20)],
      [' '.join(['eins'] * 20)],
      r'the corpus holds no pairs \(1 were longer than max_len=16\); raise max_len',
    ),
  ],
)
def test_bad_data_gives_one_line_naming_file_and_line(tmp_path, name, en, de, expected):
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  (corpus / 'train.en').write_text(''.join(f'{line}\n' for line in en))
  if isinstance(de, bytes):
    (corpus / 'train.de').write_bytes(de)
  elif de is not None:
    (corpus / 'train.de').write_text(''.join(f'{line}\n' for line in de))
  status, _, err = call(train_cli.main, [*OPTIONS, '--data', corpus, '--workdir', tmp_path / 'run'])
  assert status == 1 and 'Traceback' not in err
  assert re.search(expected, error_line(err, 'train.py')), err


# --- a diverging run on a messy corpus ---------------------------------------------------
# A learning rate 1e30 times the schedule's: step 1's update overflows the parameters, so
# step 2's loss is NaN (the divergence of a too-high rate), with no test-only hook.


@pytest.fixture(scope='module')
def diverged(tmp_path_factory):
  base = tmp_path_factory.mktemp('diverged')
  corpus = write_corpus(base / 'corpus', MESSY_EN, MESSY_DE)
  workdir = base / 'run'
  status, out, err = call(
    train_cli.main,
    [
      *OPTIONS,
      '--data',
      corpus,
      '--steps=6',
      '--train.lr_scale=1e30',
      '--train.checkpoint_every=1',
      '--workdir',
      workdir,
    ],
  )
  return {'status': status, 'out': out, 'err': err, 'workdir': workdir, 'corpus': corpus}


def test_messy_corpus_is_filtered_and_counted(diverged):
  out = diverged['out']
  # The empty side and the over-long pair are dropped and counted; three pairs, fewer than
  # one batch holds, make one batch topped up with padding rows.
  assert 'train: 4 pairs (train.en/train.de, 1 dropped with an empty side)' in out
  assert re.search(
    r'train: 3 pairs in 1 batches per epoch of <= 256 tokens, shapes '
    r'\[B x L:batches\] 32x8:1; .*; 1 pairs dropped \(a side longer than '
    r'model.max_len=16 tokens with EOS\)',
    out,
  )
  first = read_metrics(diverged['workdir'])[0]
  assert first['step'] == 1 and np.isfinite(first['loss'])


def test_nonfinite_loss_stops_naming_the_step_and_keeps_the_last_good_checkpoint(diverged):
  workdir = diverged['workdir']
  assert diverged['status'] == 3
  message = error_line(diverged['err'], 'train.py')
  assert re.fullmatch(
    r'train.py: error: step 2: the loss or the gradient is not finite \(loss sum (nan|inf), '
    r'gradient norm (nan|inf)\); its update was not applied\. Training stopped; the last '
    + re.escape(f'checkpoint, {workdir}/checkpoints/1, holds the last good parameters. ')
    + r'Usual causes: .*To skip such steps and go on, pass --skip-nonfinite N\.',
    message,
  )
  assert saved_steps(workdir) == [1]
  state = train_state(workdir, 1)
  assert int(state.step) == 1 and finite(state)
  # The failing step is logged, counted and kept out of the averages.
  assert [line['step'] for line in read_metrics(workdir)] == [1, 2]
  second = read_metrics(workdir)[1]
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
  status, _, err = call(
    train_cli.main,
    [
      *OPTIONS,
      '--data',
      diverged['corpus'],
      '--steps=6',
      '--train.lr_scale=1e30',
      '--train.checkpoint_every=1',
      '--workdir',
      workdir,
    ],
  )
  assert status == 1 and error_line(err, 'train.py').startswith(f'train.py: error: {expected}')
  status, _, err = call(decode_cli.main, ['--checkpoint', workdir, 'one'])
  assert status == 2 and error_line(err, 'decode.py').startswith(f'decode.py: error: {expected}')


# --- train.py --objective cmlm (conftest.py's cmlm_run) --------------------------------------


def test_train_cli_cmlm_writes_a_cmlm_run(cmlm_run):
  status, out, err = cmlm_run['first']
  assert status == 0, err
  workdir = cmlm_run['workdir']
  config = json.loads((workdir / 'config.json').read_text())
  assert config['model']['kind'] == 'cmlm' and config['model']['max_length_offset'] == 4
  assert 'cmlm (non-autoregressive)' in out
  assert re.search(
    r'step 4: validation loss [\d.]+, ppl [\d.]+, token accuracy [\d.]+%, '
    r'length accuracy [\d.]+%',
    out,
  )
  assert 'test, mask-predict decoding (10 iterations, length beam 3) of 8 sentences: chrF' in out
  lines = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  train_lines = [line for line in lines if 'loss' in line]
  assert [line['step'] for line in train_lines][:2] == [2, 4]
  assert all({'length_loss', 'length_accuracy'} <= set(line) for line in train_lines)
  assert any('val_length_accuracy' in line for line in lines)
  assert any('avg_bleu' in line for line in lines)
  assert (workdir / 'average-last2' / 'checkpoints' / '4').is_dir()


def test_train_cli_cmlm_resumes(cmlm_run):
  status, out, err = cmlm_run['resumed']
  assert status == 0, err
  assert re.search(r'resumed from .*checkpoints/4', out)
  assert sorted(int(p.name) for p in (cmlm_run['workdir'] / 'checkpoints').iterdir()) == [2, 4, 6]
