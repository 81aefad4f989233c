"""encode_corpus and Batcher: exact rows, fixed shapes, the token budget, determinism, resumption."""

import collections
import math

import datasets
import jax
import numpy as np
import pytest

from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import Batch, default_buckets, encode_corpus, shard
from flax_transformer.data.corpus import DataError, load_parallel
from flax_transformer.data.plans import FirstFit
from flax_transformer.tokenizer import Tokenizer

PAD, BOS, EOS = 0, 1, 2
MAX_LEN = 24


class Letters:
  """A stand-in tokenizer, one id per letter ('a' -> 4, ...), so lengths are known exactly."""

  pad_id, bos_id, eos_id = Tokenizer.pad_id, Tokenizer.bos_id, Tokenizer.eos_id

  def encode(self, texts):
    return [[4 + ord(c) - ord('a') for c in text] for text in texts]

  encode_target = encode


def letters(ids):
  return ''.join(chr(int(i) - 4 + ord('a')) for i in ids)


@pytest.fixture(scope='module')
def dataset():
  """300 pairs of random lengths 1..30 on each side, so some exceed MAX_LEN."""
  rng = np.random.default_rng(0)

  def word():
    return ''.join(rng.choice(list('abcdefgh'), size=rng.integers(1, 31)))

  return datasets.Dataset.from_dict(
    {'source': [word() for _ in range(300)], 'target': [word() for _ in range(300)]}
  )


@pytest.fixture(scope='module')
def corpus(dataset):
  return encode_corpus(dataset, Letters(), MAX_LEN)


def expected_rows(text, max_len):
  """Independent reference: (src, tgt_in, tgt_out) of one pair padded to max_len."""
  return [
    np.array(ids + [PAD] * (max_len - len(ids)), np.int32)
    for ids in (
      [4 + ord(c) - 97 for c in text['source']] + [EOS],
      [BOS] + [4 + ord(c) - 97 for c in text['target']],
      [4 + ord(c) - 97 for c in text['target']] + [EOS],
    )
  ]


def test_encode_corpus_appends_eos_and_drops_over_long_pairs(dataset, corpus):
  # Kept iff both sides have at most MAX_LEN - 1 letters (room for EOS / BOS).
  kept = [
    i
    for i, row in enumerate(dataset)
    if len(row['source']) < MAX_LEN and len(row['target']) < MAX_LEN
  ]
  assert 0 < len(kept) < len(dataset)
  assert corpus.example_ids.tolist() == kept
  assert corpus.num_dropped == len(dataset) - len(kept) == len(dataset) - len(corpus)
  for i in (0, 1, len(corpus) - 1):
    row = dataset[int(corpus.example_ids[i])]
    assert letters(corpus.source(i)[:-1]) == row['source'] and corpus.source(i)[-1] == EOS
    assert letters(corpus.target(i)[:-1]) == row['target'] and corpus.target(i)[-1] == EOS
  assert corpus.src_ids.dtype == np.int32
  assert corpus.lengths.max() <= MAX_LEN


def test_encode_corpus_boundary():
  pairs = datasets.Dataset.from_dict({'source': ['abc', 'abcd', 'a'], 'target': ['a', 'b', 'abcd']})
  corpus = encode_corpus(pairs, Letters(), max_len=4)  # 3 letters + EOS fit, 4 do not
  assert corpus.example_ids.tolist() == [0] and corpus.num_dropped == 2


def test_encode_corpus_argument_errors(dataset):
  with pytest.raises(DataError, match=r'one split \(a datasets.Dataset\), got DatasetDict'):
    encode_corpus(datasets.DatasetDict({'train': dataset}), Letters(), MAX_LEN)
  with pytest.raises(DataError, match=r"needs columns 'source' and 'target'"):
    encode_corpus(dataset.rename_column('target', 'de'), Letters(), MAX_LEN)
  with pytest.raises(DataError, match='max_len must be an integer >= 2'):
    encode_corpus(dataset, Letters(), 1)


def test_default_buckets():
  assert default_buckets(64) == (8, 16, 24, 32, 48, 64)
  assert default_buckets(100) == (8, 16, 24, 32, 48, 64, 96, 100)
  assert default_buckets(256) == (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
  assert default_buckets(5) == (5,)


@pytest.fixture(scope='module')
def batcher(corpus):
  return Batcher(corpus, max_tokens=100, seed=7)


def test_rows_per_bucket_follow_the_token_budget(batcher):
  assert batcher.length_buckets == (8, 16, 24)
  assert batcher.rows == (100 // 8, 100 // 16, 100 // 24) == (12, 6, 4)
  with_devices = Batcher(batcher.corpus, max_tokens=100, seed=7, row_multiple=4)
  assert with_devices.rows == (12, 4, 4)
  # max_tokens below row_multiple * L: one row per device is the least a batch holds.
  assert Batcher(batcher.corpus, max_tokens=10, seed=7, row_multiple=2).rows == (2, 2, 2)


def test_every_pair_exactly_once_in_its_smallest_bucket(batcher, corpus, dataset):
  epoch = batcher.epoch(0)
  assert len(epoch) == batcher.batches_per_epoch()
  seen = []
  for batch in epoch:
    rows, length = batch.src.shape
    assert (rows, length) in batcher.shapes
    assert batch.tgt_in.shape == batch.tgt_out.shape == (rows, length)
    assert rows * length <= batcher.max_tokens
    assert all(a.dtype == np.int32 for a in jax.tree.leaves(batch))
    for r, example in enumerate(batch.example_ids):
      if example < 0:
        continue
      seen.append(int(example))
      src, tgt_in, tgt_out = expected_rows(dataset[int(example)], length)
      np.testing.assert_array_equal(batch.src[r], src)
      np.testing.assert_array_equal(batch.tgt_in[r], tgt_in)
      np.testing.assert_array_equal(batch.tgt_out[r], tgt_out)
      need = max(len(dataset[int(example)]['source']), len(dataset[int(example)]['target'])) + 1
      smaller = [b for b in batcher.length_buckets if b < length]
      assert need <= length and all(b < need for b in smaller)
  assert sorted(seen) == corpus.example_ids.tolist()


def test_pad_rows_fill_each_buckets_last_batch(batcher, corpus):
  epoch = list(batcher.epoch(0))
  pad_rows = sum(int((b.example_ids < 0).sum()) for b in epoch)
  counts = np.bincount(
    np.searchsorted(batcher.length_buckets, corpus.lengths), minlength=len(batcher.length_buckets)
  )
  assert pad_rows == sum(math.ceil(n / r) * r - n for n, r in zip(counts, batcher.rows))
  assert pad_rows > 0
  for batch in epoch:
    pad = batch.example_ids < 0
    assert (batch.src[pad] == PAD).all() and (batch.tgt_in[pad] == PAD).all()
    assert (batch.tgt_out[pad] == PAD).all()
    assert int(batch.num_pairs) == int((~pad).sum())
  total_tokens = sum(int(b.num_tokens) for b in epoch)
  assert total_tokens == int(np.diff(corpus.tgt_offsets).sum())  # every target token + EOS


def test_deterministic_per_seed_and_epoch(batcher, corpus):
  def order(b, epoch):
    return np.concatenate([x.example_ids for x in b.epoch(epoch)]).tolist()

  first = order(batcher, 0)
  assert order(Batcher(corpus, max_tokens=100, seed=7), 0) == first
  assert order(batcher, 1) != first
  assert order(Batcher(corpus, max_tokens=100, seed=8), 0) != first
  # Batches are shuffled across buckets, not grouped by length.
  lengths = [x.src.shape[1] for x in batcher.epoch(0)]
  assert lengths != sorted(lengths)


def test_batch_at_matches_epochs_and_resumes(batcher, corpus):
  n = batcher.batches_per_epoch()
  resumed = Batcher(corpus, max_tokens=100, seed=7)  # a fresh process: no iterator state
  for step in (0, 1, n - 1, n, n + 5, 3 * n + 2):
    want = batcher.epoch(step // n)[step % n]
    for got in (batcher.batch_at(step), resumed.batch_at(step)):
      for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
  with pytest.raises(DataError, match='step must be >= 0'):
    batcher.batch_at(-1)


def test_no_shuffle_is_bucket_then_corpus_order(corpus):
  ordered = Batcher(corpus, max_tokens=100, seed=0, shuffle=False)
  ids = [x.example_ids[x.example_ids >= 0] for x in ordered.epoch(3)]
  lengths = [x.src.shape[1] for x in ordered.epoch(3)]
  assert lengths == sorted(lengths)
  flat = np.concatenate(ids)
  bucket = np.searchsorted(ordered.length_buckets, corpus.lengths)
  want = np.concatenate([corpus.example_ids[bucket == b] for b in range(3)])
  np.testing.assert_array_equal(flat, want)


def test_explicit_buckets_and_their_errors(corpus):
  two = Batcher(corpus, max_tokens=120, seed=0, length_buckets=[24, 12])
  assert two.length_buckets == (12, 24) and two.rows == (10, 5)
  assert {x.src.shape for x in two.epoch(0)} <= {(10, 12), (5, 24)}
  with pytest.raises(
    DataError,
    match=r'largest length bucket, 16, is shorter than the corpus '
    'max_len=24',
  ):
    Batcher(corpus, max_tokens=100, seed=0, length_buckets=[8, 16])
  with pytest.raises(DataError, match='max_tokens must be a positive integer, got 0'):
    Batcher(corpus, max_tokens=0, seed=0)
  with pytest.raises(DataError, match='seed must be a non-negative integer'):
    Batcher(corpus, max_tokens=100, seed=-1)


def test_empty_corpus_is_refused():
  pairs = datasets.Dataset.from_dict({'source': ['abcdef'], 'target': ['a']})
  with pytest.raises(DataError, match=r'holds no pairs \(1 were longer than max_len=4\)'):
    Batcher(encode_corpus(pairs, Letters(), 4), max_tokens=100, seed=0)


def test_shard_is_a_contiguous_block(batcher):
  batch = batcher.batch_at(0)
  rows = batch.src.shape[0]
  parts = [shard(batch, i, 2) for i in range(2)]
  for i, part in enumerate(parts):
    np.testing.assert_array_equal(part.src, batch.src[i * rows // 2 : (i + 1) * rows // 2])
  np.testing.assert_array_equal(np.concatenate([p.example_ids for p in parts]), batch.example_ids)
  with pytest.raises(DataError, match=rf'{rows} rows does not split into {rows + 1} equal shards'):
    shard(batch, 0, rows + 1)
  with pytest.raises(DataError, match=r'shard index 2 is outside \[0, 2\)'):
    shard(batch, 2, 2)


def test_batch_is_a_pytree_for_jit(batcher):
  batch = batcher.batch_at(0)
  device = jax.device_put(batch)
  assert isinstance(device, Batch)
  assert int(jax.jit(lambda b: b.num_tokens)(device)) == int(batch.num_tokens)


class MarianLetters(Letters):
  """Letters with Marian's special ids: EOS 0, PAD 2 (bos == pad), so id 0 is a real token."""

  pad_id = bos_id = 2
  eos_id = 0


@pytest.mark.parametrize('packed', [False, True])
def test_num_tokens_counts_with_the_corpus_pad_id(dataset, packed):

  corpus = encode_corpus(dataset, MarianLetters(), MAX_LEN)
  assert corpus.pad_id == 2
  batcher = (
    Batcher(corpus, max_tokens=100, seed=7, plan=FirstFit(16))
    if packed
    else Batcher(corpus, max_tokens=100, seed=7)
  )
  batches = list(batcher.epoch(0))
  assert all(batch.pad_id == 2 for batch in batches)
  # Every target token and its EOS (id 0, ours PAD) counts; the PAD positions (id 2) do not.
  expected = int(np.diff(corpus.tgt_offsets).sum())
  assert sum(int(batch.num_tokens) for batch in batches) == expected
  assert any((batch.tgt_out == 2).any() for batch in batches)
  # Under jit too: the pad id is static data of the pytree, not an array.
  batch = batches[0]
  assert int(jax.jit(lambda b: b.num_tokens)(jax.device_put(batch))) == int(batch.num_tokens)


def test_describe(batcher):
  line = batcher.describe()
  assert line.startswith(
    f'{len(batcher.corpus):,} pairs in {batcher.batches_per_epoch()} '
    'batches per epoch of <= 100 tokens, shapes [B x L:batches] '
  )
  # Each shape's batches, as the bench takes them, add up to the epoch's.
  counts = batcher.shape_batches()
  assert list(counts) == [(12, 8), (6, 16), (4, 24)]
  assert sum(counts.values()) == batcher.batches_per_epoch()
  assert ','.join(f'{b}x{n}:{k}' for (b, n), k in counts.items()) in line
  epoch = batcher.epoch(0)
  assert counts == collections.Counter(
    (int(epoch[i].src.shape[0]), int(epoch[i].src.shape[1])) for i in range(len(epoch))
  )
  assert line.endswith('of target positions are padding')


def test_multi30k_end_to_end(multi30k_dir):
  ds = load_parallel(str(multi30k_dir), 'en', 'de', splits={'validation': 'val'})['validation']
  tokenizer = Tokenizer.train(ds['source'][:] + ds['target'][:], vocab_size=2000)
  corpus = encode_corpus(ds, tokenizer, max_len=64)
  assert len(corpus) + corpus.num_dropped == 1014
  batcher = Batcher(corpus, max_tokens=2048, seed=0, row_multiple=8)
  assert all(rows % 8 == 0 for rows, _ in batcher.shapes)
  batch = batcher.batch_at(0)
  real = batch.example_ids >= 0
  assert tokenizer.decode(batch.src[real]) == [
    ds[int(i)]['source'] for i in batch.example_ids[real]
  ]
  assert tokenizer.decode(batch.tgt_out[real]) == [
    ds[int(i)]['target'] for i in batch.example_ids[real]
  ]
