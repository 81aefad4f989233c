"""Text in, text out: a run directory's model, parameters and tokenizer behind one call.

    translator = Translator.from_checkpoint('runs/multi30k', average_last=5)
    translator.translate(['Ein Mann fährt Fahrrad.'])                 # beam 4, alpha 0.6
    translator.translate(sentences, method='sample', top_p=0.9, seed=1)
    Translator.from_checkpoint('runs/cmlm').translate(sentences, method='nat')  # mask-predict
    alignment = translator.alignment('Ein Mann fährt Fahrrad.')      # cross-attention, for plots

Sources are tokenized as in training (subwords + EOS) and truncated to
`model.max_len` tokens, EOS included. Sentences are sorted by length and decoded
in batches padded to a multiple of 8 tokens and a power of two of rows (bounded
by `batch_size`), so that few shapes compile; the results come back in input
order. Empty (or all-space) sentences translate to '' without decoding.

A checkpoint's `model.kind` decides the methods that apply: 'beam', 'greedy'
and 'sample' decode an autoregressive model, 'nat' (mask-predict,
`nat_decoding.mask_predict`) a cmlm one; any other pairing is a ConfigError.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import jax
import numpy as np

from flax_transformer import decoding, nat, nat_decoding
from flax_transformer.checkpoint import build_model, load_for_inference
from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.model import Transformer, attention_weights
from flax_transformer.tokenizer import Tokenizer

METHODS = ('beam', 'greedy', 'sample', 'nat')
# The methods that decode each model.kind.
KIND_METHODS = {'autoregressive': ('beam', 'greedy', 'sample'), 'cmlm': ('nat',)}
# Source widths are rounded up to a multiple of this, so a corpus compiles a few shapes.
WIDTH_MULTIPLE = 8


@dataclasses.dataclass(frozen=True)
class Search:
  """How to choose the output: the method and its settings.

  method: 'beam' (the paper: beam_size 4, alpha 0.6), 'greedy', or 'sample'
    (temperature, top_k, top_p; `seed` makes draws reproducible) for an
    autoregressive model; 'nat' for a cmlm model: mask-predict with
    `iterations` refinement passes over the `length_beam` most probable lengths
    (nat_length 'predict'), or over a fixed canvas of source length +
    model.max_length_offset tokens cut at the first EOS (nat_length 'fixed',
    length_beam 1).
  max_len: output tokens per sentence; None: source length + 50, capped at
    model.max_len. Not for 'nat', whose output length is the predicted one.
  Settings of another method must stay at their defaults, so that a setting is
  never silently ignored.
  """
  method: Literal['beam', 'greedy', 'sample', 'nat'] = 'beam'
  beam_size: int = 4
  alpha: float = 0.6
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  iterations: int = 10
  length_beam: int = 3
  nat_length: Literal['predict', 'fixed'] = 'predict'
  max_len: int | None = None

  def __post_init__(self):
    if self.method not in METHODS:
      raise ConfigError(f'method must be one of {", ".join(METHODS)}; got {self.method!r}')
    owners = {'beam': ('beam_size', 'alpha'), 'sample': ('temperature', 'top_k', 'top_p', 'seed'),
              'nat': ('iterations', 'length_beam', 'nat_length')}
    defaults = Search.__dataclass_fields__
    for method, names in owners.items():
      changed = [n for n in names if getattr(self, n) != defaults[n].default]
      if changed and method != self.method:
        raise ConfigError(f'{", ".join(changed)} only apply to method {method!r}, '
                          f'not {self.method!r}')
    if self.method == 'nat' and self.max_len is not None:
      raise ConfigError("max_len only applies to the autoregressive methods (beam, greedy, "
                        "sample), not 'nat', whose output length is the length predicted")
    # Check the values now, not at the first batch.
    decoding.BeamConfig(beam_size=self.beam_size, alpha=self.alpha)
    decoding.SamplingConfig(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
    nat_decoding.MaskPredictConfig(iterations=self.iterations, length_beam=self.length_beam,
                                   length=self.nat_length)

  def describe(self) -> str:
    """The method and its settings in words, for reports: 'greedy decoding', ..."""
    if self.method == 'beam':
      return f'beam search (beam {self.beam_size}, alpha {self.alpha})'
    if self.method == 'greedy':
      return 'greedy decoding'
    if self.method == 'sample':
      return (f'sampling (temperature {self.temperature}, top-k {self.top_k}, '
              f'top-p {self.top_p}, seed {self.seed})')
    if self.nat_length == 'fixed':
      return f'mask-predict decoding ({self.iterations} iterations, fixed length)'
    return (f'mask-predict decoding ({self.iterations} iterations, length beam '
            f'{self.length_beam})')

  def check_model(self, config: ModelConfig) -> None:
    """Raises ConfigError unless this method and its settings can decode a model of `config`."""
    methods = KIND_METHODS[config.kind]
    if self.method not in methods:
      other = 'cmlm' if config.kind == 'autoregressive' else 'autoregressive'
      choices = ', '.join(map(repr, methods[:-1])) + ' or ' * (len(methods) > 1) + repr(methods[-1])
      raise ConfigError(f'method {self.method!r} decodes {other} models, but this model is '
                        f'model.kind={config.kind!r}; use method {choices}')
    classes = nat.num_length_classes(config)
    if self.method == 'nat' and self.length_beam > classes:
      raise ConfigError(f'length_beam={self.length_beam} exceeds the model\'s {classes} length '
                        f'classes (2 * model.max_length_offset + 1, max_length_offset='
                        f'{config.max_length_offset})')

  def run(self, model: Transformer, params, src: np.ndarray, batch_index: int) -> np.ndarray:
    """Output tokens `[B, L]` for source ids `[B, S]`; `model` of a kind `check_model` accepts."""
    if self.method == 'nat':
      tokens = nat_decoding.mask_predict(model, params, src, iterations=self.iterations,
                                         length_beam=self.length_beam, length=self.nat_length)
    elif self.method == 'beam':
      tokens, _ = decoding.beam_search(model, params, src, beam_size=self.beam_size,
                                       alpha=self.alpha, max_len=self.max_len)
    elif self.method == 'greedy':
      tokens = decoding.greedy(model, params, src, max_len=self.max_len)
    else:
      # One key per batch: batches draw independently, and a rerun draws the same.
      rng = jax.random.fold_in(jax.random.key(self.seed), batch_index)
      tokens = decoding.sample(model, params, src, rng, temperature=self.temperature,
                               top_k=self.top_k, top_p=self.top_p, max_len=self.max_len)
    return np.asarray(tokens)


@dataclasses.dataclass(frozen=True)
class Sources:
  """Tokenized source sentences.

  ids: int32 ids per sentence, EOS-terminated; None for an empty sentence.
  truncated: (index, subword count) of each sentence cut to model.max_len - 1 subwords.
  """
  ids: list[np.ndarray | None]
  truncated: list[tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class Alignment:
  """Cross-attention of a translation over its source, for plotting.

  source_tokens: the source subwords, EOS last, as the tokenizer spells them.
  target_tokens: the output subwords, EOS last when the output has one.
  weights: float32 `[decoder layers, heads, T, S]`: row t is how output token t
    (predicted from the tokens before it) attends over the source. A common
    plot is `weights[-1].mean(axis=0)`.
  """
  source_tokens: list[str]
  target_tokens: list[str]
  weights: np.ndarray


class Translator:
  """A model, its parameters and its tokenizer, translating lists of strings."""

  def __init__(self, config: ModelConfig, params, tokenizer: Tokenizer):
    tokenizer.check_compatible(config)
    self.config = config
    self.model = build_model(config)
    self.variables = decoding.as_variables(params)
    self.tokenizer = tokenizer
    self._attention_weights = jax.jit(functools.partial(attention_weights, self.model))

  @classmethod
  def from_checkpoint(cls, workdir: str | Path, step: int | None = None,
                      average_last: int = 0) -> Translator:
    """Loads WORKDIR's config, tokenizer and parameters (see `checkpoint.load_for_inference`).

    step: the checkpoint to load, None for the latest; average_last > 0: the
    mean of the last `average_last` checkpoints up to it (the paper averages 5).
    """
    return cls(*load_for_inference(workdir, step=step, average_last=average_last))

  def encode(self, sentences: Sequence[str]) -> Sources:
    """Subwords + EOS per sentence, cut to model.max_len tokens (see `Sources`)."""
    if isinstance(sentences, str):
      raise TypeError('sentences must be a list of strings; wrap a single one as [sentence]')
    keep = self.config.max_len - 1
    ids, truncated = [], []
    for index, (sentence, subwords) in enumerate(zip(sentences, self.tokenizer.encode(sentences))):
      if not sentence.strip():
        ids.append(None)
        continue
      if len(subwords) > keep:
        truncated.append((index, len(subwords)))
        subwords = subwords[:keep]
      ids.append(np.array(subwords + [self.tokenizer.eos_id], np.int32))
    return Sources(ids=ids, truncated=truncated)

  def translate(self, sentences: Sequence[str], *, method: str | None = None, beam_size: int = 4,
                alpha: float = 0.6, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                seed: int = 0, iterations: int = 10, length_beam: int = 3,
                nat_length: str = 'predict', max_len: int | None = None,
                batch_size: int = 64) -> list[str]:
    """Translations of `sentences`, in their order (settings: see `Search`).

    method None: the model's own, 'beam' (the paper's beam 4) for an autoregressive
    model, 'nat' (mask-predict) for a cmlm one. A sentence longer than model.max_len
    tokens is truncated with a warning.
    """
    if method is None:
      method = 'nat' if self.config.kind == 'cmlm' else 'beam'
    search = Search(method=method, beam_size=beam_size, alpha=alpha, temperature=temperature,
                    top_k=top_k, top_p=top_p, seed=seed, iterations=iterations,
                    length_beam=length_beam, nat_length=nat_length, max_len=max_len)
    sources = self.encode(sentences)
    for index, count in sources.truncated:
      warnings.warn(f'sentence {index}: {count} subwords + EOS exceed model.max_len='
                    f'{self.config.max_len}; truncated to {self.config.max_len - 1} subwords',
                    stacklevel=2)
    return self.translate_sources(sources, search, batch_size)

  def translate_sources(self, sources: Sources, search: Search, batch_size: int = 64,
                        on_batch: Callable[[int], object] | None = None) -> list[str]:
    """Translations of encoded sources, in their order ('' for empty ones).

    Decodes the non-empty sources longest first, `batch_size` at a time, and
    calls `on_batch(number of sentences)` after each batch (e.g. a progress bar's
    update).
    """
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f'batch_size must be a positive integer, got {batch_size!r}')
    search.check_model(self.config)
    present = [i for i, ids in enumerate(sources.ids) if ids is not None]
    order = sorted(present, key=lambda i: -len(sources.ids[i]))
    translations = [''] * len(sources.ids)
    for batch_index, start in enumerate(range(0, len(order), batch_size)):
      indices = order[start:start + batch_size]
      src = self._pad([sources.ids[i] for i in indices], batch_size)
      tokens = search.run(self.model, self.variables, src, batch_index)
      for index, text in zip(indices, self.tokenizer.decode(tokens[:len(indices)])):
        translations[index] = text
      if on_batch is not None:
        on_batch(len(indices))
    return translations

  def alignment(self, sentence: str, translation: str | None = None,
                search: Search = Search()) -> Alignment:
    """Cross-attention weights of `translation` (default: decoded with `search`) over `sentence`.

    The weights come from one teacher-forced pass over the output tokens
    (`model.attention_weights`), so they are exactly what the decoder saw.
    Autoregressive models only: a cmlm decoder sees MASK placeholders, not a
    prefix, so this pass would not show what it attended to.
    """
    if self.config.kind != 'autoregressive':
      raise ConfigError(f'alignment needs an autoregressive model; this one is '
                        f'model.kind={self.config.kind!r}, whose decoder reads MASK placeholders '
                        'rather than the output prefix')
    search.check_model(self.config)
    sources = self.encode([sentence])
    if sources.ids[0] is None:
      raise ValueError('cannot align an empty sentence')
    src = sources.ids[0][None]
    if translation is None:
      output = search.run(self.model, self.variables, src, batch_index=0)[0]
      output = output[output != self.tokenizer.pad_id]
    else:
      output = np.array(self.tokenizer.encode([translation])[0] + [self.tokenizer.eos_id])
    output = output[:self.config.max_len]
    tgt_in = np.concatenate([[self.tokenizer.bos_id], output[:-1]])[None].astype(np.int32)
    weights = self._attention_weights(self.variables, src, tgt_in)
    layers = [weights[f'decoder/layer_{i}/cross_attention'][0]
              for i in range(self.config.num_decoder_layers)]
    spell = lambda ids: [self.tokenizer.id_to_token(int(i)) for i in ids]
    return Alignment(source_tokens=spell(src[0]), target_tokens=spell(output),
                     weights=np.stack(layers))

  def _pad(self, rows: list[np.ndarray], batch_size: int) -> np.ndarray:
    """Ids `[R, W]`: W the longest row rounded up to WIDTH_MULTIPLE (at most model.max_len), R
    the rows rounded up to a power of two (at most batch_size); extra rows are all PAD,
    which decoding treats as batch padding."""
    longest = max(len(row) for row in rows)
    width = min(-(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, self.config.max_len)
    height = min(1 << (len(rows) - 1).bit_length(), batch_size)
    src = np.full((height, width), self.tokenizer.pad_id, np.int32)
    for i, row in enumerate(rows):
      src[i, :len(row)] = row
    return src
