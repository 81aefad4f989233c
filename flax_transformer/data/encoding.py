"""Encoding a pair source's text into flat id arrays, block by block, in order.

    for lines, block in encoded_blocks(source, tokenizer, max_len, workers=None,
                                       block_lines=BLOCK_LINES, total_lines=source.num_lines):
      src_ids, src_lengths, tgt_ids, tgt_lengths, kept_rows, clean_rows = block
      ...   # `cache` appends each block to its array files (flat arrays, EOS included)

It is the one encoder of pairs: the corpus cache streams a split's files through it, and
`batching.encode_corpus` a `datasets.Dataset` (a validation split), in this process.

Encoding runs in one of two ways, chosen by `workers`:

  * in this process, one block of lines at a time: `Tokenizer.encode_flat` encodes by
    words (`data.word_memo`: Arrow splits and groups the words, each distinct word goes
    through `tokenizers` once, NumPy gathers the ids). The default for a `Tokenizer`
    (`workers=None`);
  * in a pool of spawned processes (safe beside JAX's threads; a script calling this must
    guard its main code with `if __name__ == '__main__'`, as for any spawned pool): the
    main process reads blocks of lines, each worker decodes, cleans and tokenizes a block
    single-threaded and returns flat arrays, the main process appends them in order. The
    default for any other tokenizer (a Marian tokenizer's sentencepiece call is a Python
    loop per sentence, so a pool is its only parallelism); `workers=N` forces it. A
    worker's tokenizer is unpickled through its constructor, so it keeps its settings.

For a `Tokenizer` on a host of a few cores the one process is the faster way: a worker
pays seconds to import the package, and its memo starts empty (docs/input_pipeline.md has
the numbers). Corpora under `POOL_MIN_LINES` lines
never start a pool. Either way memory is bounded by the blocks in flight and the memo's
cap, never by the corpus: no Python list outlives its block.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import os
import pickle
import signal
from collections import deque
from collections.abc import Iterator

import numpy as np

from flax_transformer.data.corpus import invalid_utf8
from flax_transformer.data.pair_sources import PairSource
from flax_transformer.tokenizer import TextTokenizer, Tokenizer
from flax_transformer.tokenizer.word_memo import flat_rows

# Lines a worker encodes at a time: large enough to amortise the hand-over, small enough
# that the blocks in flight (2 per worker) stay a few tens of MB.
BLOCK_LINES = 20_000
# Smaller corpora are encoded in the calling process: starting workers would cost more.
POOL_MIN_LINES = 100_000


def encoded_blocks(
  source: PairSource,
  tokenizer: TextTokenizer,
  max_len: int,
  workers: int | None,
  block_lines: int,
  total_lines: int | None,
) -> Iterator[tuple[int, tuple]]:
  """(lines in the block, `_encode_block`'s result) per block, in order."""
  if workers is None:  # a `Tokenizer` parallelises its batch call itself (module docstring)
    workers = (
      1
      if isinstance(tokenizer, Tokenizer)
      else (len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count())
    )
  blocks = source.blocks(block_lines)
  first = next(blocks, None)
  if first is None:
    return
  second = next(blocks, None)
  blocks = itertools.chain([first] + ([second] if second is not None else []), blocks)
  if workers > 1 and second is not None and (total_lines is None or total_lines >= POOL_MIN_LINES):
    try:
      payload = pickle.dumps(tokenizer)
    except Exception:  # a tokenizer that cannot travel is encoded here instead
      payload = None
    if payload is not None:
      yield from _pool_blocks(blocks, payload, max_len, workers)
      return
  for block in blocks:
    yield _block_rows(block), _encode_block(tokenizer, max_len, block)


def _pool_blocks(
  blocks: Iterator[tuple], tokenizer_pickle: bytes, max_len: int, workers: int
) -> Iterator[tuple[int, tuple]]:
  context = multiprocessing.get_context('spawn')
  with concurrent.futures.ProcessPoolExecutor(
    workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer_pickle, max_len)
  ) as pool:
    in_flight: deque = deque()
    for block in blocks:
      in_flight.append((_block_rows(block), pool.submit(_encode_in_worker, block)))
      if len(in_flight) >= 2 * workers:
        rows, future = in_flight.popleft()
        yield rows, future.result()
    while in_flight:
      rows, future = in_flight.popleft()
      yield rows, future.result()


def _block_rows(block: tuple) -> int:
  kind, sources = block[0], block[1]
  return sources.count(b'\n') + (not sources.endswith(b'\n')) if kind == 'text' else len(sources)


_WORKER: dict = {}


def _start_worker(tokenizer_pickle: bytes, max_len: int) -> None:
  # Ctrl-C reaches the whole process group: the parent decides when to stop, and ends the pool.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  # One thread per worker: the workers are the parallelism (no oversubscription).
  os.environ['TOKENIZERS_PARALLELISM'] = 'false'
  _WORKER['tokenizer'] = pickle.loads(tokenizer_pickle)
  _WORKER['max_len'] = max_len


def _encode_in_worker(block: tuple) -> tuple:
  return _encode_block(_WORKER['tokenizer'], _WORKER['max_len'], block)


def _encode_block(tokenizer: TextTokenizer, max_len: int, block: tuple) -> tuple:
  """One block -> (src ids with EOS, src lengths, tgt ids with EOS, tgt lengths, kept rows
  (0-based among the block's rows after cleaning), rows after cleaning); arrays, no lists."""
  kind, sources, targets, first, names = block
  if kind == 'text':
    sources = _decode_lines(sources, names[0], first)
    targets = _decode_lines(targets, names[1], first)
    pairs = [(s, t) for s, t in zip(sources, targets) if s and t]
    sources, targets = [s for s, _ in pairs], [t for _, t in pairs]
  src_ids, src_lengths = _encode_flat(tokenizer, sources, target=False)
  tgt_ids, tgt_lengths = _encode_flat(tokenizer, targets, target=True)
  keep = (src_lengths < max_len) & (tgt_lengths < max_len)
  eos = tokenizer.eos_id
  src_ids, src_lengths = _with_eos(src_ids, src_lengths, keep, eos)
  tgt_ids, tgt_lengths = _with_eos(tgt_ids, tgt_lengths, keep, eos)
  return src_ids, src_lengths, tgt_ids, tgt_lengths, np.flatnonzero(keep), len(sources)


def _decode_lines(data: bytes, where: str, first: int) -> list[str]:
  """The block's lines, stripped (as `corpus.load_parallel` cleans them)."""
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    raise invalid_utf8(where, data, error, first) from None
  lines = text.split('\n')
  if lines[-1] == '':
    lines.pop()
  return [line.strip() for line in lines]


def _encode_flat(
  tokenizer: TextTokenizer, texts: list[str], target: bool
) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32, lengths int64) of `texts` on the source or target side."""
  if isinstance(tokenizer, Tokenizer):  # one vocabulary for both sides, encoded by words
    return tokenizer.encode_flat(texts)
  return flat_rows(tokenizer.encode_target(texts) if target else tokenizer.encode(texts))


def _with_eos(
  ids: np.ndarray, lengths: np.ndarray, keep: np.ndarray, eos: int
) -> tuple[np.ndarray, np.ndarray]:
  """The kept rows' ids, each followed by EOS, and their lengths with EOS."""
  ids = ids[np.repeat(keep, lengths)]
  lengths = lengths[keep]
  out = np.empty(len(ids) + len(lengths), np.int32)
  ends = np.cumsum(lengths + 1) - 1
  is_eos = np.zeros(len(out), bool)
  is_eos[ends] = True
  out[is_eos] = eos
  out[~is_eos] = ids
  return out, lengths + 1
