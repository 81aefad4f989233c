"""Stopping training: StopSignals and Interrupted (flax_transformer/train/interruption.py) in this
process, and real train.py processes stopped by SIGTERM, SIGINT, kill -9 in the middle of a
save, a full disk.

One corpus and one set of settings for every process, so that they compile the
same training step; JAX's persistent compilation cache (a directory of this
module) shares that compilation between them. The runs, in three phases of
concurrent processes:

  1 term      SIGTERM once three steps are logged: exit 143, the step reached
              is saved.
  2 term      resumed, and stopped by SIGINT three steps later: exit 130, the
              step reached (the run's total, T) is saved.
    killed    tests/support/held_commit.py: checkpoint HELD is written but its commit
              (the rename of HELD.orbax-checkpoint-tmp to HELD) waits; the test
              polls for the temporary directory and sends SIGKILL at once. The
              kill lands after the checkpoint's files began to appear and
              before the rename, whatever the machine's speed: the held commit
              keeps that window open until the kill.
    preempted two train.py processes, one job over 127.0.0.1; SIGTERM to process
              1 alone once three steps are logged: both exit 143 after saving
              the step JAX's preemption service agreed on.
    disk      RLIMIT_FSIZE of 64 KiB, more than config.json and tokenizer.json
              need and less than a checkpoint's array file (about 100 KiB):
              every checkpoint write fails with EFBIG ("File too large"), as on
              a full disk with ENOSPC, through the same orbax and tensorstore
              paths.
  3 straight  the same settings to step T, never interrupted.
    killed    resumed to step T.

Every step is logged (log_every=1), so metrics.jsonl holds each step's loss,
and the comparisons are exact: the same seed and data must give bit-identical
losses, and a resumed run must continue exactly as the uninterrupted one.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flax_transformer.data.toy_task import number_translation
from flax_transformer.files import file_digest
from flax_transformer.train.interruption import Interrupted, StopSignals
from support.environment import xla_flags
from support.processes import free_ports, host_name_is_loopback
from support.runs import assert_trees_equal, saved_steps, train_state

ROOT = Path(__file__).resolve().parents[1]
SAVE_EVERY = 2
HELD = 4  # the checkpoint the killed run never commits; term runs past it before SIGINT
# One layer each side and a vocabulary that puts every pair in the 8-token bucket: one
# training-step shape. Every checkpoint is kept, so that each can be compared.
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
  f'--train.checkpoint_every={SAVE_EVERY}',
  '--train.keep_checkpoints=1000',
]
# Bounds a hang of one process; each takes seconds.
DEADLINE_S = 180
VALUES = ('loss', 'ppl', 'accuracy', 'learning_rate', 'grad_norm')
FILE_LIMIT = 64 * 1024
# train.py with RLIMIT_FSIZE set first (python's own -c, where preexec_fn would fork a
# multithreaded process). Its stdout and stderr go through pipes to `cat` processes
# started before the limit: the limit is for the checkpoint files, and the tracebacks
# that orbax's writing threads print (their number depends on timing) would otherwise
# fill a 64 KiB stderr file too and lose train.py's own last line.
LIMITED = (
  'import atexit, os, resource, runpy, subprocess, sys\n'
  'relays = [subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=fd) for fd in (1, 2)]\n'
  'for fd, relay in zip((1, 2), relays):\n'
  '  os.dup2(relay.stdin.fileno(), fd)\n'
  '  relay.stdin.close()\n'
  f'resource.setrlimit(resource.RLIMIT_FSIZE, ({FILE_LIMIT}, {FILE_LIMIT}))\n'
  'sys.argv = sys.argv[1:]\n'
  '# Everything written reaches the files before this process exits, which train.py\n'
  '# ends itself after the atexit callbacks (cli/failures.py).\n'
  '@atexit.register\n'
  'def drain():\n'
  '  sys.stdout.flush()\n'
  '  sys.stderr.flush()\n'
  '  os.close(1)\n'
  '  os.close(2)\n'
  '  for relay in relays:\n'
  '    relay.wait()\n'
  'runpy.run_path(sys.argv[0], run_name="__main__")\n'
)


def environment(cache: Path) -> dict[str, str]:
  """CPU only, one device per process, compilations cached in `cache`.

  XLA's backend optimisation is off, as in tests/test_multihost.py: compiling
  dominates these runs, and every run of a comparison uses the same flags.
  """
  flags = xla_flags(
    '--xla_force_host_platform_device_count=1', '--xla_backend_optimization_level=0'
  )
  return {
    **os.environ,
    'JAX_PLATFORMS': 'cpu',
    'PYTHONPATH': str(ROOT),
    'XLA_FLAGS': flags,
    'JAX_COMPILATION_CACHE_DIR': str(cache),
    'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS': '0',
    'JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES': '0',
  }


class Setup:
  """The corpus, the compilation cache and the command line every process shares."""

  def __init__(self, base: Path):
    self.base = base
    corpus = base / 'corpus'
    corpus.mkdir()
    pairs = number_translation(num_train=400, num_validation=1, num_test=1)['train']
    for lang, column in (('en', 'source'), ('de', 'target')):
      (corpus / f'train.{lang}').write_text(''.join(f'{s}\n' for s in pairs[column]))
    self.corpus = corpus
    self.cache = base / 'jax-cache'
    self.processes: list[subprocess.Popen] = []

  def launch(
    self,
    name: str,
    steps: int,
    script: tuple[str, ...] = ('train.py',),
    extra: tuple[str, ...] = (),
    log: str = '',
  ) -> subprocess.Popen:
    """train.py (or `script`) on WORKDIR=base/name; output appended to `log_file`s beside it."""
    workdir = self.base / name
    workdir.mkdir(exist_ok=True)
    with (
      open(log_file(workdir, 'stdout', log), 'a') as out,
      open(log_file(workdir, 'stderr', log), 'a') as err,
    ):
      process = subprocess.Popen(
        [
          sys.executable,
          *script,
          *OPTIONS,
          '--data',
          str(self.corpus),
          f'--steps={steps}',
          '--workdir',
          str(workdir),
          *extra,
        ],
        cwd=ROOT,
        env=environment(self.cache),
        stdout=out,
        stderr=err,
      )
    process.log = log_file(workdir, 'stderr', log)  # for the failure messages
    self.processes.append(process)
    return process

  def kill_all(self) -> None:
    """Ends whatever a failed test left running."""
    for process in self.processes:
      if process.poll() is None:
        process.kill()
        process.wait()


def finish(process: subprocess.Popen) -> int:
  try:
    return process.wait(timeout=DEADLINE_S)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    pytest.fail(f'{process.args} still ran after {DEADLINE_S} s:\n{log_tail(process)}')


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
  deadline = time.monotonic() + DEADLINE_S
  while not condition():
    if process.poll() is not None:
      pytest.fail(
        f'the process ended (exit {process.returncode}) before {what}:\n{log_tail(process)}'
      )
    if time.monotonic() > deadline:
      process.kill()
      pytest.fail(f'no {what} after {DEADLINE_S} s:\n{log_tail(process)}')
    time.sleep(0.01)


def log_tail(process: subprocess.Popen) -> str:
  return process.log.read_text()[-3000:]


def logged(workdir: Path) -> dict[int, dict]:
  """metrics.jsonl's training lines by step (a line being written is not yet one)."""
  path = workdir / 'metrics.jsonl'
  text = path.read_text() if path.is_file() else ''
  lines = [json.loads(line) for line in text.split('\n')[:-1]]
  return {line['step']: line for line in lines if 'loss' in line}


def log_file(workdir: Path, stream: str, log: str = '') -> Path:
  """Where a launch's standard output or error goes: beside WORKDIR, never in it (train.py
  refuses a --workdir holding files it did not write)."""
  return workdir.parent / f'{workdir.name}.{stream}{log}.txt'


def last_line(path: Path) -> str:
  """The last line of a log, progress bars' carriage returns counting as line ends."""
  return re.split(r'[\r\n]', path.read_text().strip())[-1]


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  setup = Setup(tmp_path_factory.mktemp('interrupt'))
  yield setup
  setup.kill_all()


@pytest.fixture(scope='module')
def runs(setup):
  """Every run of the module docstring, in three phases of concurrent processes; what each left."""
  base, facts = setup.base, {}

  # 1. term until SIGTERM; its process compiles the step for all the others.
  term = base / 'term'
  process = setup.launch('term', steps=100_000)
  wait_for(lambda: len(logged(term)) >= 3, process, 'three logged steps')
  process.send_signal(signal.SIGTERM)
  facts['term_exit'] = finish(process)
  facts['term_message'] = last_line(log_file(term, 'stderr'))
  facts['term_step'] = max(logged(term))
  facts['term_checkpoints'] = saved_steps(term)

  # 2. term resumed until SIGINT; killed until the save of HELD begins; disk; preempted.
  preempted = []
  if host_name_is_loopback():
    coordinator = f'127.0.0.1:{free_ports(1)[0]}'
    preempted = [
      setup.launch(
        'preempted',
        steps=100_000,
        log=str(index),
        extra=('--coordinator', coordinator, '--num-processes', '2', '--process-id', str(index)),
      )
      for index in (0, 1)
    ]
  killed_dir = base / 'killed'
  held = killed_dir / 'checkpoints' / f'{HELD}.orbax-checkpoint-tmp'
  killed = setup.launch(
    'killed', steps=HELD + SAVE_EVERY, script=('tests/support/held_commit.py', str(HELD))
  )
  disk = setup.launch('disk', steps=4 * SAVE_EVERY, script=('-c', LIMITED, 'train.py'))
  process = setup.launch('term', steps=100_000)
  wait_for(lambda: max(logged(term)) >= facts['term_step'] + 3, process, 'three more steps')
  process.send_signal(signal.SIGINT)
  wait_for(held.is_dir, killed, f'the temporary directory of checkpoint {HELD}')
  killed.send_signal(signal.SIGKILL)
  facts['killed_exit'] = killed.wait()
  facts['killed_listing'] = sorted(p.name for p in (killed_dir / 'checkpoints').iterdir())
  facts['killed_checkpoints'] = saved_steps(killed_dir)
  facts['int_exit'] = finish(process)
  facts['int_message'] = last_line(log_file(term, 'stderr'))
  facts['int_step'] = max(logged(term))
  facts['int_checkpoints'] = saved_steps(term)
  facts['disk_exit'] = finish(disk)
  facts['preempted'] = preempted  # the preempted fixture stops them

  # 3. straight, and killed resumed, to the step where SIGINT stopped term (> HELD).
  total = facts['total'] = facts['int_step']
  last = [setup.launch('straight', steps=total), setup.launch('killed', steps=total)]
  facts['straight_exit'], facts['resumed_exit'] = map(finish, last)
  facts['killed_listing_after'] = sorted(p.name for p in (killed_dir / 'checkpoints').iterdir())
  facts['killed_stdout'] = log_file(killed_dir, 'stdout').read_text()
  return facts


def stop_message(name: str, step: int, workdir: Path) -> str:
  return (
    f'train.py: stopped by {name} after step {step}; saved {workdir}/checkpoints/{step}. '
    'Run the same command again to resume from there.'
  )


@pytest.mark.parametrize(
  'run, number, code', [('term', signal.SIGTERM, 143), ('int', signal.SIGINT, 130)]
)
def test_a_signal_saves_the_step_reached_and_exits_128_plus_its_number(
  runs, setup, run, number, code
):
  step = runs[f'{run}_step']
  assert runs[f'{run}_exit'] == 128 + number == code
  assert runs[f'{run}_message'] == stop_message(number.name, step, setup.base / 'term')
  # The regular checkpoints, and the one of the step reached.
  checkpoints = runs[f'{run}_checkpoints']
  assert checkpoints[-1] == step and set(range(SAVE_EVERY, step + 1, SAVE_EVERY)) <= {*checkpoints}
  assert runs['int_step'] >= runs['term_step'] + 3


@pytest.fixture(scope='module')
def preempted(runs, setup) -> list[int]:
  """The exit statuses of the 2-process job, SIGTERM sent to process 1 once 3 steps are logged.

  A fixture of its own, so that a failure of this job fails its test alone.
  """
  processes = runs['preempted']
  if not processes:
    pytest.skip("gloo would listen on this host name's address, which is not loopback")
  wait_for(lambda: len(logged(setup.base / 'preempted')) >= 3, processes[0], 'three logged steps')
  processes[1].send_signal(signal.SIGTERM)  # process 1 only
  return [finish(process) for process in processes]


def test_sigterm_to_one_process_of_a_job_stops_every_process_at_one_step(preempted, setup):
  workdir = setup.base / 'preempted'
  step = max(logged(workdir))
  assert preempted == [143, 143]
  # JAX's preemption service told process 0 too; both saved the same step, in one checkpoint.
  for index in (0, 1):
    assert last_line(log_file(workdir, 'stderr', str(index))) == stop_message(
      'SIGTERM', step, workdir
    )
  assert saved_steps(workdir) == [*range(SAVE_EVERY, step, SAVE_EVERY), step]


def test_kill_9_during_a_save_leaves_the_previous_checkpoint_intact(runs, setup):
  assert runs['killed_exit'] == -signal.SIGKILL
  # At the kill: checkpoint HELD half done in its temporary directory, the previous one whole.
  assert runs['killed_listing'] == [str(SAVE_EVERY), f'{HELD}.orbax-checkpoint-tmp']
  assert runs['killed_checkpoints'] == [SAVE_EVERY]
  # ... and holding exactly what the uninterrupted run saved at that step.
  killed = train_state(setup.base / 'killed', SAVE_EVERY)
  assert_trees_equal(killed, train_state(setup.base / 'straight', SAVE_EVERY))
  assert int(killed.step) == SAVE_EVERY


def test_resume_after_kill_9_removes_the_partial_save(runs, setup):
  assert runs['resumed_exit'] == 0 and runs['straight_exit'] == 0
  listing = runs['killed_listing_after']
  assert not [name for name in listing if 'tmp' in name]
  total = runs['total']
  assert sorted(map(int, listing)) == sorted({*range(SAVE_EVERY, total + 1, SAVE_EVERY), total})
  assert f'resumed from {setup.base}/killed/checkpoints/{SAVE_EVERY}\n' in runs['killed_stdout']


def test_same_seed_and_data_give_bit_identical_losses(runs, setup):
  # The first steps of three fresh processes: term (before SIGTERM), straight, killed.
  first = runs['term_step']
  histories = [logged(setup.base / name) for name in ('term', 'straight', 'killed')]
  for step in range(1, first + 1):
    rows = [{key: history[step][key] for key in VALUES} for history in histories]
    assert rows[0] == rows[1] == rows[2], f'step {step}'
  assert (
    len(
      {file_digest(setup.base / name / 'tokenizer.json') for name in ('term', 'straight', 'killed')}
    )
    == 1
  )


def test_resumed_runs_continue_exactly_as_the_uninterrupted_run(runs, setup):
  # term: resumed after SIGTERM, saved at SIGINT; killed: resumed after kill -9, to the same step.
  total = runs['total']
  straight = logged(setup.base / 'straight')
  assert sorted(straight) == list(range(1, total + 1))
  final = train_state(setup.base / 'straight', total)
  for name in ('term', 'killed'):
    history = logged(setup.base / name)
    # One line per step: the lines past a resumed checkpoint were dropped, then rewritten.
    assert sorted(history) == list(range(1, total + 1)), name
    for step in range(1, total + 1):
      assert {k: history[step][k] for k in VALUES} == {k: straight[step][k] for k in VALUES}, (
        f'{name}, step {step}'
      )
    assert_trees_equal(train_state(setup.base / name, total), final)
  # Training moved on after the first interruption, so the equality is not trivial.
  assert straight[total]['loss'] != straight[runs['term_step']]['loss']


def test_a_full_disk_stops_training_with_one_clear_line(runs, setup):
  workdir = setup.base / 'disk'
  assert runs['disk_exit'] == 1
  # The tracebacks of orbax's and tensorstore's threads are silenced (cli/failures.py):
  # train.py's report comes alone, after the progress bar.
  stderr = log_file(workdir, 'stderr').read_text()
  assert 'Traceback' not in stderr and 'ERROR:absl' not in stderr
  (message,) = [line for line in re.split(r'[\r\n]', stderr) if 'train.py:' in line]
  assert message.startswith(
    f'train.py: error: {workdir}/checkpoints/{SAVE_EVERY}: the checkpoint could not be written ('
  )
  assert 'File too large' in message and 'no earlier checkpoint exists' in message
  assert message.endswith('Free disk space or fix the permissions, then run again to resume')
  # Stopped at the latest when the next checkpoint was due, without starting it.
  assert max(logged(workdir)) <= 2 * SAVE_EVERY
  assert [p.name for p in (workdir / 'checkpoints').iterdir()] == [
    f'{SAVE_EVERY}.orbax-checkpoint-tmp'
  ]


# --- StopSignals and Interrupted, in this process ----------------------------------------


def test_stop_signals_note_the_first_signal_and_a_second_ctrl_c_stops_at_once():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  with StopSignals() as stop:
    assert not stop.requested(1)
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.requested(2) and stop.signal_number == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGINT)  # after SIGTERM: still the save under way
    assert stop.signal_number == signal.SIGTERM
  with StopSignals() as stop:
    os.kill(os.getpid(), signal.SIGINT)
    assert stop.requested(1) and stop.signal_number == signal.SIGINT
    with pytest.raises(KeyboardInterrupt, match='second SIGINT'):
      os.kill(os.getpid(), signal.SIGINT)
  assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
  stopped = Interrupted(signal.SIGTERM, 7, Path('run/checkpoints/7'))
  assert stopped.exit_code == 143 and str(stopped) == (
    'stopped by SIGTERM after step 7; saved run/checkpoints/7. Run the same command again to '
    'resume from there.'
  )
