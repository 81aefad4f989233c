"""Decoding methods as values: one small frozen class per method, which IS its settings.

    translator.translate(sentences, BeamSearch(beam_size=8, alpha=1.0))
    method = default_method(model_config)     # BeamSearch() or, for cmlm, MaskPredict()
    tokens = method.run(model, params, src)   # [B, L] int32, as the functional API returns

This module defines what a method is (`DecodingMethod`), lists the methods
(`METHODS`, decode.py's --method names: every subclass with a `name` enters
itself) and picks one. Each class is defined beside the functional API that runs
it (`BeamSearch`, `Greedy`, `Sampling` in `autoregressive`, `MaskPredict` in
`non_autoregressive`), and reachable from here as before (`methods.BeamSearch`).
A method's fields are its settings, each a `config.setting(default, help,
bounds=...)`: the default, the one-line help and the range are written there
once (the paper's beam 4 and alpha 0.6 on `BeamSearch`), checked when the value
is made (`config.check_fields`, plus the class's own cross-field rules), read as
defaults by the functional API's keyword arguments (`beam_search(..., beam_size=8)`),
and turned into decode.py's and distill.py's options (cli/options.py). Each class
also says in words what it does (`describe`), refuses a model it cannot decode
(`check_model`), and decodes a batch of source ids (`run`). Adding a setting is
adding a field and reading it; adding a method is adding a subclass with a `name`.

Autoregressive methods take `max_len`, the output tokens per sentence (None:
source length + 50, capped at model.max_len); mask-predict's output length is
the one its length classifier predicts, scaled by `length_ratio` and shifted by
`length_offset` (`MaskPredict(length_ratio=0.8)`: about 20% shorter output).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import ClassVar

import numpy as np

from flax_transformer.config import RENAMED, ConfigError, ModelConfig, check_fields
from flax_transformer.nn import cmlm

__all__ = [
  'METHODS',
  'DecodingMethod',
  'default_method',
  'method_from_name',
  'renamed_methods',
]

# decode.py's --method names -> their classes, in the order defined. Each subclass of
# DecodingMethod with a `name` enters itself when its module is imported (the decode
# package imports `autoregressive` and `non_autoregressive`, so any import of this module
# sees all four).
METHODS: dict[str, type[DecodingMethod]] = {}


@dataclasses.dataclass(frozen=True)
class DecodingMethod:
  """What every decoding method has: a `name` (decode.py's --method), the model kind it decodes.

  A method is a frozen dataclass whose fields are its settings, each a
  `config.setting(default, help, bounds=...)`: the default and the range are
  written there once, checked when the value is made (`check_fields`, errors
  naming 'NAME.field'), and decode.py's and distill.py's options are generated
  from them (cli/options.py). The functional API (`beam_search(..., beam_size=8)`)
  builds the method value from its keyword arguments. A subclass that sets `name`
  is listed in METHODS under it; a name already taken is refused.
  """

  name: ClassVar[str]
  model_kind: ClassVar[str] = 'autoregressive'

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if 'name' not in vars(cls):
      return  # an intermediate class, not a method of its own
    taken = METHODS.get(cls.name)
    if taken is not None and taken.__qualname__ != cls.__qualname__:
      raise TypeError(
        f'decoding method name {cls.name!r} of {cls.__module__}.{cls.__qualname__} is '
        f'taken by {taken.__module__}.{taken.__qualname__}'
      )
    METHODS[cls.name] = cls

  def __post_init__(self):
    check_fields(self, self.name)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    """Output ids `[B, L]` for source ids `[B, S]`; batch_index seeds per-batch randomness."""
    raise NotImplementedError

  def describe(self) -> str:
    """The method and its settings in words, for reports."""
    raise NotImplementedError

  def check_model(self, config: ModelConfig) -> None:
    """Raises ConfigError unless this method and its settings can decode a model of `config`."""
    if config.kind != self.model_kind:
      names = [repr(name) for name, cls in METHODS.items() if cls.model_kind == config.kind]
      usable = ', '.join(names[:-1]) + ' or ' * (len(names) > 1) + names[-1]
      raise ConfigError(
        f'method {self.name!r} decodes {self.model_kind} models, but this model '
        f'is model.kind={config.kind!r}; use method {usable}'
      )
    max_len = getattr(self, 'max_len', None)
    if max_len is not None and max_len > config.max_len:
      raise ConfigError(
        f"max_len must be in [1, {config.max_len}] (the model's max_len, the "
        f'length of its positional table), got {max_len}'
      )

  def check_fits(self, config: ModelConfig, rows: int) -> None:
    """Raises ConfigError when decoding `rows` sentences at once cannot fit in this machine's
    memory; a method whose memory grows with a setting (beams) checks it."""


# The concrete classes live beside the functional API that runs them; this module still
# answers `methods.BeamSearch` etc., as it did when it imported them: from METHODS, once the
# decode package has imported every module that defines one (they import this one, so not
# before it is asked).
def __getattr__(name: str):
  importlib.import_module('flax_transformer.decode')
  for cls in METHODS.values():
    if cls.__name__ == name:
      return cls
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def renamed_methods() -> dict[str, str]:
  """Method names of earlier versions -> their names now (config.RENAMED's 'method.NAME')."""
  return {
    old.split('.', 1)[1]: new.split('.', 1)[1]
    for old, new in RENAMED.items()
    if old.startswith('method.')
  }


def default_method(
  config: ModelConfig, autoregressive: DecodingMethod | None = None, **settings
) -> DecodingMethod:
  """How a model decodes unless told otherwise: a cmlm model with mask-predict (its length
  beam at most the model's length classes), an autoregressive one with `autoregressive`
  (default: the paper's beam search, BeamSearch(); training's quick BLEU passes Greedy()).
  `settings` (decode.py's options given without --method) replace the method's own, refused
  if another method's.
  """
  if config.kind == 'cmlm':
    mask_predict = METHODS['mask_predict']
    length_beam = min(mask_predict.length_beam, cmlm.num_length_classes(config))
    method = mask_predict(length_beam=length_beam)
  else:
    method = autoregressive if autoregressive is not None else METHODS['beam']()
  _refuse_foreign_settings(type(method), settings)
  return dataclasses.replace(method, **settings) if settings else method


def method_from_name(name: str, **settings) -> DecodingMethod:
  """The method decode.py's `--method NAME` and its given settings describe.

  A setting that belongs to another method is refused, naming it, rather than ignored.
  """
  renamed = renamed_methods()
  if name in renamed:
    raise ConfigError(f'method {name!r} is now called {renamed[name]!r}')
  if name not in METHODS:
    raise ConfigError(f'method must be one of {", ".join(METHODS)}; got {name!r}')
  _refuse_foreign_settings(METHODS[name], settings)
  return METHODS[name](**settings)


def _refuse_foreign_settings(cls: type[DecodingMethod], settings) -> None:
  own = {field.name for field in dataclasses.fields(cls)}
  for setting in settings:
    if setting not in own:
      owners = [
        other.name
        for other in METHODS.values()
        if setting in {f.name for f in dataclasses.fields(other)}
      ]
      raise ConfigError(
        f'{setting} only applies to method {" or ".join(map(repr, owners))}, not {cls.name!r}'
      )
