"""Configuration as frozen dataclasses: the model, the training run and its data.

Every default and every setting's help is written here, once: each field is a
`setting(default, help)`, and train.py's `--help` is generated from the help.
Presets are classmethods that take overrides, e.g. `ModelConfig.base(vocab_size=8000)`,
`TrainConfig.toy(steps=500)`; `parse_overrides` turns command-line strings like
`--model.d_model=256` into values. Choices (`Literal` fields) are checked from
their annotations, so a new choice is added in one place.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from typing import Literal

import jax
import jax.numpy as jnp
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


def setting(default, help: str, bounds: Bounds | None = None):  # noqa: A002 -- argparse's name
  """A settings field: its default, a one-line help (train.py --help, decode.py --help) and
  the values it admits (checked by `check_fields`)."""
  return dataclasses.field(default=default, metadata={'help': help, 'bounds': bounds})


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
    if not bounds.admits(value):
      raise ConfigError(f'{section}.{field.name} must be {bounds.describe()}, got {value!r}')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the encoder–decoder Transformer.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  """

  vocab_size: int = setting(
    37_000, 'vocabulary size V (set from the trained tokenizer)', bounds=POSITIVE_INT
  )
  d_model: int = setting(512, 'model width D', bounds=POSITIVE_INT)
  num_heads: int = setting(8, 'attention heads N (must divide d_model)', bounds=POSITIVE_INT)
  num_encoder_layers: int = setting(6, 'encoder layers', bounds=POSITIVE_INT)
  num_decoder_layers: int = setting(6, 'decoder layers', bounds=POSITIVE_INT)
  d_ff: int = setting(2048, 'inner width F of the feed-forward layers', bounds=POSITIVE_INT)
  dropout_rate: float = setting(
    0.1,
    'dropout on embeddings + positions and on every sub-layer output (paper §5.4)',
    bounds=UNIT_INTERVAL,
  )
  attention_dropout_rate: float = setting(
    0.0, 'dropout on the attention weights (the paper: none)', bounds=UNIT_INTERVAL
  )
  max_len: int = setting(
    256,
    'longest source or target in tokens, EOS included: the length of '
    'the positional table (longer training pairs are dropped)',
    bounds=POSITIVE_INT,
  )
  activation: Literal['relu', 'gelu', 'silu'] = setting(
    'relu', 'feed-forward activation (silu: x * sigmoid(x), which Marian calls swish)'
  )
  norm_placement: Literal['post', 'pre'] = setting(
    'post', 'post: LayerNorm(x + Sublayer(x)) as in the paper; pre: x + Sublayer(LayerNorm(x))'
  )
  share_embeddings: bool = setting(
    True,
    'one embedding matrix for source, target and the '
    'pre-softmax projection (paper §3.4; true/false)',
  )
  positions: Literal['interleaved', 'concatenated'] = setting(
    'interleaved',
    "positional table's layout: sin and cos of each wavelength side by side (the "
    'paper) or every sin first, then every cos (Marian)',
  )
  logits_bias: bool = setting(
    False, 'a learned bias on the output logits (Marian: final_logits_bias; true/false)'
  )
  # 1e-5, not tensor2tensor's 1e-6: PyTorch, fairseq, Marian, transformers and CTranslate2 all
  # fix 1e-5, so an exported default run decodes the same in each (1e-6 changed greedy output
  # on 33 of 400 Multi30k lines of a 600-step run).
  layer_norm_epsilon: float = setting(
    1e-5,
    'epsilon of every LayerNorm (PyTorch, fairseq, Marian, transformers and CTranslate2: '
    '1e-5; runs begun before 2026-12-05 used 1e-6 and keep it in their config.json)',
    bounds=POSITIVE,
  )
  qkv_init_gain: float = setting(
    1.0,
    'gain of the Xavier-uniform initialisation of the query, key and value projections: 1 '
    '(tensor2tensor, Flax) or 0.7071 = 1/sqrt(2) (fairseq: Xavier over the fused [3D, D] '
    'in-projection, "convergence much better"); the output projection keeps gain 1',
    bounds=POSITIVE,
  )
  attention_radius: int | None = setting(
    None,
    'restricted self-attention (paper §4): each '
    'position sees positions within this distance; '
    'none: unrestricted',
    bounds=NONNEGATIVE_INT,
  )
  dtype: Literal['auto', 'float32', 'bfloat16'] = setting(
    'auto',
    'compute dtype (parameters, logits and loss stay float32); auto: bfloat16 on a GPU '
    'or TPU, float32 on a CPU, decided where the model runs; a run begun with float32 or '
    'bfloat16 keeps it when resumed',
  )
  remat: Literal['none', 'layer', 'dots'] = setting(
    'none',
    "training's memory for time: none keeps every activation for the backward pass; "
    "layer keeps each layer's input and recomputes the rest; dots also keeps the dense "
    'projections (and feed-forward) outputs and recomputes attention and the elementwise work '
    '(the layers then run as one scan); either way the loss takes the logits 2,048 tokens at a '
    'time. The same gradients; dropout draws other masks. A run may change it when resumed',
  )
  attention_kernel: Literal['auto', 'einsum', 'xla', 'cudnn'] = setting(
    'auto',
    'how attention is computed (the same function): einsum, our own products, the '
    'reference; xla or cudnn, jax.nn.dot_product_attention (cudnn: fused flash attention, a '
    'GPU with bfloat16 compute and head_dim <= 256, a multiple of 8); auto: cudnn for whole '
    'sequences on a GPU where it applies, einsum elsewhere. Rows must be right-padded; packed '
    'rows, restricted attention, pooled beams and attention dropout take einsum (xla and cudnn '
    'refuse attention dropout). A run may change it when resumed',
  )
  kind: Literal['autoregressive', 'cmlm'] = setting(
    'autoregressive',
    "autoregressive: the paper's causal decoder, one token per step; cmlm: "
    'the non-autoregressive conditional masked LM (Ghazvininejad et al. 2019), decoded with '
    'mask-predict',
  )
  max_length_offset: int = setting(
    32,
    'cmlm: the length classifier predicts target length - source length within +- this',
    bounds=NONNEGATIVE_INT,
  )
  cmlm_decoder_input: Literal['mask', 'uniform_copy'] = setting(
    'mask',
    'cmlm: a MASKed position is fed the MASK embedding (mask) or the source token at '
    'the same relative position, round(j * S / N) (uniform_copy, Gu et al. 2018)',
  )
  pad_id: int = setting(0, 'PAD id (set from the tokenizer)')
  bos_id: int = setting(
    1,
    "BOS id, the decoder's start token (set from the tokenizer; may equal "
    'pad_id, as in Marian, whose decoder starts from PAD)',
  )
  eos_id: int = setting(2, 'EOS id (set from the tokenizer)')
  unk_id: int = setting(3, 'UNK id (set from the tokenizer)')

  # Fields the tokenizer decides: the trained vocabulary's size and its special ids.
  TOKENIZER_FIELDS = ('vocab_size', 'pad_id', 'bos_id', 'eos_id', 'unk_id')
  # Fields a resumed run may change: how it computes, not what (and how it was initialised,
  # which a resumed run restores over: runs of the multi30k_fairseq preset begun before
  # qkv_init_gain existed resume under today's preset).
  RESUMABLE_CHANGES = frozenset({'remat', 'attention_kernel', 'qkv_init_gain'})

  def __post_init__(self):
    check_fields(self, 'model')
    if self.d_model % self.num_heads:
      raise ConfigError(
        f'model.d_model={self.d_model} is not divisible by model.num_heads='
        f'{self.num_heads}: each head needs d_model / num_heads dimensions'
      )
    if self.cmlm_decoder_input != 'mask' and self.kind != 'cmlm':
      raise ConfigError(
        f'model.cmlm_decoder_input={self.cmlm_decoder_input!r} is for '
        f"model.kind='cmlm'; an {self.kind} decoder is fed its previous tokens"
      )
    _check_attention_kernel(self)
    special = {
      'pad_id': self.pad_id,
      'bos_id': self.bos_id,
      'eos_id': self.eos_id,
      'unk_id': self.unk_id,
    }
    # BOS may be PAD (a decoder that starts from PAD); the others must differ.
    ids = [self.pad_id, self.eos_id, self.unk_id] + [self.bos_id] * (self.bos_id != self.pad_id)
    if len(set(ids)) != len(ids):
      raise ConfigError(
        f'special token ids must be distinct (bos_id may equal pad_id), got {special}'
      )
    if self.bos_id == self.pad_id and self.kind != 'autoregressive':
      raise ConfigError(
        f'model.bos_id equal to model.pad_id is for autoregressive models, not '
        f'model.kind={self.kind!r}'
      )
    for name, value in special.items():
      if not 0 <= value < self.vocab_size:
        raise ConfigError(
          f'model.{name}={value} is outside the vocabulary (model.vocab_size={self.vocab_size})'
        )

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def compute_dtype(self) -> jnp.dtype:
    """The dtype the model computes in here: `dtype`, with 'auto' resolved (`resolve_dtype`)."""
    return jnp.dtype(resolve_dtype(self.dtype))

  def replace(self, **overrides) -> ModelConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def tiny(cls, **overrides) -> ModelConfig:
    """A few-thousand-parameter model for tests: d=32, 2+2 layers, 4 heads."""
    defaults = dict(
      vocab_size=64,
      d_model=32,
      num_heads=4,
      num_encoder_layers=2,
      num_decoder_layers=2,
      d_ff=64,
      dropout_rate=0.1,
      max_len=64,
    )
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


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, batching and bookkeeping of a training run.

  A step is one batch of about `max_tokens` tokens: with `grad_accum_steps` K,
  the optimizer updates once every K steps and the learning-rate schedule
  counts those updates.
  """

  seed: int = setting(0, 'seed of the parameters, batch order and dropout', bounds=SEED)
  steps: int = setting(
    100_000, 'batches to train on (with accumulation K: steps / K updates)', bounds=POSITIVE_INT
  )
  max_tokens: int = setting(
    25_000,
    'padded tokens per batch and side (a batch of length-L rows '
    "holds max_tokens // L rows; the paper's held about 25k)",
    bounds=POSITIVE_INT,
  )
  packing: int = setting(
    0,
    'pack several sentence pairs into each row of this many positions '
    '(segment masks keep them apart; longer pairs go to the larger length '
    'buckets, packed there too); 0: one pair per row',
    bounds=NONNEGATIVE_INT,
  )
  warmup_steps: int = setting(4000, 'updates of linear learning-rate warmup', bounds=POSITIVE_INT)
  lr_scale: float = setting(
    1.0,
    "factor on the paper's rate d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5), n = update + 1",
    bounds=POSITIVE,
  )
  peak_lr: float | None = setting(
    None,
    'the peak learning rate, reached after warmup_steps '
    'and decayed as the inverse square root of the update '
    "(fairseq's --lr with inverse_sqrt): the paper's schedule "
    "scaled to this peak; none: the paper's peak, "
    '(d_model * warmup_steps)^-0.5 * lr_scale',
    bounds=POSITIVE,
  )
  adam_b1: float = setting(0.9, 'Adam beta1', bounds=UNIT_INTERVAL)
  adam_b2: float = setting(0.98, 'Adam beta2', bounds=UNIT_INTERVAL)
  adam_eps: float = setting(1e-9, 'Adam epsilon', bounds=POSITIVE)
  label_smoothing: float = setting(0.1, 'label smoothing epsilon', bounds=UNIT_INTERVAL)
  max_grad_norm: float | None = setting(
    None, 'clip the global gradient norm to this; none: no clipping (the paper)', bounds=POSITIVE
  )
  weight_decay: float = setting(
    0.0,
    'decoupled (AdamW) decay of weight matrices and embeddings; 0: plain Adam (the paper)',
    bounds=NONNEGATIVE,
  )
  grad_accum_steps: int = setting(
    1, 'batches accumulated per optimizer update', bounds=POSITIVE_INT
  )
  log_every: int = setting(
    100, 'steps between lines of training metrics (bar and metrics.jsonl)', bounds=POSITIVE_INT
  )
  eval_every: int = setting(1000, 'steps between validation losses', bounds=POSITIVE_INT)
  checkpoint_every: int = setting(
    1000, 'steps between checkpoints (and one at the end)', bounds=POSITIVE_INT
  )
  keep_checkpoints: int = setting(
    5, 'checkpoints kept on disk, the newest (the paper averages the last 5)', bounds=POSITIVE_INT
  )
  bleu_every: int = setting(
    0, 'steps between validation BLEU scores; 0: only at the end', bounds=NONNEGATIVE_INT
  )
  best_metric: Literal['loss', 'bleu'] = setting(
    'loss',
    'what WORKDIR/best keeps: the parameters of the lowest validation loss (every '
    'eval_every steps) or the highest validation tokenized BLEU (every bleu_every steps)',
  )
  patience: int = setting(
    0,
    'stop after this many validations of train.best_metric without '
    "improvement (fairseq's --patience); 0: train to train.steps",
    bounds=NONNEGATIVE_INT,
  )
  length_loss_weight: float = setting(
    0.1,
    "cmlm: weight of the length classifier's "
    'cross-entropy (per sentence) beside the masked-token '
    "loss (fairseq's CMLM: 0.1)",
    bounds=NONNEGATIVE,
  )
  eos_fill_rate: float = setting(
    0.1,
    'cmlm: fraction of target rows whose PAD positions are '
    'filled with EOS while training, for fixed-length '
    'decoding',
    bounds=UNIT_INTERVAL,
  )
  scheduled_sampling: Literal['off', 'linear', 'exponential', 'inverse_sigmoid'] = setting(
    'off',
    'off: teacher forcing (the paper); else scheduled sampling (Mihaylova & Martins '
    '2019): a second decoder pass fed, per token, the first pass prediction with probability '
    '1 - eps_i, where eps_i, the gold-token probability at step i, decays as in Bengio et al. '
    '2015: linear min(1, max(eps, k - c*i)), exponential k^i, inverse_sigmoid k/(k + exp(i/k))',
  )
  scheduled_sampling_k: float = setting(
    1.0,
    'scheduled sampling: k of the decay (linear: the '
    'start, > 1 holds eps_i at 1 for (k - 1) / c steps; '
    'exponential: 0 < k <= 1; inverse_sigmoid: k >= 1)',
    bounds=NUMBER,
  )
  scheduled_sampling_c: float = setting(
    1e-4,
    'scheduled sampling, linear: the decrease of the gold-token probability per step',
    bounds=NUMBER,
  )
  scheduled_sampling_eps: float = setting(
    0.0, 'scheduled sampling, linear: the lowest gold-token probability, in [0, 1]', bounds=NUMBER
  )
  prefetch: int = setting(
    2,
    'batches built ahead by a background thread (and put on the '
    'devices) while the devices run a step; 0: built between steps',
    bounds=NONNEGATIVE_INT,
  )
  scheduled_sampling_choice: Literal['argmax', 'sample'] = setting(
    'argmax',
    "scheduled sampling: the first pass's prediction is its argmax, or a token "
    'sampled from its softmax',
  )
  profile: str | None = setting(
    None,
    'START,STOP: a jax.profiler trace of the steps after '
    'step START up to step STOP, in WORKDIR/profile '
    '(TensorBoard or Perfetto); none: no trace',
  )

  # Fields a resumed run may change: they say how long and how chattily to train, not how.
  RESUMABLE_CHANGES = frozenset(
    {
      'steps',
      'log_every',
      'eval_every',
      'checkpoint_every',
      'keep_checkpoints',
      'bleu_every',
      'prefetch',
      'profile',
      'patience',
    }
  )

  def __post_init__(self):
    check_fields(self, 'train')
    _check_scheduled_sampling(self)
    profile = self.profile_steps  # raises ConfigError for a malformed train.profile
    if profile is not None and profile[0] >= self.steps:
      raise ConfigError(
        f'train.profile={self.profile} starts after the last step (train.steps='
        f'{self.steps}): no step would be traced'
      )
    if self.peak_lr is not None and self.lr_scale != 1.0:
      raise ConfigError(
        f'train.peak_lr={self.peak_lr} sets the peak itself; train.lr_scale='
        f"{self.lr_scale} scales the paper's peak: set one of them"
      )
    if self.best_metric == 'bleu' and not self.bleu_every:
      raise ConfigError(
        'train.best_metric=bleu needs validation BLEU during training: set train.bleu_every'
      )

  @property
  def profile_steps(self) -> tuple[int, int] | None:
    """train.profile as (START, STOP), 0 <= START < STOP; None when not profiling."""
    if self.profile is None:
      return None
    parts = self.profile.split(',')
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
      raise ConfigError(
        f'train.profile must be START,STOP (two step numbers, e.g. 10,15), got {self.profile!r}'
      )
    start, stop = (int(part) for part in parts)
    if start >= stop:
      raise ConfigError(
        f'train.profile={self.profile}: STOP must be after START (the steps '
        'after START up to STOP are traced)'
      )
    return start, stop

  def replace(self, **overrides) -> TrainConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def paper(cls, **overrides) -> TrainConfig:
    """The base model's schedule (§5.2-5.4): 100k steps of 25k tokens, warmup 4000."""
    return cls(**overrides)

  @classmethod
  def multi30k(cls, **overrides) -> TrainConfig:
    """Multi30k: 8,000 batches of 4k tokens per side, pairs packed into rows of 64 (~76
    epochs), a shorter warmup than the paper's, a checkpoint every 250 steps and the last 10
    kept for averaging (docs/multi30k.md: how it was chosen, and what it scores)."""
    defaults = dict(
      steps=8000,
      max_tokens=4096,
      warmup_steps=1000,
      packing=64,
      log_every=50,
      eval_every=500,
      checkpoint_every=250,
      keep_checkpoints=10,
      bleu_every=1000,
    )
    return cls(**{**defaults, **overrides})

  @classmethod
  def multi30k_fairseq(cls, **overrides) -> TrainConfig:
    """Wu et al. (2021)'s fairseq baseline on Multi30k (`--preset multi30k_fairseq`): 8,000
    updates of 8,192 tokens, --lr 0.005 after 2,000 warm-up updates, an epoch checkpoint and
    validation, patience 10, the last 10 epochs kept for averaging."""
    defaults = dict(
      seed=1,
      steps=8000,
      max_tokens=8192,
      warmup_steps=2000,
      peak_lr=0.005,
      adam_eps=1e-8,
      max_grad_norm=25.0,
      log_every=50,
      eval_every=MULTI30K_FAIRSEQ_EPOCH,
      checkpoint_every=MULTI30K_FAIRSEQ_EPOCH,
      keep_checkpoints=10,
      patience=10,
      bleu_every=5 * MULTI30K_FAIRSEQ_EPOCH,
    )
    return cls(**{**defaults, **overrides})

  @classmethod
  def toy(cls, **overrides) -> TrainConfig:
    """The offline default (`python train.py`): minutes on a laptop CPU."""
    defaults = dict(
      steps=400,
      max_tokens=2048,
      warmup_steps=200,
      log_every=50,
      eval_every=200,
      checkpoint_every=200,
    )
    return cls(**{**defaults, **overrides})


def resolve_dtype(dtype: str, backend: str | None = None) -> str:
  """`ModelConfig.dtype` as a dtype name: 'auto' is 'bfloat16' on a GPU or TPU (their matrix
  units run it at several times float32's rate) and 'float32' on a CPU (`backend`, default
  JAX's), where bfloat16 is slower without bfloat16 instructions (benchmarks/README.md)."""
  if dtype != 'auto':
    return dtype
  return 'float32' if (backend or jax.default_backend()) == 'cpu' else 'bfloat16'


# cuDNN's fused attention takes these compute dtypes and head sizes (jax 0.10.2): up to 256 on
# Hopper and later, 128 before (auto's limit, which every GPU it picks cuDNN on takes).
CUDNN_DTYPES = ('bfloat16', 'float16')
CUDNN_MAX_HEAD_DIM = 256
AUTO_CUDNN_MAX_HEAD_DIM = 128


def resolve_attention_kernel(config: ModelConfig, backend: str | None = None) -> str:
  """`ModelConfig.attention_kernel` as the kernel the model runs on `backend` (default JAX's):
  'einsum', 'xla' or 'cudnn'.

  auto is cudnn on a GPU when cuDNN takes the model (bfloat16 compute, head_dim <= 128 and a
  multiple of 8, no attention dropout; an Ampere or later card): its saving is the `[B, N, T,
  S]` scores a training step keeps for the backward pass. Elsewhere auto is einsum: a CPU runs
  the same products either way (benchmarks/README.md), and a TPU has no cuDNN. Raises
  ConfigError for cudnn where no GPU is.
  """
  if backend is None and jax.default_backend() == 'gpu' and not _flash_capable_gpu():
    backend = 'gpu (before Ampere)'  # no cuDNN flash attention: auto takes einsum
  backend = backend or jax.default_backend()
  if config.attention_kernel == 'cudnn' and backend != 'gpu':
    raise ConfigError(
      f'model.attention_kernel=cudnn needs a GPU (cuDNN); this runs on {backend}: '
      'use auto, einsum or xla'
    )
  if config.attention_kernel != 'auto':
    return config.attention_kernel
  dtype = resolve_dtype(config.dtype, backend)
  fits = (
    dtype in CUDNN_DTYPES
    and config.head_dim <= AUTO_CUDNN_MAX_HEAD_DIM
    and config.head_dim % 8 == 0
    and config.attention_dropout_rate == 0
  )
  return 'cudnn' if backend == 'gpu' and fits else 'einsum'


def _flash_capable_gpu() -> bool:
  """Whether JAX's first device is a GPU of compute capability 8.0 or later (Ampere on), the
  cards cuDNN's flash attention runs on."""
  try:
    return float(jax.devices()[0].compute_capability) >= 8.0
  except (AttributeError, TypeError, ValueError):
    return False


def _check_attention_kernel(config: ModelConfig) -> None:
  """Raises ConfigError for an explicit fused kernel the model's settings rule out."""
  kernel = config.attention_kernel
  if kernel in ('xla', 'cudnn') and config.attention_dropout_rate > 0:
    raise ConfigError(
      f'model.attention_kernel={kernel} has no attention dropout '
      f'(jax.nn.dot_product_attention); with model.attention_dropout_rate='
      f'{config.attention_dropout_rate} use einsum or auto'
    )
  if kernel != 'cudnn':
    return
  if config.dtype not in ('auto', *CUDNN_DTYPES):
    raise ConfigError(
      f'model.attention_kernel=cudnn computes in bfloat16 or float16, not '
      f'model.dtype={config.dtype}: use model.dtype=bfloat16 (or auto, on a GPU)'
    )
  if config.head_dim > CUDNN_MAX_HEAD_DIM or config.head_dim % 8:
    raise ConfigError(
      f'model.attention_kernel=cudnn needs a head size (d_model / num_heads) of at '
      f'most {CUDNN_MAX_HEAD_DIM} and a multiple of 8, got {config.head_dim}'
    )


def _check_scheduled_sampling(config: TrainConfig) -> None:
  """Raises ConfigError naming the train.scheduled_sampling_* setting that is out of range for
  the chosen schedule, or that the schedule does not read."""
  schedule, k = config.scheduled_sampling, config.scheduled_sampling_k
  defaults = TrainConfig.__dataclass_fields__
  unread = {
    'off': ('k', 'c', 'eps', 'choice'),
    'linear': (),
    'exponential': ('c', 'eps'),
    'inverse_sigmoid': ('c', 'eps'),
  }[schedule]
  for name in unread:
    field = f'scheduled_sampling_{name}'
    if getattr(config, field) != defaults[field].default:
      raise ConfigError(
        f'train.{field}={getattr(config, field)!r} is not read with '
        f'train.scheduled_sampling={schedule!r}'
      )
  # Numbers, each (check_fields); their ranges depend on the schedule.
  numbers = {name: getattr(config, f'scheduled_sampling_{name}') for name in ('k', 'c', 'eps')}
  ranges = {
    'linear': (
      k >= 0 and numbers['c'] >= 0 and 0 <= numbers['eps'] <= 1,
      'k >= 0, c >= 0 and 0 <= eps <= 1',
    ),
    'exponential': (0 < k <= 1, '0 < k <= 1'),
    'inverse_sigmoid': (k >= 1, 'k >= 1'),
  }
  valid, rule = ranges.get(schedule, (True, ''))
  if not valid:
    values = ', '.join(f'train.scheduled_sampling_{n}={v!r}' for n, v in numbers.items())
    raise ConfigError(f'train.scheduled_sampling={schedule!r} needs {rule}; got {values}')


@dataclasses.dataclass(frozen=True)
class DataConfig:
  """Where the parallel text comes from and how its shared vocabulary is built."""

  source: str = setting(
    'toy',
    'toy (English -> German number words, generated in code, '
    'offline), a directory or table file of parallel text, or a Hub '
    'dataset (see data.load_parallel)',
  )
  src_lang: str = setting('en', 'source language code (file suffix or column)')
  tgt_lang: str = setting('de', 'target language code (file suffix or column)')
  vocab_size: int = setting(
    8000,
    'size of the shared subword vocabulary to train; '
    "model.vocab_size becomes the trained tokenizer's size, which "
    'a small corpus may leave below this',
    bounds=POSITIVE_INT,
  )
  tokenizer: Literal['bpe', 'unigram'] = setting('bpe', 'subword model of the tokenizer')
  valid_split: str | None = setting(
    None, 'file stem (or Hub split) to validate on; none: the first of val, valid, validation, dev'
  )
  test_split: str | None = setting(
    None,
    'file stem (or Hub split) to test on, e.g. '
    "test_2016_flickr; none: 'test', or the only test* one",
  )
  tokenizer_sample: int = setting(
    500_000,
    'training pairs (both sides) the tokenizer is trained '
    'on, drawn at random when the split has more, so '
    'that training it takes minutes at any corpus size; '
    '0: every pair',
    bounds=NONNEGATIVE_INT,
  )
  cache_dir: str | None = setting(
    None,
    'where the tokenized training split is cached, one '
    'subdirectory per data content and tokenizer (share it '
    'between runs of one corpus); none: WORKDIR/encoded',
  )
  normalize_punctuation: bool = setting(
    False,
    "Moses' punctuation normalisation of every text "
    "the tokenizer sees (Multi30k's standard "
    'preprocessing; true/false)',
  )
  lowercase: bool = setting(
    False, 'lowercase every text the tokenizer sees, so outputs are lowercase (true/false)'
  )
  pretokenize: Literal['none', 'moses'] = setting(
    'none',
    "moses: split punctuation from words with the Moses tokenizer of each side's "
    'language before the subword model (training, validation and decoding input alike); none: '
    'the subword model sees text as written',
  )
  detokenize: bool = setting(
    True,
    'with data.pretokenize=moses: Moses-detokenize outputs into '
    'text; false: leave them tokenized (true/false)',
  )

  # Fields a resumed run may change: where the cache lives changes no token id.
  RESUMABLE_CHANGES = frozenset({'cache_dir'})

  def __post_init__(self):
    check_fields(self, 'data')
    for name in ('valid_split', 'test_split', 'cache_dir'):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise ConfigError(f'data.{name} must be a non-empty string or None, got {value!r}')
    for name in ('source', 'src_lang', 'tgt_lang'):
      value = getattr(self, name)
      if not isinstance(value, str) or not value:
        raise ConfigError(f'data.{name} must be a non-empty string, got {value!r}')
    if self.src_lang == self.tgt_lang:
      raise ConfigError(f'data.src_lang and data.tgt_lang are both {self.src_lang!r}')
    if not self.detokenize and self.pretokenize != 'moses':
      raise ConfigError(
        'data.detokenize=false is read only with data.pretokenize=moses (there '
        'is nothing to detokenize)'
      )

  def replace(self, **overrides) -> DataConfig:
    return dataclasses.replace(self, **overrides)


# The three sections of a run's settings, as config.json and train.py's options name them.
SECTIONS = {'model': ModelConfig, 'train': TrainConfig, 'data': DataConfig}
RUN_PRESETS = ('toy', 'multi30k', 'multi30k_fairseq', 'base')
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


# Batches of 8,192 tokens in one epoch of Multi30k's 29,000 training pairs, preprocessed as the
# multi30k_fairseq preset does: its validations and checkpoints come once an epoch.
MULTI30K_FAIRSEQ_EPOCH = 72


def run_preset(name: str) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The (model, training, data) settings of a named run, as train.py's `--preset`.

  toy: numbers in English words -> German, generated in code; a 1M-parameter
    model that reaches ~98% exact match in a few minutes on a laptop CPU.
  multi30k: Multi30k en->de (the Hub's 'bentrevett/multi30k', or `--data DIR`);
    a 4+4-layer d=128 model, dropout 0.3, bfloat16 compute, 16,000 BPE tokens,
    packed rows (docs/multi30k.md says why each).
  base: the paper's base model and schedule on WMT14 en->de from the Hub.
  """
  if name == 'toy':
    return (
      ModelConfig(
        d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=512, max_len=64
      ),
      TrainConfig.toy(),
      DataConfig(source='toy', vocab_size=256),
    )
  if name == 'multi30k':
    return (
      ModelConfig(
        d_model=128,
        num_heads=4,
        num_encoder_layers=4,
        num_decoder_layers=4,
        d_ff=512,
        max_len=128,
        dropout_rate=0.3,
        dtype='bfloat16',
      ),
      TrainConfig.multi30k(),
      DataConfig(source='bentrevett/multi30k', vocab_size=16_000),
    )
  if name == 'multi30k_fairseq':
    # Wu et al. (2021)'s fairseq baseline, LividWo/Revisit-MMT README-baseline.md: its
    # transformer_tiny, 2 GPUs x 4,096 tokens an update, --lr 0.005 after 2,000 warm-up
    # updates, Adam eps 1e-8, --clip-norm 25, --patience 10 on the validation loss of each
    # epoch, the last 10 epoch checkpoints averaged (docs/multi30k.md).
    return (
      ModelConfig(
        d_model=128,
        num_heads=4,
        num_encoder_layers=4,
        num_decoder_layers=4,
        d_ff=256,
        max_len=128,
        dropout_rate=0.3,
        qkv_init_gain=2**-0.5,
      ),
      TrainConfig.multi30k_fairseq(),
      DataConfig(
        source='bentrevett/multi30k',
        vocab_size=10_000,
        normalize_punctuation=True,
        lowercase=True,
        pretokenize='moses',
      ),
    )
  if name == 'base':
    return (
      ModelConfig.base(),
      TrainConfig.paper(),
      DataConfig(source='wmt14:de-en', vocab_size=37_000),
    )
  raise ConfigError(f'unknown preset {name!r}; choose one of {", ".join(RUN_PRESETS)}')


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
