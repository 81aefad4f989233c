"""Text in, text out: a run directory's model, parameters and tokenizer behind one call.

    translator = Translator.from_checkpoint('runs/multi30k', average_last=5)
    translator = Translator.from_pretrained('opus-mt-en-de')        # a Hugging Face Marian model
    translator.translate(['Ein Mann fährt Fahrrad.'])                 # beam 4, alpha 0.6
    translator.translate(sentences, Sampling(top_p=0.9, seed=1))
    cmlm = Translator.from_checkpoint('runs/cmlm')
    cmlm.translate(sentences)                                        # mask-predict
    cmlm.translate(sentences, MaskPredict(length_offset=2))          # 2 tokens longer
    alignment = translator.alignment('Ein Mann fährt Fahrrad.')      # cross-attention, for plots

Sources are tokenized as in training (subwords + EOS) and truncated to
`model.max_len` tokens, EOS included. Sentences are sorted by length and decoded
in batches padded to a multiple of 8 tokens and a power of two of rows (bounded
by `batch_size`), so that few shapes compile; the results come back in input
order. Empty (or all-space) sentences translate to '' without decoding.

A method is a value from `methods` (`BeamSearch()`, `Greedy()`, `Sampling(...)`,
`MaskPredict(...)`); None means the model's `methods.default_method`. A method
that cannot decode the checkpoint's `model.kind` is a ConfigError. A cmlm
model's output length is controlled by the method value: `MaskPredict`'s
`length_ratio` scales each predicted length and `length_offset` adds to it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import numpy as np

from flax_transformer import signals
from flax_transformer.config import ConfigError, ModelConfig
from flax_transformer.decode import autoregressive
from flax_transformer.decode.methods import BeamSearch, DecodingMethod, default_method
from flax_transformer.nn.backend import compute_dtype
from flax_transformer.nn.build import build_model
from flax_transformer.nn.model import attention_weights
from flax_transformer.run.loading import load_for_inference
from flax_transformer.run.sizes import check_fits
from flax_transformer.tokenizer import Tokenizer

# Source widths are rounded up to a multiple of this, so a corpus compiles a few shapes.
WIDTH_MULTIPLE = 8


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

  def __init__(self, config: ModelConfig, params, tokenizer: Tokenizer, dtype: str | None = None):
    """dtype: the compute dtype to decode in, 'float32', 'bfloat16' (bfloat16 matmuls with
    float32 accumulation, logits and search in float32) or 'auto' (`nn.backend.resolve_dtype`);
    None: the model's own `config.dtype`."""
    tokenizer.check_compatible(config)
    kernel = config.attention_kernel
    if kernel == 'cudnn' and (jax.default_backend() != 'gpu' or dtype == 'float32'):
      kernel = 'auto'  # a model trained with cuDNN's kernel decodes anywhere: it is how, not what
    self.config = config.replace(dtype=dtype or config.dtype, attention_kernel=kernel)
    self.model = build_model(self.config)
    # Matrices in the compute dtype once here, not at every decoding step.
    self.variables = autoregressive.cast_matrices(
      autoregressive.as_variables(params), compute_dtype(self.config)
    )
    self.tokenizer = tokenizer
    self._attention_weights = jax.jit(functools.partial(attention_weights, self.model))

  @classmethod
  def from_checkpoint(
    cls,
    workdir: str | Path,
    step: int | None = None,
    average_last: int = 0,
    dtype: str | None = None,
    on_unverified: Callable[[str], object] | None = None,
  ) -> Translator:
    """Loads WORKDIR's config, tokenizer and parameters (see `checkpoint.load_for_inference`).

    step: the checkpoint to load, None for the latest; average_last > 0: the
    mean of the last `average_last` checkpoints up to it (the paper averages 5).
    dtype: the compute dtype to decode in (see `Translator`).
    on_unverified: load a checkpoint without recorded SHA-256s, telling this function
      (None: refuse it, as damaged).
    """
    return cls(
      *load_for_inference(
        workdir, step=step, average_last=average_last, on_unverified=on_unverified
      ),
      dtype=dtype,
    )

  @classmethod
  def from_pretrained(cls, directory: str | Path, dtype: str | None = None) -> Translator:
    """Loads a Hugging Face Marian directory (see `pretrained.load_marian`), refusing a model
    its config.json makes too large for this machine before reading the weights."""
    from flax_transformer.pretrained.marian import load_marian

    return cls(
      *load_marian(directory, lambda config: check_fits(config, training=False)), dtype=dtype
    )

  @classmethod
  def from_directory(
    cls,
    directory: str | Path,
    step: int | None = None,
    average_last: int = 0,
    dtype: str | None = None,
    on_unverified: Callable[[str], object] | None = None,
  ) -> Translator:
    """A run directory (`from_checkpoint`) or a Marian directory (`from_pretrained`), by its files."""
    from flax_transformer.pretrained.marian import is_marian_directory

    if not is_marian_directory(directory):
      return cls.from_checkpoint(
        directory, step=step, average_last=average_last, dtype=dtype, on_unverified=on_unverified
      )
    if step is not None or average_last:
      raise ConfigError(
        f'{directory} is a pretrained Marian model, which has one set of '
        'parameters: step and average_last apply to run directories'
      )
    return cls.from_pretrained(directory, dtype=dtype)

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

  def translate(
    self,
    sentences: Sequence[str],
    method: DecodingMethod | None = None,
    *,
    batch_size: int = 64,
    on_batch: Callable[[int], object] | None = None,
    on_truncated: Callable[[int, int], object] | None = None,
  ) -> list[str]:
    """Translations of `sentences`, in their order, decoded with `method`.

    method: None is the model's `default_method` (the paper's beam search, or
      mask-predict for a cmlm model).
    on_batch: called with the number of sentences done after each batch (and
      once for the empty ones), e.g. a progress bar's update.
    on_truncated: called as (index, subword count) for each sentence longer than
      model.max_len tokens, which is truncated; None warns.
    """
    if method is not None and not isinstance(method, DecodingMethod):
      raise TypeError(
        f'method must be a decoding method value such as BeamSearch(beam_size=4) '
        f'or Greedy() (flax_transformer.decode.methods), got {method!r}'
      )
    sources = self.encode(sentences)
    for index, count in sources.truncated:
      if on_truncated is not None:
        on_truncated(index, count)
      else:
        warnings.warn(
          f'sentence {index}: {count} subwords + EOS exceed model.max_len='
          f'{self.config.max_len}; truncated to {self.config.max_len - 1} subwords',
          stacklevel=2,
        )
    translations = self.translate_sources(
      sources, method or default_method(self.config), batch_size, on_batch
    )
    empty = sum(ids is None for ids in sources.ids)
    if on_batch is not None and empty:
      on_batch(empty)
    return translations

  def check_method(self, method: DecodingMethod, sentences: int, batch_size: int = 64) -> None:
    """Raises ConfigError unless `method` decodes this model and `sentences` sentences,
    `batch_size` at a time, fit in memory: the checks of `translate` before any work."""
    method.check_model(self.config)
    method.check_fits(self.config, max(1, min(batch_size, sentences)))

  def translate_sources(
    self,
    sources: Sources,
    method: DecodingMethod,
    batch_size: int = 64,
    on_batch: Callable[[int], object] | None = None,
  ) -> list[str]:
    """Translations of encoded sources, in their order ('' for empty ones).

    Decodes the non-empty sources longest first, `batch_size` at a time, and
    calls `on_batch(number of sentences)` after each batch (e.g. a progress bar's
    update). Under `signals.recording()` (the programs), a SIGTERM or SIGINT raises
    `signals.Stopped` before the next batch.
    """
    if not isinstance(batch_size, int) or batch_size < 1:
      raise ValueError(f'batch_size must be a positive integer, got {batch_size!r}')
    present = [i for i, ids in enumerate(sources.ids) if ids is not None]
    self.check_method(method, len(present), batch_size)
    order = sorted(present, key=lambda i: -len(sources.ids[i]))
    translations = [''] * len(sources.ids)
    for batch_index, start in enumerate(range(0, len(order), batch_size)):
      signals.check()  # a program's SIGTERM or SIGINT stops here, between batches
      indices = order[start : start + batch_size]
      src = self._pad([sources.ids[i] for i in indices], batch_size)
      tokens = method.run(self.model, self.variables, src, batch_index)
      for index, text in zip(indices, self.tokenizer.decode(tokens[: len(indices)])):
        translations[index] = text
      if on_batch is not None:
        on_batch(len(indices))
    return translations

  def alignment(
    self, sentence: str, translation: str | None = None, method: DecodingMethod = BeamSearch()
  ) -> Alignment:
    """Cross-attention weights of `translation` (default: decoded with `method`) over `sentence`.

    The weights come from one teacher-forced pass over the output tokens
    (`model.attention_weights`), so they are exactly what the decoder saw.
    Autoregressive models only: a cmlm decoder sees MASK placeholders, not a
    prefix, so this pass would not show what it attended to.
    """
    if self.config.kind != 'autoregressive':
      raise ConfigError(
        f'alignment needs an autoregressive model; this one is '
        f'model.kind={self.config.kind!r}, whose decoder reads MASK placeholders '
        'rather than the output prefix'
      )
    method.check_model(self.config)
    sources = self.encode([sentence])
    if sources.ids[0] is None:
      raise ValueError('cannot align an empty sentence')
    src = sources.ids[0][None]
    if translation is None:
      output = method.run(self.model, self.variables, src)[0]
      output = output[output != self.tokenizer.pad_id]
    else:
      output = np.array(self.tokenizer.encode_target([translation])[0] + [self.tokenizer.eos_id])
    output = output[: self.config.max_len]
    tgt_in = np.concatenate([[self.tokenizer.bos_id], output[:-1]])[None].astype(np.int32)
    weights = self._attention_weights(self.variables, src, tgt_in)
    layers = [
      weights[f'decoder/layer_{i}/cross_attention'][0]
      for i in range(self.config.num_decoder_layers)
    ]
    spell = lambda ids: [self.tokenizer.id_to_token(int(i)) for i in ids]
    return Alignment(
      source_tokens=spell(src[0]), target_tokens=spell(output), weights=np.stack(layers)
    )

  def _pad(self, rows: list[np.ndarray], batch_size: int) -> np.ndarray:
    """Ids `[R, W]`: W the longest row rounded up to WIDTH_MULTIPLE (at most model.max_len), R
    the rows rounded up to a power of two (at most batch_size); extra rows are all PAD,
    which decoding treats as batch padding."""
    longest = max(len(row) for row in rows)
    width = min(-(-longest // WIDTH_MULTIPLE) * WIDTH_MULTIPLE, self.config.max_len)
    height = min(1 << (len(rows) - 1).bit_length(), batch_size)
    src = np.full((height, width), self.tokenizer.pad_id, np.int32)
    for i, row in enumerate(rows):
      src[i, : len(row)] = row
    return src
