"""The tokenized corpus, cached on disk: encoded once, in parallel, memory-mapped on every later start.

    source = TextPairFiles('data/train.en', 'data/train.de')   # or DatasetPairs(ds['train'], fp)
    corpus = load_or_encode(source, tokenizer, file_digest('run/tokenizer.json'), max_len=256,
                            cache_dir='data/.encoded')
    # an EncodedCorpus whose five arrays are read-only np.memmap views of files on disk,
    # equal, id for id, to encode_corpus(load_parallel('data', 'en', 'de')['train'], tokenizer, 256)

Layout: `cache_dir/<key[:32]>/` holds five raw little-endian arrays (`src_ids.i32`,
`src_offsets.i64`, `tgt_ids.i32`, `tgt_offsets.i64`, `example_ids.i64`, exactly the
fields of `EncodedCorpus`) and `manifest.json`: the full key and what made it, the counts,
and each array's dtype, length, byte size and SHA-256. Raw arrays rather than `.npy` or
Arrow because they are written as a stream, block after block, before their length is
known (a `.npy` header needs the shape up front), and `np.memmap` reads them back with no
copy; rather than the `datasets` Arrow cache because that one would hold the ids as lists
per row, and its fingerprint of an in-memory table is random, so it would not survive a
restart.

The key (`cache_key`) is a SHA-256 over the source's content fingerprint, the tokenizer's
digest (the SHA-256 of its file(s), as the run directory records it), `max_len`, the
special ids, `FORMAT_VERSION` and `TEXT_ENCODING`: a changed data file or tokenizer, or
another max_len, is another key and so another directory, encoded afresh; a resume finds
its own (a cache of an older `TEXT_ENCODING` is named in the log once, and encoded anew). The
sources and their fingerprints (a text file's is its size and the SHA-256 of its bytes, not
its path and mtime) are `pair_sources`'; `TextPairFiles`, `DatasetPairs`, `PairSource`,
`files_fingerprint` and `sample_rows` are still importable from here.

A build writes into `.<name>.partial-<pid>-<random>/`, the manifest last (through a
rename), then renames the directory into place: a crash leaves a partial directory,
never a complete-looking one. Loading trusts nothing it cannot check: a missing or
unparsable manifest, another key or format, a missing file, a wrong size, inconsistent
offsets or (with `verify=True`, the default) a digest mismatch make the cache invalid,
and the writer sets it aside and encodes again.

Encoding (`encoding.encoded_blocks`: in this process, or in a pool of spawned workers,
chosen by `workers`; `BLOCK_LINES` and `POOL_MIN_LINES` are its own) hands this module one block
of flat arrays at a time, which it appends to the array files: memory is bounded by the
blocks in flight, never by the corpus.

Multi-host: every process calls `load_or_encode` with `is_writer=(process_index == 0)` and
`wait`, a barrier all processes reach (e.g. `jax.experimental.multihost_utils.
sync_global_devices`). The writer makes sure the cache is valid (building it if need be)
and then waits; the others wait first and then read, so the corpus is encoded once per
job. `cache_dir` must then be on a filesystem every process sees.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from flax_transformer import signals
from flax_transformer.config import check_bounds
from flax_transformer.data.batching import SEQUENCE_LENGTH, EncodedCorpus
from flax_transformer.data.encoding import BLOCK_LINES, encoded_blocks
from flax_transformer.data.pair_sources import (
  DatasetPairs,
  PairSource,
  TextPairFiles,
  files_fingerprint,
  sample_rows,
)
from flax_transformer.errors import CacheError, DataError
from flax_transformer.files import file_digest, write_atomically
from flax_transformer.tokenizer import TextTokenizer

# The pair sources and BLOCK_LINES moved out (`pair_sources`, `encoding`); they are still here.
__all__ = [
  'ARRAYS',
  'BLOCK_LINES',
  'FORMAT_VERSION',
  'MANIFEST',
  'TEXT_ENCODING',
  'DatasetPairs',
  'PairSource',
  'TextPairFiles',
  'cache_key',
  'cache_path',
  'files_fingerprint',
  'load',
  'load_or_encode',
  'sample_rows',
]

FORMAT_VERSION = 1
# How text becomes ids beyond what the tokenizer's files say. 2: special tokens' strings in
# the text ('</s>', '<pad>', ...) are text (`tokenizer` module docstring); 1 (before): they
# were read as those tokens. Part of the key, since a line holding one gets other ids.
TEXT_ENCODING = 2
MANIFEST = 'manifest.json'
# EncodedCorpus field -> (file name, dtype). Little-endian on every platform we run on.
ARRAYS = {
  'src_ids': ('src_ids.i32', '<i4'),
  'src_offsets': ('src_offsets.i64', '<i8'),
  'tgt_ids': ('tgt_ids.i32', '<i4'),
  'tgt_offsets': ('tgt_offsets.i64', '<i8'),
  'example_ids': ('example_ids.i64', '<i8'),
}
# Names a partial build's directory, so that only this host's dead builders' are removed.
_HOST = socket.gethostname().replace('-', '_').replace('/', '_') or 'host'


# ------------------------------------------------------------------------------------------------
# The key.


def cache_key(
  fingerprint: dict,
  tokenizer_digest: str,
  max_len: int,
  special_ids: tuple[int, int, int] = (0, 1, 2),
  text_encoding: int = TEXT_ENCODING,
) -> str:
  """SHA-256 hex of everything the encoded arrays depend on: the source's content
  fingerprint, the tokenizer's digest, `max_len`, the (pad, bos, eos) ids, the format and
  `TEXT_ENCODING` (1 gives the keys of caches made before it existed)."""
  if not tokenizer_digest:
    raise CacheError('cache_key needs the tokenizer digest (the SHA-256 of its files)')
  inputs = {
    'format': FORMAT_VERSION,
    'source': fingerprint,
    'tokenizer': tokenizer_digest,
    'max_len': int(max_len),
    'special_ids': [int(i) for i in special_ids],
  }
  if text_encoding != 1:
    inputs['text_encoding'] = int(text_encoding)
  return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def cache_path(cache_dir: str | Path, key: str) -> Path:
  """The directory of the cache with `key`."""
  return Path(cache_dir) / key[:32]


# ------------------------------------------------------------------------------------------------
# Loading and checking.


def load(cache_dir: str | Path, key: str, verify: bool = True) -> EncodedCorpus:
  """The cached corpus with `key`, memory-mapped; raises CacheError (saying what is wrong)
  for a missing, partial or damaged one."""
  directory = cache_path(cache_dir, key)
  manifest_file = directory / MANIFEST
  try:
    manifest = json.loads(manifest_file.read_text())
  except FileNotFoundError:
    raise CacheError(f'{directory}: no {MANIFEST} (absent or never finished)') from None
  except (OSError, ValueError) as error:
    raise CacheError(f'{manifest_file}: unreadable ({error})') from None
  if (
    not isinstance(manifest, dict)
    or manifest.get('format') != FORMAT_VERSION
    or manifest.get('key') != key
  ):
    raise CacheError(f'{manifest_file}: written for another format or key')
  arrays = {}
  try:
    for field, (name, dtype) in ARRAYS.items():
      entry = manifest['arrays'][field]
      path = directory / name
      count, expected = int(entry['count']), int(entry['count']) * np.dtype(dtype).itemsize
      if entry['dtype'] != dtype or int(entry['bytes']) != expected:
        raise CacheError(f'{manifest_file}: {field} recorded as {entry}, not {dtype}')
      try:
        size = path.stat().st_size
      except FileNotFoundError:
        raise CacheError(f'{path}: missing') from None
      if size != expected:
        raise CacheError(f'{path}: {size:,} bytes, the manifest says {expected:,}')
      if verify and file_digest(path) != entry['sha256']:
        raise CacheError(f"{path}: its SHA-256 differs from the manifest's (damaged)")
      arrays[field] = (
        np.memmap(path, dtype=dtype, mode='r', shape=(count,)) if count else np.zeros(0, dtype)
      )
    num_pairs = int(manifest['num_pairs'])
    corpus = EncodedCorpus(
      max_len=int(manifest['max_len']),
      num_dropped=int(manifest['num_dropped']),
      pad_id=int(manifest['pad_id']),
      bos_id=int(manifest['bos_id']),
      **arrays,
    )
  except (KeyError, TypeError, ValueError) as error:
    raise CacheError(f'{manifest_file}: incomplete ({type(error).__name__}: {error})') from None
  for side in ('src', 'tgt'):
    offsets, ids = getattr(corpus, f'{side}_offsets'), getattr(corpus, f'{side}_ids')
    if len(offsets) != num_pairs + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
      raise CacheError(f'{directory}: {side}_offsets do not span {side}_ids')
  if len(corpus.example_ids) != num_pairs:
    raise CacheError(
      f'{directory}: {len(corpus.example_ids):,} example ids for {num_pairs:,} pairs'
    )
  return corpus


# ------------------------------------------------------------------------------------------------
# The entry point.


def load_or_encode(
  source: PairSource,
  tokenizer: TextTokenizer,
  tokenizer_digest: str,
  max_len: int,
  cache_dir: str | Path,
  *,
  is_writer: bool = True,
  wait: Callable[[], None] | None = None,
  workers: int | None = None,
  block_lines: int = BLOCK_LINES,
  verify: bool = True,
  progress: bool = True,
  say: Callable[[str], None] | None = None,
) -> EncodedCorpus:
  """The encoded corpus of `source`: read from `cache_dir` when a valid cache of the same key
  is there, else encoded (by the writer) and cached first.

  Args:
    source: `TextPairFiles` or `DatasetPairs`.
    tokenizer: encodes the text (`encode`, `encode_target`, the special ids); sent to the
      worker processes by pickle.
    tokenizer_digest: the SHA-256 of the tokenizer's file(s) (`files.file_digest`
      of tokenizer.json, or `files.files_digest`): part of the key.
    max_len: as `encode_corpus`: pairs with a side of max_len tokens or more are dropped.
    cache_dir: where the caches live, one subdirectory per key (created).
    is_writer: whether this process may encode and write (process 0 of a job).
    wait: a barrier every process of the job reaches; the writer calls it after the cache
      is in place, the others before reading it. None for a single process.
    workers: 1 encodes in this process, through the tokenizer's batch call (for a
      `Tokenizer`, Rust threads on every core); N > 1 in a pool of N processes. None: 1 for
      a `Tokenizer`, else the CPUs this process may use. A corpus of one block or under
      `POOL_MIN_LINES` lines is always encoded in this process.
    block_lines: lines per block handed to a worker.
    verify: check each array's SHA-256 on loading (reads every byte once; seconds at WMT14's
      size); False checks sizes and offsets only.
    progress: show a bar (pairs, rate, ETA) while encoding.
    say: called with one line per stage ('cache: hit ...', 'cache: encoded ...').
  Raises:
    CacheError: a non-writer found no valid cache after the barrier; or writing failed.
    DataError: the text is unreadable (invalid UTF-8, unequal line counts).
  """
  check_bounds(max_len, SEQUENCE_LENGTH, 'max_len', DataError, why=' (a token and EOS)')
  say = say or (lambda line: None)
  special = (tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id)
  started = time.perf_counter()
  fingerprint = source.fingerprint()
  key = cache_key(fingerprint, tokenizer_digest, max_len, special, TEXT_ENCODING)
  directory = cache_path(cache_dir, key)
  if not is_writer:
    if wait is not None:
      wait()
    try:
      corpus = load(cache_dir, key, verify)
    except CacheError as error:
      raise CacheError(
        f'process 0 left no valid encoded corpus at {directory} ({error}); '
        'cache_dir must be on a filesystem every process shares'
      ) from None
    say(
      f'cache: read {len(corpus):,} pairs from {directory} ({time.perf_counter() - started:.1f}s)'
    )
    return corpus
  try:
    corpus = load(cache_dir, key, verify)
    say(
      f'cache: hit, {len(corpus):,} pairs from {directory} ({time.perf_counter() - started:.1f}s)'
    )
  except CacheError as error:
    if directory.exists():
      say(f'cache: {error}; encoding again')
    elif (
      legacy := cache_path(
        cache_dir, cache_key(fingerprint, tokenizer_digest, max_len, special, text_encoding=1)
      )
    ).is_dir():
      say(
        f"cache: {legacy} was encoded with special tokens' strings in the text (</s>, "
        '<pad>, <unk>, <s>) read as those tokens; they are text now, so the corpus is '
        'encoded again (the old cache is no longer used and can be deleted)'
      )
    _build(
      source, fingerprint, tokenizer, key, max_len, Path(cache_dir), workers, block_lines, progress
    )
    corpus = load(cache_dir, key, verify=False)  # just written and hashed as written
    say(
      f'cache: encoded {len(corpus):,} pairs ({corpus.num_dropped:,} longer than max_len='
      f'{max_len} dropped) into {directory} in {time.perf_counter() - started:.1f}s'
    )
  if wait is not None:
    wait()
  return corpus


# ------------------------------------------------------------------------------------------------
# Building.


class _ArrayFile:
  """An array written as a stream: raw bytes appended, counted and hashed as they go."""

  def __init__(self, path: Path, dtype: str):
    self.path, self.dtype = path, np.dtype(dtype)
    self.file = open(path, 'wb')
    self.digest = hashlib.sha256()
    self.count = 0

  def append(self, values: np.ndarray) -> None:
    data = np.ascontiguousarray(values, self.dtype).tobytes()
    self.file.write(data)
    self.digest.update(data)
    self.count += len(values)

  def close(self) -> dict:
    self.file.flush()
    os.fsync(self.file.fileno())
    self.file.close()
    return {
      'dtype': self.dtype.str,
      'count': self.count,
      'bytes': self.count * self.dtype.itemsize,
      'sha256': self.digest.hexdigest(),
    }


def _build(
  source: PairSource,
  fingerprint: dict,
  tokenizer: TextTokenizer,
  key: str,
  max_len: int,
  cache_dir: Path,
  workers: int | None,
  block_lines: int,
  progress: bool,
) -> None:
  """Encodes `source` into a partial directory, then renames it to `cache_path(key)`."""
  final = cache_path(cache_dir, key)
  partial = _make_partial(cache_dir, final)
  try:
    total_lines = (
      len(source.dataset) if isinstance(source, DatasetPairs) else fingerprint['files'][0]['lines']
    )
    arrays, rows, kept = _write_arrays(
      partial, source, tokenizer, max_len, workers, block_lines, total_lines, progress
    )
    manifest = {
      'format': FORMAT_VERSION,
      'key': key,
      'fingerprint': fingerprint,
      'source': source.describe(),
      'tokenizer': type(tokenizer).__name__,
      'max_len': int(max_len),
      'num_pairs': kept,
      'num_dropped': rows - kept,
      'pad_id': int(tokenizer.pad_id),
      'bos_id': int(tokenizer.bos_id),
      'eos_id': int(tokenizer.eos_id),
      'created': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
      'arrays': arrays,
    }
    write_atomically(partial / MANIFEST, json.dumps(manifest, indent=1))
    _install(partial, final)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def _make_partial(cache_dir: Path, final: Path) -> Path:
  """A new directory to build `final` in, named for this host and process; dead ones go."""
  try:
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(cache_dir, final.name)
    partial = cache_dir / f'.{final.name}.partial-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}'
    partial.mkdir()
  except OSError as error:
    raise CacheError(
      f'{cache_dir}: cannot write the encoded-corpus cache '
      f'({error.strerror or error}); choose another cache directory'
    ) from error
  return partial


def _write_arrays(
  partial: Path,
  source: PairSource,
  tokenizer: TextTokenizer,
  max_len: int,
  workers: int | None,
  block_lines: int,
  total_lines: int,
  progress: bool,
) -> tuple[dict, int, int]:
  """Encodes `source` block by block into the array files of `partial`.

  Returns the arrays' manifest entries, the rows read and the pairs kept.
  """
  files = {field: _ArrayFile(partial / name, dtype) for field, (name, dtype) in ARRAYS.items()}
  files['src_offsets'].append(np.zeros(1, np.int64))
  files['tgt_offsets'].append(np.zeros(1, np.int64))
  src_total = tgt_total = rows = kept = 0
  with tqdm(
    total=total_lines,
    desc='encode',
    unit='pairs',
    unit_scale=True,
    disable=not progress,
    dynamic_ncols=True,
    mininterval=1.0,
  ) as bar:
    for block_rows, result in encoded_blocks(
      source, tokenizer, max_len, workers, block_lines, total_lines
    ):
      src_ids, src_lengths, tgt_ids, tgt_lengths, kept_rows, clean_rows = result
      files['src_ids'].append(src_ids)
      files['tgt_ids'].append(tgt_ids)
      files['src_offsets'].append(src_total + np.cumsum(src_lengths))
      files['tgt_offsets'].append(tgt_total + np.cumsum(tgt_lengths))
      files['example_ids'].append(rows + kept_rows)
      src_total += int(src_lengths.sum())
      tgt_total += int(tgt_lengths.sum())
      rows += clean_rows
      kept += len(kept_rows)
      bar.update(block_rows)
      signals.check()  # a program's SIGTERM or SIGINT: the partial directory is removed
  return {field: file.close() for field, file in files.items()}, rows, kept


def _remove_dead_partials(cache_dir: Path, name: str) -> None:
  """Deletes partial builds of `name` left by processes of this host that no longer run (a
  crash mid-build); a live builder's directory stays, and so does another host's."""
  for path in cache_dir.glob(f'.{name}.partial-{_HOST}-*'):
    try:
      os.kill(int(path.name.rsplit('-', 2)[-2]), 0)
    except ProcessLookupError:
      shutil.rmtree(path, ignore_errors=True)
    except (ValueError, IndexError, PermissionError, OSError):
      pass


def _install(partial: Path, final: Path) -> None:
  """Renames the finished `partial` directory to `final`, setting aside what was there (an
  invalid cache: a valid one would have been loaded)."""
  if final.exists():
    stale = final.with_name(f'.{final.name}.stale-{os.getpid()}-{secrets.token_hex(4)}')
    try:
      os.rename(final, stale)
    except FileNotFoundError:
      stale = None  # another writer set it aside first
    if stale is not None:
      shutil.rmtree(stale, ignore_errors=True)
  try:
    os.rename(partial, final)
  except OSError:
    # Another writer of the same key installed its copy in between: identical content.
    shutil.rmtree(partial, ignore_errors=True)
    if not (final / MANIFEST).is_file():
      raise
