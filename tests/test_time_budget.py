"""train.time_budget: the costs measured with a fake clock, the arithmetic that turns them into
steps, and a run that fixes its steps by them, records them and keeps them when resumed."""

import dataclasses
import itertools
import json

import numpy as np
import pytest

from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.data.toy_task import number_translation
from flax_transformer.errors import CheckpointError
from flax_transformer.train.budget import (
  RunCosts,
  measure_costs,
  resumed_steps,
  shape_steps,
  steps_within,
)
from flax_transformer.train.loop import train
from support.runs import read_metrics


class FakeClock:
  """A clock that moves only when told to: `advance(seconds)`."""

  def __init__(self):
    self.now = 100.0

  def __call__(self) -> float:
    return self.now

  def advance(self, seconds: float) -> None:
    self.now += seconds


def test_shape_steps_gives_each_shapes_share_and_its_first_steps():
  shapes = ['a', 'b', 'a', 'a', 'c', 'a', 'b', 'a']
  assert shape_steps(shapes, timed=2) == [
    (5 / 8, [0, 2, 3]),  # compiled at step 0, timed at 2 and 3; its later steps not needed
    (2 / 8, [1, 6]),
    (1 / 8, [4]),  # one step only: timed with its compilation
  ]


def test_measure_costs_weighs_each_shapes_step_by_its_share_with_the_clock_it_is_given():
  clock = FakeClock()
  # Shape 'long' compiles in 9 s and runs in 2 s; 'short' compiles in 5 s and runs in 1 s.
  seconds = {0: 9.0, 1: 2.0, 2: 2.2, 3: 5.0, 4: 1.0, 5: 1.0}
  steps = []

  def run_step(index):
    steps.append(index)
    clock.advance(seconds[index])

  plan = [(0.25, [0, 1, 2]), (0.75, [3, 4, 5])]
  costs = measure_costs(
    run_step, plan, lambda: clock.advance(3.0), lambda: clock.advance(20.0), clock
  )
  assert steps == [0, 1, 2, 3, 4, 5]
  # A step: 0.25 x 2.1 (the median of 2.0 and 2.2) + 0.75 x 1.0; compiling: 9 + 5 s.
  assert dataclasses.astuple(costs) == pytest.approx((1.275, 14.0, 3.0, 20.0))
  # Without validation data neither is run or counted; a lone step counts with its compile.
  alone = measure_costs(lambda i: clock.advance(2.0), [(1.0, [7])], None, None, clock)
  assert dataclasses.astuple(alone) == pytest.approx((2.0, 2.0, 0.0, 0.0))


def test_steps_within_counts_validations_decodings_and_the_final_evaluation():
  costs = RunCosts(step_s=1.0, compile_s=10.0, validation_s=5.0, decoding_s=30.0)
  config = TrainConfig(eval_every=50, bleu_every=100, time_budget='1h')
  # Left: 3600 - 200 spent - 10 compile - 2 * 30 final - 5 last validation = 3325 s; a step
  # costs 1 + 5/50 + 30/100 = 1.4 s: 2375 steps.
  assert steps_within(3600, 200, costs, config, start=0, final_decodings=2) == 2375
  assert steps_within(3600, 200, costs, config, start=1000, final_decodings=2) == 3375
  # The inequality itself, with no BLEU during training: a step costs 1.1 s.
  quiet = config.replace(bleu_every=0)
  steps = steps_within(3600, 200, costs, quiet, final_decodings=1)
  used = lambda n: 200 + 10 + 30 + 5 + n * (1.0 + 5.0 / 50)
  assert used(steps) <= 3600 < used(steps + 1)


def test_a_budget_too_short_for_one_step_and_its_validation_is_refused():
  costs = RunCosts(step_s=1.0, compile_s=10.0, validation_s=5.0, decoding_s=30.0)
  config = TrainConfig(time_budget='40s')
  with pytest.raises(ConfigError, match=r'train.time_budget=40s \(40 s\) is too short for one'):
    steps_within(40, 2, costs, config)


@pytest.mark.parametrize('text', ['90', 'soon', '0s', '5m later'])
def test_a_malformed_time_budget_is_refused_in_one_line(text):
  with pytest.raises(ConfigError, match='train.time_budget must be'):
    TrainConfig(time_budget=text)


def test_durations_read_as_seconds():
  budgets = {'90m': 5400, '2h': 7200, '1h30m': 5400, '5400s': 5400, '1.5h': 5400, '45s': 45}
  assert {b: TrainConfig(time_budget=b).time_budget_s for b in budgets} == budgets


def test_a_resume_keeps_the_steps_its_budget_fixed_and_refuses_another_budget():
  saved = TrainConfig(time_budget='90m', steps=3412)
  assert resumed_steps(saved, TrainConfig(time_budget='90m')).steps == 3412
  assert resumed_steps(saved, TrainConfig(time_budget='1h30m')).steps == 3412
  assert resumed_steps(saved, TrainConfig(steps=50)).steps == 50  # no budget asked: as given
  with pytest.raises(CheckpointError, match='saved 90m, requested 2h: the saved budget fixed'):
    resumed_steps(saved, TrainConfig(time_budget='2h'))
  with pytest.raises(CheckpointError, match='saved none'):
    resumed_steps(TrainConfig(), TrainConfig(time_budget='2h'))


MODEL = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=64)
TRAIN = TrainConfig(
  steps=1000,  # replaced by what the budget holds
  max_tokens=256,
  warmup_steps=4,
  peak_lr=0.003,
  schedule='linear',
  log_every=1,
  eval_every=4,
  checkpoint_every=4,
  time_budget='30s',
)


def test_a_run_fixes_its_steps_by_its_budget_and_keeps_them_when_resumed(tmp_path):
  numbers = number_translation(num_train=300, num_validation=24, num_test=24)
  ticks = itertools.count()
  # Every reading of the clock is 0.5 s after the one before: so the start, the steps, the
  # validation and the decoding each measure 0.5 s. The readings: the run's start (0), what
  # was spent before measuring (0.5), the measurement's start (1.0), 10 while measuring (the
  # toy's batches come in one shape: its compiling step and 2 timed ones, a validation, a
  # decoding), and the end (6.5): 6 s spent. Left: 30 - 6 - 0.5 compile - 0.5 final - 0.5
  # last validation = 22.5 s at 0.5 + 0.5 / 4 s a step: 36 steps.
  clock = lambda: 0.5 * next(ticks)
  messages = []
  result = train(
    MODEL,
    TRAIN,
    DataConfig(vocab_size=256),
    tmp_path,
    dataset=numbers,
    clock=clock,
    print_fn=messages.append,
  )
  assert int(result.state.step) == 36
  saved = json.loads((tmp_path / 'config.json').read_text())['train']
  assert (saved['steps'], saved['time_budget']) == (36, '30s')
  assert any(
    m.startswith('time budget 30s: 36 steps fit, so train.steps=36 (a step 0.5 s') for m in messages
  )
  assert any(m.endswith('steps 0 -> as many as the 30s budget holds') for m in messages)
  # The linear schedule ends at the fixed last step.
  rates = {line['step']: line['learning_rate'] for line in read_metrics(tmp_path) if 'loss' in line}
  assert sorted(rates) == list(range(1, 37))
  np.testing.assert_allclose([rates[4], rates[36]], [0.003, 0.0], atol=1e-9)
  # Resumed with the same budget: the same 36 steps, nothing measured again.
  again = []
  train(
    MODEL,
    TRAIN,
    DataConfig(vocab_size=256),
    tmp_path,
    dataset=numbers,
    clock=clock,
    print_fn=again.append,
  )
  assert any('already trained to step 36' in m for m in again)
  assert not any(m.startswith('time budget') for m in again)
  with pytest.raises(CheckpointError, match='train.time_budget: saved 30s, requested 40s'):
    train(
      MODEL,
      TRAIN.replace(time_budget='40s'),
      DataConfig(vocab_size=256),
      tmp_path,
      dataset=numbers,
      clock=clock,
    )
