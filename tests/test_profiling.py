"""--train.profile: a jax.profiler trace of chosen steps, under the run directory.

The trace is read back as what TensorBoard and Perfetto open: the xplane protobuf
holds the step's compiled program by name, and the Perfetto JSON lists the events
of the traced steps (only those: the trace starts after step START is ready).
"""

import gzip
import json

import pytest
from conftest import CMLM_OPTIONS

import train as train_cli
from flax_transformer.train.profiling import profile_plan
from support.script_calls import call

OPTIONS = [option for option in CMLM_OPTIONS if 'max_length_offset' not in option]


@pytest.fixture(scope='module')
def profiled(numbers_corpus, tmp_path_factory):
  workdir = tmp_path_factory.mktemp('profiled') / 'run'
  result = call(
    train_cli.main,
    [*OPTIONS, '--data', numbers_corpus, '--workdir', workdir, '--steps=4', '--train.profile=1,3'],
  )
  return workdir, result


def test_the_trace_holds_the_training_step_in_both_formats(profiled):
  workdir, (status, out, err) = profiled
  assert status == 0, err
  # the defaults, named
  assert (
    'float32 compute (model.dtype auto on cpu), einsum attention '
    '(model.attention_kernel auto on cpu);'
  ) in out
  assert (
    f'profile: steps 2 to 3 traced into {workdir}/profile (tensorboard --logdir '
    f'{workdir}/profile, or *.trace.json.gz in ui.perfetto.dev)'
  ) in out.splitlines()
  (xplane,) = (workdir / 'profile').glob('plugins/profile/*/*.xplane.pb')
  assert b'train_step' in xplane.read_bytes()
  (perfetto,) = (workdir / 'profile').glob('plugins/profile/*/*.trace.json.gz')
  events = json.loads(gzip.decompress(perfetto.read_bytes()))['traceEvents']
  calls = [
    (event['ts'], event['ts'] + event['dur'])
    for event in events
    if event.get('name') == 'PjitFunction(train_step)'
  ]
  # Each call shows as a dispatch with the mapped program nested inside it: count the outer.
  outer = [
    span
    for span in calls
    if not any(other != span and other[0] <= span[0] and span[1] <= other[1] for other in calls)
  ]
  assert len(outer) == 2, calls  # steps 2 and 3, not 1 or 4


def test_a_profiled_run_is_still_a_run_that_resumes(profiled, numbers_corpus):
  workdir, _ = profiled
  status, out, err = call(
    train_cli.main, [*OPTIONS, '--data', numbers_corpus, '--workdir', workdir, '--steps=5']
  )
  assert status == 0, err
  assert f'resumed from {workdir}/checkpoints/4' in out


@pytest.mark.parametrize(
  'value, message',
  [
    (
      '3,1',
      'train.profile=3,1: STOP must be after START (the steps after START up to STOP are traced)',
    ),
    ('5', "train.profile must be START,STOP (two step numbers, e.g. 10,15), got '5'"),
    # The toy preset's 400 steps end before the range begins: a trace of nothing, refused.
    (
      '400,410',
      'train.profile=400,410 starts after the last step (train.steps=400): no step would be traced',
    ),
  ],
)
def test_a_bad_profile_range_is_refused_naming_it(value, message, tmp_path):
  status, _, err = call(train_cli.main, ['--workdir', tmp_path / 'run', f'--train.profile={value}'])
  assert status == 2 and message in err and not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
  'start,last,line',
  [
    (0, 20, None),  # as asked
    (12, 20, 'this run resumed at step 12, inside the range: steps 13 to 15 are traced'),
    (15, 20, 'this run resumed at step 15, past those steps; nothing is traced'),
    (30, 40, 'this run resumed at step 30, past those steps; nothing is traced'),
    (0, 13, 'the run ends at train.steps=13, inside the range: steps 11 to 13 are traced'),
    (11, 13, 'resumed at step 11 and ending at train.steps=13: steps 12 to 13 are traced'),
  ],
)
def test_a_range_the_run_does_not_cover_is_stated_in_one_line(start, last, line):
  planned = profile_plan((10, 15), start, last)
  if line is None:
    assert planned is None
  else:
    assert planned.startswith('train.profile=10,15: ') and line in planned
  assert profile_plan(None, start, last) is None
