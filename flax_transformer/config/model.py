"""The model's settings: `ModelConfig`, its presets, and what they resolve to where it runs.

`ModelConfig.tiny()` (tests), `.base()` and `.big()` (the paper's Table 3) take overrides.
`resolve_dtype` turns `dtype='auto'` into the compute dtype of a backend, and
`resolve_attention_kernel` `attention_kernel='auto'` into the kernel it runs (einsum, xla or
cudnn), `resolve_loss_chunk` `loss_chunk='auto'` into the chunk a training step fuses its loss
over; `ModelConfig` refuses an explicit fused kernel its other settings rule out.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from flax_transformer.config.settings import (
  ARCHITECTURE,
  COMPUTATION,
  INITIALISATION,
  NONNEGATIVE_INT,
  POSITIVE,
  POSITIVE_INT,
  REGULARISATION,
  UNIT_INTERVAL,
  VOCABULARY,
  check_fields,
  setting,
)
from flax_transformer.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the encoder–decoder Transformer.

  Frozen and hashable, so it can be a static argument of `jax.jit`.
  """

  # The architecture: what a checkpoint means.
  d_model: int = setting(512, 'model width D', bounds=POSITIVE_INT, lifetime=ARCHITECTURE)
  num_heads: int = setting(
    8, 'attention heads N (must divide d_model)', bounds=POSITIVE_INT, lifetime=ARCHITECTURE
  )
  num_encoder_layers: int = setting(6, 'encoder layers', bounds=POSITIVE_INT, lifetime=ARCHITECTURE)
  num_decoder_layers: int = setting(6, 'decoder layers', bounds=POSITIVE_INT, lifetime=ARCHITECTURE)
  d_ff: int = setting(
    2048, 'inner width F of the feed-forward layers', bounds=POSITIVE_INT, lifetime=ARCHITECTURE
  )
  max_len: int = setting(
    256,
    'longest source or target in tokens, EOS included: the length of '
    'the positional table (longer training pairs are dropped)',
    bounds=POSITIVE_INT,
    lifetime=ARCHITECTURE,
  )
  activation: Literal['relu', 'gelu', 'silu'] = setting(
    'relu',
    'feed-forward activation (silu: x * sigmoid(x), which Marian calls swish)',
    lifetime=ARCHITECTURE,
  )
  norm_placement: Literal['post', 'pre'] = setting(
    'post',
    'post: LayerNorm(x + Sublayer(x)) as in the paper; pre: x + Sublayer(LayerNorm(x))',
    lifetime=ARCHITECTURE,
  )
  share_embeddings: bool = setting(
    True,
    'one embedding matrix for source, target and the '
    'pre-softmax projection (paper §3.4; true/false)',
    lifetime=ARCHITECTURE,
  )
  positions: Literal['interleaved', 'concatenated'] = setting(
    'interleaved',
    "positional table's layout: sin and cos of each wavelength side by side (the "
    'paper) or every sin first, then every cos (Marian)',
    lifetime=ARCHITECTURE,
  )
  logits_bias: bool = setting(
    False,
    'a learned bias on the output logits (Marian: final_logits_bias; true/false)',
    lifetime=ARCHITECTURE,
  )
  # 1e-5, not tensor2tensor's 1e-6: PyTorch, fairseq, Marian, transformers and CTranslate2 all
  # fix 1e-5, so an exported default run decodes the same in each (1e-6 changed greedy output
  # on 33 of 400 Multi30k lines of a 600-step run).
  layer_norm_epsilon: float = setting(
    1e-5,
    'epsilon of every LayerNorm (PyTorch, fairseq, Marian, transformers and CTranslate2: '
    '1e-5; runs begun before 2026-12-05 used 1e-6 and keep it in their config.json)',
    bounds=POSITIVE,
    lifetime=ARCHITECTURE,
  )
  attention_radius: int | None = setting(
    None,
    'restricted self-attention (paper §4): each '
    'position sees positions within this distance; '
    'none: unrestricted',
    bounds=NONNEGATIVE_INT,
    lifetime=ARCHITECTURE,
  )
  kind: Literal['autoregressive', 'cmlm'] = setting(
    'autoregressive',
    "autoregressive: the paper's causal decoder, one token per step; cmlm: "
    'the non-autoregressive conditional masked LM (Ghazvininejad et al. 2019), decoded with '
    'mask-predict',
    lifetime=ARCHITECTURE,
  )
  max_length_offset: int = setting(
    32,
    'cmlm: the length classifier predicts target length - source length within +- this',
    bounds=NONNEGATIVE_INT,
    lifetime=ARCHITECTURE,
  )
  cmlm_decoder_input: Literal['mask', 'uniform_copy'] = setting(
    'mask',
    'cmlm: a MASKed position is fed the MASK embedding (mask) or the source token at '
    'the same relative position, round(j * S / N) (uniform_copy, Gu et al. 2018)',
    lifetime=ARCHITECTURE,
  )

  # The vocabulary: the trained tokenizer's size and special ids (not options: set from it).
  vocab_size: int = setting(
    37_000,
    'vocabulary size V (set from the trained tokenizer)',
    bounds=POSITIVE_INT,
    lifetime=VOCABULARY,
  )
  pad_id: int = setting(0, 'PAD id (set from the tokenizer)', lifetime=VOCABULARY)
  bos_id: int = setting(
    1,
    "BOS id, the decoder's start token (set from the tokenizer; may equal "
    'pad_id, as in Marian, whose decoder starts from PAD)',
    lifetime=VOCABULARY,
  )
  eos_id: int = setting(2, 'EOS id (set from the tokenizer)', lifetime=VOCABULARY)
  unk_id: int = setting(3, 'UNK id (set from the tokenizer)', lifetime=VOCABULARY)

  # The initialisation: how fresh parameters are drawn (a resumed run restores over them).
  qkv_init_gain: float = setting(
    1.0,
    'gain of the Xavier-uniform initialisation of the query, key and value projections: 1 '
    '(tensor2tensor, Flax) or 0.7071 = 1/sqrt(2) (fairseq: Xavier over the fused [3D, D] '
    'in-projection, "convergence much better"); the output projection keeps gain 1',
    bounds=POSITIVE,
    lifetime=INITIALISATION,
  )

  # Regularisation: dropout (fine-tuning may change it).
  dropout_rate: float = setting(
    0.1,
    'dropout on embeddings + positions and on every sub-layer output (paper §5.4)',
    bounds=UNIT_INTERVAL,
    lifetime=REGULARISATION,
  )
  attention_dropout_rate: float = setting(
    0.0,
    'dropout on the attention weights (the paper: none)',
    bounds=UNIT_INTERVAL,
    lifetime=REGULARISATION,
  )
  activation_dropout_rate: float = setting(
    0.0,
    "dropout on the feed-forward's hidden activations, after the nonlinearity (the paper: "
    "none; fairseq's --activation-dropout, tensor2tensor's relu_dropout)",
    bounds=UNIT_INTERVAL,
    lifetime=REGULARISATION,
  )

  # The computation: chosen per run, resolved per backend in nn.backend, never compared.
  dtype: Literal['auto', 'float32', 'bfloat16'] = setting(
    'auto',
    'compute dtype (parameters, logits and loss stay float32); auto: bfloat16 on a GPU '
    'or TPU, float32 on a CPU, decided where the model runs',
    lifetime=COMPUTATION,
  )
  remat: Literal['none', 'layer', 'dots'] = setting(
    'none',
    "training's memory for time: none keeps every activation for the backward pass; "
    "layer keeps each layer's input and recomputes the rest; dots also keeps the dense "
    'projections (and feed-forward) outputs and recomputes attention and the elementwise work '
    '(the layers then run as one scan); either way the loss takes the logits 2,048 tokens at a '
    'time. The same gradients; dropout draws other masks',
    lifetime=COMPUTATION,
  )
  loss_chunk: int | Literal['auto'] = setting(
    'auto',
    'training an autoregressive model: the output projection, log-softmax and label-smoothed '
    'loss fused over chunks of this many tokens, their gradient taken in the same pass '
    '(train.losses.fused_loss_sums): no [tokens, vocabulary] logits are kept, and none '
    'recomputed; the same loss and gradients; 0: the whole batch at once; auto: 1,024 on a '
    "CPU computing in float32 where a batch's logits would pass 64 MiB, 0 elsewhere, "
    'decided where the model runs',
    bounds=NONNEGATIVE_INT,
    lifetime=COMPUTATION,
  )
  attention_kernel: Literal['auto', 'einsum', 'xla', 'cudnn'] = setting(
    'auto',
    'how attention is computed (the same function): einsum, our own products, the '
    'reference; xla or cudnn, jax.nn.dot_product_attention (cudnn: fused flash attention, a '
    'GPU with bfloat16 compute and head_dim <= 256, a multiple of 8); auto: cudnn for whole '
    'sequences on a GPU where it applies, einsum elsewhere. Rows must be right-padded; packed '
    'rows, restricted attention, pooled beams and attention dropout take einsum (xla and cudnn '
    'refuse attention dropout)',
    lifetime=COMPUTATION,
  )

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


# cuDNN's fused attention takes these compute dtypes and head sizes (jax 0.10.2): up to 256 on
# Hopper and later, 128 before (nn.backend.AUTO_CUDNN_MAX_HEAD_DIM, auto's limit).
CUDNN_DTYPES = ('bfloat16', 'float16')
CUDNN_MAX_HEAD_DIM = 256


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
