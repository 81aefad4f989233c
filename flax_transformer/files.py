"""Files written whole or not at all, and their SHA-256 digests.

A run directory, the encoded-corpus cache and the tokenizer are read back by later runs, so a
crash or a full disk must leave either the old file or the new one, never half of one:

    write_atomically(workdir / 'config.json', json.dumps(content))
    write_atomically(workdir / 'tokenizer.json', writer=backend.save)   # a library's own writer
    file_digest(workdir / 'tokenizer.json')                           # hex SHA-256

The temporary file sits beside the target (`.NAME.tmp`), so the rename stays in one file system
and is atomic on POSIX; a leftover temporary file from a crash is overwritten by the next write.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path

# Bytes read at a time when hashing: large files (an encoded corpus) are not read whole.
_HASH_BLOCK = 8 << 20


def temporary_path(path: str | Path) -> Path:
  """Where `path` is written before its rename: `.NAME.tmp` in the same directory."""
  path = Path(path)
  return path.with_name(f'.{path.name}.tmp')


def write_atomically(
  path: str | Path, text: str | None = None, *, writer: Callable[[str], object] | None = None
) -> Path:
  """Writes `text` (UTF-8), or whatever `writer(temporary path)` writes, to `path` through a
  temporary file and a rename: a crash leaves the old file or the new one. Returns `path`."""
  if (text is None) == (writer is None):
    raise TypeError('write_atomically takes the text or a writer, one of them')
  path = Path(path)
  temporary = temporary_path(path)
  if writer is None:
    temporary.write_text(text, encoding='utf-8')
  else:
    writer(str(temporary))
  os.replace(temporary, path)
  return path


def write_lines_atomically(path: str | Path, lines: Iterable[str]) -> Path:
  """`write_atomically` for lines written as they come (each ends with its own newline)."""
  path = Path(path)
  temporary = temporary_path(path)
  with temporary.open('w', encoding='utf-8') as file:
    file.writelines(lines)
  os.replace(temporary, path)
  return path


def file_digest(path: str | Path) -> str:
  """SHA-256 of a file's bytes, in hex, read a block at a time."""
  digest = hashlib.sha256()
  with open(path, 'rb') as file:
    while block := file.read(_HASH_BLOCK):
      digest.update(block)
  return digest.hexdigest()


def files_digest(paths: Iterable[str | Path]) -> str:
  """One SHA-256 over several files, in order: each file's name, a NUL, then its bytes (a
  Marian tokenizer's vocabulary and sentencepiece models together)."""
  digest = hashlib.sha256()
  for path in paths:
    digest.update(Path(path).name.encode() + b'\0')
    with open(path, 'rb') as file:
      while block := file.read(_HASH_BLOCK):
        digest.update(block)
  return digest.hexdigest()


def read_json_object(path: Path, error: type[Exception]) -> dict:
  """The JSON object in `path`, or `error` naming the file and why it is not one."""
  try:
    value = json.loads(path.read_text(encoding='utf-8'))
  except OSError as reason:
    raise error(f'{path}: cannot be read ({reason.strerror or reason})') from None
  except UnicodeDecodeError as reason:
    raise error(f'{path}: not UTF-8 text ({reason.reason} at byte {reason.start})') from None
  except ValueError as reason:
    raise error(f'{path}: not valid JSON ({reason})') from None
  if not isinstance(value, dict):
    raise error(f'{path}: holds {json_kind(value)}, not a JSON object')
  return value


def json_kind(value) -> str:
  """How a message names a parsed JSON value's kind: 'null', 'an array', 'a string', ..."""
  if value is None or isinstance(value, bool):
    return json.dumps(value)
  kinds = {list: 'an array', str: 'a string', int: 'a number', float: 'a number', dict: 'an object'}
  return next(kind for kind_type, kind in kinds.items() if isinstance(value, kind_type))
