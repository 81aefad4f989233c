"""Array-built batches (data/assembly.py): bit for bit the Python-loop oracles'
(tests/support/loop_batches.py) from the same plan, per process equal to `shard`, and a best-fit
plan (data/plans.py) with no more padding than first fit's `pack_rows`.

Corpora: random ones (lengths and ids drawn, a Marian-like tokenizer's special ids) and the
first lines of Multi30k encoded with a small tokenizer (skipped if Multi30k is absent).
"""

from pathlib import Path

import jax
import numpy as np
import pytest

from flax_transformer.data import assembly
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import EncodedCorpus, encode_corpus, shard
from flax_transformer.data.corpus import load_parallel
from flax_transformer.data.plans import BestFit, FirstFit, PackedRows, pack_plan, pack_rows
from flax_transformer.tokenizer import Tokenizer
from support.loop_batches import LoopBatcher, loop_packed

MULTI30K = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'
needs_multi30k = pytest.mark.skipif(
  not (MULTI30K / 'train.en').is_file(), reason=f'Multi30k is not at {MULTI30K}'
)


def random_corpus(
  pairs: int, max_len: int, seed: int, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2
) -> EncodedCorpus:
  """Pairs of random lengths 2..max_len a side (EOS included), ids in [4, 500)."""
  rng = np.random.default_rng(seed)
  sides = {}
  for side in ('src', 'tgt'):
    lengths = rng.integers(1, max_len, size=pairs)  # without EOS
    ids = rng.integers(4, 500, size=int(lengths.sum()) + pairs).astype(np.int32)
    offsets = np.zeros(pairs + 1, np.int64)
    np.cumsum(lengths + 1, out=offsets[1:])
    ids[offsets[1:] - 1] = eos_id
    sides[side] = (ids, offsets)
  example_ids = np.sort(rng.choice(pairs * 2, size=pairs, replace=False)).astype(np.int64)
  return EncodedCorpus(
    src_ids=sides['src'][0],
    src_offsets=sides['src'][1],
    tgt_ids=sides['tgt'][0],
    tgt_offsets=sides['tgt'][1],
    example_ids=example_ids,
    max_len=max_len,
    num_dropped=pairs,
    pad_id=pad_id,
    bos_id=bos_id,
  )


@pytest.fixture(scope='module')
def multi30k_corpus():
  if not (MULTI30K / 'train.en').is_file():
    pytest.skip(f'Multi30k is not at {MULTI30K}')
  split = load_parallel(str(MULTI30K), 'en', 'de')['train'].select(range(4_000))
  tokenizer = Tokenizer.train(split['source'][:] + split['target'][:], 2_000)
  return encode_corpus(split, tokenizer, 64)


CORPORA = {
  'random': lambda: random_corpus(700, 40, seed=1),
  'random_marian_ids': lambda: random_corpus(
    500, 100, seed=2, pad_id=58100, bos_id=58100, eos_id=0
  ),
}


@pytest.fixture(params=[*CORPORA, 'multi30k'])
def corpus(request):
  if request.param == 'multi30k':
    return request.getfixturevalue('multi30k_corpus')
  return CORPORA[request.param]()


def assert_same(got, want):
  got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for a, b in zip(got_leaves, want_leaves):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)
  assert got.pad_id == want.pad_id


def test_bucketed_batches_are_bit_identical(corpus):
  for max_tokens, row_multiple in ((1024, 1), (2048, 4)):
    today = LoopBatcher(corpus, max_tokens, seed=3, row_multiple=row_multiple)
    ours = Batcher(corpus, max_tokens, seed=3, row_multiple=row_multiple)
    for step in range(2 * today.batches_per_epoch()):  # two epochs, every bucket's last batch
      assert_same(ours.batch_at(step), today.batch_at(step))
  evaluation = LoopBatcher(corpus, 1024, seed=0, shuffle=False)
  ours = Batcher(corpus, 1024, seed=0, shuffle=False)
  for want, got in zip(evaluation.epoch(0), ours.epoch(0)):
    assert_same(got, want)


def test_packed_batches_are_bit_identical(corpus):
  row_length = 24  # longer pairs go to the larger buckets, packed there too
  for plan in (FirstFit(row_length), BestFit(row_length)):
    today = LoopBatcher(corpus, 1536, seed=5, plan=plan, row_multiple=2)
    ours = Batcher(corpus, 1536, seed=5, plan=plan, row_multiple=2)
    steps = len(today.epoch(0)) + len(today.epoch(1))
    for step in range(steps):
      assert_same(ours.batch_at(step), today.batch_at(step))
  # And from first fit's rows as pack_rows gives them (lists of arrays).
  src, tgt = np.diff(corpus.src_offsets), np.diff(corpus.tgt_offsets)
  order = np.flatnonzero(corpus.lengths <= row_length)[:200]
  rows_of_pairs = pack_rows(order, src, tgt, row_length)[:16]
  assert_same(
    assembly.build_packed(corpus, rows_of_pairs, 16, row_length),
    loop_packed(corpus, rows_of_pairs, 16, row_length),
  )


@pytest.mark.parametrize('count', [2, 4])
def test_local_rows_equal_the_shard_of_the_global_batch(corpus, count):
  batchers = [
    Batcher(corpus, 1024, seed=7, row_multiple=4),
    Batcher(corpus, 1024, seed=7, plan=BestFit(32), row_multiple=4),
    Batcher(corpus, 1024, seed=7, plan=FirstFit(32), row_multiple=4),
  ]
  for batcher in batchers:
    steps = range(len(batcher.epoch(0)))  # includes each bucket's part-empty last batch
    for step in steps:
      whole = batcher.batch_at(step)
      for index in range(count):
        assert_same(batcher.local_batch_at(step, index, count), shard(whole, index, count))


def test_pack_plan_places_every_pair_once_within_the_row(corpus):
  lengths = corpus.lengths
  src, tgt = np.diff(corpus.src_offsets), np.diff(corpus.tgt_offsets)
  for length in (24, 64):
    order = np.random.default_rng(0).permutation(np.flatnonzero(lengths <= length))
    plan = pack_plan(order, src, tgt, length, np.random.default_rng(1))
    np.testing.assert_array_equal(np.sort(plan.pairs), np.sort(order))
    rows = np.repeat(np.arange(len(plan)), np.diff(plan.splits))
    assert np.bincount(rows, src[plan.pairs]).max() <= length
    assert np.bincount(rows, tgt[plan.pairs]).max() <= length
    again = pack_plan(order, src, tgt, length, np.random.default_rng(1))
    np.testing.assert_array_equal(again.pairs, plan.pairs)  # a pure function of its inputs
    assert len(plan) <= len(pack_rows(order, src, tgt, length))


def _padding(batcher) -> float:
  plan = batcher.plan_of(0)
  return assembly.plan_padding(plan, batcher.rows, batcher.length_buckets, batcher.corpus)['target']


def test_packing_plan_pads_no_more_than_today(corpus):
  for row_length in (32, 64):
    today = Batcher(corpus, 2048, seed=0, plan=FirstFit(row_length))
    ours = Batcher(corpus, 2048, seed=0, plan=BestFit(row_length))
    assert _padding(ours) <= _padding(today)
    # Every pair exactly once per epoch, each row within the bucket's length.
    pairs = np.concatenate([rows.pairs for _, rows in ours.plan_of(1)])
    np.testing.assert_array_equal(np.sort(pairs), np.arange(len(corpus)))


@needs_multi30k
def test_packing_plan_pads_less_on_multi30k_at_64(multi30k_corpus):
  today = Batcher(multi30k_corpus, 4096, seed=0, plan=FirstFit(64))
  ours = Batcher(multi30k_corpus, 4096, seed=0, plan=BestFit(64))
  assert _padding(ours) < _padding(today)


def test_best_fit_batches_resume_exactly_and_cross_epochs():
  corpus = random_corpus(300, 30, seed=4)
  batcher = Batcher(corpus, 512, seed=9, plan=BestFit(32), row_multiple=2)
  first = len(batcher.epoch(0))
  fresh = Batcher(corpus, 512, seed=9, plan=BestFit(32), row_multiple=2)
  for step in (first + 1, 0, first - 1, first):
    assert_same(fresh.batch_at(step), batcher.batch_at(step))
  ids = np.concatenate([batcher.batch_at(step).example_ids.ravel() for step in range(first)])
  np.testing.assert_array_equal(np.sort(ids[ids >= 0]), corpus.example_ids)


def test_packed_rows_behave_as_the_list_of_rows():
  rows = [np.array([3, 1]), np.array([0]), np.array([4, 2, 5])]
  packed = PackedRows.from_rows(rows)
  assert len(packed) == 3 and len(packed[1:]) == 2 and len(packed[5:]) == 0
  for got, want in zip(packed[1:].rows(), rows[1:]):
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(packed[2], rows[2])
