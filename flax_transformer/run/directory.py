"""The run directory: what a training run writes besides its checkpoints, and the rules for it.

    WORKDIR/config.json      the run's settings and marker (config_file.py)
    WORKDIR/tokenizer.json   the shared subword vocabulary (Tokenizer.save)
    WORKDIR/checkpoints/     orbax checkpoints, one directory per step (checkpoints.py)
    WORKDIR/metrics.jsonl    one JSON object per logged step (metrics_log.py)
    WORKDIR/encoded/         the tokenized training split (data/cache.py), unless
                             data.cache_dir names another place
    WORKDIR/profile/         a jax.profiler trace, if train.profile asks (train/profiling.py)

`RunDirectory` is what training asks of it: `locked` (the directory created,
writable and locked against a second writer for the whole run: run_lock.py),
`prepare` (cleared for a fresh run), `check_settings` (refuse settings that differ from the
saved run's) and `write_settings` (config.json, once the checkpoint is
restored). Decoding only reads: `read_config` and `check_tokenizer`. config.json's
writing, reading and comparing (`write_config`, `read_config`, `check_resumable`,
`read_marker`, `run_format`) are `config_file.py`'s, and still importable from here.

A directory is a run only if it says so (`run_format`: config.json's marker,
or the three sections of older runs) and holds nothing but what train.py writes
(`foreign_entries`): `check_workdir` refuses any other directory before anything
is written in it, and `clear_run` (--no-resume) deletes only a run's own files,
so that neither a pretrained model, an averaged output nor another tool's files
are ever taken for a run and overwritten.

Crash safety: config.json and tokenizer.json are written to a temporary file
and renamed over the old one, so a process killed at any moment leaves each
either as it was or complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
from jax.experimental import multihost_utils

from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.errors import CheckpointError, NotARun, WriteError
from flax_transformer.files import file_digest
from flax_transformer.pretrained.marian import is_export
from flax_transformer.run.config_file import (
  AVERAGED_KEY,
  CONFIG_FILE,
  FORMER_TOKENIZER_DIGEST,
  PACKING_PLAN,
  PACKING_PLAN_KEY,
  TOKENIZER_DIGEST,
  TOKENIZER_FILES_KEY,
  check_resumable,
  read_config,
  read_marker,
  run_format,
  write_config,
)
from flax_transformer.run.config_file import RUN_FORMAT as RUN_FORMAT
from flax_transformer.run.config_file import WRITTEN_BY as WRITTEN_BY
from flax_transformer.run.config_file import write_averaged_config as write_averaged_config
from flax_transformer.run.lock import LOCK_FILE, RunLock
from flax_transformer.run.outputs import Protected, check_output
from flax_transformer.tokenizer import FILE_NAME as TOKENIZER_FILE
from flax_transformer.tokenizer import (
  MarianTokenizer,
  TextTokenizer,
  Tokenizer,
  digest_of,
  vocabulary_mismatches,
)

CHECKPOINT_DIR = 'checkpoints'
METRICS_FILE = 'metrics.jsonl'
TENSORBOARD_DIR = 'tensorboard'
# The tokenized training split's cache (data.cache), unless data.cache_dir puts it elsewhere.
ENCODED_DIR = 'encoded'
PROFILE_DIR = 'profile'
# The parameters of the best validation score so far (train.best_metric), decodable as a run.
BEST_DIR = 'best'
BEST_KEY = 'best'
# The parameters' exponential moving average at the last step (train.ema_decay), decodable.
EMA_DIR = 'ema'
EMA_KEY = 'ema'
AVERAGE_PREFIX = 'average-last'
# What a run holds besides config.json and its tokenizer's files; their temporary files
# (.NAME.tmp) and check_writable's probes (.write-test-*) are its own too.
_RUN_ENTRIES = frozenset(
  {
    TOKENIZER_FILE,
    CHECKPOINT_DIR,
    METRICS_FILE,
    TENSORBOARD_DIR,
    ENCODED_DIR,
    PROFILE_DIR,
    LOCK_FILE,
    BEST_DIR,
    EMA_DIR,
  }
)


def check_writable(workdir: str | Path) -> None:
  """Creates WORKDIR if needed and checks that a file can be written in it.

  Called before training, so that an unwritable directory is reported before
  hours of work whose first save would fail.
  """
  workdir = Path(workdir)
  probe = workdir / f'.write-test-{jax.process_index()}-{os.getpid()}'
  try:
    workdir.mkdir(parents=True, exist_ok=True)
    probe.write_bytes(b'')
    probe.unlink()
  except OSError as error:
    raise WriteError(
      f'{workdir}: cannot write the run directory ({error.strerror or error}); '
      'choose another --workdir or make this one writable'
    ) from error


def check_tokenizer(workdir: str | Path) -> None:
  """Raises CheckpointError if WORKDIR/tokenizer.json is not the file config.json recorded.

  Token ids mean nothing with another vocabulary, and two vocabularies of the
  same size fit the same model, so the sizes alone cannot tell. A config.json
  without a recorded digest (older runs) is not checked.
  """
  workdir = Path(workdir)
  config_path, tokenizer_path = workdir / CONFIG_FILE, workdir / TOKENIZER_FILE
  # A missing or malformed config.json is read_config's to report.
  recorded = _recorded_tokenizer_digest(workdir)
  if recorded is None or not tokenizer_path.is_file():
    return
  actual = _tokenizer_digest(workdir, recorded[0])
  if actual != recorded[1]:
    raise CheckpointError(
      f'{tokenizer_path} is not the tokenizer this run was trained with: its digest is '
      f'{actual[:12]}..., {config_path} records {recorded[1][:12]}...; the token ids in the '
      "checkpoints belong to that one. Put the run's own tokenizer.json back, or start a new "
      'run in another --workdir (or with --no-resume)'
    )


def check_tokenizer_fits(workdir: str | Path, tokenizer: TextTokenizer) -> None:
  """Raises CheckpointError unless `tokenizer` has the vocabulary of config.json's model.

  Without a recorded digest (older runs, or one deleted) `check_tokenizer` cannot
  tell another tokenizer; a different size or special ids can. Changing
  model.vocab_size would not help: the checkpoints hold the run's own vocabulary.
  """
  workdir = Path(workdir)
  model_config = read_config(workdir)[0]
  for name, saved, actual in vocabulary_mismatches(tokenizer, model_config):
    if _is_recorded_tokenizer(workdir):
      # The digest config.json recorded is this tokenizer.json's: config.json is what changed.
      raise CheckpointError(
        f'{workdir / CONFIG_FILE}: model.{name}={saved} is not what this run was trained with: '
        f'its tokenizer.json, the file config.json records (same digest), has {name} '
        f'{actual}; config.json was edited: set model.{name} back to {actual}'
      )
    raise CheckpointError(
      f'{workdir / TOKENIZER_FILE} does not belong to this run: it has {name} {actual}, '
      f'the model in {workdir / CONFIG_FILE} and its checkpoints were trained with '
      f"{saved}. Put the run's own tokenizer.json back, or start a new run in another "
      '--workdir (or with --no-resume)'
    )


def _recorded_tokenizer_digest(workdir: Path) -> tuple[str, str] | None:
  """(config.json's key, the tokenizer digest it records), or None (none recorded, or
  config.json missing or not a JSON object). Runs before TOKENIZER_DIGEST recorded the
  SHA-256 of tokenizer.json (FORMER_TOKENIZER_DIGEST)."""
  try:
    content = json.loads((workdir / CONFIG_FILE).read_text())
    for key in (TOKENIZER_DIGEST, FORMER_TOKENIZER_DIGEST):
      if isinstance(content.get(key), str):
        return key, content[key]
  except (OSError, ValueError, AttributeError):
    pass
  return None


def _tokenizer_digest(workdir: Path, key: str) -> str:
  """WORKDIR's tokenizer as config.json's `key` identifies it: its digest(), or (a run
  written before it) the SHA-256 of tokenizer.json."""
  return digest_of(workdir) if key == TOKENIZER_DIGEST else file_digest(workdir / TOKENIZER_FILE)


def _is_recorded_tokenizer(workdir: Path) -> bool:
  """Whether WORKDIR's tokenizer is the one whose digest config.json recorded."""
  recorded = _recorded_tokenizer_digest(workdir)
  try:
    return recorded is not None and recorded[1] == _tokenizer_digest(workdir, recorded[0])
  except OSError:
    return False


def averaged_run(directory: str | Path) -> Path | None:
  """The run whose checkpoints DIRECTORY averages (an average-lastK output), else None."""
  directory = Path(directory).resolve()
  content = read_marker(directory)
  if content is None:
    return None
  inside_run = directory.name.startswith(AVERAGE_PREFIX) and read_marker(directory.parent)
  if inside_run:  # averages written before AVERAGED_KEY are known by their place
    return directory.parent
  averaged = content.get(AVERAGED_KEY)
  return Path(averaged.get('run', directory)) if isinstance(averaged, dict) else None


def _parameters_only_kind(directory: Path) -> str:
  """What a parameters-only copy of a run is, in words: 'a best checkpoint (step 40)', 'the
  moving average of the parameters (step 400)', or 'an average of checkpoints 8, 10'."""
  content = read_marker(directory) or {}
  for key, words in (
    (BEST_KEY, 'a best checkpoint'),
    (EMA_KEY, 'the moving average of the parameters'),
  ):
    record = content.get(key)
    if isinstance(record, dict):
      return f'{words} (step {record.get("step")})'
  steps = (content.get(AVERAGED_KEY) or {}).get('steps') or []
  return (
    f'an average of checkpoints {", ".join(map(str, steps))}' if steps else 'an averaged output'
  )


def foreign_entries(workdir: str | Path, init_from: str | Path | None = None) -> list[str]:
  """The entries of WORKDIR (resolved) that no run of train.py wrote, sorted; [] for a new,
  empty or train.py's own directory.

  A run's own: config.json marked as train.py's, the files of `_RUN_ENTRIES`, its
  average-lastK outputs, exports written into it (export.py), their temporary files, and its tokenizer's files: tokenizer.json,
  or a fine-tuned Marian model's when config.json lists them (older runs: when config.json is
  train.py's) or when they are `init_from`'s, copied by a run that stopped before writing
  config.json.
  """
  workdir = Path(workdir).resolve()
  if not workdir.is_dir():
    return []
  content = read_marker(workdir)
  own = set(_RUN_ENTRIES)
  if content is not None:
    listed = content.get(TOKENIZER_FILES_KEY)
    own.update({CONFIG_FILE}, listed if isinstance(listed, list) else MarianTokenizer.FILES)
  elif init_from is not None:
    own.update(
      name for name in MarianTokenizer.FILES if _same_file(workdir / name, Path(init_from) / name)
    )
  own_temporary = {f'.{name}.tmp' for name in own | {CONFIG_FILE}}
  return sorted(
    entry.name
    for entry in workdir.iterdir()
    if entry.name not in own | own_temporary
    and not entry.name.startswith('.write-test-')
    and not (entry.name.startswith(AVERAGE_PREFIX) and _is_average(entry))
    and not _is_own_export(entry)
  )


def _is_own_export(directory: Path) -> bool:
  """Whether DIRECTORY is an export.py output (`export.py RUN --to RUN/export`, as its error
  messages suggest): made from the run, kept by it like an average."""
  return directory.is_dir() and not directory.is_symlink() and is_export(directory)


def _is_average(directory: Path) -> bool:
  """Whether DIRECTORY is an averaging output holding only what averaging writes."""
  return (
    directory.is_dir()
    and not directory.is_symlink()
    and averaged_run(directory) is not None
    and {e.name for e in directory.iterdir()}
    <= {CONFIG_FILE, CHECKPOINT_DIR, *Tokenizer.FILES, *MarianTokenizer.FILES}
  )


def _same_file(path: Path, original: Path) -> bool:
  return path.is_file() and original.is_file() and file_digest(path) == file_digest(original)


def check_workdir(
  workdir: str | Path, init_from: str | Path | None = None, inputs: Sequence[Protected] = ()
) -> None:
  """Raises NotARun unless WORKDIR may be a run directory of train.py: new, empty, or a run of
  its own (symlinks followed); never the current directory unless it is a run already, an
  averaged output, nor one of `inputs` (the data, --init-from's model), one holding them
  or inside them (`outputs.check_output`).

  Checked before anything is written in it: a directory this refuses is left untouched.
  """
  check_output(
    Path(workdir),
    [*inputs]
    + ([Protected(Path(init_from), f'--init-from {init_from}')] if init_from is not None else []),
    '--workdir',
    NotARun,
    advice='choose a new --workdir',
  )
  resolved = Path(workdir).resolve()
  averaged = averaged_run(resolved) if resolved.is_dir() else None
  if averaged is not None:
    what = _parameters_only_kind(resolved)
    inside = resolved.parent == averaged.resolve()
    raise NotARun(
      f'--workdir {workdir} is {what} (its checkpoint holds parameters only, no training '
      'state), not a run: decode or export it, and '
      + (
        f'resume {averaged} itself, or train in a new --workdir'
        if inside
        else 'train in a new --workdir'
      )
    )
  if resolved == Path.cwd().resolve() and run_format(resolved) is None:
    raise NotARun(
      f'--workdir {str(workdir)!r} is the current directory, not a run directory of '
      'train.py; name a new directory (default: runs/PRESET)'
    )
  foreign = foreign_entries(resolved, init_from)
  if foreign:
    shown = ', '.join(foreign[:5]) + (f' and {len(foreign) - 5} more' if len(foreign) > 5 else '')
    config = " (config.json is not train.py's)" if CONFIG_FILE in foreign else ''
    raise NotARun(
      f'--workdir {workdir} holds what no run of train.py wrote: {shown}{config}; '
      'train.py writes (and --no-resume deletes) only its own run directories: '
      'choose a new --workdir'
    )


def saved_steps(workdir: str | Path) -> list[int]:
  """The steps of WORKDIR's checkpoints, by their directories' names (none opened), sorted."""
  checkpoints = Path(workdir) / CHECKPOINT_DIR
  if not checkpoints.is_dir():
    return []
  return sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit() and p.is_dir())


def clear_run(workdir: str | Path, init_from: str | Path | None = None) -> None:
  """Deletes what a previous run wrote to `workdir`, and nothing else.

  Raises NotARun, deleting nothing, if WORKDIR holds anything a run did not write
  (`check_workdir`; init_from: the Marian directory a fine-tuning run copied its tokenizer
  from).
  """
  check_workdir(workdir, init_from)
  workdir = Path(workdir).resolve()
  for name in (CONFIG_FILE, METRICS_FILE, *Tokenizer.FILES, *MarianTokenizer.FILES):
    (workdir / name).unlink(missing_ok=True)
  for directory in [
    workdir / CHECKPOINT_DIR,
    workdir / TENSORBOARD_DIR,
    workdir / BEST_DIR,
    workdir / f'.{BEST_DIR}.tmp',
    workdir / EMA_DIR,
    workdir / f'.{EMA_DIR}.tmp',
    *workdir.glob(f'{AVERAGE_PREFIX}*'),
  ]:
    if directory.is_dir():
      shutil.rmtree(directory)


def _remove_if_unused(workdir: Path) -> None:
  """Removes WORKDIR if it holds nothing but the lock file and an empty checkpoints/."""
  checkpoints = workdir / CHECKPOINT_DIR
  if set(os.listdir(workdir)) <= {LOCK_FILE, CHECKPOINT_DIR} and (
    not checkpoints.exists() or (checkpoints.is_dir() and not any(checkpoints.iterdir()))
  ):
    if checkpoints.exists():
      checkpoints.rmdir()
    (workdir / LOCK_FILE).unlink(missing_ok=True)
    workdir.rmdir()


class RunDirectory:
  """A training run's directory, prepared stage by stage (see the module docstring).

  Process 0 alone writes config.json and clears an old run; the other processes wait at a
  barrier, then read what it wrote (the training loop's setup trains the tokenizer the same
  way: train/run_tokenizer.py).
  """

  def __init__(
    self, workdir: str | Path, init_from: str | Path | None = None, data: str | None = None
  ):
    """init_from: --init-from's Marian directory; data: data.source, which WORKDIR must neither
    be, hold nor lie inside when it is a path (`check_workdir`)."""
    self.path = Path(workdir)
    self.is_main = jax.process_index() == 0
    self.init_from = init_from
    source = Path(data).expanduser() if data else None
    self.inputs = (
      (Protected(source, f'--data {source}'),) if source is not None and source.exists() else ()
    )

  @property
  def metrics_file(self) -> Path:
    return self.path / METRICS_FILE

  @property
  def tensorboard_dir(self) -> Path:
    return self.path / TENSORBOARD_DIR

  @property
  def encoded_dir(self) -> Path:
    return self.path / ENCODED_DIR

  @property
  def profile_dir(self) -> Path:
    return self.path / PROFILE_DIR

  def check_writable(self) -> None:
    """Raises WriteError now, rather than at the first save hours later."""
    check_writable(self.path)

  @contextlib.contextmanager
  def locked(self) -> Iterator[None]:
    """Creates WORKDIR, checks it is writable and holds its lock (process 0) for the block.

    Taken before anything in WORKDIR is cleared or written, and after `check_workdir`: a
    directory that is not a run is refused untouched. A WORKDIR this run created is removed
    again if the run fails before writing anything in it (a bad --data leaves no empty run
    directory behind).
    """
    check_workdir(self.path, self.init_from, self.inputs)
    created = not self.path.exists()
    self.check_writable()
    lock = RunLock(self.path) if self.is_main else None
    try:
      if lock is not None:
        lock.acquire()
      yield
    except BaseException:
      if created and self.is_main:
        _remove_if_unused(self.path)
      raise
    finally:
      if lock is not None:
        lock.release()

  def prepare(self, resume: bool) -> None:
    """Without `resume`, deletes the previous run's files first."""
    if not resume and self.is_main:
      clear_run(self.path, self.init_from)
    multihost_utils.sync_global_devices('run directory ready')

  def check_settings(
    self, model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig
  ) -> None:
    """Refuses settings that differ from the saved run's (CheckpointError).

    Checked also before the first checkpoint: the saved tokenizer belongs to the
    saved settings.
    """
    if (self.path / CONFIG_FILE).is_file():
      check_resumable(self.path, model_config, train_config, data_config)

  def has_settings(self) -> bool:
    """Whether the directory holds a config.json (a run to resume, or another program's)."""
    return (self.path / CONFIG_FILE).is_file()

  def write_settings(
    self,
    model_config: ModelConfig,
    train_config: TrainConfig,
    data_config: DataConfig,
    packing_plan: str = PACKING_PLAN,
  ) -> None:
    """Writes config.json (process 0); called once the checkpoint to resume is restored."""
    if self.is_main:
      write_config(self.path, model_config, train_config, data_config, packing_plan)

  def packing_plan(self, has_checkpoints: bool) -> str:
    """How this run's packed rows are planned: what config.json records; 'first_fit' for a
    run begun before the record existed (its batches stay as they were); else best fit."""
    try:
      saved = json.loads((self.path / CONFIG_FILE).read_text()).get(PACKING_PLAN_KEY)
    except (OSError, json.JSONDecodeError, AttributeError):
      saved = None
    if saved is None and has_checkpoints:
      return 'first_fit'
    return saved or PACKING_PLAN
