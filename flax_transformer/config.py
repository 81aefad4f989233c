"""Configuration as frozen dataclasses: the model, the training run and its data.

Every default is decided here and nowhere else. Presets are classmethods that
take overrides, e.g. `ModelConfig.base(vocab_size=8000)`, `TrainConfig.toy(steps=500)`;
`parse_overrides` turns command-line strings like `--model.d_model=256` into values.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import jax.numpy as jnp


class ConfigError(ValueError):
  """A configuration value is invalid; the message names the option."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the encoder–decoder Transformer.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  """

  vocab_size: int = 37_000
  d_model: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  d_ff: int = 2048
  # Dropout on embeddings + positions and on every sub-layer output (paper §5.4).
  dropout_rate: float = 0.1
  # Dropout on the attention weights; the paper does not use it.
  attention_dropout_rate: float = 0.0
  # Length of the positional-encoding table: the longest source or target sequence.
  max_len: int = 256
  activation: Literal['relu', 'gelu'] = 'relu'
  # 'post': LayerNorm(x + Sublayer(x)) as in the paper; 'pre': x + Sublayer(LayerNorm(x)).
  norm_placement: Literal['post', 'pre'] = 'post'
  # One embedding matrix for source, target and the pre-softmax projection (paper §3.4).
  share_embeddings: bool = True
  # Restricted self-attention (paper §4): each position sees positions within this
  # distance. None means unrestricted.
  attention_radius: int | None = None
  # Compute dtype ('float32' or 'bfloat16'); parameters, logits and loss stay float32.
  dtype: Literal['float32', 'bfloat16'] = 'float32'
  # 'autoregressive': the paper's causal decoder, one token per step. 'cmlm': a
  # non-autoregressive decoder (conditional masked LM, Ghazvininejad et al. 2019) whose
  # self-attention sees the whole target row, fed MASK placeholders (id vocab_size, an
  # extra embedding row), plus a length classifier over the mean-pooled encoder output.
  kind: Literal['autoregressive', 'cmlm'] = 'autoregressive'
  # cmlm: the classifier predicts target length - source length, clipped to
  # [-max_length_offset, max_length_offset] (2 * max_length_offset + 1 classes).
  max_length_offset: int = 32
  # cmlm: what a MASKed decoder position is fed. 'mask': the learned MASK embedding
  # (CMLM). 'uniform_copy': the embedding of the source token at the same relative
  # position, round(j * S / N) for position j of an N-token row and S source tokens
  # (Gu et al., 2018), so even the first pass starts from the source's words.
  nat_decoder_input: Literal['mask', 'uniform_copy'] = 'mask'
  pad_id: int = 0
  bos_id: int = 1
  eos_id: int = 2
  unk_id: int = 3

  def __post_init__(self):
    positive = ('vocab_size', 'd_model', 'num_heads', 'num_encoder_layers', 'num_decoder_layers',
                'd_ff', 'max_len')
    for name in positive:
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ConfigError(f'model.{name} must be a positive integer, got {value!r}')
    if self.d_model % self.num_heads:
      raise ConfigError(f'model.d_model={self.d_model} is not divisible by model.num_heads='
                        f'{self.num_heads}: each head needs d_model / num_heads dimensions')
    for name in ('dropout_rate', 'attention_dropout_rate'):
      value = getattr(self, name)
      if not 0.0 <= value < 1.0:
        raise ConfigError(f'model.{name} must be in [0, 1), got {value!r}')
    if self.activation not in ('relu', 'gelu'):
      raise ConfigError(f"model.activation must be 'relu' or 'gelu', got {self.activation!r}")
    if self.norm_placement not in ('post', 'pre'):
      raise ConfigError(f"model.norm_placement must be 'post' or 'pre', got {self.norm_placement!r}")
    if self.dtype not in ('float32', 'bfloat16'):
      raise ConfigError(f"model.dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
    if self.kind not in ('autoregressive', 'cmlm'):
      raise ConfigError(f"model.kind must be 'autoregressive' or 'cmlm', got {self.kind!r}")
    if isinstance(self.max_length_offset, bool) or not isinstance(self.max_length_offset, int) \
        or self.max_length_offset < 0:
      raise ConfigError(f'model.max_length_offset must be a non-negative integer, '
                        f'got {self.max_length_offset!r}')
    if self.nat_decoder_input not in ('mask', 'uniform_copy'):
      raise ConfigError(f"model.nat_decoder_input must be 'mask' or 'uniform_copy', "
                        f'got {self.nat_decoder_input!r}')
    if self.nat_decoder_input != 'mask' and self.kind != 'cmlm':
      raise ConfigError(f"model.nat_decoder_input={self.nat_decoder_input!r} is for "
                        f"model.kind='cmlm'; an {self.kind} decoder is fed its previous tokens")
    if self.attention_radius is not None and self.attention_radius < 0:
      raise ConfigError(f'model.attention_radius must be >= 0 or None, got {self.attention_radius!r}')
    special = {'pad_id': self.pad_id, 'bos_id': self.bos_id, 'eos_id': self.eos_id,
               'unk_id': self.unk_id}
    if len(set(special.values())) != len(special):
      raise ConfigError(f'special token ids must be distinct, got {special}')
    for name, value in special.items():
      if not 0 <= value < self.vocab_size:
        raise ConfigError(f'model.{name}={value} is outside the vocabulary '
                          f'(model.vocab_size={self.vocab_size})')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  def replace(self, **overrides) -> ModelConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A few-thousand-parameter model for tests: d=32, 2+2 layers, 4 heads."""
    defaults = dict(vocab_size=64, d_model=32, num_heads=4, num_encoder_layers=2,
                    num_decoder_layers=2, d_ff=64, dropout_rate=0.1, max_len=64)
    return cls(**{**defaults, **overrides})

  @classmethod
  def base(cls, **overrides) -> ModelConfig:
    """The paper's base model (Table 3): N=6, d=512, d_ff=2048, h=8, dropout 0.1."""
    return cls(**overrides)

  @classmethod
  def big(cls, **overrides) -> ModelConfig:
    """The paper's big model (Table 3): N=6, d=1024, d_ff=4096, h=16, dropout 0.3."""
    defaults = dict(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
    return cls(**{**defaults, **overrides})


def _check_fields(config, section: str, positive_ints=(), nonnegative_ints=(), positive_floats=(),
                  unit_floats=()):
  """Raises ConfigError naming `section.field` for the first value outside its range."""
  for name in positive_ints + nonnegative_ints:
    value, low = getattr(config, name), 1 if name in positive_ints else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      kind = 'a positive integer' if low else 'a non-negative integer'
      raise ConfigError(f'{section}.{name} must be {kind}, got {value!r}')
  for name in positive_floats:
    value = getattr(config, name)
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
      raise ConfigError(f'{section}.{name} must be a positive number, got {value!r}')
  for name in unit_floats:
    value = getattr(config, name)
    if not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
      raise ConfigError(f'{section}.{name} must be in [0, 1), got {value!r}')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, batching and bookkeeping of a training run.

  A step is one batch of about `max_tokens` tokens: with `grad_accum_steps` K,
  the optimizer updates once every K steps and the learning-rate schedule
  counts those updates.
  """

  seed: int = 0
  steps: int = 100_000
  # Padded tokens per batch and side (a batch of length-L rows holds max_tokens // L
  # rows); the paper's batches held about 25k source and 25k target tokens.
  max_tokens: int = 25_000
  # lrate = lr_scale * d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5), n = update + 1.
  warmup_steps: int = 4000
  lr_scale: float = 1.0
  adam_b1: float = 0.9
  adam_b2: float = 0.98
  adam_eps: float = 1e-9
  label_smoothing: float = 0.1
  # Clip the global gradient norm to this value; None: no clipping (the paper).
  max_grad_norm: float | None = None
  # Decoupled (AdamW) decay of weight matrices and embeddings; 0: plain Adam (the paper).
  weight_decay: float = 0.0
  grad_accum_steps: int = 1
  log_every: int = 100
  eval_every: int = 1000
  checkpoint_every: int = 1000
  # The paper averages the last 5 checkpoints, so keep at least that many.
  keep_checkpoints: int = 5
  # BLEU on the validation split every this many steps; 0: only at the end of training.
  bleu_every: int = 0
  # model.kind='cmlm' only. Weight of the length classifier's cross-entropy (per sentence)
  # beside the masked-token loss (per masked token); fairseq's CMLM uses 0.1.
  length_loss_weight: float = 0.1
  # model.kind='cmlm' only. Fraction of target rows whose PAD positions (up to the batch
  # width) are filled with EOS while training, so that decoding at a fixed maximum
  # length and cutting at the first EOS has seen rows that go on past their end.
  eos_fill_rate: float = 0.1

  # Fields a resumed run may change: they say how long and how chattily to train, not how.
  RESUMABLE_CHANGES = frozenset({'steps', 'log_every', 'eval_every', 'checkpoint_every',
                                 'keep_checkpoints', 'bleu_every'})

  def __post_init__(self):
    _check_fields(
        self, 'train',
        positive_ints=('steps', 'max_tokens', 'warmup_steps', 'grad_accum_steps', 'log_every',
                       'eval_every', 'checkpoint_every', 'keep_checkpoints'),
        nonnegative_ints=('seed', 'bleu_every'),
        positive_floats=('lr_scale', 'adam_eps', 'max_grad_norm'),
        unit_floats=('adam_b1', 'adam_b2', 'label_smoothing', 'eos_fill_rate'))
    if not (isinstance(self.length_loss_weight, (int, float)) and self.length_loss_weight >= 0):
      raise ConfigError(f'train.length_loss_weight must be >= 0, got {self.length_loss_weight!r}')
    if not (isinstance(self.weight_decay, (int, float)) and self.weight_decay >= 0):
      raise ConfigError(f'train.weight_decay must be >= 0, got {self.weight_decay!r}')

  def replace(self, **overrides) -> TrainConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def paper(cls, **overrides) -> TrainConfig:
    """The base model's schedule (§5.2-5.4): 100k steps of 25k tokens, warmup 4000."""
    return cls(**overrides)

  @classmethod
  def multi30k(cls, **overrides) -> TrainConfig:
    """Multi30k: 6,000 batches of 4k tokens per side (~38 epochs), a shorter warmup than the paper's.

    1 h 51 min on a 2-core CPU with bfloat16 compute (~1.1 s per step), inside a 2.5-hour
    budget. Validation BLEU still rose from 5,000 steps to 6,000 (36.3 -> 36.4 greedy; the
    mean of the last 5 with beam 4: 38.6 -> 39.3).
    """
    defaults = dict(steps=6000, max_tokens=4096, warmup_steps=1000, log_every=50,
                    eval_every=500, checkpoint_every=500, keep_checkpoints=5, bleu_every=1000)
    return cls(**{**defaults, **overrides})

  @classmethod
  def toy(cls, **overrides) -> TrainConfig:
    """The offline default (`python train.py`): minutes on a laptop CPU."""
    defaults = dict(steps=400, max_tokens=2048, warmup_steps=200, log_every=50,
                    eval_every=200, checkpoint_every=200)
    return cls(**{**defaults, **overrides})


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the parallel text comes from and how its shared vocabulary is built."""

  # 'toy': numbers in English words -> German words, generated in code (offline);
  # otherwise a local directory or file, or a Hub dataset name (see data.load_parallel).
  source: str = 'toy'
  src_lang: str = 'en'
  tgt_lang: str = 'de'
  # Requested size of the shared subword vocabulary; model.vocab_size is set to the
  # trained tokenizer's actual size, which small corpora may leave below this.
  vocab_size: int = 8000
  tokenizer: Literal['bpe', 'unigram'] = 'bpe'

  def __post_init__(self):
    _check_fields(self, 'data', positive_ints=('vocab_size',))
    for name in ('source', 'src_lang', 'tgt_lang'):
      value = getattr(self, name)
      if not isinstance(value, str) or not value:
        raise ConfigError(f'data.{name} must be a non-empty string, got {value!r}')
    if self.src_lang == self.tgt_lang:
      raise ConfigError(f'data.src_lang and data.tgt_lang are both {self.src_lang!r}')
    if self.tokenizer not in ('bpe', 'unigram'):
      raise ConfigError(f"data.tokenizer must be 'bpe' or 'unigram', got {self.tokenizer!r}")

  def replace(self, **overrides) -> DataConfig:
    return dataclasses.replace(self, **overrides)


RUN_PRESETS = ('toy', 'multi30k', 'base')


def run_preset(name: str) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The (model, training, data) settings of a named run, as train.py's `--preset`.

  toy: numbers in English words -> German, generated in code; a 1M-parameter
    model that reaches ~98% exact match in a few minutes on a laptop CPU.
  multi30k: Multi30k en->de (the Hub's 'bentrevett/multi30k', or `--data DIR`);
    a 3+3-layer d=256 model.
  base: the paper's base model and schedule on WMT14 en->de from the Hub.
  """
  if name == 'toy':
    return (ModelConfig(d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2,
                        d_ff=512, max_len=64),
            TrainConfig.toy(), DataConfig(source='toy', vocab_size=256))
  if name == 'multi30k':
    # 29k sentence pairs overfit a 7.6M-parameter model quickly: dropout 0.3, as the small
    # Multi30k models of the literature use; bfloat16 matmuls (f32 accumulation) ~1.5x faster.
    # 8,000 BPE tokens: 4,000 trailed on validation from 2,000 steps on; 16,000 tied at equal
    # training time, its steps 1.25x dearer (README, "Choosing the vocabulary size").
    return (ModelConfig(d_model=256, num_heads=4, num_encoder_layers=3, num_decoder_layers=3,
                        d_ff=1024, max_len=128, dropout_rate=0.3, dtype='bfloat16'),
            TrainConfig.multi30k(), DataConfig(source='bentrevett/multi30k', vocab_size=8000))
  if name == 'base':
    return ModelConfig.base(), TrainConfig.paper(), DataConfig(source='wmt14:de-en',
                                                                  vocab_size=37_000)
  raise ConfigError(f'unknown preset {name!r}; choose one of {", ".join(RUN_PRESETS)}')

def parse_overrides(config, section: str, assignments: dict[str, str]):
  """Returns `config` with string values parsed by each field's annotation.

  `parse_overrides(ModelConfig(), 'model', {'d_model': '256', 'attention_radius': 'none'})`.
  Booleans accept true/false/1/0/yes/no, optional fields accept 'none', and
  Literal fields accept one of their choices. Errors name `section.field`.
  """
  hints = typing.get_type_hints(type(config))
  fields = {f.name for f in dataclasses.fields(config)}
  values = {}
  for name, text in assignments.items():
    if name not in fields:
      raise ConfigError(f'unknown option {section}.{name}; known: '
                        + ', '.join(sorted(f'{section}.{f}' for f in fields)))
    values[name] = _parse_value(hints[name], text, f'{section}.{name}')
  return dataclasses.replace(config, **values)


def _parse_value(annotation, text: str, option: str):
  """One command-line string -> a value of `annotation` (int, float, bool, str, Literal, X | None)."""
  args = typing.get_args(annotation)
  if type(None) in args:
    if text.strip().lower() == 'none':
      return None
    (annotation,) = [a for a in args if a is not type(None)]
    args = typing.get_args(annotation)
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
    raise ConfigError(f'{option} must be {kind}, got {text!r}') from None
