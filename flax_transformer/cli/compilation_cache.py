"""JAX's persistent compilation cache, on by default: a restart reads its compiled programs.

    cache = compilation_cache.enable(None)   # the default place, or a directory, or 'off'
    ...                                       # compile and run
    cache.report()                            # on process 0:
    # compilation cache /home/me/.cache/flax_transformer/jax: 41 programs read, 0 compiled

Compiling the training step, the evaluation and the decoding loops of a base-size model is
slow, on a CPU most of all (benchmarks/README.md); a resumed run compiles the same programs
again unless they are kept. JAX keeps them when it has a
directory (`jax_compilation_cache_dir`) and, by its defaults, only those that took a second
or more to compile; here every program is kept (small ones too, so that a restart compiles
nothing), in the first of:

  1. the setting (train.py's `--compilation-cache DIR`; 'off' turns the cache off);
  2. the environment variable JAX_COMPILATION_CACHE_DIR, which JAX itself reads;
  3. `$XDG_CACHE_HOME/flax_transformer/jax` (`~/.cache/...` without it): one per user.

A program's key covers its computation, the devices, JAX's and XLA's versions and flags,
so one directory serves every run, model and version; JAX writes each entry whole, so a
process killed mid-write leaves none half-written. The directory only grows: delete it
whenever you like, the next run compiles again. When the default directory cannot be made
(a read-only home) the program runs without a cache and says so; a directory given by
setting or environment that cannot be made is an error naming it.

The count of programs read and compiled comes from JAX's monitoring events
('/jax/compilation_cache/compile_requests_use_cache', '/jax/compilation_cache/cache_hits').
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from flax_transformer.config import ConfigError

OFF = 'off'
HELP = (
  "where compiled programs are kept, so that a restart skips compiling; 'off' keeps "
  'none (default: $JAX_COMPILATION_CACHE_DIR if set, else ~/.cache/flax_transformer/jax)'
)
ENVIRONMENT = 'JAX_COMPILATION_CACHE_DIR'
_REQUESTS = '/jax/compilation_cache/compile_requests_use_cache'
_HITS = '/jax/compilation_cache/cache_hits'
_events: collections.Counter = collections.Counter()
_listening = False


def default_directory(environ: Mapping[str, str] = os.environ) -> Path:
  """`$XDG_CACHE_HOME/flax_transformer/jax`, or `~/.cache/flax_transformer/jax`."""
  base = environ.get('XDG_CACHE_HOME') or Path.home() / '.cache'
  return Path(base) / 'flax_transformer' / 'jax'


def location(
  setting: str | None, environ: Mapping[str, str] = os.environ
) -> tuple[Path | None, str]:
  """(the directory, or None for no cache; where it came from: 'setting', 'environment' or
  'default'), by the precedence of the module docstring."""
  if setting is not None:
    return (None, 'setting') if setting.strip().lower() == OFF else (Path(setting), 'setting')
  if environ.get(ENVIRONMENT):
    return Path(environ[ENVIRONMENT]), 'environment'
  return default_directory(environ), 'default'


@dataclasses.dataclass
class CompilationCache:
  """Where the cache is (None: off) and the counts of JAX's events when it was enabled."""

  directory: Path | None
  note: str = ''
  _start: dict = dataclasses.field(default_factory=dict)

  def counts(self) -> tuple[int, int]:
    """(programs read from the cache, programs compiled) since `enable`."""
    requests = _events[_REQUESTS] - self._start.get(_REQUESTS, 0)
    hits = _events[_HITS] - self._start.get(_HITS, 0)
    return hits, requests - hits

  def summary(self) -> str:
    """One line for the log: where, and how many programs were read and compiled."""
    if self.directory is None:
      return f'compilation cache: off{self.note}'
    read, compiled = self.counts()
    return (
      f'compilation cache {self.directory}: {read:,} programs read, {compiled:,} '
      f'compiled{self.note}'
    )

  def report(self) -> None:
    """Prints `summary` on process 0 of the job."""
    import jax

    if jax.process_index() == 0:
      print(self.summary())


def enable(setting: str | None, environ: Mapping[str, str] = os.environ) -> CompilationCache:
  """Points JAX's persistent compilation cache at `location(setting)` (or turns it off);
  call before the first compilation. Raises ConfigError for a directory given by setting
  or environment that cannot be made."""
  import jax

  directory, source = location(setting, environ)
  if directory is not None:
    try:
      directory.mkdir(parents=True, exist_ok=True)
      if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionError(f'cannot write into {directory}')
    except OSError as error:
      if source != 'default':
        name = '--compilation-cache' if source == 'setting' else ENVIRONMENT
        raise ConfigError(
          f'{name}={directory}: cannot use it as the compilation cache '
          f"({error.strerror or error}); give another directory, or 'off'"
        ) from None
      return _off(
        jax,
        f' ({directory} cannot be made: {error.strerror or error}; '
        f'--compilation-cache DIR chooses another)',
      )
  if directory is None:
    return _off(jax, '')
  jax.config.update('jax_enable_compilation_cache', True)
  jax.config.update('jax_compilation_cache_dir', str(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)
  listen()
  return CompilationCache(directory, _start=dict(_events))


def _off(jax, note: str) -> CompilationCache:
  jax.config.update('jax_enable_compilation_cache', False)
  return CompilationCache(None, note)


def listen() -> None:
  """Counts JAX's cache events from now on (once per process; `enable` calls it)."""
  import jax

  global _listening
  if not _listening:
    jax.monitoring.register_event_listener(_count)
    _listening = True


def totals() -> tuple[int, int]:
  """(programs read from the cache, programs compiled) since `listen()` was first called."""
  return _events[_HITS], _events[_REQUESTS] - _events[_HITS]


def _count(event: str, **_) -> None:
  if event in (_REQUESTS, _HITS):
    _events[event] += 1
