"""Decoding methods as values: one small frozen class per method, which IS its settings.

    translator.translate(sentences, BeamSearch(beam_size=8, alpha=1.0))
    method = default_method(model_config)     # BeamSearch() or, for cmlm, MaskPredict()
    tokens = method.run(model, params, src)   # [B, L] int32, as the functional API returns

Each class is defined beside the functional API that runs it (`BeamSearch`,
`Greedy`, `Sampling` in `autoregressive`, `MaskPredict` in `non_autoregressive`);
this module lists them (`METHODS`, decode.py's --method names) and picks one.
A method's fields are its settings, each a `config.setting(default, help,
bounds=...)`: the default, the one-line help and the range are written there
once (the paper's beam 4 and alpha 0.6 on `BeamSearch`), checked when the value
is made (`config.check_fields`, plus the class's own cross-field rules), read as
defaults by the functional API's keyword arguments (`beam_search(..., beam_size=8)`),
and turned into decode.py's and distill.py's options (cli/options.py). Each class
also says in words what it does (`describe`), refuses a model it cannot decode
(`check_model`), and decodes a batch of source ids (`run`). Adding a setting is
adding a field and reading it; adding a method is adding a class and listing it here.

Autoregressive methods take `max_len`, the output tokens per sentence (None:
source length + 50, capped at model.max_len); mask-predict's output length is
the one its length classifier predicts, scaled by `length_ratio` and shifted by
`length_offset` (`MaskPredict(length_ratio=0.8)`: about 20% shorter output).
"""

from __future__ import annotations

import dataclasses

from flax_transformer.config import RENAMED, ConfigError, ModelConfig
from flax_transformer.decode.autoregressive import BeamSearch, DecodingMethod, Greedy, Sampling
from flax_transformer.decode.non_autoregressive import MaskPredict
from flax_transformer.nn import cmlm

__all__ = [
  'METHODS',
  'BeamSearch',
  'DecodingMethod',
  'Greedy',
  'MaskPredict',
  'Sampling',
  'default_method',
  'method_from_name',
  'renamed_methods',
]

# decode.py's --method names.
METHODS: dict[str, type[DecodingMethod]] = {
  cls.name: cls for cls in (BeamSearch, Greedy, Sampling, MaskPredict)
}


def renamed_methods() -> dict[str, str]:
  """Method names of earlier versions -> their names now (config.RENAMED's 'method.NAME')."""
  return {
    old.split('.', 1)[1]: new.split('.', 1)[1]
    for old, new in RENAMED.items()
    if old.startswith('method.')
  }


def default_method(
  config: ModelConfig, autoregressive: DecodingMethod = BeamSearch(), **settings
) -> DecodingMethod:
  """How a model decodes unless told otherwise: a cmlm model with mask-predict (its length
  beam at most the model's length classes), an autoregressive one with `autoregressive`
  (the paper's beam search; training's quick BLEU passes Greedy()). `settings` (decode.py's
  options given without --method) replace the method's own, refused if another method's.
  """
  if config.kind == 'cmlm':
    method = MaskPredict(length_beam=min(MaskPredict.length_beam, cmlm.num_length_classes(config)))
  else:
    method = autoregressive
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
