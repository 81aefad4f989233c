"""What the benchmarks run: the model sizes and batch shapes, the FLOPs they take, and our step.

Shared by `benchmarks.solo` and its workers, `step_parts`, `ab`, `cmlm`, `packing`
and tests/test_benchmarks.py (which checks the FLOP counts against the dots XLA
is given). Only the standard library is imported here up front: a peer's worker
process runs under a python of its own, without flax_transformer; whatever
needs JAX or the library imports it inside.

  Shape, SHAPE        a training batch; the issue's 32 x (32 + 32) tokens
  model_config        'base' (the paper's, vocabulary 8,000), 'small' (the first
                      multi30k preset's size, `first_preset`), 'big'
  train_flops         one training step's matmul FLOPs, and `train_flop_classes`
                      the same split by the matmul shape they run at
  decode_flops        greedy / beam decoding's (`prefix_flops` + `step_flops`), and
                      `decode_flop_classes`
  synthetic_batch     random full-length rows; `decode_sources` for decoding
  OurStep             the library's mapped training step, compiled ahead of time
"""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / 'results'
# The first multi30k preset's size, kept as data beside the results measured at it.
FIRST_PRESET = RESULTS / 'first_preset.json'
MODELS = ('base', 'small', 'big')
VOCAB_SIZE = 8000


@dataclasses.dataclass(frozen=True)
class Shape:
  """One batch: `batch` rows of `src_len` source and `tgt_len` target tokens."""
  batch: int
  src_len: int
  tgt_len: int

  @property
  def target_tokens(self) -> int:
    return self.batch * self.tgt_len

  def __str__(self):
    return f'{self.batch}x{self.src_len}+{self.tgt_len}'


SHAPE = Shape(batch=32, src_len=32, tgt_len=32)


def first_preset() -> dict:
  """{'model': {d_model, num_heads, layers, d_ff}, 'vocab_size': 8000}: the first multi30k preset."""
  recorded = json.loads(FIRST_PRESET.read_text())
  return {'model': recorded['model'], 'vocab_size': recorded['vocab_size']}


def model_config(name: str = 'base', **overrides):
  """The benchmarked sizes, vocabulary 8,000 (imported late: JAX starts after pinning threads).

  'base' and 'big' are the paper's; 'small' is the first multi30k preset's
  shape (d=256, 3+3 layers, 4 heads of 64, d_ff 1024) on the base settings.
  """
  from flax_transformer.config import ModelConfig
  if name not in MODELS:
    raise ValueError(f'unknown model {name!r}; choose from {", ".join(MODELS)}')
  if name == 'big':
    config = ModelConfig.big(vocab_size=VOCAB_SIZE)
  else:
    config = ModelConfig.base(vocab_size=VOCAB_SIZE)
    if name == 'small':
      config = config.replace(**first_preset()['model'])
  return config.replace(**overrides)


# --- FLOPs -------------------------------------------------------------------------------

def encoder_layer_flops(config, batch: int, src_len: int) -> int:
  """Matmul FLOPs of one encoder layer's forward pass over B rows of S tokens (2 per multiply-add):
  2BS(4D^2 + 2DF) for Q, K, V, O and the FFN, 4BS^2 D for QK^T and AV."""
  B, S, D, F = batch, src_len, config.d_model, config.d_ff
  return 2 * B * S * (4 * D * D + 2 * D * F) + 4 * B * S * S * D


def train_flops(config, shape: Shape) -> int:
  """Matmul FLOPs of one training step (2 per multiply-add), forward and backward.

  With B rows, S source and T target tokens, D = d_model, F = d_ff, V = vocab,
  N_e / N_d encoder / decoder layers, the forward pass multiplies

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D          Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BT(4D^2 + 2DF) + 4BT^2 D          masked self-attention, FFN
                    + 2BT(2D^2) + 2BS(2D^2) + 4BTSD    cross-attention: Q, O on T; K, V on S
    output          2BTDV                              logits against the shared embedding

  and the backward pass multiplies twice as much (for every matmul, the
  gradients of both operands). The causal mask does not halve QK^T: the masked
  half is computed and then masked, in our step and in the peers'. Not counted:
  the embedding lookups and their scatter-add gradient, softmax, LayerNorm,
  dropout and Adam (elementwise; under 1% of the total at the benchmarked shapes).
  """
  B, S, T = shape.batch, shape.src_len, shape.tgt_len
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  encoder = encoder_layer_flops(config, B, S)
  decoder = (2 * B * T * (4 * D * D + 2 * D * F) + 4 * B * T * T * D
             + 2 * B * T * 2 * D * D + 2 * B * S * 2 * D * D + 4 * B * T * S * D)
  forward = (config.num_encoder_layers * encoder + config.num_decoder_layers * decoder
             + 2 * B * T * D * V)
  return 3 * forward


def prefix_flops(config, batch: int, src_len: int) -> int:
  """Matmul FLOPs before the first decoding step (2 per multiply-add): the encoder, then K and V.

  With B sources of S tokens, D = d_model, F = d_ff, N_e / N_d layers:

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D      Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BS(2D^2)                      cross-attention K and V, once
  """
  D = config.d_model
  return (config.num_encoder_layers * encoder_layer_flops(config, batch, src_len)
          + config.num_decoder_layers * 2 * batch * src_len * 2 * D * D)


def step_flops(config, rows: int, src_len: int, attended: int) -> int:
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


def decode_flops(config, batch: int, src_len: int, new_tokens: int, beam_size: int = 1) -> int:
  """Model FLOPs of decoding `new_tokens` for B sources: the prefix plus every step on B * beams rows.

  The same count for every contender, so GFLOP/s compare like tokens/s; not
  counted: softmax, LayerNorm, top-k and the cache reorder.
  """
  return prefix_flops(config, batch, src_len) + sum(
      step_flops(config, batch * beam_size, src_len, t + 1) for t in range(new_tokens))


def _encoder_classes(classes: collections.Counter, config, batch: int, src_len: int) -> None:
  """Adds the encoder's forward matmuls over batch x src_len rows to `classes`."""
  D, F, rs = config.d_model, config.d_ff, batch * src_len
  for _ in range(config.num_encoder_layers):
    classes[rs, D, D] += 2 * rs * 4 * D * D + 4 * batch * src_len * src_len * D
    classes[rs, D, F] += 2 * rs * D * F
    classes[rs, F, D] += 2 * rs * F * D
  # The decoder's cross-attention keys and values, projected from the encoder's output.
  classes[rs, D, D] += config.num_decoder_layers * 2 * rs * 2 * D * D


def train_flop_classes(config, shape: Shape) -> dict[tuple[int, int, int], int]:
  """`train_flops` split by the matmul shape it is done at: {(rows, K, N): FLOPs}.

  The weight products go to their own [rows, K] @ [K, N]; attention's QK^T
  and AV (about 1% at 32 tokens) are counted at the [rows, D] @ [D, D] class;
  the backward pass (2x) at the forward's shapes. Sums to `train_flops`.
  """
  classes = collections.Counter()
  B, S, T = shape.batch, shape.src_len, shape.tgt_len
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  _encoder_classes(classes, config, B, S)
  rt = B * T
  for _ in range(config.num_decoder_layers):
    classes[rt, D, D] += 2 * rt * 6 * D * D + 4 * B * T * T * D + 4 * B * T * S * D
    classes[rt, D, F] += 2 * rt * D * F
    classes[rt, F, D] += 2 * rt * F * D
  classes[rt, D, V] += 2 * rt * D * V
  return {key: 3 * flops for key, flops in classes.items()}


def decode_flop_classes(config, batch: int, src_len: int, new_tokens: int,
                        beam_size: int = 1) -> dict[tuple[int, int, int], int]:
  """`decode_flops` split by matmul shape: the prefix at batch x src_len rows, every step at
  batch x beams rows (attention products at the [rows, D] @ [D, D] class). Sums to `decode_flops`.
  """
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  classes = collections.Counter()
  _encoder_classes(classes, config, batch, src_len)
  R = batch * beam_size
  for t in range(new_tokens):
    for _ in range(config.num_decoder_layers):
      classes[R, D, D] += 2 * R * 6 * D * D + 4 * R * src_len * D + 4 * R * (t + 1) * D
      classes[R, D, F] += 2 * R * D * F
      classes[R, F, D] += 2 * R * F * D
    classes[R, D, V] += 2 * R * D * V
  return dict(classes)


# --- inputs ------------------------------------------------------------------------------

def synthetic_arrays(config, shape: Shape, seed: int = 0):
  """(src [B, S], tgt_in [B, T], tgt_out [B, T]) as NumPy int32: random full-length rows, no PAD.

  `src` and `tgt_out` end with EOS, `tgt_in` = BOS + `tgt_out`[:-1]. `config`
  needs only vocab_size and the special ids: the peers' worker processes
  (benchmarks/solo_worker.py) pass a plain namespace.
  """
  import numpy as np

  rng = np.random.default_rng(seed)
  first = config.unk_id + 1  # ordinary tokens only
  src = rng.integers(first, config.vocab_size, (shape.batch, shape.src_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  tgt_out = rng.integers(first, config.vocab_size, (shape.batch, shape.tgt_len)).astype(np.int32)
  tgt_out[:, -1] = config.eos_id
  tgt_in = np.concatenate([np.full((shape.batch, 1), config.bos_id, np.int32), tgt_out[:, :-1]], 1)
  return src, tgt_in, tgt_out


def synthetic_batch(config, shape: Shape, seed: int = 0):
  """`synthetic_arrays` as the library's `Batch`."""
  import numpy as np

  from flax_transformer.data.batching import Batch
  src, tgt_in, tgt_out = synthetic_arrays(config, shape, seed)
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out,
               example_ids=np.arange(shape.batch, dtype=np.int32))


def decode_sources(config, batch: int, source_len: int):
  """Random ordinary ids `[batch, source_len]` (NumPy int32), EOS last: what every decoder is given."""
  import numpy as np
  rng = np.random.default_rng(0)
  src = rng.integers(config.unk_id + 1, config.vocab_size, (batch, source_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  return src


# --- our step ----------------------------------------------------------------------------

class OurStep:
  """`train.make_parallel_step` on `devices`, compiled ahead of time, on one fixed batch.

  `compile_s` is tracing + lowering + XLA compilation; `step()` runs one update
  (state buffers donated, as in training), waits for it and returns its loss
  (the label-smoothed loss per target token, before the update).
  """

  def __init__(self, model_config, train_config, shape: Shape, devices, mode: str = 'shard_map'):
    import jax

    from flax_transformer import train
    from flax_transformer.nn.model import Transformer
    model = Transformer(model_config)
    optimizer = train.make_optimizer(train_config, model_config)
    parallel = train.DataParallel(devices=devices, mode=mode)
    state = parallel.replicate(train.create_train_state(model, optimizer, seed=0))
    batch = parallel.shard_batch(synthetic_batch(model_config, shape))
    start = time.perf_counter()
    compiled = train.make_parallel_step(model, optimizer, train_config, parallel).lower(
        state, batch).compile()
    self.compile_s = time.perf_counter() - start
    self.compiled = compiled  # e.g. its memory_analysis()
    self._state = state

    def step() -> float:
      self._state, metrics = compiled(self._state, batch)
      jax.block_until_ready((self._state, metrics))
      return float(metrics['loss_sum']) / float(metrics['tokens'])

    self.step = step
