"""The training run's input side (data/pipeline.py): the training split kept on disk, the
tokenizer's bounded sample, the batcher of the settings, the packing plan a run records, and
batches made ahead in a background thread."""

import json
import threading

import numpy as np
import pytest

from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.data.batching import EncodedCorpus
from flax_transformer.data.cache import TextPairFiles
from flax_transformer.data.corpus import DataError, load_parallel
from flax_transformer.data.pipeline import Prefetcher, load_training_data, make_batcher
from flax_transformer.data.plans import BestFit, Bucketed, FirstFit
from flax_transformer.run.directory import CONFIG_FILE, PACKING_PLAN_KEY, RunDirectory
from support.loop_batches import LoopBatcher

SOURCES = [f'  sentence {i} ' if i % 7 else f'line {i}' for i in range(60)]
TARGETS = [f'Satz {i}' if i % 11 else '   ' for i in range(60)]  # every 11th pair: empty side


@pytest.fixture
def text_dir(tmp_path):
  directory = tmp_path / 'data'
  directory.mkdir()
  for split, count in (('train', 60), ('val', 5), ('test', 4)):
    (directory / f'{split}.en').write_text(''.join(f'{s}\n' for s in SOURCES[:count]))
    (directory / f'{split}.de').write_text(''.join(f'{t}\n' for t in TARGETS[:count]))
  return directory


def test_text_directory_keeps_its_training_split_on_disk(text_dir):
  data = load_training_data(DataConfig(source=str(text_dir)))
  assert isinstance(data.train, TextPairFiles)
  assert data.train.source == text_dir / 'train.en' and data.train.target == text_dir / 'train.de'
  assert set(data.evaluation) == {'validation', 'test'}
  tables = load_parallel(str(text_dir), 'en', 'de')
  for split in ('validation', 'test'):
    assert data.evaluation[split]['source'] == tables[split]['source']
  assert 'read as a stream' in data.describe() and 'validation: 4 pairs' in data.describe()


def test_tokenizer_sample_of_everything_is_the_cleaned_split(text_dir):
  """Sample 0 (or one larger than the split) is every pair, cleaned as load_parallel cleans."""
  data = load_training_data(DataConfig(source=str(text_dir)))
  train = load_parallel(str(text_dir), 'en', 'de')['train']
  expected = list(train['source']) + list(train['target'])
  assert data.tokenizer_texts(0) == expected
  assert data.tokenizer_texts(10_000) == expected
  assert len(expected) == 2 * (60 - 6)  # six pairs (0, 11, ..., 55) have an empty target


def test_tokenizer_sample_is_bounded_seeded_and_in_file_order(text_dir):
  data = load_training_data(DataConfig(source=str(text_dir)))
  sample = data.tokenizer_texts(20)
  assert sample == data.tokenizer_texts(20)  # the same draw every time
  sources, targets = sample[: len(sample) // 2], sample[len(sample) // 2 :]
  # 20 lines drawn, those with an empty side dropped; each pair kept whole and in order.
  assert 20 - 6 <= len(sources) <= 20
  numbers = [int(text.split()[-1]) for text in sources]
  assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
  assert targets == [f'Satz {n}' for n in numbers]
  assert numbers != list(range(numbers[0], numbers[0] + len(numbers)))  # drawn, not a prefix


def test_tokenizer_sample_of_a_table_split():
  data = load_training_data(DataConfig(source='toy'))
  assert not isinstance(data.train, TextPairFiles)
  sample = data.tokenizer_texts(100)
  assert len(sample) == 200
  pairs = set(zip(data.train['source'], data.train['target']))
  assert all(pair in pairs for pair in zip(sample[:100], sample[100:]))


def test_invalid_utf8_in_the_sample_names_file_and_line(tmp_path):
  (tmp_path / 'train.en').write_bytes(b'good\nbad \xff\n')
  (tmp_path / 'train.de').write_bytes(b'gut\nschlecht\n')
  data = load_training_data(DataConfig(source=str(tmp_path)))
  with pytest.raises(DataError, match=r'train\.en, line 2: invalid UTF-8'):
    data.tokenizer_texts(0)


def _corpus(lengths) -> EncodedCorpus:
  src = [np.arange(1, n + 1, dtype=np.int32) for n in lengths]
  ids = np.concatenate(src)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  return EncodedCorpus(
    src_ids=ids,
    src_offsets=offsets,
    tgt_ids=ids.copy(),
    tgt_offsets=offsets.copy(),
    example_ids=np.arange(len(lengths)),
    max_len=32,
    num_dropped=0,
  )


@pytest.mark.parametrize('packing', [0, 16])
def test_make_batcher_follows_the_settings(packing):
  corpus = _corpus(np.random.default_rng(0).integers(2, 14, size=200))
  config = TrainConfig(max_tokens=128, packing=packing, seed=3)
  batcher = make_batcher(corpus, config, row_multiple=2)
  assert batcher.plan == (BestFit(packing) if packing else Bucketed())
  # An old run's packed batches, planned first fit, are the loop oracle's from that plan.
  old = make_batcher(corpus, config, row_multiple=2, packing_plan='first_fit')
  assert old.plan == (FirstFit(packing) if packing else Bucketed())
  reference = LoopBatcher(corpus, 128, 3, old.plan, row_multiple=2)
  for step in (0, 5, 40):
    expected = reference.batch_at(step)
    np.testing.assert_array_equal(old.batch_at(step).tgt_out, expected.tgt_out)
    assert batcher.batch_at(step).tgt_out.shape[1] in batcher.length_buckets


def _write_config(directory, content):
  directory.mkdir(exist_ok=True)
  (directory / CONFIG_FILE).write_text(json.dumps(content))


def test_packing_plan_of_new_old_and_recorded_runs(tmp_path):
  directory = RunDirectory(tmp_path / 'run')
  assert directory.packing_plan(has_checkpoints=False) == 'best_fit'  # a new run
  _write_config(directory.path, {'model': {}, 'train': {}, 'data': {}})
  assert directory.packing_plan(has_checkpoints=True) == 'first_fit'  # begun before the record
  assert directory.packing_plan(has_checkpoints=False) == 'best_fit'  # nothing trained yet
  _write_config(directory.path, {'model': {}, PACKING_PLAN_KEY: 'first_fit'})
  assert directory.packing_plan(has_checkpoints=True) == 'first_fit'  # as recorded
  _write_config(directory.path, {'model': {}, PACKING_PLAN_KEY: 'best_fit'})
  assert directory.packing_plan(has_checkpoints=True) == 'best_fit'


@pytest.mark.parametrize('depth', [0, 1, 3])
def test_prefetcher_yields_what_make_returns_in_order(depth):
  made = []

  def make(index):
    made.append(index)
    return index * index

  with Prefetcher(make, 5, 12, depth) as items:
    assert list(items) == [(i, i * i) for i in range(5, 12)]
  assert made == list(range(5, 12))  # each item made once


def test_prefetcher_raises_the_error_at_its_item():
  def make(index):
    if index == 3:
      raise DataError('step 3 is bad')
    return index

  seen = []
  with pytest.raises(DataError, match='step 3 is bad'):
    with Prefetcher(make, 0, 10, 2) as items:
      for _, item in items:
        seen.append(item)
  assert seen == [0, 1, 2]


def test_prefetcher_runs_ahead_and_stops_when_left():
  started = threading.Event()
  made = []

  def make(index):
    made.append(index)
    started.set()
    return index

  items = Prefetcher(make, 0, 1_000_000, 2)
  started.wait(5)
  iterator = iter(items)
  assert next(iterator) == (0, 0)
  items.close()
  assert not items._thread.is_alive()
  # Bounded: at most the queue's depth plus the one being made, not the whole range.
  assert len(made) <= 4
