"""The cmlm (non-autoregressive) training step: on 2 simulated devices it equals 1 device
(a subprocess, as tests/test_multidevice.py), its loss falls on a tiny copy task, and its
validation sums are deterministic.

train.py --objective cmlm is tests/test_train_cli.py's, decode.py --method mask_predict
tests/test_decode_cli.py's, the distillation that makes a cmlm corpus test_distill_cli.py's.
"""

import jax
import numpy as np
import pytest

from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.cmlm import CMLMTransformer
from flax_transformer.train import (
  DataParallel,
  create_train_state,
  length_metrics,
  make_optimizer,
  make_parallel_eval,
  make_parallel_step,
  token_metrics,
)
from support.copy_task import PAD, copy_batch
from support.device_workers import run_values, run_worker

# --- the training step ------------------------------------------------------------------

WORKER = r"""
import sys
import jax
import numpy as np
from flax import traverse_util
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.cmlm import CMLMTransformer
from flax_transformer.train import (DataParallel, create_train_state, make_optimizer,
                                   make_parallel_eval, make_parallel_step)
from support.copy_task import copy_batch

out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
assert jax.device_count() == 2, jax.devices()
config = ModelConfig.tiny(kind='cmlm', num_encoder_layers=1, num_decoder_layers=1,
                          dropout_rate=0.0, max_length_offset=4)
# adam_eps=1: see tests/test_multidevice.py. EOS fill at 0.5 so that some rows are filled.
train_config = TrainConfig(steps=steps, warmup_steps=4, lr_scale=4.0, adam_eps=1.0,
                           eos_fill_rate=0.5)
model = CMLMTransformer(config)
optimizer = make_optimizer(train_config, config)
initial = jax.device_get(create_train_state(model, optimizer, seed=0))
results = {}
for run in runs:
  mode, count = run.split('-')
  parallel = DataParallel(jax.devices()[:int(count)], mode=mode)
  step = make_parallel_step(model, optimizer, train_config, parallel)
  evaluate = make_parallel_eval(model, train_config, parallel)
  state = parallel.replicate(initial)
  for index in range(steps):
    batch = copy_batch(np.random.default_rng(index), 8, 12, config.vocab_size)
    state, metrics = step(state, parallel.shard_batch(batch))
    for name, value in parallel.unreplicate(metrics).items():
      results[f'{run}/{name}/{index}'] = value
  sums = parallel.unreplicate(evaluate(state.params, parallel.shard_batch(batch)))
  results.update({f'{run}/eval_{name}/0': value for name, value in sums.items()})
  params = traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/')
  results.update({f'{run}/params/{name}': value for name, value in params.items()})
np.savez(out, **results)
"""
STEPS = 3
# pmap's equality with shard_map is tests/test_multidevice.py's; the cmlm step adds no mode logic.
RUNS = ('shard_map-1', 'shard_map-2')


@pytest.fixture(scope='module')
def device_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp('nat_devices') / 'runs.npz'
  return run_worker(WORKER, out, [STEPS, *RUNS], device_count=2, backend_optimization=False)


@pytest.mark.parametrize('run', RUNS[1:])
def test_cmlm_step_on_two_devices_equals_one_device(device_runs, run):
  """Same masks (keyed by the row's place in the global batch), same global normalisation:
  the metrics to 1e-6 and the parameters to 1e-5 relative, as tests/test_multidevice.py."""
  one = 'shard_map-1'
  for kind in ('tokens', 'sentences', 'target_tokens', 'length_correct', 'correct'):
    assert run_values(device_runs, run, kind) == run_values(device_runs, one, kind), kind
  for kind in ('loss_sum', 'length_loss_sum', 'grad_norm', 'eval_loss_sum', 'eval_length_loss_sum'):
    reference = run_values(device_runs, one, kind)
    for index, value in run_values(device_runs, run, kind).items():
      np.testing.assert_allclose(value, reference[index], rtol=1e-5, err_msg=f'{kind} {index}')
  reference = run_values(device_runs, one, 'params')
  for name, value in run_values(device_runs, run, 'params').items():
    np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_cmlm_step_metrics_count_masked_tokens_and_real_sentences(device_runs):
  one = 'shard_map-1'
  for index in map(str, range(STEPS)):
    batch = copy_batch(np.random.default_rng(int(index)), 8, 12, 64)
    real_rows = int((batch.tgt_out != PAD).any(axis=1).sum())
    assert run_values(device_runs, one, 'sentences')[index] == real_rows == 7
    assert run_values(device_runs, one, 'target_tokens')[index] == (batch.tgt_out != PAD).sum()
    # At least one masked token per real row; EOS-filled rows may add up to the batch width.
    masked = run_values(device_runs, one, 'tokens')[index]
    assert real_rows <= masked <= real_rows * batch.tgt_out.shape[1]
  # Different steps draw different masks.
  assert len({float(v) for v in run_values(device_runs, one, 'tokens').values()}) > 1


@pytest.fixture(scope='module')
def copy_task_training():
  """60 steps of the tiny cmlm model on 4 fixed copy batches, on one device."""
  config = ModelConfig.tiny(
    kind='cmlm',
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
    max_length_offset=4,
    vocab_size=16,
  )
  train_config = TrainConfig(warmup_steps=20)
  model = CMLMTransformer(config)
  optimizer = make_optimizer(train_config, config)
  parallel = DataParallel(jax.devices()[:1])
  step = make_parallel_step(model, optimizer, train_config, parallel)
  state = parallel.replicate(create_train_state(model, optimizer, seed=0))
  batches = [copy_batch(np.random.default_rng(i), 8, 10, config.vocab_size) for i in range(4)]
  history = []
  for index in range(60):
    state, metrics = step(state, parallel.shard_batch(batches[index % 4]))
    history.append(parallel.unreplicate(metrics))
  evaluate = make_parallel_eval(model, train_config, parallel)
  evaluations = [
    parallel.unreplicate(evaluate(state.params, parallel.shard_batch(batches[0]))) for _ in range(2)
  ]
  return history, evaluations, batches


def test_cmlm_loss_falls_on_a_copy_task(copy_task_training):
  history, _, _ = copy_task_training

  def window(steps):
    sums = {name: sum(m[name] for m in steps) for name in steps[0]}
    return {**token_metrics(sums), **length_metrics(sums)}

  # Measured: loss 2.69 -> 2.1 (smoothed; ln 16 = 2.77 is a uniform guess), masked-token
  # accuracy 0.18 -> 0.3, and the length (= the source's) learnt exactly.
  first, last = window(history[:10]), window(history[-10:])
  assert not any(m['nonfinite'] for m in history)
  assert last['loss'] < first['loss'] - 0.3, (first, last)
  assert last['accuracy'] > first['accuracy'] + 0.08, (first, last)
  assert last['length_loss'] < 0.5 * first['length_loss'], (first, last)


def test_cmlm_validation_sums_are_deterministic(copy_task_training):
  _, (a, b), batches = copy_task_training
  assert a == b
  assert a['sentences'] == 7
  # No EOS fill in validation: at most every real target token is masked.
  assert 7 <= a['tokens'] <= (batches[0].tgt_out != PAD).sum()
