"""A training run's input side: the text, its encoded training split, and batches made ahead.

    data = load_training_data(data_config)            # the training split stays on disk
    texts = data.tokenizer_texts(data_config.tokenizer_sample)
    corpus = data.encoded_train(tokenizer, digest, max_len, cache_dir='runs/x/encoded')
    batcher = make_batcher(corpus, train_config, row_multiple=8)
    with Prefetcher(lambda step: batcher.local_batch_at(step, 0, 1), start, stop, depth=2) as it:
      for step, batch in it: ...

The training split of a directory of `<stem>.<lang>` text pairs (the WMT layout) is never
loaded as a table: the tokenizer is trained on a bounded random sample of its lines
(`TextPairFiles.sample_pairs`), and the split is encoded once, block by block, into the
memory-mapped cache of `cache.load_or_encode`; a resumed run reads the cache. Tables and Hub
datasets are loaded by `datasets` (their own Arrow cache on disk) and encoded into the same
cache, keyed by the dataset's fingerprint; an in-memory dataset (the toy task, a `dataset`
passed to `train`) has no stable fingerprint and is encoded in memory, as before.

Batches are `batcher.Batcher`'s, a row plan plus the array assembler: each
process building only its own rows (`local_batch_at`), and, with `Prefetcher`, in a
background thread while the devices run the previous step. NumPy's gathers and JAX's
transfers release the GIL, so the thread overlaps the step's dispatch and run.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Generic, TypeVar

import datasets

from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import EncodedCorpus, encode_corpus
from flax_transformer.data.cache import load_or_encode
from flax_transformer.data.corpus import describe, load_parallel, text_pair_files
from flax_transformer.data.pair_sources import DatasetPairs, TextPairFiles
from flax_transformer.data.plans import PackingPlan, row_plan
from flax_transformer.data.resegmenting import Resegmenting
from flax_transformer.data.toy_task import number_translation
from flax_transformer.errors import DataError
from flax_transformer.tokenizer import TextTokenizer

# The tokenizer's sample is drawn with this seed, not the run's: the vocabulary is a function
# of the data and the data settings alone.
SAMPLE_SEED = 0


@dataclasses.dataclass
class TrainingData:
  """The run's parallel text.

  train: the training split, as files read as a stream (`TextPairFiles`) or a table.
  evaluation: 'validation' and 'test' when present, as tables (they are small).
  """

  train: TextPairFiles | datasets.Dataset
  evaluation: datasets.DatasetDict

  def describe(self) -> str:
    """One line for logs, as `corpus.describe`; a streamed split is named by its files."""
    if isinstance(self.train, datasets.Dataset):
      return describe(datasets.DatasetDict({'train': self.train, **self.evaluation}))
    source, target = Path(self.train.source), Path(self.train.target)
    line = f'train: {source.name}/{target.name} in {source.parent}, read as a stream'
    return ' | '.join([line, describe(self.evaluation)] if len(self.evaluation) else [line])

  def _pairs(self) -> TextPairFiles | DatasetPairs:
    if isinstance(self.train, TextPairFiles):
      return self.train
    return DatasetPairs(self.train, content=self.train._fingerprint)

  def tokenizer_texts(self, sample: int) -> list[str]:
    """What the tokenizer is trained on: the sources, then the targets, of `sample` training
    pairs drawn at random (every pair when 0 or when the split has no more)."""
    sources, targets = self.tokenizer_pairs(sample)
    return sources + targets

  def tokenizer_pairs(self, sample: int) -> tuple[list[str], list[str]]:
    """`tokenizer_texts`' sources and targets apart (each side is preprocessed in its own
    language)."""
    sources, targets = self._pairs().sample_pairs(sample, SAMPLE_SEED)
    if not sources:
      self._check_not_empty(0)
    return sources, targets

  def _check_not_empty(self, pairs: int) -> None:
    """Raises DataError, as `corpus.load_parallel` does, for a split with no pair left."""
    if pairs or not isinstance(self.train, TextPairFiles):
      return
    source, target = Path(self.train.source), Path(self.train.target)
    raise DataError(
      f'{source.parent}/{source.name}/{target.name}: no sentence pairs '
      f'({self.train.num_lines:,} read, all with an empty side)'
    )

  def encoded_train(
    self,
    tokenizer: TextTokenizer,
    tokenizer_digest: str,
    max_len: int,
    cache_dir: str | Path,
    *,
    is_writer: bool = True,
    wait: Callable[[], None] | None = None,
    progress: bool = True,
    say: Callable[[str], None] | None = None,
  ) -> EncodedCorpus:
    """The training split encoded: from the cache in `cache_dir` (built first when missing,
    stale or damaged), or in memory for a dataset without files on disk."""
    if isinstance(self.train, datasets.Dataset) and not self.train.cache_files:
      if wait is not None:
        wait()  # every process encodes its own copy; the barrier keeps the job in step
      return encode_corpus(self.train, tokenizer, max_len)
    corpus = load_or_encode(
      self._pairs(),
      tokenizer,
      tokenizer_digest,
      max_len,
      cache_dir,
      is_writer=is_writer,
      wait=wait,
      progress=progress,
      say=say,
    )
    cleaned = len(corpus) + corpus.num_dropped
    self._check_not_empty(cleaned)
    if isinstance(self.train, TextPairFiles) and say is not None:
      source, target = Path(self.train.source).name, Path(self.train.target).name
      say(
        f'train: {cleaned:,} pairs ({source}/{target}, '
        f'{self.train.num_lines - cleaned:,} dropped with an empty side)'
      )
    return corpus


def load_training_data(
  data_config: DataConfig, dataset: datasets.DatasetDict | None = None
) -> TrainingData:
  """The text of `data_config.source` (or the `dataset` given): a directory of text pairs
  keeps its training split on disk; anything else is loaded by `corpus.load_parallel`."""
  if dataset is None and data_config.source == 'toy':
    dataset = number_translation()
  if dataset is None:
    files = text_pair_files(
      data_config.source,
      data_config.src_lang,
      data_config.tgt_lang,
      valid_split=data_config.valid_split,
      test_split=data_config.test_split,
    )
    if files is not None and 'train' in files:
      stems = {
        name: src.name[: -len(f'.{data_config.src_lang}')]
        for name, (src, _) in files.items()
        if name != 'train'
      }
      evaluation = (
        load_parallel(data_config.source, data_config.src_lang, data_config.tgt_lang, splits=stems)
        if stems
        else datasets.DatasetDict()
      )
      return TrainingData(train=TextPairFiles(*files['train']), evaluation=evaluation)
    dataset = load_parallel(
      data_config.source,
      data_config.src_lang,
      data_config.tgt_lang,
      valid_split=data_config.valid_split,
      test_split=data_config.test_split,
    )
  if 'train' not in dataset:
    raise DataError(f'the data has no train split (splits: {", ".join(dataset)})')
  return TrainingData(
    train=dataset['train'],
    evaluation=datasets.DatasetDict(
      {name: split for name, split in dataset.items() if name != 'train'}
    ),
  )


def make_batcher(
  corpus: EncodedCorpus,
  config: TrainConfig,
  row_multiple: int,
  packing_plan: PackingPlan = 'best_fit',
  resegmenting: Resegmenting | None = None,
) -> Batcher:
  """The training batcher of `config`: bucketed rows, or packed ones (`config.packing`) whose
  rows are planned by `packing_plan` (runs begun before best fit existed resume with
  'first_fit', so their batches stay the same); `resegmenting`: BPE-dropout's resampling
  (`resegmenting.resegmenting_of`)."""
  plan = row_plan(config.packing, packing_plan)
  return Batcher(
    corpus,
    config.max_tokens,
    config.seed,
    plan,
    row_multiple=row_multiple,
    resegmenting=resegmenting,
  )


T = TypeVar('T')


class Prefetcher(Generic[T]):
  """(i, make(i)) for i in range(start, stop), made up to `depth` ahead by a background thread.

  `make` must be a pure function of i, so prefetching changes no result; an error raised by
  it is raised again, in order, by the iteration. depth 0 makes each item when it is asked
  for, in the calling thread. Use as a context manager (or call `close`): leaving early
  stops the thread.
  """

  def __init__(self, make: Callable[[int], T], start: int, stop: int, depth: int):
    if depth < 0:
      raise ValueError(f'depth must be >= 0, got {depth}')
    self._make, self._start, self._stop, self._depth = make, start, stop, depth
    self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
    self._closed = threading.Event()
    self._thread = None
    if depth:
      self._thread = threading.Thread(target=self._produce, name='prefetch', daemon=True)
      self._thread.start()

  def _produce(self) -> None:
    for index in range(self._start, self._stop):
      try:
        item = (index, self._make(index), None)
      except BaseException as error:  # handed to the consumer, which raises it
        item = (index, None, error)
      while not self._closed.is_set():
        try:
          self._queue.put(item, timeout=0.1)
          break
        except queue.Full:
          continue
      if self._closed.is_set() or item[2] is not None:
        return

  def __iter__(self) -> Iterator[tuple[int, T]]:
    if self._thread is None:
      for index in range(self._start, self._stop):
        yield index, self._make(index)
      return
    for _ in range(self._start, self._stop):
      index, item, error = self._queue.get()
      if error is not None:
        raise error
      yield index, item

  def close(self) -> None:
    self._closed.set()
    if self._thread is not None:
      self._thread.join()

  def __enter__(self) -> Prefetcher[T]:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
