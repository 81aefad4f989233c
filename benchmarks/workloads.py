"""What the benchmarks run: the model sizes and batch shapes, the FLOPs they take, and our step.

Shared by `benchmarks.solo` and its workers, `ab`, `cmlm`, `packing`, `gpu_check`
and tests/test_benchmarks.py (which checks the FLOP counts against the dots XLA
is given). Up front only the standard library and `flax_transformer.bench.flops` (the
hand counts: the config and the model modules, jax and flax) are imported: a peer's
worker process runs under a python of its own; whatever needs more of the library
imports it inside.

  Shape, SHAPE        a training batch; the issue's 32 x (32 + 32) tokens
  model_config        'base' (the paper's, vocabulary 8,000), 'small' (the first
                      multi30k preset's size, `first_preset`), 'big'
  train_flops         one training step's matmul FLOPs (the library's), and `train_flop_classes`
                      the same split by the matmul shape they run at
  decode_flops        greedy / beam decoding's (`prefix_flops` + `step_flops`), and
                      `decode_flop_classes`
  synthetic_batch     random full-length rows; `decode_sources` for decoding
  OurStep             the library's mapped training step, compiled ahead of time
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

# The hand counts and the batch shape; flax_transformer.bench.flops imports only the config
# (and the package's model modules: jax and flax), which a peer's python has too.
from flax_transformer.bench.flops import BatchShape

RESULTS = Path(__file__).resolve().parent / 'results'
# The first multi30k preset's size, kept as data beside the results measured at it.
FIRST_PRESET = RESULTS / 'first_preset.json'
MODELS = ('base', 'small', 'big', 'multi30k')
VOCAB_SIZE = 8000


# One batch: `batch` rows of `src_len` source and `tgt_len` target tokens (the library's).
Shape = BatchShape


SHAPE = Shape(batch=32, src_len=32, tgt_len=32)


def first_preset() -> dict:
  """{'model': {d_model, num_heads, layers, d_ff}, 'vocab_size': 8000}: the first multi30k preset."""
  recorded = json.loads(FIRST_PRESET.read_text())
  return {'model': recorded['model'], 'vocab_size': recorded['vocab_size']}


def model_config(name: str = 'base', **overrides):
  """The benchmarked sizes, vocabulary 8,000 (imported late: JAX starts after pinning threads).

  'base' and 'big' are the paper's; 'small' is the first multi30k preset's
  shape (d=256, 3+3 layers, 4 heads of 64, d_ff 1024) on the base settings;
  'multi30k' is the model of the Multi30k studies (docs/multi30k.md): the
  `multi30k_fairseq` preset with d_ff 512 (d=128, 4+4 layers, 4 heads, dropout
  0.3) and its vocabulary of 10,000, the loss fused over 1,024-token chunks
  (`model.loss_chunk`, its fastest setting on a CPU: docs/training_step.md).
  """
  from flax_transformer.config import ModelConfig

  if name not in MODELS:
    raise ValueError(f'unknown model {name!r}; choose from {", ".join(MODELS)}')
  if name == 'multi30k':
    from flax_transformer.config.presets import run_preset

    model, _, data = run_preset('multi30k_fairseq')
    return model.replace(d_ff=512, vocab_size=data.vocab_size, loss_chunk=1024, **overrides)
  if name == 'big':
    config = ModelConfig.big(vocab_size=VOCAB_SIZE)
  else:
    config = ModelConfig.base(vocab_size=VOCAB_SIZE)
    if name == 'small':
      config = config.replace(**first_preset()['model'])
  return config.replace(**overrides)


# --- FLOPs (the hand counts are the library's: flax_transformer.bench.flops) -------------


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


def decode_flop_classes(
  config, batch: int, src_len: int, new_tokens: int, beam_size: int = 1
) -> dict[tuple[int, int, int], int]:
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
  """`synthetic_arrays` as the library's `Batch` (`flax_transformer.bench.synthetic_batch`,
  which draws the same ids: tests/test_benchmarks.py checks)."""
  from flax_transformer.bench.step import synthetic_batch

  return synthetic_batch(config, shape, seed=seed)


def decode_sources(config, batch: int, source_len: int):
  """Random ordinary ids `[batch, source_len]` (NumPy int32), EOS last: what every decoder is given."""
  import numpy as np

  rng = np.random.default_rng(0)
  src = rng.integers(config.unk_id + 1, config.vocab_size, (batch, source_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  return src


# --- our step ----------------------------------------------------------------------------


class OurStep:
  """`flax_transformer.bench.TrainingStep` (train.py's mapped step) on the first
  `len(devices)` devices, on one fixed batch: `compile_s`, `compiled` (e.g. its
  memory_analysis()), and `step()`, one update (state donated) that waits for it and returns
  its loss (the label-smoothed loss per target token, before the update)."""

  def __init__(self, model_config, train_config, shape: Shape, devices, mode: str = 'shard_map'):
    from flax_transformer.bench.step import TrainingStep

    self.training_step = TrainingStep(
      model_config, train_config, shape, devices=len(devices), parallel=mode
    )
    self.compile_s = self.training_step.compilation.seconds
    self.compiled = self.training_step.compiled

  def step(self) -> float:
    metrics = self.training_step.run()
    return float(metrics['loss_sum']) / float(metrics['tokens'])
