"""config.check_bounds: a public function's range check, with the rule and message of a field's."""

import math

import numpy as np
import pytest

from flax_transformer.config import (
  NONNEGATIVE,
  NONNEGATIVE_INT,
  NUMBER,
  POSITIVE_INT,
  Bounds,
  ConfigError,
  ModelConfig,
  TrainConfig,
  check_bounds,
)


class Refused(ValueError):
  pass


@pytest.mark.parametrize(
  'value, bounds, message',
  [
    (0, POSITIVE_INT, 'n must be a positive integer, got 0'),
    (1.0, POSITIVE_INT, 'n must be a positive integer, got 1.0'),
    (True, POSITIVE_INT, 'n must be a positive integer, got True'),
    (-1, NONNEGATIVE_INT, 'n must be a non-negative integer, got -1'),
    (-1, NONNEGATIVE, 'n must be >= 0, got -1'),
    (math.nan, NONNEGATIVE, 'n must be >= 0, got nan'),
    (1, Bounds(low=2, integer=True), 'n must be an integer >= 2, got 1'),
    ('1', NUMBER, "n must be a number, got '1'"),
  ],
)
def test_a_value_outside_is_refused_in_one_line(value, bounds, message):
  with pytest.raises(Refused) as raised:
    check_bounds(value, bounds, 'n', Refused)
  assert str(raised.value) == message


def test_inside_passes_numpy_scalars_too_and_the_reason_follows_the_range():
  for value in (1, np.int64(3), np.int32(1)):
    check_bounds(value, POSITIVE_INT, 'n')
  check_bounds(np.float32(0.5), NONNEGATIVE, 'n')
  with pytest.raises(
    ConfigError,
    match=r'max_len must be an integer >= 2 \(a token and EOS\), '
    r'got np.int64\(1\)',
  ):
    check_bounds(np.int64(1), Bounds(low=2, integer=True), 'max_len', why=' (a token and EOS)')


def test_fields_declare_theirs():
  with pytest.raises(
    ConfigError, match='model.attention_radius must be a non-negative integer, got -1'
  ):
    ModelConfig(attention_radius=-1)
  assert ModelConfig(attention_radius=None).attention_radius is None
  with pytest.raises(ConfigError, match='train.lr_scale must be a positive number, got nan'):
    TrainConfig(lr_scale=math.nan)
  with pytest.raises(ConfigError, match="train.scheduled_sampling_c must be a number, got '1'"):
    TrainConfig(scheduled_sampling='linear', scheduled_sampling_c='1')
