"""FLOPs of a training step and of decoding: counted by hand, and as XLA counts the program.

    train_flops(config, BatchShape(batch=32, src_len=32, tgt_len=32))   # matmuls, 2 per MAC
    decode_flops(config, batch=32, src_len=32, new_tokens=32, beam_size=4)
    xla_flops(compiled)                                                 # cost_analysis()

The hand count is the matmuls of the paper's model: 6 x (matmul parameters) x tokens plus
attention's products, forward and backward (tests/test_benchmarks.py checks it against the
dot products in the lowered step, exactly). XLA's count covers everything compiled, the
elementwise work too (softmax, LayerNorm, dropout, Adam), a few percent more at the usual
sizes; a second decoder pass (scheduled sampling) or remat's recomputation shows there only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only read: the counts take any object with the config's fields
  from flax_transformer.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class BatchShape:
  """One training batch: `batch` rows of `src_len` source and `tgt_len` target positions
  (train.py's buckets and packed rows have src_len == tgt_len)."""

  batch: int
  src_len: int
  tgt_len: int

  def __post_init__(self):
    for name in ('batch', 'src_len', 'tgt_len'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'BatchShape.{name} must be a positive integer, got {value!r}')

  @classmethod
  def parse(cls, text: str) -> BatchShape:
    """'ROWSxSRC+TGT' ('32x64+64') or 'ROWSxLEN' ('32x64': both sides 64)."""
    try:
      rows, lengths = text.lower().split('x')
      src, _, tgt = lengths.partition('+')
      return cls(int(rows), int(src), int(tgt or src))
    except ValueError:
      raise ValueError(
        f'{text!r} is not a batch shape: ROWSxSRC+TGT (32x64+64) or ROWSxLEN '
        '(32x64), positive integers'
      ) from None

  @classmethod
  def for_tokens(cls, max_tokens: int, length: int, row_multiple: int = 1) -> BatchShape:
    """The batch train.py builds from a token budget at bucket length `length`: max_tokens //
    length rows, rounded down to a multiple of `row_multiple` (the devices), at least that."""
    if max_tokens < 1 or length < 1:
      raise ValueError(f'max_tokens and length must be positive, got {max_tokens}, {length}')
    rows = max(row_multiple, max_tokens // length // row_multiple * row_multiple)
    return cls(rows, length, length)

  @property
  def target_tokens(self) -> int:
    return self.batch * self.tgt_len

  def __str__(self):
    return f'{self.batch}x{self.src_len}+{self.tgt_len}'


def encoder_layer_flops(config: ModelConfig, batch: int, src_len: int) -> int:
  """Matmul FLOPs of one encoder layer's forward pass over B rows of S tokens (2 per multiply-add):
  2BS(4D^2 + 2DF) for Q, K, V, O and the FFN, 4BS^2 D for QK^T and AV."""
  B, S, D, F = batch, src_len, config.d_model, config.d_ff
  return 2 * B * S * (4 * D * D + 2 * D * F) + 4 * B * S * S * D


def train_flops(config: ModelConfig, shape: BatchShape) -> int:
  """Matmul FLOPs of one training step (2 per multiply-add), forward and backward.

  With B rows, S source and T target tokens, D = d_model, F = d_ff, V = vocab,
  N_e / N_d encoder / decoder layers, the forward pass multiplies

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D          Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BT(4D^2 + 2DF) + 4BT^2 D          masked self-attention, FFN
                    + 2BT(2D^2) + 2BS(2D^2) + 4BTSD    cross-attention: Q, O on T; K, V on S
    output          2BTDV                              logits against the shared embedding

  and the backward pass multiplies twice as much (for every matmul, the
  gradients of both operands). The causal mask does not halve QK^T: the masked
  half is computed and then masked. Not counted: the embedding lookups and their
  scatter-add gradient, softmax, LayerNorm, dropout and Adam (elementwise; under 1%
  of the total at the paper's shapes).
  """
  B, S, T = shape.batch, shape.src_len, shape.tgt_len
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  encoder = encoder_layer_flops(config, B, S)
  decoder = (
    2 * B * T * (4 * D * D + 2 * D * F)
    + 4 * B * T * T * D
    + 2 * B * T * 2 * D * D
    + 2 * B * S * 2 * D * D
    + 4 * B * T * S * D
  )
  forward = (
    config.num_encoder_layers * encoder + config.num_decoder_layers * decoder + 2 * B * T * D * V
  )
  return 3 * forward


def prefix_flops(config: ModelConfig, batch: int, src_len: int) -> int:
  """Matmul FLOPs before the first decoding step (2 per multiply-add): the encoder, then K and V.

  With B sources of S tokens, D = d_model, F = d_ff, N_e / N_d layers:

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D      Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BS(2D^2)                      cross-attention K and V, once
  """
  D = config.d_model
  return (
    config.num_encoder_layers * encoder_layer_flops(config, batch, src_len)
    + config.num_decoder_layers * 2 * batch * src_len * 2 * D * D
  )


def step_flops(config: ModelConfig, rows: int, src_len: int, attended: int) -> int:
  """Matmul FLOPs of one decode step of R rows attending to `attended` positions of their own.

    decoder layer   2R(4D^2 + 2DF)                 Q, K, V, O of one token, FFN
                    + 2R(2D^2) + 4RSD              cross-attention Q, O; QK^T and AV over S
                    + 4R A D                       self-attention QK^T and AV over A positions
    output          2RDV                           logits against the shared embedding

  The compiled step attends to all L cache slots (masked), so its dots count
  A = L; `decode_flops` counts the model's work, A = t + 1 at step t.
  """
  R, S, A = rows, src_len, attended
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  layer = 2 * R * (4 * D * D + 2 * D * F) + 2 * R * 2 * D * D + 4 * R * S * D + 4 * R * A * D
  return config.num_decoder_layers * layer + 2 * R * D * V


def decode_flops(
  config: ModelConfig, batch: int, src_len: int, new_tokens: int, beam_size: int = 1
) -> int:
  """Model FLOPs of decoding `new_tokens` for B sources: the prefix plus every step on B * beams
  rows. Not counted: softmax, LayerNorm, top-k and the cache reorder."""
  return prefix_flops(config, batch, src_len) + sum(
    step_flops(config, batch * beam_size, src_len, t + 1) for t in range(new_tokens)
  )


def xla_flops(compiled) -> float | None:
  """The FLOPs XLA counts in a compiled program (`jax.stages.Compiled.cost_analysis()`), per
  device; None where the backend gives no count."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # noqa: BLE001  # a backend without the analysis raises
    return None
  if isinstance(analysis, (list, tuple)):  # one entry per program in older jax versions
    analysis = analysis[0] if analysis else None
  flops = (analysis or {}).get('flops')
  return float(flops) if flops is not None and flops >= 0 else None
