"""Decoding methods as values: one small frozen class per method.

    translator.translate(sentences, BeamSearch(beam_size=8, alpha=1.0))
    method = default_method(model_config)     # BeamSearch() or, for cmlm, MaskPredict()
    tokens = method.run(model, params, src)   # [B, L] int32, as the functional API returns

Each class checks its own settings when it is made, says in words what it does
(`describe`), refuses a model it cannot decode (`check_model`), and decodes a
batch of source ids (`run`) through the functional API (`autoregressive.greedy`,
`autoregressive.sample`, `autoregressive.beam_search`, `non_autoregressive.mask_predict`), whose
defaults it shares: the paper's beam 4 and alpha 0.6 are written once, in
`autoregressive.BeamConfig`. Adding a method is adding a class here.

Autoregressive methods take `max_len`, the output tokens per sentence (None:
source length + 50, capped at model.max_len); mask-predict's output length is
the one its length classifier predicts, scaled by `length_ratio` and shifted by
`length_offset` (`MaskPredict(length_ratio=0.8)`: about 20% shorter output).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Literal

import jax
import numpy as np

from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.decode import autoregressive, non_autoregressive
from flax_transformer.nn import cmlm


@dataclasses.dataclass(frozen=True)
class DecodingMethod:
  """What every method has: a `name` (decode.py's --method), the model kind it decodes."""

  name: ClassVar[str]
  model_kind: ClassVar[str] = 'autoregressive'

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    """Output ids `[B, L]` for source ids `[B, S]`; batch_index seeds per-batch randomness."""
    raise NotImplementedError

  def describe(self) -> str:
    """The method and its settings in words, for reports."""
    raise NotImplementedError

  def check_model(self, config: ModelConfig) -> None:
    """Raises ConfigError unless this method and its settings can decode a model of `config`."""
    if config.kind != self.model_kind:
      names = [repr(cls.name) for cls in METHODS.values() if cls.model_kind == config.kind]
      usable = ', '.join(names[:-1]) + ' or ' * (len(names) > 1) + names[-1]
      raise ConfigError(f'method {self.name!r} decodes {self.model_kind} models, but this model '
                        f'is model.kind={config.kind!r}; use method {usable}')
    max_len = getattr(self, 'max_len', None)
    if max_len is not None and max_len > config.max_len:
      raise ConfigError(f"max_len must be in [1, {config.max_len}] (the model's max_len, the "
                        f'length of its positional table), got {max_len}')


def _check_max_len(max_len: int | None) -> None:
  if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int)
                              or max_len < 1):
    raise ConfigError(f'max_len must be a positive integer or None, got {max_len!r}')


@dataclasses.dataclass(frozen=True)
class Greedy(DecodingMethod):
  """The most probable token at each step."""

  name: ClassVar[str] = 'greedy'
  max_len: int | None = None

  def __post_init__(self):
    _check_max_len(self.max_len)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    return np.asarray(autoregressive.greedy(model, params, src, max_len=self.max_len))

  def describe(self) -> str:
    return 'greedy decoding'


@dataclasses.dataclass(frozen=True)
class BeamSearch(DecodingMethod):
  """Beam search with the GNMT length penalty ((5 + |Y|) / 6)^alpha (paper: beam 4, alpha 0.6)."""

  name: ClassVar[str] = 'beam'
  beam_size: int = autoregressive.BeamConfig.beam_size
  alpha: float = autoregressive.BeamConfig.alpha
  max_len: int | None = None

  def __post_init__(self):
    autoregressive.BeamConfig(beam_size=self.beam_size, alpha=self.alpha)
    _check_max_len(self.max_len)

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    tokens, _ = autoregressive.beam_search(model, params, src, beam_size=self.beam_size,
                                     alpha=self.alpha, max_len=self.max_len)
    return np.asarray(tokens)

  def describe(self) -> str:
    return f'beam search (beam {self.beam_size}, alpha {self.alpha})'


@dataclasses.dataclass(frozen=True)
class Sampling(DecodingMethod):
  """Ancestral sampling with temperature, top-k and top-p; `seed` makes the draws repeatable."""

  name: ClassVar[str] = 'sample'
  temperature: float = autoregressive.SamplingConfig.temperature
  top_k: int = autoregressive.SamplingConfig.top_k
  top_p: float = autoregressive.SamplingConfig.top_p
  seed: int = 0
  max_len: int | None = None

  def __post_init__(self):
    autoregressive.SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
    _check_max_len(self.max_len)
    if isinstance(self.seed, bool) or not isinstance(self.seed, int):
      raise ConfigError(f'sampling seed must be an integer, got {self.seed!r}')

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    # One key per batch: batches draw independently, and a rerun draws the same.
    rng = jax.random.fold_in(jax.random.key(self.seed), batch_index)
    return np.asarray(autoregressive.sample(model, params, src, rng, temperature=self.temperature,
                                      top_k=self.top_k, top_p=self.top_p, max_len=self.max_len))

  def describe(self) -> str:
    return (f'sampling (temperature {self.temperature}, top-k {self.top_k}, top-p {self.top_p}, '
            f'seed {self.seed})')


@dataclasses.dataclass(frozen=True)
class MaskPredict(DecodingMethod):
  """Mask-predict decoding of a cmlm model (Ghazvininejad et al. 2019).

  `iterations` refinement passes over the `length_beam` most probable lengths
  (length 'predict'), or over one canvas of source length +
  model.max_length_offset tokens cut at the first EOS (length 'fixed',
  length_beam 1). Each length N is then adjusted to round(length_ratio * N) +
  length_offset, clipped to [1, model.max_len] (with length 'fixed': the canvas).
  """

  name: ClassVar[str] = 'mask_predict'
  model_kind: ClassVar[str] = 'cmlm'
  iterations: int = non_autoregressive.MaskPredictConfig.iterations
  length_beam: int = non_autoregressive.MaskPredictConfig.length_beam
  length: Literal['predict', 'fixed'] = non_autoregressive.MaskPredictConfig.length
  length_ratio: float = non_autoregressive.MaskPredictConfig.length_ratio
  length_offset: int = non_autoregressive.MaskPredictConfig.length_offset

  def __post_init__(self):
    self.settings()

  def settings(self) -> non_autoregressive.MaskPredictConfig:
    """The functional API's settings (checked when made)."""
    return non_autoregressive.MaskPredictConfig(**{field.name: getattr(self, field.name)
                                              for field in dataclasses.fields(self)})

  def check_model(self, config: ModelConfig) -> None:
    super().check_model(config)
    classes = cmlm.num_length_classes(config)
    if self.length_beam > classes:
      raise ConfigError(f"length_beam={self.length_beam} exceeds the model's {classes} length "
                        f'classes (2 * model.max_length_offset + 1, max_length_offset='
                        f'{config.max_length_offset})')

  def run(self, model, params, src, batch_index: int = 0) -> np.ndarray:
    return np.asarray(non_autoregressive.mask_predict(model, params, src,
                                                 **dataclasses.asdict(self.settings())))

  def describe(self) -> str:
    parts = [f'{self.iterations} iterations',
             'fixed length' if self.length == 'fixed' else f'length beam {self.length_beam}']
    if self.length_ratio != 1 or self.length_offset:
      parts.append(f'lengths x {self.length_ratio} {self.length_offset:+d}')
    return f'mask-predict decoding ({", ".join(parts)})'


# decode.py's --method names.
METHODS: dict[str, type[DecodingMethod]] = {
    cls.name: cls for cls in (BeamSearch, Greedy, Sampling, MaskPredict)}
# Method names of earlier versions.
RENAMED_METHODS = {'nat': MaskPredict.name}


def default_method(config: ModelConfig, autoregressive: DecodingMethod = BeamSearch()
                   ) -> DecodingMethod:
  """How a model decodes unless told otherwise: a cmlm model with mask-predict (its length
  beam at most the model's length classes), an autoregressive one with `autoregressive`
  (the paper's beam search; training's quick BLEU passes Greedy())."""
  if config.kind == 'cmlm':
    return MaskPredict(length_beam=min(MaskPredict.length_beam, cmlm.num_length_classes(config)))
  return autoregressive


def method_from_name(name: str, **settings) -> DecodingMethod:
  """The method decode.py's `--method NAME` and its given settings describe.

  A setting that belongs to another method is refused, naming it, rather than ignored.
  """
  if name in RENAMED_METHODS:
    raise ConfigError(f'method {name!r} is now called {RENAMED_METHODS[name]!r}')
  if name not in METHODS:
    raise ConfigError(f'method must be one of {", ".join(METHODS)}; got {name!r}')
  cls = METHODS[name]
  own = {field.name for field in dataclasses.fields(cls)}
  for setting in settings:
    if setting not in own:
      owners = [other.name for other in METHODS.values()
                if setting in {f.name for f in dataclasses.fields(other)}]
      raise ConfigError(f'{setting} only applies to method {" or ".join(map(repr, owners))}, '
                        f'not {name!r}')
  return cls(**settings)
