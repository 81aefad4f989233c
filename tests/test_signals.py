"""SIGTERM and SIGINT recorded, never raised inside arbitrary code, acted on at safe points.

The unit tests drive `flax_transformer.signals` directly. The sweep sends a signal
at many points of a short train.py run in this process: a profile hook counts the
Python calls of the run and sends the signal at the K-th, so it lands inside
whatever is running then (tracing, a step, a checkpoint save, an evaluation, a
weakref or gc callback, the last lines of the program). Each time the status and
the one line are README's, what is on disk matches the line, and the same command
then finishes the run with the parameters and scores of an uninterrupted one. One
real process gets SIGTERM after its final line (the case that once exited 0).
"""

import os
import re
import signal
import subprocess
import sys
import weakref
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import CMLM_OPTIONS

import train as train_cli
from flax_transformer import signals
from flax_transformer.run.loading import load_for_inference
from support.script_calls import call

REPO = Path(__file__).resolve().parents[1]
# The numbers corpus on the tiny model of the cmlm runs, autoregressive: validation every 2
# steps, a BLEU evaluation at step 4 (between checkpoints, at 3 and 6: an abandoned one must
# save its step itself), greedy decoding of the test split at the end.
OPTIONS = [
  option
  for option in CMLM_OPTIONS
  if 'max_length_offset' not in option and 'checkpoint_every' not in option
] + ['--train.checkpoint_every=3', '--train.bleu_every=4', '--steps=6']


# --- the record ----------------------------------------------------------------------------------


def test_a_signal_is_recorded_and_raised_only_where_checked():
  before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
  with signals.recording('x.py'):
    signals.check()  # nothing yet
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.received() == signal.SIGTERM
    with signals.recording():  # nested: the same record
      with pytest.raises(signals.Stopped) as stopped:
        signals.check()
    assert stopped.value.exit_code == 143 and str(stopped.value) == 'stopped by SIGTERM'
    assert signals.received() == signal.SIGTERM  # kept for every caller on the way out
    os.kill(os.getpid(), signal.SIGINT)  # after SIGTERM: noted, not acted on
    assert signals.received() == signal.SIGTERM
  assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
  assert signals.received() is None  # the next block starts afresh
  with signals.recording():
    os.kill(os.getpid(), signal.SIGINT)
    assert signals.received() == signal.SIGINT
    with pytest.raises(KeyboardInterrupt, match='second SIGINT'):  # library code, no program
      os.kill(os.getpid(), signal.SIGINT)


def test_a_signal_inside_a_weakref_callback_is_not_lost():
  """The handler that raised lost it: an exception in a weakref callback is only printed
  ('Exception ignored in ...'), and the program went on to exit 0."""

  class Thing:
    pass

  ran = []

  def callback(reference):
    os.kill(os.getpid(), signal.SIGTERM)
    ran.append(sum(range(10)))  # bytecodes after the signal, inside the callback

  with signals.recording():
    thing = Thing()
    reference = weakref.ref(thing, callback)
    del thing
    assert ran == [45] and reference() is None
    with pytest.raises(signals.Stopped):
      signals.check()


def test_a_second_ctrl_c_ends_a_program_at_once_with_one_line():
  code = (
    'import os, signal, time\n'
    'from flax_transformer import signals\n'
    "with signals.recording('x.py'):\n"
    '  os.kill(os.getpid(), signal.SIGINT)\n'
    '  os.kill(os.getpid(), signal.SIGINT)\n'
    '  time.sleep(30)\n'
  )
  done = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, timeout=60, cwd=REPO
  )
  assert done.returncode == 130 and done.stderr == (
    'x.py received SIGINT: stopping at the next safe point (train.py: after the step under '
    'way, which it saves); Ctrl-C again stops now without saving\n'
    'x.py: interrupted twice: stopped at once, without waiting for a safe point; what was '
    'written before stays (checkpoints and outputs are complete)\n'
  )


def test_the_first_signal_is_answered_at_once_with_one_line():
  # The program reaches its safe point later (here after 0.5 s): the line comes before it.
  code = (
    'import os, signal, sys, time\n'
    'from flax_transformer import signals\n'
    "with signals.recording('x.py'):\n"
    '  os.kill(os.getpid(), signal.SIGTERM)\n'
    "  sys.stderr.write('working\\n'); sys.stderr.flush()\n"
    '  time.sleep(0.5)\n'
    '  try:\n'
    '    signals.check()\n'
    '  except signals.Stopped as stop:\n'
    '    sys.exit(stop.exit_code)\n'
  )
  done = subprocess.run(
    [sys.executable, '-c', code], capture_output=True, text=True, timeout=60, cwd=REPO
  )
  assert done.returncode == 143
  assert done.stderr.splitlines() == [
    'x.py received SIGTERM: stopping at the next safe point (train.py: after the step under '
    'way, which it saves); Ctrl-C again stops now without saving',
    'working',
  ]


# --- the sweep -----------------------------------------------------------------------------------

LANDMARKS = ('main', 'train_from', '_validation_bleu', '_final_evaluation', '_after_the_work')


def profiled_train(argv, signal_at=None, number=signal.SIGTERM):
  """train.py's main(argv) in this process, counting the Python calls of the main thread.

  signal_at: (landmark, k) sends `number` at the k-th call after the landmark function's
  first call (counting from a landmark of this run, not from the start, keeps the point in
  its phase). Returns ((status, out, err), {landmark: the call of its first entry}).
  """
  calls, landmarks = [0], {}

  def hook(frame, event, arg):
    if event == 'call':
      calls[0] += 1
      name = frame.f_code.co_name
      if name in LANDMARKS and name not in landmarks:
        landmarks[name] = calls[0]
      if (
        signal_at
        and signal_at[0] in landmarks
        and (calls[0] == landmarks[signal_at[0]] + signal_at[1])
      ):
        os.kill(os.getpid(), number)

  outside = []  # a signal the program did not record (this process must not die of it)
  previous = {n: signal.signal(n, lambda n, frame: outside.append(n)) for n in signals.SIGNALS}
  sys.setprofile(hook)
  try:
    result = call(train_cli.main, argv)
  finally:
    sys.setprofile(None)
    for n, handler in previous.items():
      signal.signal(n, handler)
  assert not signal_at or signal_at[0] in landmarks, f'{signal_at}: not reached: {result}'
  assert not outside, f'signal at {signal_at} ({calls[0]} calls) came outside the program'
  return result, landmarks


def final_params(workdir: Path):
  _, params, _ = load_for_inference(workdir, step=6)
  return params


@pytest.fixture(scope='module')
def reference(numbers_corpus, tmp_path_factory):
  """An uninterrupted run (twice: the second, with every program compiled, is the one whose
  calls are counted) and its landmarks."""
  root = tmp_path_factory.mktemp('signals')
  call(train_cli.main, [*OPTIONS, '--data', numbers_corpus, '--workdir', root / 'warm'])
  (status, out, err), landmarks = profiled_train(
    [*OPTIONS, '--data', numbers_corpus, '--workdir', root / 'reference']
  )
  assert status == 0, err
  assert set(landmarks) == set(LANDMARKS), landmarks
  return {'out': out, 'landmarks': landmarks, 'params': final_params(root / 'reference')}


def sweep_points(landmarks: dict) -> list[tuple[str, int]]:
  """(landmark, calls after it) to signal at: while loading and compiling, in the steps, in
  the BLEU evaluation at step 4, in the final evaluation, and in the last calls of the work,
  after its last line."""
  phases = list(zip(LANDMARKS, LANDMARKS[1:]))
  fractions = {
    'main': (0.02, 0.6),
    'train_from': (0.1, 0.9),
    '_validation_bleu': (0.5,),
    '_final_evaluation': (0.2, 0.6, 0.99),
  }
  return [
    (start, max(1, int((landmarks[stop] - landmarks[start]) * fraction)))
    for start, stop in phases
    for fraction in fractions[start]
  ]


LINES = {
  'loading': r'stopped by (\w+) before the first step \(while loading\); nothing new was saved: '
  r'run the same command to resume from the latest checkpoint, if any',
  'step': r'stopped by (\w+) after step (\d); saved (\S+)\. Run the same command again to '
  r'resume from there\.',
  'final evaluation': r'stopped by (\w+) in the final evaluation of step 6, saved in (\S+)\. '
  r'Run the same command again to evaluate it\.',
  'done': r'stopped by (\w+) after its work was done \(nothing is lost\)',
}


def test_a_signal_at_any_point_ends_with_its_line_and_the_run_resumes_to_the_same_result(
  reference, numbers_corpus, tmp_path
):
  points = sweep_points(reference['landmarks'])
  seen = {}
  for index, point in enumerate(points):
    number = (signal.SIGTERM, signal.SIGINT)[index % 2]
    workdir = tmp_path / f'at-{point[0]}-{point[1]}'
    argv = [*OPTIONS, '--data', numbers_corpus, '--workdir', workdir]
    (status, out, err), _ = profiled_train(argv, signal_at=point, number=number)
    where = f'{signal.Signals(number).name} at {point}: {err[-600:]}'
    assert status == 128 + number, where
    lines = [line for line in re.split(r'[\r\n]', err) if line.startswith('train.py:')]
    assert len(lines) == 1, where
    ((kind, found),) = [
      (kind, re.fullmatch(pattern, lines[0].removeprefix('train.py: ')))
      for kind, pattern in LINES.items()
      if re.fullmatch(pattern, lines[0].removeprefix('train.py: '))
    ]
    assert found.group(1) == signal.Signals(number).name, where
    seen.setdefault(kind, []).append(point)
    saved = sorted(int(p.name) for p in (workdir / 'checkpoints').glob('[0-9]*'))
    if kind == 'loading':
      assert not saved and not (workdir / 'config.json').exists(), where
    elif kind == 'step':
      assert saved[-1] == int(found.group(2)) and found.group(3) == str(
        workdir / 'checkpoints' / found.group(2)
      ), where
    else:
      assert saved[-1] == 6, where
    assert ('test, greedy decoding' in out) == (kind == 'done'), where
    # The same command again: the run finishes as the uninterrupted one did.
    status, out, err = call(train_cli.main, argv)
    assert status == 0, err
    final_line = next(
      line for line in reference['out'].splitlines() if line.startswith('test, greedy decoding')
    )
    assert final_line in out.splitlines(), (where, out)
    jax.tree.map(
      lambda ours, theirs: np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7),
      final_params(workdir),
      reference['params'],
    )
  assert set(seen) == set(LINES), seen  # every kind of point was reached


def test_sigterm_after_the_final_line_of_a_real_process_ends_it_with_143(numbers_corpus, tmp_path):
  """The case that was swallowed: SIGTERM just after 'test, greedy decoding of' appears, while
  the process prints its samples and ends."""
  process = subprocess.Popen(
    [sys.executable, 'train.py', *OPTIONS, '--data', numbers_corpus, '--workdir', tmp_path / 'run'],
    cwd=REPO,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    env={**os.environ, 'PYTHONUNBUFFERED': '1'},
  )
  for line in process.stdout:
    if line.startswith('test, greedy decoding'):
      process.send_signal(signal.SIGTERM)
      break
  out, err = process.communicate(timeout=120)
  assert process.returncode == 143, err
  assert err.splitlines()[-1] == (
    'train.py: stopped by SIGTERM after its work was done (nothing is lost)'
  )


# --- decode.py and distill.py: between batches ---------------------------------------------------


def signal_at_batch(monkeypatch, method: type, batch: int, number=signal.SIGTERM) -> None:
  """`number` arrives while batch `batch` (1-based) of `method` decodes."""
  run, calls = method.run, [0]

  def counted(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == batch:
      os.kill(os.getpid(), number)
    return run(self, *args, **kwargs)

  monkeypatch.setattr(method, 'run', counted)


@pytest.mark.filterwarnings('ignore:source length .* output capped')
@pytest.mark.parametrize('number', [signal.SIGTERM, signal.SIGINT])
def test_decode_stops_between_batches_keeping_the_blocks_written(
  teacher, tmp_path, monkeypatch, number
):
  """Batches of 2, blocks of 16 lines (8 batches): a signal in the 10th batch stops before the
  11th; the first block's 16 translations are in the output, the second block's are not."""
  from flax_transformer.cli import decode as decode_cli
  from flax_transformer.decode.autoregressive import Greedy

  lines = [f'{n} hundred' for n in range(40)]
  (tmp_path / 'in.txt').write_text(''.join(line + '\n' for line in lines))
  signal_at_batch(monkeypatch, Greedy, 10, number)
  output = tmp_path / 'out.txt'
  status, _, err = call(
    decode_cli.main,
    [
      '--checkpoint',
      teacher,
      '--method',
      'greedy',
      '--batch-size',
      '2',
      '--input',
      tmp_path / 'in.txt',
      '--output',
      output,
    ],
  )
  assert status == 128 + number
  assert err.splitlines()[-1] == (
    f'decode.py: stopped by {signal.Signals(number).name}; '
    f'{output} holds the translations of the first 16 lines'
  )
  assert len(output.read_text().splitlines()) == 16


@pytest.mark.filterwarnings('ignore:source length .* output capped')
def test_distill_stops_between_batches_and_writes_nothing(
  teacher, numbers_corpus, tmp_path, monkeypatch
):
  from flax_transformer.cli import distill as distill_cli
  from flax_transformer.decode.autoregressive import BeamSearch

  signal_at_batch(monkeypatch, BeamSearch, 2)
  output = tmp_path / 'distilled'
  status, _, err = call(
    distill_cli.main,
    [
      '--checkpoint',
      teacher,
      '--data',
      numbers_corpus,
      '--output',
      output,
      '--beam-size',
      '2',
      '--batch-size',
      '16',
    ],
  )
  assert status == 143
  assert err.splitlines()[-1] == (
    'distill.py: stopped by SIGTERM before its work was done; its output was not written'
  )
  assert not output.exists() and not list(tmp_path.iterdir())
