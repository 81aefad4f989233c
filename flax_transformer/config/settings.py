"""The setting machinery every section of settings shares, and decoding methods too.

A field is `setting(default, help, bounds=...)`: its default, its one-line help (train.py's
and decode.py's `--help` are generated from it) and the values it admits, a `Bounds` range
(`POSITIVE_INT`, `UNIT_INTERVAL`, ...). `check_fields` checks a settings object against its
`Literal` choices and bounds, `check_bounds` a function's raw argument by the same rule;
`parse_overrides` turns command-line strings like `--model.d_model=256` into values by each
field's annotation, and `RENAMED` names the settings and methods of earlier versions.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import numpy as np

from flax_transformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Bounds:
  """The values a numeric setting admits, declared on its field (`setting(..., bounds=...)`).

  `low` and `high` are inclusive unless `low_open` / `high_open`; `integer` admits
  ints only (never bools); NaN is outside any limit. None passes when the field's
  annotation admits None. `check_bounds` checks a function's raw argument with the same
  rule and message.
  """

  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  integer: bool = False

  def admits(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, int if self.integer else (int, float)):
      return False
    if self.low is not None and not (value > self.low if self.low_open else value >= self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def describe(self) -> str:
    """What the error message says a value must be."""
    if self == POSITIVE_INT:
      return 'a positive integer'
    if self == NONNEGATIVE_INT:
      return 'a non-negative integer'
    if self == POSITIVE:
      return 'a positive number'
    if self.low is None and self.high is None:
      return 'an integer' if self.integer else 'a number'
    return ('an integer ' if self.integer else '') + self.limits()

  def limits(self, number: str = '') -> str:
    """The range alone: '>= 1', '> 0', 'in [0, 1)'; `number` formats the limits (e.g. 'g')."""
    # Integer limits in full (2**63 - 1, not 9.22337e+18); `number` formats the others.
    low, high = (
      None if x is None else str(x) if isinstance(x, int) else format(x, number)
      for x in (self.low, self.high)
    )
    if high is None:
      return f'{">" if self.low_open else ">="} {low}'
    if low is None:
      return f'{"<" if self.high_open else "<="} {high}'
    return f'in {"(" if self.low_open else "["}{low}, {high}{")" if self.high_open else "]"}'


POSITIVE_INT = Bounds(low=1, integer=True)
NONNEGATIVE_INT = Bounds(low=0, integer=True)
POSITIVE = Bounds(low=0, low_open=True)
NONNEGATIVE = Bounds(low=0)
UNIT_INTERVAL = Bounds(low=0, high=1, high_open=True)  # [0, 1): rates and probabilities
NUMBER = Bounds()  # any int or float, no limit
# What jax.random.key takes: a signed 64-bit integer (larger ones overflow part way).
SEED = Bounds(low=0, high=2**63 - 1, integer=True)


def check_bounds(
  value, bounds: Bounds, name: str, error: type[Exception] = ConfigError, why: str = ''
) -> None:
  """Raises `error('{name} must be {bounds}{why}, got {value!r}')` unless `bounds` admit
  `value`: the range check of a public function's raw argument (a settings field declares
  its range instead, `setting(..., bounds=...)`). A numpy scalar counts as the number it holds."""
  plain = value.item() if isinstance(value, np.generic) else value
  if not bounds.admits(plain):
    raise error(f'{name} must be {bounds.describe()}{why}, got {value!r}')


@dataclasses.dataclass(frozen=True)
class Lifetime:
  """How long a run's setting lives: what changing it means for a saved run.

  Each field of `ModelConfig`, `TrainConfig` and `DataConfig` declares one (`setting(...,
  lifetime=...)`), and every rule about changing settings is read from them: a resumed run
  may change the `resumable` ones (the others are its identity, compared with config.json);
  a run initialised from a pretrained model may override the `fine_tunable` ones; `option`
  says whether train.py offers it (the vocabulary comes from the tokenizer instead).
  """

  name: str
  meaning: str
  resumable: bool
  fine_tunable: bool = False
  option: bool = True


# The model's settings.
ARCHITECTURE = Lifetime(
  'architecture', 'what a checkpoint means: its shapes and what its parameters compute', False
)
VOCABULARY = Lifetime(
  'vocabulary',
  "the tokenizer's size and special ids, set from the trained tokenizer",
  False,
  option=False,
)
INITIALISATION = Lifetime(
  'initialisation', 'how fresh parameters are drawn; a resumed run restores over them', True
)
COMPUTATION = Lifetime(
  'computation',
  'how this run computes the same function: chosen per run, resolved per backend (nn.backend), '
  'recorded, never compared',
  True,
  fine_tunable=True,
)
REGULARISATION = Lifetime('regularisation', 'dropout, which fine-tuning may change', False, True)
# The training run's.
OPTIMIZER = Lifetime(
  'optimizer', 'the updates: seed, batches, learning-rate schedule, Adam, clipping, decay', False
)
OBJECTIVE = Lifetime(
  'objective',
  'what is minimised and what the best checkpoint is chosen by: label smoothing, the cmlm '
  'losses, scheduled sampling, train.best_metric',
  False,
)
CADENCE = Lifetime(
  'cadence', 'how long and how often: steps, intervals, prefetch, profile, patience', True
)
# The data's.
CORPUS = Lifetime('corpus', 'the parallel text and how it becomes token ids', False)
LOCATION = Lifetime('location', 'where derived files are kept; no token id depends on it', True)

LIFETIMES = (
  ARCHITECTURE,
  VOCABULARY,
  INITIALISATION,
  COMPUTATION,
  REGULARISATION,
  OPTIMIZER,
  OBJECTIVE,
  CADENCE,
  CORPUS,
  LOCATION,
)


def setting(
  default,
  help: str,  # noqa: A002 -- argparse's name
  bounds: Bounds | None = None,
  lifetime: Lifetime | None = None,
):
  """A settings field: its default, a one-line help (train.py --help, decode.py --help), the
  values it admits (checked by `check_fields`) and, for a run's settings, its `Lifetime`."""
  return dataclasses.field(
    default=default, metadata={'help': help, 'bounds': bounds, 'lifetime': lifetime}
  )


def lifetime_of(config_class, name: str) -> Lifetime:
  """The `Lifetime` a run's setting declares (ValueError for a field without one)."""
  lifetime = {f.name: f for f in dataclasses.fields(config_class)}[name].metadata['lifetime']
  if lifetime is None:
    raise ValueError(f'{config_class.__name__}.{name} declares no lifetime')
  return lifetime


def fields_where(config_class, rule) -> tuple[str, ...]:
  """The names of `config_class`'s fields whose `Lifetime` satisfies `rule`, in field order:
  `fields_where(ModelConfig, lambda lifetime: lifetime.fine_tunable)`."""
  return tuple(
    f.name for f in dataclasses.fields(config_class) if rule(lifetime_of(config_class, f.name))
  )


def help_of(config_class, name: str) -> str:
  """The one-line help of a config field."""
  return {f.name: f for f in dataclasses.fields(config_class)}[name].metadata['help']


@functools.cache
def field_types(config_class) -> dict[str, object]:
  """Each field's annotation, resolved (the module's annotations are strings)."""
  return typing.get_type_hints(config_class)


def check_fields(settings, section: str) -> None:
  """Raises ConfigError naming `section.field` for the first field outside what it admits:
  a `Literal` annotation's choices, or the `Bounds` declared with `setting`."""
  hints = field_types(type(settings))
  for field in dataclasses.fields(settings):
    value, hint = getattr(settings, field.name), hints[field.name]
    choices = typing.get_args(hint)
    if typing.get_origin(hint) is Literal and value not in choices:
      raise ConfigError(
        f'{section}.{field.name} must be one of {", ".join(map(str, choices))}, got {value!r}'
      )
    bounds = field.metadata.get('bounds')
    if bounds is None or (value is None and type(None) in choices):
      continue
    if isinstance(value, str) and value in _named_values(hint):
      continue  # a number's field that also takes a name ('auto'): the name is not bounded
    if not bounds.admits(value):
      names = ''.join(f' or {name}' for name in _named_values(hint))
      raise ConfigError(f'{section}.{field.name} must be {bounds.describe()}{names}, got {value!r}')


# Names of earlier versions, old -> new, the one table every reader reads: a setting is
# 'SECTION.NAME', its section a config's ('model': train.py refuses the old option naming the
# new one, config.json's old key is read as the new) or a decoding method's name
# ('mask_predict': decode.py refuses the old option); a decoding method is 'method.NAME'
# (decode.py's --method). The non-autoregressive model was called nat before it was cmlm.
RENAMED = {
  'model.nat_decoder_input': 'model.cmlm_decoder_input',
  'method.nat': 'method.mask_predict',
  'mask_predict.nat_length': 'mask_predict.length',
}


def parse_overrides(config, section: str, assignments: dict[str, str]):
  """Returns `config` with string values parsed by each field's annotation.

  `parse_overrides(ModelConfig(), 'model', {'d_model': '256', 'attention_radius': 'none'})`.
  Booleans accept true/false/1/0/yes/no, optional fields accept 'none', and
  Literal fields accept one of their choices. Errors name `section.field`.
  """
  hints = field_types(type(config))
  fields = {f.name for f in dataclasses.fields(config)}
  values = {}
  for name, text in assignments.items():
    if f'{section}.{name}' in RENAMED:
      raise ConfigError(f'{section}.{name} is now called {RENAMED[f"{section}.{name}"]}')
    if name not in fields:
      raise ConfigError(
        f'unknown option {section}.{name}; known: '
        + ', '.join(sorted(f'{section}.{f}' for f in fields))
      )
    values[name] = _parse_value(hints[name], text, f'{section}.{name}')
  return dataclasses.replace(config, **values)


def _named_values(annotation) -> tuple[str, ...]:
  """The names a number's field also takes: ('auto',) for `int | Literal['auto']`."""
  literals = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
  return tuple(name for literal in literals for name in typing.get_args(literal))


def _parse_value(annotation, text: str, option: str):
  """One command-line string -> a value of `annotation` (int, float, bool, str, Literal,
  X | None, or a number that also takes names: int | Literal['auto'])."""
  args = typing.get_args(annotation)
  if type(None) in args:
    if text.strip().lower() == 'none':
      return None
    (annotation,) = [a for a in args if a is not type(None)]
    args = typing.get_args(annotation)
  names = _named_values(annotation) if typing.get_origin(annotation) is not Literal else ()
  if names:
    if text in names:
      return text
    (annotation,) = [a for a in args if typing.get_origin(a) is not Literal]
  if typing.get_origin(annotation) is Literal:
    if text not in args:
      raise ConfigError(f'{option} must be one of {", ".join(map(str, args))}, got {text!r}')
    return text
  if annotation is bool:
    lowered = text.strip().lower()
    if lowered not in ('true', 'false', '1', '0', 'yes', 'no'):
      raise ConfigError(f'{option} must be true or false, got {text!r}')
    return lowered in ('true', '1', 'yes')
  try:
    return annotation(text)
  except ValueError:
    kind = {int: 'an integer', float: 'a number'}.get(annotation, annotation.__name__)
    alternatives = ''.join(f' or {name}' for name in names)
    raise ConfigError(f'{option} must be {kind}{alternatives}, got {text!r}') from None
