"""Multi-host training with real processes: jax.distributed on 127.0.0.1.

Two `train.py` processes with 2 simulated CPU devices each form one 4-device
job (`--coordinator 127.0.0.1:PORT --num-processes 2 --process-id I`, gloo
collectives). Beside them, one `train.py` process with 4 simulated devices
trains on the same data with the same settings: the same global batches, each
row block on the device of the same index, hence the same dropout masks. The
two runs must agree step by step; the 2-process run's checkpoint, restored
here (one process, one device) as a resumed run restores it, must hold the
1-process run's training state; and only process 0 may print or write the
run's files. tests/support/multihost_worker.py, a second 2-process job started at the
same time, covers pmap and the split BLEU decoding.

Tolerances: the runs differ only in how the all-reduce sums the 4 devices'
float32 gradients and loss sums (gloo between processes, XLA within one), so
they agree up to rounding: 1e-5 relative on every logged value, and 1e-5
relative + 1e-6 absolute on parameters, while training moves parameters by
more than 0.05. Measured: 5e-7 relative on the logged values, 6e-8 absolute
on parameters. The runs use adam_eps=1 rather than the paper's 1e-9: with
eps ~ 0, Adam divides each gradient by its own magnitude, so an entry whose
gradient is a nearly cancelling sum turns its rounding into a step of a
visible size (with 1e-9, a few entries differed by 5e-6 after 4 steps); with
eps = 1 the update is smooth in the gradient, and the comparison sees what
the process layout changes: rounding alone (as in tests/test_multidevice.py).

Bounded: every process is killed when the test's deadline passes or the
fixture fails. Only loopback is used: the coordinator is bound to 127.0.0.1
(train.py binds a loopback coordinator address to itself), and gloo listens
on the address of this machine's host name, which the test checks is loopback.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import traverse_util

from flax_transformer.data.toy_task import number_translation
from flax_transformer.nn.model import Transformer
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import read_config
from flax_transformer.run.loading import load_for_inference
from flax_transformer.train import TrainState, create_train_state, make_optimizer
from support.environment import xla_flags
from support.processes import free_ports, host_name_is_loopback

ROOT = Path(__file__).resolve().parents[1]

STEPS = 4
SAVE_EVERY = 2
# The three jobs take 50-100 s together on 2 cores, depending on what else runs there;
# the deadline only bounds a hang (a process that died leaves its peer waiting).
DEADLINE_S = 300
# One layer each side, and a vocabulary that puts every pair in the 8-token bucket,
# so that each process compiles one training step.
OPTIONS = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--model.max_len=16',
  '--data.vocab_size=256',
  '--train.max_tokens=256',
  f'--steps={STEPS}',
  '--train.warmup_steps=4',
  '--train.lr_scale=4',
  '--train.adam_eps=1',
  '--train.log_every=1',
  f'--train.eval_every={SAVE_EVERY}',
  f'--train.checkpoint_every={SAVE_EVERY}',
  f'--average-last={STEPS // SAVE_EVERY}',
]
AVERAGED = f'average-last{STEPS // SAVE_EVERY}'
# Metrics of the end of the run: greedy decoding of the validation split, with the
# last parameters and with the average of the checkpoints.
FINAL_VALUES = tuple(
  f'{prefix}{name}' for prefix in ('', 'avg_') for name in ('bleu', 'chrf', 'exact_match')
)
# What process 0 prints for the job: none of it may come from process 1.
REPORTS = ('data:', 'tokenizer:', 'model:', 'validation loss', 'greedy decoding of')
TRAIN_VALUES = ('loss', 'ppl', 'accuracy', 'learning_rate', 'grad_norm')


def environment(devices: int) -> dict[str, str]:
  """CPU only, `devices` simulated devices, and XLA's backend optimisation off.

  Compiling dominates these runs (a few steps of a tiny model); without LLVM's
  optimisations each process needs about 30% less CPU time. Every run of a
  comparison uses the same flags.
  """
  flags = xla_flags(
    f'--xla_force_host_platform_device_count={devices}', '--xla_backend_optimization_level=0'
  )
  return {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(ROOT), 'XLA_FLAGS': flags}


def run_together(
  jobs: dict[str, tuple[list[str], int]], logs: Path, deadline: float
) -> dict[str, str]:
  """Starts every job `name: (arguments, devices)` at once; returns each one's stdout.

  Fails with the logs of the processes that failed; kills whatever still runs
  at the deadline (time.monotonic) or when anything goes wrong.
  """
  processes = {}
  try:
    for name, (arguments, devices) in jobs.items():
      with open(logs / f'{name}.out', 'w') as out, open(logs / f'{name}.err', 'w') as err:
        processes[name] = subprocess.Popen(
          [sys.executable, *arguments], cwd=ROOT, env=environment(devices), stdout=out, stderr=err
        )
    for name, process in processes.items():
      try:
        process.wait(timeout=max(deadline - time.monotonic(), 0))
      except subprocess.TimeoutExpired:
        pytest.fail(
          f'{name} still ran at the {DEADLINE_S} s deadline:\n'
          + (logs / f'{name}.err').read_text()[-3000:]
        )
    failed = [name for name, process in processes.items() if process.returncode]
    assert not failed, '\n\n'.join(
      f'{name} exited with {processes[name].returncode}:\n'
      + (logs / f'{name}.err').read_text()[-3000:]
      for name in failed
    )
  finally:
    for process in processes.values():
      if process.poll() is None:
        process.kill()
        process.wait()
  return {name: (logs / f'{name}.out').read_text() for name in jobs}


def write_corpus(directory: Path) -> Path:
  """Number words as train.en/train.de and validation.en/validation.de."""
  numbers = number_translation(num_train=256, num_validation=20, num_test=1)
  directory.mkdir()
  for split in ('train', 'validation'):
    for column, lang in (('source', 'en'), ('target', 'de')):
      (directory / f'{split}.{lang}').write_text('\n'.join(numbers[split][column]) + '\n')
  return directory


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """The 2-process run, the 1-process run and the worker job, all at once."""
  if not host_name_is_loopback():
    pytest.skip(
      f'the host name {socket.gethostname()!r} does not resolve to a loopback address, '
      'so gloo would listen on a network interface; this test uses loopback only'
    )
  root = tmp_path_factory.mktemp('multihost').resolve()
  data = write_corpus(root / 'data')
  dirs = {name: root / name for name in ('two', 'one', 'worker')}
  dirs['worker'].mkdir()
  train_port, worker_port = free_ports(2)

  def train(workdir, *flags):
    return ['train.py', '--data', str(data), '--workdir', str(workdir), *OPTIONS, *flags]

  jobs = {
    f'process {i}': (
      train(
        dirs['two'],
        f'--coordinator=127.0.0.1:{train_port}',
        '--num-processes=2',
        f'--process-id={i}',
      ),
      2,
    )
    for i in range(2)
  }
  jobs['one process'] = (train(dirs['one']), 4)
  jobs.update(
    {
      f'worker {i}': (
        [
          'tests/support/multihost_worker.py',
          f'127.0.0.1:{worker_port}',
          str(i),
          str(dirs['worker']),
        ],
        2,
      )
      for i in range(2)
    }
  )
  outputs = run_together(jobs, root, time.monotonic() + DEADLINE_S)
  return {
    'dirs': dirs,
    'outputs': outputs,
    'errors': {name: (root / f'{name}.err').read_text() for name in outputs},
  }


def metrics(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


def by_step(lines: list[dict], names) -> dict[tuple[int, str], float]:
  return {(line['step'], name): line[name] for line in lines for name in names if name in line}


def flat(params) -> dict[str, np.ndarray]:
  return traverse_util.flatten_dict(jax.device_get(params), sep='/')


def flat_params(workdir: Path, step: int) -> dict[str, np.ndarray]:
  """The parameters saved at `step`, as decoding loads them, in this process."""
  return flat(load_for_inference(workdir, step=step)[1])


def training_state(workdir: Path) -> TrainState:
  """The latest checkpoint's TrainState, restored in this process as train() resumes it."""
  model_config, train_config, _ = read_config(workdir)
  model, optimizer = Transformer(model_config), make_optimizer(train_config, model_config)
  abstract = jax.eval_shape(lambda: create_train_state(model, optimizer, train_config.seed))
  checkpoints = Checkpoints(workdir)
  try:
    return checkpoints.restore(checkpoints.latest_step(), abstract)
  finally:
    checkpoints.close()


def assert_params_close(actual: dict, expected: dict):
  assert actual.keys() == expected.keys()
  for name, value in expected.items():
    np.testing.assert_allclose(actual[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_only_process_0_reports(runs):
  out, err = runs['outputs'], runs['errors']
  for report in REPORTS:
    assert report in out['process 0'], report
    assert report not in out['process 1'] + err['process 1'], report
  assert '4 device(s) in 2 processes via shard_map' in out['process 0']  # one job formed
  # The training split was encoded once, by process 0, into the one cache both read.
  assert out['process 0'].count('cache: encoded') == 1
  cached = [path.name for path in (runs['dirs']['two'] / 'encoded').iterdir()]
  assert len(cached) == 1 and not cached[0].startswith('.'), cached
  assert 'train: 100%' in err['process 0']  # the progress bar
  assert '%|' not in err['process 1']  # no bar at all, nor the loading ones
  lines = metrics(runs['dirs']['two'])
  # Written once: a second writer would have repeated or interleaved the lines.
  assert [line['step'] for line in lines if 'loss' in line] == list(range(1, STEPS + 1))
  assert [line['step'] for line in lines if 'val_loss' in line] == [SAVE_EVERY, STEPS]


def test_loss_curve_equals_one_process(runs):
  two, one = metrics(runs['dirs']['two']), metrics(runs['dirs']['one'])
  names = TRAIN_VALUES + ('val_loss', 'val_ppl', 'val_accuracy') + FINAL_VALUES
  expected = by_step(one, names)
  actual = by_step(two, names)
  assert actual.keys() == expected.keys()
  assert len(expected) == STEPS * len(TRAIN_VALUES) + 2 * 3 + len(FINAL_VALUES)
  for key, value in expected.items():
    np.testing.assert_allclose(actual[key], value, rtol=1e-5, err_msg=str(key))
  losses = [expected[(step, 'loss')] for step in range(1, STEPS + 1)]
  assert losses[-1] < losses[0] - 0.5  # it trains: the curves are not flat by accident


def test_final_parameters_equal_one_process(runs):
  """The last parameters, and the average of the checkpoints that every process wrote."""
  two = flat_params(runs['dirs']['two'], STEPS)
  assert_params_close(two, flat_params(runs['dirs']['one'], STEPS))
  earlier = flat_params(runs['dirs']['two'], SAVE_EVERY)
  assert max(np.max(np.abs(two[name] - earlier[name])) for name in two) > 0.05
  averaged = flat_params(runs['dirs']['two'] / AVERAGED, STEPS)
  assert_params_close(averaged, flat_params(runs['dirs']['one'] / AVERAGED, STEPS))
  for name, value in averaged.items():  # an independent mean of the two checkpoints
    np.testing.assert_allclose(
      value, (np.float64(two[name]) + earlier[name]) / 2, rtol=1e-6, atol=1e-7, err_msg=name
    )


def test_checkpoint_is_written_once(runs):
  """Every process calls save; one copy lands, laid out as a 1-process run's.

  orbax gives each writing process its own OCDBT store, `ocdbt.process_<i>`;
  the replicated state is written by process 0 alone.
  """

  def layout(workdir):
    return sorted(
      str(path.relative_to(workdir))
      for path in workdir.rglob('*')
      if path.is_dir() and 'checkpoints' in path.parts
    )

  two, one = runs['dirs']['two'], runs['dirs']['one']
  assert layout(two) == layout(one)
  assert f'{AVERAGED}/checkpoints/{STEPS}/params' in layout(two)
  assert not list(two.rglob('ocdbt.process_1'))


def test_one_process_restores_the_two_process_training_state(runs):
  """What train() restores to resume: the step, the parameters and Adam's moments.

  Each moment leaf agrees to 1e-5 of its largest entry: its small entries are
  sums of gradients that nearly cancel, which keep their absolute accuracy only
  (measured: under 4e-7 of the largest entry, but up to 3e-4 relative on tiny
  entries).
  """
  two, one = training_state(runs['dirs']['two']), training_state(runs['dirs']['one'])
  assert int(two.step) == int(one.step) == STEPS
  assert_params_close(flat(two.params), flat(one.params))
  expected = jax.tree_util.tree_flatten_with_path(one.opt_state)[0]
  actual = jax.tree_util.tree_flatten_with_path(two.opt_state)[0]
  assert [path for path, _ in actual] == [path for path, _ in expected]
  for (path, value), (_, restored) in zip(expected, actual):
    np.testing.assert_allclose(
      restored, value, rtol=0, atol=1e-5 * np.max(np.abs(value)), err_msg=jax.tree_util.keystr(path)
    )


@pytest.fixture(scope='module')
def worker(runs):
  return [dict(np.load(runs['dirs']['worker'] / f'process_{i}.npz')) for i in range(2)]


def test_pmap_equals_shard_map_across_processes(worker):
  """pmap over the devices of both processes trains the model shard_map trains."""
  first, second = worker
  for name, value in first.items():  # the processes hold one replicated result
    np.testing.assert_array_equal(second[name], value, err_msg=name)
  np.testing.assert_allclose(first['pmap/loss'], first['shard_map/loss'], rtol=1e-5)
  params = {
    mode: {
      name.removeprefix(f'{mode}/params/'): value
      for name, value in first.items()
      if name.startswith(f'{mode}/params/')
    }
    for mode in ('pmap', 'shard_map')
  }
  assert_params_close(params['pmap'], params['shard_map'])


def test_translations_are_split_between_processes(worker):
  """Each process decodes every other sentence; both get all of them back, in order."""
  for results in worker:
    assert list(results['translations']) == list(results['reference'])
  reference = list(worker[0]['reference'])
  assert len(reference) == 9 and reference[-1] == ''  # the empty sentence is not decoded
  assert len(set(reference)) >= 5  # outputs depend on the input: misplaced ones would show
