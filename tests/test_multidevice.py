"""Data parallelism: 4 simulated CPU devices train exactly like 1 device on the same global batch.

JAX fixes the device count when it starts, so the runs happen in a subprocess
started with XLA_FLAGS=--xla_force_host_platform_device_count=4; it saves each
run's losses and parameters to an .npz file that the test compares.

Dropout is 0: with dropout the runs could not agree, because each device draws
its own masks (seed, step, device index) for its own rows, and a row's mask
then depends on which device holds it. The batches have rows of very different
lengths, so the devices hold different numbers of target tokens, which is what
the step's global token normalisation must get right.
"""

import numpy as np
import pytest

from support.device_workers import run_values, run_worker

STEPS = 4
RUNS = ('shard_map-1', 'shard_map-4', 'pmap-4')
# The same with the paper's Adam epsilon (RUN@EPS; the runs above use adam_eps=1).
PAPER_EPS_RUNS = ('shard_map-1@1e-9', 'shard_map-4@1e-9')

WORKER = r"""
import sys
import jax
import numpy as np
from flax import traverse_util
from support.device_workers import uneven_batch
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.model import Transformer
from flax_transformer.train import (DataParallel, create_train_state, make_optimizer,
                                   make_parallel_step)

out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
assert jax.device_count() == 4, jax.devices()
config = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
model = Transformer(config)

def optimizer_with(eps):
  # adam_eps=1 unless the run names another: see test_parameters_match_one_device.
  train_config = TrainConfig(steps=steps, warmup_steps=4, lr_scale=4.0, adam_eps=eps)
  return train_config, make_optimizer(train_config, config)

initial = jax.device_get(create_train_state(model, optimizer_with(1.0)[1], seed=0))
results = {f'initial/params/{name}': value
           for name, value in traverse_util.flatten_dict(initial.params, sep='/').items()}

def batch(step):
  return uneven_batch(config.vocab_size, step)

for run in runs:
  devices, _, eps = run.partition('@')
  mode, count = devices.split('-')
  train_config, optimizer = optimizer_with(float(eps or 1.0))
  parallel = DataParallel(jax.devices()[:int(count)], mode=mode)
  step = make_parallel_step(model, optimizer, train_config, parallel)
  # Adam's initial state does not depend on eps.
  state = parallel.replicate(initial)
  for index in range(steps):
    state, metrics = step(state, parallel.shard_batch(batch(index)))
    metrics = parallel.unreplicate(metrics)
    results[f'{run}/loss/{index}'] = metrics['loss_sum'] / metrics['tokens']
    results[f'{run}/grad_norm/{index}'] = metrics['grad_norm']
  params = traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/')
  results.update({f'{run}/params/{name}': value for name, value in params.items()})
np.savez(out, **results)
"""


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp('multidevice') / 'runs.npz'
  return run_worker(WORKER, out, [STEPS, *RUNS, *PAPER_EPS_RUNS], device_count=4)


@pytest.mark.parametrize('run', [r for r in RUNS if r != 'shard_map-1'])
def test_losses_match_one_device(results, run):
  """Tolerance: 1e-6 relative, float32 sums taken in another order."""
  reference = run_values(results, 'shard_map-1', 'loss')
  losses = run_values(results, run, 'loss')
  assert len(losses) == STEPS
  for index, loss in reference.items():
    np.testing.assert_allclose(losses[index], loss, rtol=1e-6, err_msg=f'step {index}')
  first = float(reference['0'])
  assert float(reference[str(STEPS - 1)]) < first  # it trains, so the comparison is not vacuous


@pytest.mark.parametrize('run', [r for r in RUNS if r != 'shard_map-1'])
def test_parameters_match_one_device(results, run):
  """Tolerance: 1e-6 absolute + 1e-5 relative, while the updates moved parameters by > 0.05.

  The runs use adam_eps=1 rather than the paper's 1e-9: with eps = 1 the update
  is smooth in the gradient, so the comparison sees what data parallelism
  changes, nothing but rounding, at rounding's tolerance. (The paper's eps is
  test_parameters_match_one_device_with_the_papers_adam_eps's.)
  """
  reference = run_values(results, 'shard_map-1', 'params')
  initial = run_values(results, 'initial', 'params')
  params = run_values(results, run, 'params')
  assert params.keys() == reference.keys() == initial.keys()
  for name, value in reference.items():
    np.testing.assert_allclose(params[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  movement = max(np.max(np.abs(reference[name] - initial[name])) for name in reference)
  assert movement > 0.05
  grad_norms = run_values(results, run, 'grad_norm')
  for index, norm in run_values(results, 'shard_map-1', 'grad_norm').items():
    np.testing.assert_allclose(grad_norms[index], norm, rtol=1e-5, err_msg=f'step {index}')


def test_parameters_match_one_device_with_the_papers_adam_eps(results):
  """adam_eps=1e-9: 4 devices within 1% of the parameters' movement of 1 device.

  With eps ~ 0 Adam divides each gradient by its running RMS, so its first update
  is lr * sign(g) and an element whose gradient is small amplifies float32
  rounding (another summation order on 4 devices) by lr / |g|: a few elements
  differ by more than rounding (measured: 100 of 23,328 by > 1e-6 + 1e-5 |p|, at
  most 9e-4 against a movement of 0.88 after 4 steps). A data-parallel error that
  changes the gradient's direction, such as averaging per-device means, flips
  signs and moves elements by up to 2 lr (0.18) per step; one that only scales the
  gradient is invisible to Adam here, and test_losses_match_one_device and the
  gradient norms above catch it.
  """
  reference = run_values(results, 'shard_map-1@1e-9', 'params')
  params = run_values(results, 'shard_map-4@1e-9', 'params')
  initial = run_values(results, 'initial', 'params')
  assert params.keys() == reference.keys() == initial.keys()
  movement = max(np.max(np.abs(reference[name] - initial[name])) for name in reference)
  assert movement > 0.5
  worst = max(np.max(np.abs(params[name] - reference[name])) for name in reference)
  assert worst < 0.01 * movement, (worst, movement)
  beyond_rounding = sum(
    int(np.sum(np.abs(params[name] - reference[name]) > 1e-6 + 1e-5 * np.abs(reference[name])))
    for name in reference
  )
  assert beyond_rounding < 0.02 * sum(value.size for value in reference.values())
