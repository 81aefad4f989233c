"""flax_transformer.files: a file is written whole or not at all, and its digest is its bytes'."""

import hashlib

import pytest

from flax_transformer import files


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
  path = tmp_path / 'config.json'
  path.write_text('old')
  assert files.write_atomically(path, 'new ü') == path
  assert path.read_text(encoding='utf-8') == 'new ü'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json']


def test_a_writer_that_fails_leaves_the_old_file(tmp_path):
  """A library's writer (the tokenizer's save) that dies part way: the target keeps its old
  bytes; the next write overwrites the leftover temporary file."""
  path = tmp_path / 'tokenizer.json'
  path.write_text('old')

  def dies_part_way(temporary):
    with open(temporary, 'w') as file:
      file.write('half')
    raise OSError(28, 'No space left on device')

  with pytest.raises(OSError, match='No space left'):
    files.write_atomically(path, writer=dies_part_way)
  assert path.read_text() == 'old'
  assert files.temporary_path(path).read_text() == 'half'
  files.write_lines_atomically(path, (f'{n}\n' for n in range(3)))
  assert path.read_text() == '0\n1\n2\n'
  assert not files.temporary_path(path).exists()


def test_text_or_a_writer_not_both(tmp_path):
  with pytest.raises(TypeError, match='one of them'):
    files.write_atomically(tmp_path / 'x', 'text', writer=lambda path: None)
  with pytest.raises(TypeError, match='one of them'):
    files.write_atomically(tmp_path / 'x')


def test_digests_are_sha256_of_the_bytes_and_names(tmp_path, monkeypatch):
  """Read a block at a time (blocks smaller than the file here), the digest is the bytes'; the
  several-file digest covers each name and the order, so renaming or swapping files changes it."""
  monkeypatch.setattr(files, '_HASH_BLOCK', 7)
  a, b = tmp_path / 'a.spm', tmp_path / 'b.spm'
  a.write_bytes(bytes(range(50)))
  b.write_bytes(b'vocabulary')
  assert files.file_digest(a) == hashlib.sha256(bytes(range(50))).hexdigest()
  expected = hashlib.sha256(b'a.spm\0' + bytes(range(50)) + b'b.spm\0' + b'vocabulary')
  assert files.files_digest([a, b]) == expected.hexdigest()
  assert files.files_digest([b, a]) != files.files_digest([a, b])
  c = tmp_path / 'c.spm'
  c.write_bytes(bytes(range(50)))
  assert files.files_digest([c, b]) != files.files_digest([a, b])
