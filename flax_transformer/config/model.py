"""The model's settings: `ModelConfig`, its presets, and what they resolve to where it runs.

`ModelConfig.tiny()` (tests), `.base()` and `.big()` (the paper's Table 3) take overrides.
`resolve_dtype` turns `dtype='auto'` into the compute dtype of a backend, and
`resolve_attention_kernel` `attention_kernel='auto'` into the kernel it runs (einsum, xla or
cudnn); `ModelConfig` refuses an explicit fused kernel its other settings rule out.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from flax_transformer.config.settings import (
  NONNEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  UNIT_INTERVAL,
  check_fields,
  setting,
)
from flax_transformer.errors import ConfigError


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
