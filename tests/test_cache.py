"""The encoded-corpus cache (data/cache.py): equal to encode_corpus, keyed, never trusted when damaged.

Small corpora: the first lines of Multi30k's training set, copied into tmp_path (never
into the repository), and a small BPE tokenizer trained on them.
"""

import hashlib
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from flax_transformer.data import cache, encoding
from flax_transformer.data.batching import encode_corpus
from flax_transformer.data.corpus import DataError, load_parallel
from flax_transformer.tokenizer import Tokenizer

MULTI30K = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'
FIELDS = ('src_ids', 'src_offsets', 'tgt_ids', 'tgt_offsets', 'example_ids')
LINES = 1_500
MAX_LEN = 20  # short enough that some pairs are dropped

pytestmark = pytest.mark.skipif(
  not (MULTI30K / 'train.en').is_file(), reason=f'Multi30k is not at {MULTI30K}'
)


def _lines(lang: str, count: int = LINES) -> list[str]:
  return (MULTI30K / f'train.{lang}').read_text(encoding='utf-8').split('\n')[:count]


@pytest.fixture(scope='module')
def tokenizer():
  return Tokenizer.train(_lines('en') + _lines('de'), 600)


@pytest.fixture(scope='module')
def other_tokenizer():
  return Tokenizer.train(_lines('en') + _lines('de'), 500)


@pytest.fixture
def data(tmp_path):
  """A text directory: Multi30k lines plus what cleaning must handle (spaces, an empty side)."""
  directory = tmp_path / 'data'
  directory.mkdir()
  en, de = _lines('en'), _lines('de')
  en[3], de[7] = '  ' + en[3] + ' \r', ''  # stripped; pair 7 dropped for its empty side
  (directory / 'train.en').write_text('\n'.join(en) + '\n', encoding='utf-8')
  (directory / 'train.de').write_text('\n'.join(de), encoding='utf-8')  # no final newline
  return directory


def _source(directory: Path) -> cache.TextPairFiles:
  return cache.TextPairFiles(directory / 'train.en', directory / 'train.de')


def _assert_same(corpus, expected):
  for field in FIELDS:
    got, want = getattr(corpus, field), getattr(expected, field)
    assert got.dtype == want.dtype, field
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=field)
  assert (corpus.max_len, corpus.num_dropped, corpus.pad_id, corpus.bos_id) == (
    expected.max_len,
    expected.num_dropped,
    expected.pad_id,
    expected.bos_id,
  )


def _expected(directory: Path, tokenizer, max_len: int = MAX_LEN):
  return encode_corpus(load_parallel(str(directory), 'en', 'de')['train'], tokenizer, max_len)


def _count_builds(monkeypatch) -> list:
  builds = []
  original = cache._build

  def counting(*args, **kwargs):
    builds.append(args)
    return original(*args, **kwargs)

  monkeypatch.setattr(cache, '_build', counting)
  return builds


def test_equals_encode_corpus_and_is_memory_mapped(data, tokenizer, tmp_path):
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
  )
  expected = _expected(data, tokenizer)
  assert expected.num_dropped > 1  # over-long pairs and the empty one
  _assert_same(corpus, expected)
  assert all(isinstance(getattr(corpus, field), np.memmap) for field in FIELDS)
  assert corpus.target(5).tolist() == expected.target(5).tolist()


def test_dataset_source_equals_encode_corpus(data, tokenizer, tmp_path):
  split = load_parallel(str(data), 'en', 'de')['train']
  source = cache.DatasetPairs(
    split, content=cache.files_fingerprint([data / 'train.en', data / 'train.de'])
  )
  corpus = cache.load_or_encode(
    source, tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', block_lines=400, progress=False
  )
  _assert_same(corpus, encode_corpus(split, tokenizer, MAX_LEN))


def test_worker_pool_equals_encode_corpus(data, tokenizer, tmp_path, monkeypatch):
  monkeypatch.setattr(encoding, 'POOL_MIN_LINES', 0)  # where `encoded_blocks` reads it
  corpus = cache.load_or_encode(
    _source(data),
    tokenizer,
    'tok',
    MAX_LEN,
    tmp_path / 'cache',
    workers=2,
    block_lines=400,
    progress=False,
  )
  _assert_same(corpus, _expected(data, tokenizer))


def test_special_strings_in_a_training_pair_are_text(tokenizer, tmp_path):
  directory = tmp_path / 'specials'
  directory.mkdir()
  en = ['</s> A dog runs.', 'A <pad> dog runs.', 'A dog runs. <s>', 'A dog<unk>runs.']
  de = ['Ein Hund </s>', '<pad>', 'Ein <s> Hund', 'Ein Hund rennt.']
  (directory / 'train.en').write_text('\n'.join(en) + '\n', encoding='utf-8')
  (directory / 'train.de').write_text('\n'.join(de) + '\n', encoding='utf-8')
  corpus = cache.load_or_encode(
    _source(directory), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
  )
  assert len(corpus) == 4
  for ids, offsets, texts in (
    (corpus.src_ids, corpus.src_offsets, en),
    (corpus.tgt_ids, corpus.tgt_offsets, de),
  ):
    for row, text in enumerate(texts):
      encoded = np.asarray(ids[offsets[row] : offsets[row + 1]])
      # EOS only where the pipeline puts it, the text's own ids before it, no PAD or BOS.
      assert encoded[-1] == tokenizer.eos_id
      assert not {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id} & set(encoded[:-1].tolist())
      assert encoded[:-1].tolist() == tokenizer.encode([text])[0]


def test_a_cache_of_the_older_text_encoding_is_named_once_and_encoded_again(
  data, tokenizer, tmp_path, monkeypatch
):
  with monkeypatch.context() as patch:  # a cache written before special strings were text
    patch.setattr(cache, 'TEXT_ENCODING', 1)
    cache.load_or_encode(
      _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
    )
  [legacy] = list((tmp_path / 'cache').iterdir())
  said = []
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False, say=said.append
  )
  assert said[0] == (
    f"cache: {legacy} was encoded with special tokens' strings in the text "
    '(</s>, <pad>, <unk>, <s>) read as those tokens; they are text now, so the '
    'corpus is encoded again (the old cache is no longer used and can be '
    'deleted)'
  )
  assert said[1].startswith('cache: encoded') and len(said) == 2
  _assert_same(corpus, _expected(data, tokenizer))
  said.clear()
  cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False, say=said.append
  )
  assert len(said) == 1 and said[0].startswith('cache: hit')  # once only


def test_the_older_text_encoding_keeps_the_keys_it_had():
  fingerprint = {'kind': 'x', 'files': []}
  before = {
    'format': cache.FORMAT_VERSION,
    'source': fingerprint,
    'tokenizer': 'tok',
    'max_len': 20,
    'special_ids': [0, 1, 2],
  }
  assert (
    cache.cache_key(fingerprint, 'tok', 20, text_encoding=1)
    == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
  )
  assert cache.cache_key(fingerprint, 'tok', 20) != cache.cache_key(
    fingerprint, 'tok', 20, text_encoding=1
  )


def test_second_call_reads_the_cache(data, tokenizer, tmp_path, monkeypatch):
  cache.load_or_encode(_source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False)
  builds = _count_builds(monkeypatch)
  lines = []
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False, say=lines.append
  )
  assert not builds and lines[0].startswith('cache: hit')
  _assert_same(corpus, _expected(data, tokenizer))
  # Touching or moving the files keeps the key: the content is the fingerprint.
  moved = tmp_path / 'moved'
  data.rename(moved)
  cache.load_or_encode(
    _source(moved), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
  )
  assert not builds


def test_changed_data_file_is_encoded_again(data, tokenizer, tmp_path, monkeypatch):
  cache.load_or_encode(_source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False)
  builds = _count_builds(monkeypatch)
  path = data / 'train.de'
  text = path.read_text(encoding='utf-8')
  path.write_text(text.replace('Ein', 'Eine', 1), encoding='utf-8')  # one word, same line count
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
  )
  assert len(builds) == 1
  _assert_same(corpus, _expected(data, tokenizer))


def test_changed_tokenizer_or_max_len_is_encoded_again(
  data, tokenizer, other_tokenizer, tmp_path, monkeypatch
):
  cache.load_or_encode(
    _source(data), tokenizer, 'tok-a', MAX_LEN, tmp_path / 'cache', progress=False
  )
  builds = _count_builds(monkeypatch)
  corpus = cache.load_or_encode(
    _source(data), other_tokenizer, 'tok-b', MAX_LEN, tmp_path / 'cache', progress=False
  )
  assert len(builds) == 1
  _assert_same(corpus, _expected(data, other_tokenizer))
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok-a', 32, tmp_path / 'cache', progress=False
  )
  assert len(builds) == 2
  _assert_same(corpus, _expected(data, tokenizer, 32))


def test_cache_key_is_pure_and_covers_its_inputs(data):
  fingerprint = _source(data).fingerprint()
  key = cache.cache_key(fingerprint, 'tok', 64)
  assert key == cache.cache_key(json.loads(json.dumps(fingerprint)), 'tok', 64)
  assert (
    len(
      {
        key,
        cache.cache_key(fingerprint, 'tok2', 64),
        cache.cache_key(fingerprint, 'tok', 65),
        cache.cache_key(fingerprint, 'tok', 64, (1, 0, 2)),
      }
    )
    == 4
  )
  assert fingerprint['files'][0]['lines'] == LINES


@pytest.mark.parametrize(
  'damage', ['truncate', 'flip', 'no_manifest', 'bad_manifest', 'missing_file', 'partial_only']
)
def test_damaged_cache_is_rebuilt(data, tokenizer, tmp_path, monkeypatch, damage):
  root = tmp_path / 'cache'
  cache.load_or_encode(_source(data), tokenizer, 'tok', MAX_LEN, root, progress=False)
  key = cache.cache_key(_source(data).fingerprint(), 'tok', MAX_LEN)
  directory = cache.cache_path(root, key)
  ids = directory / cache.ARRAYS['tgt_ids'][0]
  if damage == 'truncate':
    ids.write_bytes(ids.read_bytes()[:-4])
  elif damage == 'flip':  # same size, one id changed: only the digest can tell
    raw = bytearray(ids.read_bytes())
    raw[40] ^= 1
    ids.write_bytes(bytes(raw))
  elif damage == 'no_manifest':
    (directory / cache.MANIFEST).unlink()
  elif damage == 'bad_manifest':
    (directory / cache.MANIFEST).write_text('{"format": 1, "key": ')
  elif damage == 'missing_file':
    ids.unlink()
  else:  # a crash mid-build: only a partial directory, the manifest never written
    dead = root / f'.{directory.name}.partial-{cache._HOST}-999999999-abcd'  # no such process
    directory.rename(dead)
    (dead / cache.MANIFEST).unlink()
  with pytest.raises(cache.CacheError):
    cache.load(root, key)
  builds = _count_builds(monkeypatch)
  lines = []
  corpus = cache.load_or_encode(
    _source(data), tokenizer, 'tok', MAX_LEN, root, progress=False, say=lines.append
  )
  assert len(builds) == 1, lines
  _assert_same(corpus, _expected(data, tokenizer))
  cache.load(root, key)  # valid again, digests and all
  assert [path.name for path in root.iterdir()] == [directory.name]  # the partial one removed


def test_writer_encodes_once_and_readers_wait(data, tokenizer, tmp_path, monkeypatch):
  """Two 'processes' (threads) with a barrier: process 0 writes, process 1 waits, then reads."""
  builds = _count_builds(monkeypatch)
  barrier = threading.Barrier(2, timeout=120)
  results, errors = {}, []

  def process(index):
    try:
      results[index] = cache.load_or_encode(
        _source(data),
        tokenizer,
        'tok',
        MAX_LEN,
        tmp_path / 'cache',
        is_writer=index == 0,
        wait=barrier.wait,
        progress=False,
      )
    except Exception as error:  # reported below
      errors.append(error)

  threads = [threading.Thread(target=process, args=(index,)) for index in (1, 0)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not errors and len(builds) == 1
  expected = _expected(data, tokenizer)
  _assert_same(results[0], expected)
  _assert_same(results[1], expected)


def test_reader_without_a_cache_says_so(data, tokenizer, tmp_path):
  with pytest.raises(cache.CacheError, match='filesystem every process shares'):
    cache.load_or_encode(
      _source(data),
      tokenizer,
      'tok',
      MAX_LEN,
      tmp_path / 'cache',
      is_writer=False,
      wait=lambda: None,
      progress=False,
    )


def test_bad_text_is_a_data_error(data, tokenizer, tmp_path):
  (data / 'train.de').write_bytes((data / 'train.de').read_bytes() + b'\nextra line')
  with pytest.raises(DataError, match='lines but'):
    cache.load_or_encode(
      _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
    )
  (data / 'train.de').write_bytes(b'ok\n\xff\xfe broken\n' + b'x\n' * (LINES - 2))
  with pytest.raises(DataError, match=r'train.de, line 2: invalid UTF-8'):
    cache.load_or_encode(
      _source(data), tokenizer, 'tok', MAX_LEN, tmp_path / 'cache', progress=False
    )
  assert not list((tmp_path / 'cache').iterdir())  # nothing half-written left behind
