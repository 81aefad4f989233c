"""Faults a user meets, each answered by one line and a documented status (cli/failures.py),
or recovered from, saying so: a second writer, damaged checkpoints, a config.json that does
not fit the saved arrays, absurd sizes, a foreign tokenizer, a failure with and without
--debug, SIGTERM before training, after the final evaluation and while exiting, a bad --data,
a failed second checkpoint save.

The run directories are copies (shutil.copytree) of conftest.py's session runs: cmlm_run
(train.py --objective cmlm, checkpoints 2, 4, 6) and checkpointed_run (checkpoints 6, 8, 10
of a tiny model), so that only the resumed run trains. The lock's own tests, with a killed
holder, are tests/test_run_directory.py's.
"""

import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import numpy as np
import pytest
from conftest import CMLM_OPTIONS

from flax_transformer.cli import decode as decode_cli  # the programs of decode.py, train.py
from flax_transformer.cli import train as train_cli
from flax_transformer.config import ModelConfig
from flax_transformer.nn.build import abstract_params
from flax_transformer.nn.model import count_params
from flax_transformer.run.checkpoints import (
  DIGESTS_FILE,
  CheckpointError,
  Checkpoints,
  DamagedCheckpoint,
  WriteError,
)
from flax_transformer.run.sizes import check_fits, parameter_count
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train import loop, report, setup
from support.lock_holder import lock_holder
from support.runs import saved_steps
from support.script_calls import call, error_line, usage_error

pytestmark = [
  pytest.mark.filterwarnings('ignore:source length .* output capped'),
  # A failed read leaves tensorstore's threads calling into orbax's closed event loop;
  # train.py and decode.py silence them (cli/failures.py), tests of the library see them.
  pytest.mark.filterwarnings('ignore::pytest.PytestUnraisableExceptionWarning'),
]


def params_file(workdir: Path, step: int) -> Path:
  """The largest array file of the parameters saved at `step` (their kernels)."""
  files = (workdir / 'checkpoints' / str(step) / 'params' / 'ocdbt.process_0' / 'd').iterdir()
  return max(files, key=lambda path: path.stat().st_size)


def truncate(path: Path) -> None:
  path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero_fill(path: Path) -> None:
  path.write_bytes(bytes(path.stat().st_size))


def cmlm_train(corpus: Path, workdir: Path, *extra) -> tuple[int, str, str]:
  return call(
    train_cli.main,
    ['--objective', 'cmlm', *CMLM_OPTIONS, '--data', corpus, '--workdir', workdir, *extra],
  )


@pytest.fixture
def cmlm_copy(cmlm_run, tmp_path) -> Path:
  workdir = tmp_path / 'run'
  shutil.copytree(cmlm_run['workdir'], workdir)
  return workdir


@pytest.fixture
def tiny_copy(checkpointed_run, tmp_path) -> Path:
  workdir = tmp_path / 'tiny'
  shutil.copytree(checkpointed_run.run_dir, workdir)
  return workdir


def edit_config(workdir: Path, **model) -> None:
  content = json.loads((workdir / 'config.json').read_text())
  content['model'].update(model)
  (workdir / 'config.json').write_text(json.dumps(content))


# --- two writers -----------------------------------------------------------------------------


def test_a_second_train_py_on_a_run_directory_is_refused_naming_the_first(tmp_path):
  workdir = tmp_path / 'run'
  with lock_holder(workdir) as holder:
    status, _, err = call(train_cli.main, ['--workdir', workdir, '--steps=1'])
  assert status == 1 and 'Traceback' not in err
  line = error_line(err, 'train.py')
  assert line.startswith(
    f'train.py: error: {workdir}: another training run is writing this run '
    f'directory (pid {holder.pid} on host {socket.gethostname()} since '
  )
  assert sorted(os.listdir(workdir)) == ['run.lock']  # refused before anything was written


# --- damaged checkpoints -----------------------------------------------------------------------


def test_resume_skips_damaged_checkpoints_and_decode_names_the_file(cmlm_copy, numbers_corpus):
  workdir = cmlm_copy
  truncated, zeroed = params_file(workdir, 6), params_file(workdir, 4)
  truncate(truncated)
  zero_fill(zeroed)
  truncated_size = truncated.stat().st_size
  status, _, err = call(decode_cli.main, ['--checkpoint', workdir, 'one'])
  assert status == 2 and 'Traceback' not in err
  assert error_line(err, 'decode.py') == (
    f'decode.py: error: {workdir}/checkpoints/6: damaged checkpoint (step 6): '
    f'{truncated.relative_to(workdir / "checkpoints" / "6")} is not the file written (its '
    f'SHA-256 differs from the one recorded in {DIGESTS_FILE})'
  )
  config_before = (workdir / 'config.json').read_text()

  status, out, err = cmlm_train(numbers_corpus, workdir, '--steps=4')
  assert status == 0, err
  skipped = [line for line in out.splitlines() if line.startswith('skipped checkpoint')]
  assert len(skipped) == 2
  assert skipped[0].startswith(
    f'skipped checkpoint 6: {workdir}/checkpoints/6: damaged checkpoint (step 6): params/'
  )
  assert skipped[0].endswith(f'; moved it to {workdir}/checkpoints/damaged-6')
  assert skipped[1].startswith('skipped checkpoint 4: ')
  assert f'resumed from {workdir}/checkpoints/2' in out
  # Retrained from the intact step 2; the damaged ones kept aside, byte for byte.
  assert saved_steps(workdir) == [2, 4]
  aside = (
    workdir / 'checkpoints' / 'damaged-6' / truncated.relative_to(workdir / 'checkpoints' / '6')
  )
  assert aside.stat().st_size == truncated_size
  assert (workdir / 'checkpoints' / 'damaged-4').is_dir()
  assert json.loads((workdir / 'config.json').read_text())['train']['steps'] == 4
  assert json.loads(config_before)['train']['steps'] == 6


@pytest.mark.parametrize('damage', [truncate, zero_fill])
def test_unreadable_arrays_without_recorded_digests_are_damage_not_mismatch(tiny_copy, damage):
  # A checkpoint whose process was killed before its digests were recorded, loaded anyway
  # (--allow-unverified): orbax's read fails, and that is damage too.
  (tiny_copy / 'checkpoints' / '10' / DIGESTS_FILE).unlink()
  damage(params_file(tiny_copy, 10))
  told = []
  checkpoints = Checkpoints(tiny_copy, read_only=True, on_unverified=told.append)
  config = json.loads((tiny_copy / 'config.json').read_text())['model']
  with pytest.raises(DamagedCheckpoint) as error:
    checkpoints.restore_params(10, abstract_params(ModelConfig(**config)))
  checkpoints.close()
  assert error.value.step == 10
  assert re.fullmatch(
    rf'{tiny_copy}/checkpoints/10: damaged checkpoint \(step 10\): the array '
    rf'[\w.]+ in {tiny_copy}/checkpoints/10/params cannot be read \([^\n]+\)',
    str(error.value),
  ), str(error.value)
  assert len(str(error.value)) < 400  # not tensorstore's spec
  assert told == [
    f'{tiny_copy}/checkpoints/10: checkpoint 10 NOT VERIFIED (no {DIGESTS_FILE}); '
    'loaded as --allow-unverified asks'
  ]


def _flip_one_byte(path: Path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x01
  path.write_bytes(bytes(data))


@pytest.mark.parametrize('flipped', [False, True], ids=['intact', 'one_byte_flipped'])
def test_a_checkpoint_without_digests_is_never_loaded_unverified(tiny_copy, flipped, tmp_path):
  """sha256sums.json deleted (with or without a changed array byte): decode.py refuses in one
  line naming the checkpoint; --allow-unverified loads it, saying it was not verified."""
  digests = tiny_copy / 'checkpoints' / '10' / DIGESTS_FILE
  digests.unlink()
  if flipped:
    _flip_one_byte(params_file(tiny_copy, 10))
  status, out, err = call(decode_cli.main, ['--checkpoint', tiny_copy, '--method', 'greedy', 'a b'])
  assert status == 2 and not out
  assert error_line(err, 'decode.py') == (
    f'decode.py: error: {tiny_copy}/checkpoints/10: unverified checkpoint (step 10): it has no '
    f'{DIGESTS_FILE}, so its files cannot be checked against what was written; '
    '--allow-unverified loads it anyway'
  )
  status, out, err = call(
    decode_cli.main, ['--checkpoint', tiny_copy, '--method', 'greedy', '--allow-unverified', 'a b']
  )
  assert (
    f'decode.py: warning: {tiny_copy}/checkpoints/10: checkpoint 10 NOT VERIFIED (no '
    f'{DIGESTS_FILE}); loaded as --allow-unverified asks'
  ) in err.splitlines()
  if not flipped:
    assert status == 0 and len(out.splitlines()) == 1
  else:
    # The changed byte may still decode (the changed weights load, as asked) or may break the
    # array's encoding, which orbax's read then reports as damage, naming the step.
    assert (status == 0 and len(out.splitlines()) == 1) or (
      status == 2 and 'damaged checkpoint (step 10)' in error_line(err, 'decode.py')
    ), err


@pytest.mark.parametrize(
  'change, shown',
  [
    (
      lambda step: (step / 'stray.bin').write_bytes(b'x'),
      'stray.bin is not among the files written (not listed in sha256sums.json)',
    ),
    (
      lambda step: (step / DIGESTS_FILE).write_text(
        json.dumps({**json.loads((step / DIGESTS_FILE).read_text()), 'params/gone.bin': '0' * 64})
      ),
      'params/gone.bin is missing',
    ),
    (
      lambda step: (step / DIGESTS_FILE).write_text('[]'),
      f'{DIGESTS_FILE} is not a JSON object of file names and SHA-256s',
    ),
  ],
  ids=['extra_file', 'listed_file_missing', 'digests_not_an_object'],
)
def test_files_and_digests_must_agree_exactly(tiny_copy, change, shown):
  change(tiny_copy / 'checkpoints' / '10')
  status, _, err = call(decode_cli.main, ['--checkpoint', tiny_copy, '--method', 'greedy', 'a b'])
  assert status == 2
  assert error_line(err, 'decode.py') == (
    f'decode.py: error: {tiny_copy}/checkpoints/10: damaged checkpoint (step 10): {shown}'
  )


def test_a_resume_sets_an_unverified_checkpoint_aside_unless_allowed(cmlm_copy, numbers_corpus):
  """train.py resumes from the newest verified checkpoint, saying which it skipped and why;
  with --allow-unverified it resumes from the unverified one, saying so."""
  allowed = cmlm_copy.parent / 'allowed'
  shutil.copytree(cmlm_copy, allowed)
  for workdir in (cmlm_copy, allowed):
    (workdir / 'checkpoints' / '6' / DIGESTS_FILE).unlink()
  status, out, err = cmlm_train(numbers_corpus, cmlm_copy, '--steps=8')
  assert status == 0, err
  assert (
    f'skipped checkpoint 6: {cmlm_copy}/checkpoints/6: unverified checkpoint (step 6): it '
    f'has no {DIGESTS_FILE}'
  ) in out
  assert f'resumed from {cmlm_copy}/checkpoints/4' in out
  assert (cmlm_copy / 'checkpoints' / 'damaged-6').is_dir()
  status, out, err = cmlm_train(numbers_corpus, allowed, '--steps=8', '--allow-unverified')
  assert status == 0, err
  assert f'{allowed}/checkpoints/6: checkpoint 6 NOT VERIFIED' in out
  assert f'resumed from {allowed}/checkpoints/6' in out
  assert not (allowed / 'checkpoints' / 'damaged-6').exists()


def test_nothing_is_rewritten_when_the_restore_fails(cmlm_copy, numbers_corpus, monkeypatch):
  before = {name: (cmlm_copy / name).read_bytes() for name in ('config.json', 'metrics.jsonl')}

  def refuse(self, step, abstract_state):
    raise CheckpointError(f'checkpoint {step} refused by the test')

  monkeypatch.setattr(Checkpoints, 'restore', refuse)
  status, _, err = cmlm_train(numbers_corpus, cmlm_copy, '--steps=8')
  assert status == 1 and error_line(err, 'train.py') == (
    'train.py: error: checkpoint 6 refused by the test'
  )
  assert {name: (cmlm_copy / name).read_bytes() for name in before} == before


# --- config.json against the saved arrays ---------------------------------------------------


@pytest.mark.parametrize('layers', [3, 1000])
def test_a_config_that_does_not_fit_the_arrays_is_one_line_naming_the_first(tiny_copy, layers):
  edit_config(tiny_copy, num_encoder_layers=layers)
  status, _, err = call(decode_cli.main, ['--checkpoint', tiny_copy, 'ein Hund'])
  count = 15 * (layers - 1)  # each encoder layer of the tiny model has 15 arrays
  assert status == 2 and err.count('\n') == 1
  assert err == (
    f'decode.py: error: {tiny_copy}/checkpoints/10 does not hold parameters of the model in '
    f'config.json: {count} arrays differ, encoder/layer_1/ffn/wi/bias (64,) is not saved; '
    'encoder/layer_1/ffn/wi/kernel (32, 64) is not saved; encoder/layer_1/ffn/wo/bias (32,) is '
    f'not saved (and {count - 3} more). The checkpoint belongs to another model: use the '
    'config.json it was written with\n'
  )


# --- sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  'option',
  [
    '--model.d_ff=1000000000000',
    '--model.max_len=1000000000',
    '--model.num_encoder_layers=1000000',
  ],
)
def test_absurd_sizes_are_refused_before_allocation(option, tmp_path):
  err = usage_error(
    train_cli.main, [option, '--model.d_model=512', '--workdir', str(tmp_path / 'r')]
  )
  assert re.search(
    r'train.py: error: the model is too large for this machine: about [\d,]+ '
    r'parameters \([\d,.]+ GiB for parameters, gradients and Adam state\) and '
    r'[\d,.]+ GiB of activations for one batch of [\d,]+ tokens',
    err,
  ), err
  assert not (tmp_path / 'r').exists()


def test_decode_refuses_a_config_json_too_large_for_the_machine(tiny_copy):
  edit_config(tiny_copy, max_len=10**9, d_model=512)
  status, _, err = call(decode_cli.main, ['--checkpoint', tiny_copy, 'ein Hund'])
  assert status == 2 and err.count('\n') == 1
  assert err.startswith('decode.py: error: the model is too large for this machine: about ')


def test_the_size_estimate_is_a_close_lower_bound_and_admits_the_presets():
  for config in (
    ModelConfig.tiny(vocab_size=100),
    ModelConfig.tiny(share_embeddings=False),
    ModelConfig(vocab_size=1000, d_model=64, num_heads=4, d_ff=96),
  ):
    actual = count_params(abstract_params(config))
    assert 0.9 * actual <= parameter_count(config) <= actual
  base = ModelConfig(vocab_size=37_000)  # the paper's base model: 63M parameters
  check_fits(base, max_tokens=25_000, memory=16 * 2**30)
  with pytest.raises(Exception, match=r'more than its 1.0 GiB of memory'):
    check_fits(base, max_tokens=25_000, memory=2**30)


# --- a tokenizer swapped in --------------------------------------------------------------------


def test_a_foreign_tokenizer_without_a_digest_is_named_as_such(cmlm_copy, numbers_corpus):
  content = json.loads((cmlm_copy / 'config.json').read_text())
  del content['tokenizer_digest']
  (cmlm_copy / 'config.json').write_text(json.dumps(content))
  other = Tokenizer.train(['ein kleiner Hund', 'a small dog'], 40)
  other.save(cmlm_copy)
  expected = (
    f'{cmlm_copy}/tokenizer.json does not belong to this run: it has vocab_size '
    f'{other.vocab_size}, the model in {cmlm_copy}/config.json and its checkpoints were '
    f"trained with {content['model']['vocab_size']}. Put the run's own tokenizer.json "
    'back, or start a new run in another --workdir (or with --no-resume)'
  )
  status, _, err = cmlm_train(numbers_corpus, cmlm_copy, '--steps=8')
  assert status == 1 and error_line(err, 'train.py') == f'train.py: error: {expected}'
  status, _, err = call(decode_cli.main, ['--checkpoint', cmlm_copy, 'one'])
  assert status == 2 and error_line(err, 'decode.py') == f'decode.py: error: {expected}'


# --- one line, unless --debug ------------------------------------------------------------------


def test_an_unexpected_failure_is_one_line_and_debug_adds_the_traceback(tiny_copy, monkeypatch):
  from flax_transformer.decode.translator import Translator

  def broken(*args, **kwargs):
    raise RuntimeError('device lost\nmore detail')

  monkeypatch.setattr(Translator, 'from_checkpoint', broken)
  argv = ['--checkpoint', tiny_copy, 'ein Hund']
  line = (
    'decode.py: error: RuntimeError: device lost (unexpected; --debug or '
    'FLAX_TRANSFORMER_DEBUG=1 shows the traceback)\n'
  )
  assert call(decode_cli.main, argv) == (1, '', line)
  status, _, err = call(decode_cli.main, [*argv, '--debug'])
  assert status == 1 and err.startswith('Traceback') and err.endswith(line)
  monkeypatch.setenv('FLAX_TRANSFORMER_DEBUG', '1')
  status, _, err = call(decode_cli.main, argv)
  assert status == 1 and 'Traceback' in err and err.endswith(line)


# --- SIGTERM before training; a bad --data -----------------------------------------------------


def test_sigterm_before_the_first_step_says_so_and_writes_nothing_of_the_run(tmp_path, monkeypatch):
  load = setup.load_training_data

  def terminated_while_loading(data_config, dataset=None):
    os.kill(os.getpid(), signal.SIGTERM)  # recorded; acted on at the next safe point
    return load(data_config, dataset)

  monkeypatch.setattr(setup, 'load_training_data', terminated_while_loading)
  status, _, err = call(train_cli.main, ['--workdir', tmp_path / 'run', '--steps=1'])
  assert status == 143 and err.splitlines()[-1] == (  # after the encoding's bar, cleared
    'train.py: stopped by SIGTERM before the first step (while loading); nothing new was '
    'saved: run the same command to resume from the latest checkpoint, if any'
  )
  assert not {'config.json', 'metrics.jsonl'} & {path.name for path in (tmp_path / 'run').iterdir()}
  assert not list((tmp_path / 'run' / 'checkpoints').iterdir())
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the program's handler is gone


def test_a_bad_data_option_leaves_no_empty_run_directory(tmp_path):
  (tmp_path / 'corpus').mkdir()
  status, _, err = call(
    train_cli.main, ['--data', tmp_path / 'corpus', '--workdir', tmp_path / 'new' / 'run']
  )
  assert status == 1 and 'Traceback' not in err and error_line(err, 'train.py')
  assert not (tmp_path / 'new' / 'run').exists()


def test_debug_adds_the_traceback_to_a_known_failure_too(tmp_path):
  argv = ['--checkpoint', tmp_path / 'missing', 'ein Hund']
  line = f'decode.py: error: {tmp_path}/missing: no such directory\n'
  assert call(decode_cli.main, argv) == (2, '', line)
  status, _, err = call(decode_cli.main, [*argv, '--debug'])
  assert status == 2 and err.startswith('Traceback') and 'CheckpointError' in err
  assert err.endswith(line)


# --- leftovers: a failed second save, SIGTERM after the final evaluation -------------------------


def test_a_failed_second_save_is_one_line_without_the_library_threads_reports(tmp_path, caplog):
  # A full disk at the second save: the first save is orbax's own; the second's background
  # write fails as orbax's does, leaving an asyncio task whose exception nobody retrieves,
  # held in a reference cycle, so that it reports itself whenever it is collected.
  import asyncio
  import errno
  import gc

  from flax_transformer.cli.failures import run_program, train_failure

  def failing_save(manager):
    def save(step, force, args):
      async def write():
        raise OSError(errno.ENOSPC, 'No space left on device')

      loop = asyncio.new_event_loop()
      task = loop.create_task(write())
      loop.run_until_complete(asyncio.sleep(0))
      loop.close()
      cycle = {'task': task}
      cycle['cycle'] = cycle
      manager.pending = cycle

      def wait_until_finished():  # raises once, as orbax's does for a failed write
        del manager.wait_until_finished
        raise ValueError('RESOURCE_EXHAUSTED: No space left on device')

      manager.wait_until_finished = wait_until_finished

    return save

  def body():
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save_params(1, {'w': np.ones(3, np.float32)})
    checkpoints.check_saved()
    checkpoints._manager.save = failing_save(checkpoints._manager)  # held by it alone
    checkpoints.save_params(2, {'w': np.ones(3, np.float32)})  # the first save confirmed here
    checkpoints.close()  # the second's failure surfaces here
    return 0

  status, out, err = call(lambda argv: run_program('train.py', body, argv, train_failure), [])
  gc.collect()  # whatever the program left uncollected reports itself now, if at all
  assert status == 1 and not out
  assert err.startswith(
    f'train.py: error: {tmp_path}/checkpoints/2: the checkpoint could not '
    'be written (ValueError: RESOURCE_EXHAUSTED: No space left on device); '
    f'the previous checkpoint, {tmp_path}/checkpoints/1, is intact.'
  )
  assert err.count('\n') == 1
  assert not [record for record in caplog.records if record.name == 'asyncio']


@pytest.mark.parametrize('when', ['during', 'after'])
def test_sigterm_in_or_after_the_final_evaluation_ends_with_its_line(
  cmlm_copy, numbers_corpus, monkeypatch, when
):
  """During it: the evaluation is abandoned between batches and the line says to run again;
  after it, in the last instant of the work: the line says nothing is lost. Both 143."""
  scores = report.translation_scores

  def sigterm_in_the_evaluation(*args, **kwargs):
    if when == 'during':
      os.kill(os.getpid(), signal.SIGTERM)  # recorded; the translator stops before a batch
    result = scores(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)  # after the last batch: no safe point follows
    return result

  monkeypatch.setattr(report, 'translation_scores', sigterm_in_the_evaluation)
  status, out, err = cmlm_train(numbers_corpus, cmlm_copy, '--steps=6')  # trained: evaluates
  assert 'already trained to step 6' in out
  assert status == 143 and ('exact match' in out) == (when == 'after')
  assert err.splitlines()[-1] == (
    f'train.py: stopped by SIGTERM in the final evaluation of step 6, saved in '
    f'{cmlm_copy}/checkpoints/6. Run the same command again to evaluate it.'
    if when == 'during'
    else 'train.py: stopped by SIGTERM after its work was done (nothing is lost)'
  )


@pytest.mark.parametrize('status', [0, 1], ids=['after_success', 'after_a_failure'])
def test_sigterm_while_the_process_exits_ends_it_with_one_line(status, monkeypatch):
  # Run as the process's own program (argv None), the work done: the process ends after the
  # atexit callbacks, without the interpreter's teardown, in which Python has restored
  # SIGTERM's default action; a SIGTERM during the callbacks gets its line and status 143.
  from flax_transformer.cli import failures

  def exit_now(code):
    raise SystemExit(code)

  def sigterm_during_the_callbacks():
    os.kill(os.getpid(), signal.SIGTERM)  # recorded: the exit comes after the callbacks

  monkeypatch.setattr(failures.os, '_exit', exit_now)
  monkeypatch.setattr(failures.atexit, '_run_exitfuncs', sigterm_during_the_callbacks)
  monkeypatch.setattr(failures.sys, 'argv', ['train.py'])

  def body():
    if status:
      raise WriteError('disk full')
    return 0

  exit_status, _, err = call(
    lambda argv: failures.run_program('train.py', body, None, failures.train_failure), []
  )
  assert exit_status == (143 if status == 0 else status)
  assert err == (
    'train.py: error: disk full\n'
    if status
    else 'train.py: stopped by SIGTERM after its work was done (nothing is lost)\n'
  )
  assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_device_out_of_memory_in_a_step_is_one_line_and_keeps_the_checkpoints(
  tmp_path, monkeypatch
):
  """XLA's RESOURCE_EXHAUSTED (a batch shape too large for the device, found when it first
  runs) is named with what to lower; the checkpoint saved before it stays."""
  import jax

  build = loop.compiled_training

  def failing_build(*args, **kwargs):
    model, optimizer, step = build(*args, **kwargs)
    calls = []

    def run(state, batch):
      calls.append(1)
      if len(calls) == 2:
        raise jax.errors.JaxRuntimeError(
          'RESOURCE_EXHAUSTED: Out of memory allocating 30602629616 bytes.'
        )
      return step(state, batch)

    return model, optimizer, run

  monkeypatch.setattr(loop, 'compiled_training', failing_build)
  options = [option for option in CMLM_OPTIONS if not option.startswith('--model.max_length')]
  status, _, err = call(
    train_cli.main,
    [*options, '--workdir', tmp_path / 'run', '--steps=3', '--train.checkpoint_every=1'],
  )
  assert status == 1 and 'Traceback' not in err
  assert error_line(err, 'train.py') == (
    'train.py: error: the device ran out of memory in a training step (Out of memory '
    'allocating 30602629616 bytes.); lower --train.max_tokens (tokens per batch) or the '
    'model size; the checkpoints on disk are complete: run again to resume'
  )
  assert saved_steps(tmp_path / 'run') == [1]
