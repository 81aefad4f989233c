"""Sequence packing: the segment mask, the packing batcher, and a packed batch training exactly
like the same pairs one per row (losses, gradients, attention, devices)."""

import collections
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from flax_transformer.config import ConfigError, ModelConfig, TrainConfig
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import Batch, EncodedCorpus
from flax_transformer.data.corpus import DataError
from flax_transformer.data.packing import check_settings, padding_share
from flax_transformer.data.plans import FirstFit, pack_rows
from flax_transformer.nn import masks
from flax_transformer.nn.model import Transformer, attention_weights
from flax_transformer.train.losses import token_losses
from support.device_workers import assert_runs_match, run_values, run_worker
from support.loop_batches import flatten_with_eos

PAD, BOS, EOS = 0, 1, 2
ROW = 16  # the packed row length
MAX_LEN = 24  # pairs up to this long; those over ROW go to the 24 bucket
VOCAB = 64


def random_corpus(num_pairs: int, seed: int = 0) -> EncodedCorpus:
  """Pairs of random ids, most short (so several fit a row), a few over ROW."""
  rng = np.random.default_rng(seed)
  lengths = np.where(
    rng.random((num_pairs, 2)) < 0.9,
    rng.integers(1, 8, (num_pairs, 2)),
    rng.integers(ROW, MAX_LEN, (num_pairs, 2)),
  )
  sides = [[rng.integers(3, VOCAB, n).tolist() for n in lengths[:, side]] for side in (0, 1)]
  src_ids, src_offsets = flatten_with_eos(sides[0])
  tgt_ids, tgt_offsets = flatten_with_eos(sides[1])
  return EncodedCorpus(
    src_ids=src_ids,
    src_offsets=src_offsets,
    tgt_ids=tgt_ids,
    tgt_offsets=tgt_offsets,
    example_ids=np.arange(num_pairs) + 100,
    max_len=MAX_LEN,
    num_dropped=0,
  )


@pytest.fixture(scope='module')
def corpus():
  return random_corpus(200)


@pytest.fixture(scope='module')
def batcher(corpus):
  return Batcher(corpus, max_tokens=8 * ROW, seed=3, plan=FirstFit(ROW), row_multiple=2)


def segments_of(batch: Batch, row: int):
  """Row `row`'s pairs as [(example id, src, tgt_in, tgt_out, src_positions, tgt_positions)]."""
  out = []
  for k, example in enumerate(batch.example_ids[row], start=1):
    if example < 0:
      continue
    s, t = batch.src_segments[row] == k, batch.tgt_segments[row] == k
    out.append(
      (
        int(example),
        batch.src[row, s],
        batch.tgt_in[row, t],
        batch.tgt_out[row, t],
        batch.src_positions[row, s],
        batch.tgt_positions[row, t],
      )
    )
  return out


# --- the mask -------------------------------------------------------------------------------


def test_segment_mask_matches_numpy():
  rng = np.random.default_rng(0)
  q = rng.integers(0, 4, (3, 7))
  k = rng.integers(0, 4, (3, 5))
  want = np.zeros((3, 1, 7, 5), bool)
  for b in range(3):
    for t in range(7):
      for s in range(5):
        want[b, 0, t, s] = q[b, t] == k[b, s] and k[b, s] != 0
  np.testing.assert_array_equal(masks.segment_mask(jnp.asarray(q), jnp.asarray(k)), want)
  # The docstring's example: "a b | c PAD".
  row = jnp.asarray([[1, 1, 2, 0]])
  np.testing.assert_array_equal(
    masks.segment_mask(row, row)[0, 0].astype(int),
    [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]],
  )


# --- the batcher ----------------------------------------------------------------------------


def test_every_pair_once_per_epoch_in_its_own_segment(corpus, batcher):
  """Each pair exactly once, its src / tgt_in / tgt_out as the corpus has them, positions
  0..n-1; rows within their length; shapes fixed."""
  for epoch in (0, 1):
    seen = []
    for batch in batcher.epoch(epoch):
      assert batch.src.shape in {(rows, length) for rows, length in batcher.shapes}
      for row in range(batch.src.shape[0]):
        for example, src, tgt_in, tgt_out, src_pos, tgt_pos in segments_of(batch, row):
          pair = example - 100
          seen.append(pair)
          np.testing.assert_array_equal(src, corpus.source(pair))
          np.testing.assert_array_equal(tgt_out, corpus.target(pair))
          np.testing.assert_array_equal(tgt_in, [BOS, *corpus.target(pair)[:-1]])
          np.testing.assert_array_equal(src_pos, np.arange(len(src)))
          np.testing.assert_array_equal(tgt_pos, np.arange(len(tgt_in)))
        real = batch.src_segments[row] > 0
        assert (batch.src[row, ~real] == PAD).all() and (batch.tgt_out[row] == PAD).sum() == (
          batch.tgt_segments[row] == 0
        ).sum()
    assert sorted(seen) == list(range(len(corpus)))
  assert len(batcher.epoch(0)) < math_ceil_unpacked(corpus, batcher)


def math_ceil_unpacked(corpus, batcher):
  """Batches per epoch one pair per row, with the same row counts: packing needs fewer."""
  return -(-len(corpus) // min(batcher.rows))


def test_packs_several_pairs_per_row(corpus, batcher):
  batches = list(batcher.epoch(0))
  pairs = sum(int(b.num_pairs) for b in batches)
  rows = sum(int((b.example_ids[:, 0] >= 0).sum()) for b in batches)
  assert pairs == len(corpus) and pairs / rows > 2
  assert padding_share(batches, PAD)['target'] < 0.3
  # The shapes an epoch's draw makes, counted as the log and the bench name them.
  shapes = collections.Counter(tuple(int(n) for n in b.src.shape) for b in batches)
  assert batcher.shape_batches(0) == dict(shapes) and sum(shapes.values()) == len(batches)


def test_batch_at_is_a_pure_function_of_the_step(corpus, batcher):
  """A fresh batcher (a resumed run) gives the same batches; steps run on across epochs,
  whose lengths differ."""
  fresh = Batcher(corpus, max_tokens=8 * ROW, seed=3, plan=FirstFit(ROW), row_multiple=2)
  sizes = [len(batcher.epoch(e)) for e in range(3)]
  for step in (sizes[0] + sizes[1] + 1, 0, sizes[0], sizes[0] - 1):
    epoch, index = (
      (0, step)
      if step < sizes[0]
      else ((1, step - sizes[0]) if step < sizes[0] + sizes[1] else (2, step - sizes[0] - sizes[1]))
    )
    want = batcher.epoch(epoch)[index]
    got = fresh.batch_at(step)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
      np.testing.assert_array_equal(a, b)
  other_seed = Batcher(corpus, max_tokens=8 * ROW, seed=4, plan=FirstFit(ROW))
  assert not np.array_equal(other_seed.batch_at(0).src, batcher.batch_at(0).src)


def test_pack_rows_first_fit():
  # Capacity 5 a side: pairs (3, 2), (2, 4), (2, 1), (1, 1) -> [0, 2], [1, 3].
  rows = pack_rows(np.arange(4), np.array([3, 2, 2, 1]), np.array([2, 4, 1, 1]), 5)
  assert [r.tolist() for r in rows] == [[0, 2], [1, 3]]


def test_refusals(corpus):
  with pytest.raises(DataError, match='train.packing'):
    Batcher(corpus, max_tokens=64, seed=0, plan=FirstFit(1))
  with pytest.raises(ConfigError, match='train.packing=16.*model.attention_radius=2'):
    check_settings(ModelConfig.tiny(attention_radius=2), TrainConfig(packing=16))
  with pytest.raises(ConfigError, match='train.packing=128.*model.max_len=64'):
    check_settings(ModelConfig.tiny(), TrainConfig(packing=128))
  with pytest.raises(ConfigError, match='train.packing'):
    TrainConfig(packing=-1)


# --- the model ------------------------------------------------------------------------------

CONFIG = ModelConfig.tiny(vocab_size=VOCAB, dropout_rate=0.0, max_len=MAX_LEN)


@pytest.fixture(scope='module')
def params():
  tokens = jnp.ones((1, 1), jnp.int32)
  return Transformer(CONFIG).init(jax.random.key(0), tokens, tokens)['params']


def unpacked(batch: Batch, length: int):
  """The pairs of a packed batch one per row, each row `length` long, in segment order."""
  rows = [seg for row in range(batch.src.shape[0]) for seg in segments_of(batch, row)]
  arrays = np.zeros((3, len(rows), length), np.int32)
  for r, (_, src, tgt_in, tgt_out, _, _) in enumerate(rows):
    for side, ids in enumerate((src, tgt_in, tgt_out)):
      arrays[side, r, : len(ids)] = ids
  return Batch(
    src=arrays[0],
    tgt_in=arrays[1],
    tgt_out=arrays[2],
    example_ids=np.array([r[0] for r in rows], np.int32),
  )


@functools.partial(jax.jit, static_argnames='packed')
def nll_and_grad(params, batch: Batch, packed: bool):
  """(per-token NLL `[B, T]`, the gradient of its sum over non-PAD targets)."""

  def total(params):
    logits = Transformer(CONFIG).apply(
      {'params': params}, batch.src, batch.tgt_in, packing=batch.packing if packed else None
    )
    _, nll = token_losses(logits, batch.tgt_out, 0.0)
    nll = jnp.where(batch.tgt_out != PAD, nll, 0.0)
    return jnp.sum(nll), nll

  return jax.grad(total, has_aux=True)(params)[::-1]


@pytest.fixture(scope='module')
def packed_batch(batcher):
  """A batch of the ROW bucket with at least one row of three or more pairs."""
  for batch in batcher.epoch(0):
    if batch.src.shape[1] == ROW and (batch.example_ids[:, 2] >= 0).any():
      return batch
  raise AssertionError('no row of three pairs')


def test_packed_losses_and_gradient_equal_unpacked(params, packed_batch):
  """float32, dropout off: each pair's loss to 1e-5 relative, the gradient to 1e-5."""
  alone = unpacked(packed_batch, ROW)
  nll, grads = nll_and_grad(params, packed_batch, packed=True)
  nll_alone, grads_alone = nll_and_grad(params, alone, packed=False)
  per_pair = [
    float(np.asarray(nll)[row][packed_batch.tgt_segments[row] == k].sum())
    for row in range(packed_batch.src.shape[0])
    for k in range(1, packed_batch.tgt_segments[row].max() + 1)
  ]
  np.testing.assert_allclose(per_pair, np.asarray(nll_alone).sum(axis=1), rtol=1e-5)
  flat, flat_alone = (traverse_util.flatten_dict(g, sep='/') for g in (grads, grads_alone))
  scale = max(float(np.abs(g).max()) for g in flat_alone.values())
  assert scale > 1e-3
  for name, g in flat_alone.items():
    np.testing.assert_allclose(flat[name], g, rtol=1e-5, atol=1e-5 * scale, err_msg=name)


def test_no_attention_crosses_a_segment(params, packed_batch):
  weights = attention_weights(
    Transformer(CONFIG),
    {'params': params},
    packed_batch.src,
    packed_batch.tgt_in,
    packed_batch.packing,
  )
  src_seg, tgt_seg = packed_batch.src_segments, packed_batch.tgt_segments
  for name, w in weights.items():
    queries = src_seg if name.startswith('encoder') else tgt_seg
    keys = tgt_seg if name.endswith('self_attention') and name.startswith('decoder') else src_seg
    other = (queries[:, None, :, None] != keys[:, None, None, :]) | (keys[:, None, None, :] == 0)
    assert np.all(np.asarray(w)[np.broadcast_to(other, w.shape)] == 0.0), name
    real = np.broadcast_to((queries > 0)[:, None, :], w.shape[:3])
    np.testing.assert_allclose(np.asarray(w).sum(-1)[real], 1.0, rtol=1e-5)  # rows still sum to 1


def test_packed_bfloat16_step_with_gradient_accumulation(batcher, packed_batch):
  """The data-parallel step on packed batches in bfloat16, accumulating 2 batches per update:
  finite losses, no update after the first batch, an update after the second."""
  from flax_transformer.train import (
    DataParallel,
    create_train_state,
    make_optimizer,
    make_parallel_step,
  )

  config = CONFIG.replace(dtype='bfloat16')
  train_config = TrainConfig(grad_accum_steps=2, warmup_steps=10, packing=ROW)
  model, optimizer = Transformer(config), make_optimizer(train_config, config)
  parallel = DataParallel(jax.devices()[:1])
  step = make_parallel_step(model, optimizer, train_config, parallel)
  state = parallel.replicate(create_train_state(model, optimizer, seed=0))
  initial = jax.device_get(state.params)
  params = []
  for _ in range(2):
    state, metrics = step(state, parallel.shard_batch(packed_batch))
    assert np.isfinite(float(metrics['loss_sum'])) and float(metrics['nonfinite']) == 0.0
    assert int(metrics['tokens']) == int(packed_batch.num_tokens)
    params.append(jax.device_get(state.params))
  moved = [
    max(
      float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(initial))
    )
    for after in params
  ]
  assert moved[0] == 0.0 and moved[1] > 0.0


def test_scheduled_sampling_keeps_every_sentences_bos_gold(packed_batch):
  """With predictions always taken, every position is replaced but PAD and each sentence's
  first (its BOS), which decoding starts from."""
  from flax_transformer.train.scheduled_sampling import mix_decoder_inputs, row_keys

  gold = jnp.asarray(packed_batch.tgt_in)
  predictions = jnp.full_like(gold, VOCAB - 1)
  keys = row_keys(jax.random.key(0), 0, gold.shape[0])
  mixed = np.asarray(
    mix_decoder_inputs(gold, predictions, 1.0, keys, PAD, jnp.asarray(packed_batch.tgt_positions))
  )
  starts = (packed_batch.tgt_positions == 0) & (packed_batch.tgt_segments > 0)
  np.testing.assert_array_equal(mixed[starts], BOS)
  np.testing.assert_array_equal(mixed[packed_batch.tgt_segments == 0], PAD)
  assert (mixed[(packed_batch.tgt_segments > 0) & ~starts] == VOCAB - 1).all()


# --- devices --------------------------------------------------------------------------------

DEVICE_RUNS = ('shard_map-1', 'shard_map-4', 'pmap-4')
WORKER = r"""
import sys
import numpy as np
from flax_transformer.data.batching import EncodedCorpus
from support.loop_batches import flatten_with_eos
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.model import Transformer
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.plans import FirstFit
from support.device_workers import train_runs

out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rng = np.random.default_rng(0)
sides = [[rng.integers(3, 64, n).tolist() for n in rng.integers(1, 8, 64)] for _ in range(2)]
(src_ids, src_offsets), (tgt_ids, tgt_offsets) = map(flatten_with_eos, sides)
corpus = EncodedCorpus(src_ids=src_ids, src_offsets=src_offsets, tgt_ids=tgt_ids,
                       tgt_offsets=tgt_offsets, example_ids=np.arange(64), max_len=16,
                       num_dropped=0)
batcher = Batcher(corpus, max_tokens=8 * 16, seed=0, plan=FirstFit(16), row_multiple=4)
config = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, dropout_rate=0.0)
train_config = TrainConfig(steps=steps, warmup_steps=4, lr_scale=4.0, adam_eps=1.0, packing=16)
np.savez(out, **train_runs(Transformer(config), train_config, runs, steps, batcher.batch_at))
"""


@pytest.fixture(scope='module')
def device_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp('packing') / 'runs.npz'
  return run_worker(WORKER, out, [3, *DEVICE_RUNS], device_count=4, backend_optimization=False)


@pytest.mark.parametrize('run', DEVICE_RUNS[1:])
def test_packed_training_on_four_devices_equals_one(device_runs, run):
  """Losses to 1e-6 and parameters to 1e-5 relative (rounding of sums in another order)."""
  assert_runs_match(device_runs, run)
  losses = run_values(device_runs, 'shard_map-1', 'loss')
  assert float(losses['2']) < float(losses['0'])  # it trains, so equality is not vacuous


# --- cmlm -----------------------------------------------------------------------------------

CMLM_CONFIG = ModelConfig.tiny(
  kind='cmlm', vocab_size=VOCAB, max_len=MAX_LEN, dropout_rate=0.0, max_length_offset=4
)


@pytest.fixture(scope='module')
def cmlm_inputs_packed(packed_batch):
  from flax_transformer.train import cmlm_objective

  return cmlm_objective.cmlm_inputs(jax.random.key(5), packed_batch, CMLM_CONFIG, eos_fill_rate=0.0)


def test_cmlm_masks_and_length_targets_per_segment(packed_batch, cmlm_inputs_packed):
  """Every sentence gets its own length target and between 1 and all of its tokens masked."""
  inputs = jax.device_get(cmlm_inputs_packed)
  mask = CMLM_CONFIG.vocab_size
  counts = []
  for row in range(packed_batch.src.shape[0]):
    segments = packed_batch.tgt_segments[row]
    for k in range(1, segments.max() + 1):
      n = int((segments == k).sum())
      assert inputs.tgt_lengths[row, k - 1] == n
      masked = inputs.masked[row, segments == k]
      assert 1 <= masked.sum() <= n
      counts.append(masked.sum() / n)
    assert (inputs.tgt_lengths[row, segments.max() :] == 0).all()
    assert not inputs.masked[row, segments == 0].any()
  np.testing.assert_array_equal(inputs.tokens == mask, inputs.masked)
  np.testing.assert_array_equal(inputs.targets, packed_batch.tgt_out)
  assert min(counts) < 1 and max(counts) == 1  # counts differ by sentence: drawn per sentence
  with pytest.raises(ValueError, match='eos_fill_rate'):
    from flax_transformer.train import cmlm_objective

    cmlm_objective.cmlm_inputs(jax.random.key(5), packed_batch, CMLM_CONFIG, eos_fill_rate=0.1)
  with pytest.raises(ConfigError, match='train.packing=16.*train.eos_fill_rate=0.1'):
    check_settings(CMLM_CONFIG, TrainConfig(packing=16))


@pytest.mark.parametrize('decoder_input', ['mask', 'uniform_copy'])
def test_cmlm_packed_equals_unpacked(packed_batch, cmlm_inputs_packed, decoder_input):
  """Token logits, per-sentence pooled length logits and the loss sums of a packed batch
  equal those of its sentences one per row, masked alike (float32, to 1e-5)."""
  from flax_transformer.nn import cmlm
  from flax_transformer.train import cmlm_objective

  config = CMLM_CONFIG.replace(cmlm_decoder_input=decoder_input)
  model = cmlm.CMLMTransformer(config)
  tokens = jnp.ones((1, 1), jnp.int32)
  variables = model.init(jax.random.key(1), tokens, tokens)
  packed = jax.device_get(cmlm_inputs_packed)
  alone = unpacked(packed_batch, ROW)
  segments = packed_batch.tgt_segments
  place = [(row, k) for row in range(segments.shape[0]) for k in range(1, segments[row].max() + 1)]
  alone_tokens = np.zeros_like(alone.tgt_out)
  alone_masked = np.zeros(alone.tgt_out.shape, bool)
  for r, (row, k) in enumerate(place):
    n = int((segments[row] == k).sum())
    alone_tokens[r, :n] = packed.tokens[row, segments[row] == k]
    alone_masked[r, :n] = packed.masked[row, segments[row] == k]
  token_logits, length_logits = model.apply(
    variables, packed.src, packed.tokens, packing=packed.packing
  )
  alone_logits, alone_lengths = model.apply(variables, alone.src, alone_tokens)
  for r, (row, k) in enumerate(place):
    n = int((segments[row] == k).sum())
    np.testing.assert_allclose(
      token_logits[row, segments[row] == k], alone_logits[r, :n], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(length_logits[row, k - 1], alone_lengths[r], rtol=1e-5, atol=1e-5)
  alone_inputs = cmlm_objective.CMLMInputs(
    src=alone.src,
    tokens=alone_tokens,
    targets=alone.tgt_out,
    masked=alone_masked,
    tgt_lengths=(alone.tgt_out != PAD).sum(1),
  )
  sums = cmlm_objective.cmlm_loss_sums(token_logits, length_logits, packed, config, 0.1)
  alone_sums = cmlm_objective.cmlm_loss_sums(alone_logits, alone_lengths, alone_inputs, config, 0.1)
  assert float(sums['sentences']) == len(place)
  for name, value in alone_sums.items():
    np.testing.assert_allclose(sums[name], value, rtol=1e-5, err_msg=name)
