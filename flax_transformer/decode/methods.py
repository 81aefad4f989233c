"""Decoding methods as values: one small frozen class per method, which IS its settings.

    translator.translate(sentences, BeamSearch(beam_size=8, alpha=1.0))
    method = default_method(model_config)     # BeamSearch() or, for cmlm, MaskPredict()
    tokens = method.run(model, params, src)   # [B, L] int32, as the functional API returns

This module defines what a method is (`DecodingMethod`), the four methods
(`BeamSearch`, `Greedy`, `Sampling`, run by `autoregressive`'s functional API, and
`MaskPredict`, run by `non_autoregressive`'s), lists them (`METHODS`, decode.py's
--method names: every subclass with a `name` enters itself) and picks one. It loads no
JAX: a method's `run` imports the code that runs it, so decode.py's options (and --help)
come from here in a fraction of a second.
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
from typing import ClassVar, Literal

import numpy as np

from flax_transformer.config import (
  NONNEGATIVE,
  NONNEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  RENAMED,
  Bounds,
  ConfigError,
  ModelConfig,
  check_fields,
  setting,
)

__all__ = [
  'EXTRA_OUTPUT_TOKENS',
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

# decode.py's --method names -> their classes, in the order defined. Each subclass of
# DecodingMethod with a `name` enters itself when defined (below, and any a user adds).
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


def functional_api(module: str):
  """`decode.<module>`, the functional API that runs a method, imported when a method first
  runs: it builds method values from its keyword settings, so it imports this module, which
  therefore names it rather than importing it at its top (and stays free of JAX)."""
  return importlib.import_module(f'flax_transformer.decode.{module}')


# --- the methods: each one's settings, checked, and how it runs ---------------------------
# Their settings load without JAX (decode.py --help lists them); `run` and the checks that
# need the model's code import it when called.


# The paper's default output budget: source length + 50 (§6.1).
EXTRA_OUTPUT_TOKENS = 50


# An autoregressive method's output budget, one field shared by all three.
_MAX_LEN_HELP = (
  "output tokens per sentence (default: source length + 50, at most the model's max_len)"
)


@dataclasses.dataclass(frozen=True)
class BeamSearch(DecodingMethod):
  """Beam search ranking log P(Y | X) / lp(Y): GNMT's lp ((5 + |Y|) / 6)^alpha (paper: beam 4,
  alpha 0.6), or fairseq's |Y|^alpha (`penalty_form='fairseq'`; its `--lenpen 1` is alpha 1)."""

  name: ClassVar[str] = 'beam'
  beam_size: int = setting(4, 'beams K kept per sentence', bounds=POSITIVE_INT)
  # alpha >= 0: the early stop bounds a live beam's best final score by its score at the
  # longest length, which holds only when the penalty grows with length.
  alpha: float = setting(
    0.6,
    "the length penalty's exponent (its form: penalty_form); 0 ranks by plain log-probability",
    bounds=NONNEGATIVE,
  )
  penalty_form: Literal['gnmt', 'fairseq'] = setting(
    'gnmt',
    "the length penalty: GNMT's ((5 + |Y|) / 6)^alpha, or fairseq's |Y|^alpha (its --lenpen)",
  )
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def check_fits(self, config: ModelConfig, rows: int) -> None:
    # The shortest output budget: a one-token source + 50, unless max_len says.
    from flax_transformer.run.sizes import check_decoding_fits

    check_decoding_fits(
      config, rows, self.beam_size, '--beam-size', self.max_len or 1 + EXTRA_OUTPUT_TOKENS
    )

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    tokens, _ = functional_api('autoregressive').beam_search(
      model, params, src, **dataclasses.asdict(self)
    )
    return np.asarray(tokens)

  def describe(self) -> str:
    form = '' if self.penalty_form == 'gnmt' else f', {self.penalty_form} length penalty'
    return f'beam search (beam {self.beam_size}, alpha {self.alpha}{form})'


@dataclasses.dataclass(frozen=True)
class Greedy(DecodingMethod):
  """The most probable token at each step."""

  name: ClassVar[str] = 'greedy'
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    return np.asarray(
      functional_api('autoregressive').greedy(model, params, src, **dataclasses.asdict(self))
    )

  def describe(self) -> str:
    return 'greedy decoding'


@dataclasses.dataclass(frozen=True)
class Sampling(DecodingMethod):
  """Ancestral sampling from softmax(logits / temperature), optionally truncated: top_k keeps
  the k most probable tokens, then top_p the smallest set of them whose mass reaches p
  (nucleus sampling), on the tempered distribution. `seed` makes `run`'s draws repeatable."""

  name: ClassVar[str] = 'sample'
  temperature: float = setting(
    1.0,
    'divides the logits: above 1 flattens the distribution, below 1 sharpens it',
    bounds=POSITIVE,
  )
  top_k: int = setting(0, 'keep the k most probable tokens (0: all)', bounds=NONNEGATIVE_INT)
  top_p: float = setting(
    1.0,
    'nucleus sampling: keep the most probable tokens whose mass reaches p (1: all)',
    bounds=Bounds(low=0, high=1, low_open=True),
  )
  seed: int = setting(
    0,
    'random seed (batch i draws from the seed folded with i)',
    bounds=Bounds(low=-(2**63), high=2**63 - 1, integer=True),
  )
  max_len: int | None = setting(None, _MAX_LEN_HELP, bounds=POSITIVE_INT)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    import jax

    # One key per batch: batches draw independently, and a rerun draws the same.
    rng = jax.random.fold_in(jax.random.key(self.seed), batch_index)
    return np.asarray(
      functional_api('autoregressive').sample(model, params, src, rng, **dataclasses.asdict(self))
    )

  def describe(self) -> str:
    return (
      f'sampling (temperature {self.temperature}, top-k {self.top_k}, top-p {self.top_p}, '
      f'seed {self.seed})'
    )


# The largest length adjustment: no output is longer, so a larger ratio or offset would only
# clip every length to an end (and an offset past int32 overflows before the clip).
LENGTH_LIMIT = 2**16


@dataclasses.dataclass(frozen=True)
class MaskPredict(DecodingMethod):
  """Mask-predict decoding of a cmlm model (Ghazvininejad et al. 2019); its settings are static
  under jit.

  `iterations` refinement passes over the `length_beam` most probable lengths
  (length 'predict'), or over one canvas of source length +
  model.max_length_offset tokens cut at the first EOS (length 'fixed',
  length_beam 1). Each length N is then adjusted to round(length_ratio * N) +
  length_offset, clipped to [1, model.max_len] (`adjust_lengths`; with length
  'fixed' the canvas, which bounds the output, still cut at the first EOS).
  """

  name: ClassVar[str] = 'mask_predict'
  model_kind: ClassVar[str] = 'cmlm'
  iterations: int = setting(
    10,
    'decoding passes I; each after the first re-masks the least '
    'confident tokens (1: one-pass decoding)',
    bounds=POSITIVE_INT,
  )
  length_beam: int = setting(
    3,
    'output lengths M decoded per sentence, the length '
    "classifier's best, the most confident output kept (1 with "
    'length fixed)',
    bounds=POSITIVE_INT,
  )
  length: Literal['predict', 'fixed'] = setting(
    'predict',
    "predict the length, or decode source length + the model's "
    'max_length_offset, cut at the first EOS',
  )
  length_ratio: float = setting(
    1.0,
    'multiply each length (predicted, or with length fixed the canvas) by this and round',
    bounds=Bounds(low=0, high=LENGTH_LIMIT, low_open=True),
  )
  length_offset: int = setting(
    0,
    'add this many tokens (may be negative) to each length after '
    "length_ratio; lengths stay in [1, the model's max_len]",
    bounds=Bounds(low=-LENGTH_LIMIT, high=LENGTH_LIMIT, integer=True),
  )

  def __post_init__(self):
    super().__post_init__()
    if self.length == 'fixed' and self.length_beam != 1:
      raise ConfigError(
        f"mask_predict length='fixed' decodes one length per sentence: "
        f'length_beam must be 1, got {self.length_beam}'
      )

  def check_model(self, config: ModelConfig) -> None:
    super().check_model(config)
    from flax_transformer.nn.cmlm import num_length_classes

    classes = num_length_classes(config)
    if self.length_beam > classes:
      raise ConfigError(
        f"length_beam={self.length_beam} exceeds the model's {classes} length "
        f'classes (2 * model.max_length_offset + 1, max_length_offset='
        f'{config.max_length_offset})'
      )

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    return np.asarray(
      functional_api('non_autoregressive').mask_predict(
        model, params, src, **dataclasses.asdict(self)
      )
    )

  def describe(self) -> str:
    parts = [
      f'{self.iterations} iterations',
      'fixed length' if self.length == 'fixed' else f'length beam {self.length_beam}',
    ]
    if self.length_ratio != 1 or self.length_offset:
      parts.append(f'lengths x {self.length_ratio} {self.length_offset:+d}')
    return f'mask-predict decoding ({", ".join(parts)})'


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
    from flax_transformer.nn.cmlm import num_length_classes

    length_beam = min(MaskPredict.length_beam, num_length_classes(config))
    method = MaskPredict(length_beam=length_beam)
  else:
    method = autoregressive if autoregressive is not None else BeamSearch()
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
  for given in settings:
    if given not in own:
      owners = [
        other.name
        for other in METHODS.values()
        if given in {f.name for f in dataclasses.fields(other)}
      ]
      raise ConfigError(
        f'{given} only applies to method {" or ".join(map(repr, owners))}, not {cls.name!r}'
      )
