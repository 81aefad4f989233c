"""Marian's tokenizer (OPUS-MT): sentencepiece pieces (source.spm / target.spm) -> the ids of
vocab.json, one vocabulary for both sides.

Needs `pip install -e .[pretrained]` (sentencepiece), imported only when one is read.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

from flax_transformer.config import NONNEGATIVE_INT, ModelConfig
from flax_transformer.errors import PretrainedError, TokenizerError
from flax_transformer.files import files_digest, read_json_object
from flax_transformer.tokenizer.protocol import check_compatible

TOKENIZER_FILES = ('source.spm', 'target.spm', 'vocab.json')


def import_optional(module: str):
  """Imports an optional dependency or says how to install it."""
  try:
    return __import__(module)
  except ImportError:
    raise PretrainedError(
      f'reading a Marian directory needs {module}: pip install -e .[pretrained]'
    ) from None


class MarianTokenizer:
  """Marian's tokenizer: sentencepiece pieces (source.spm / target.spm) -> ids of vocab.json.

  The interface of `subword.Tokenizer`: pad_id, bos_id (= pad_id: the decoder
  starts from PAD), eos_id, unk_id, vocab_size, encode (source side),
  encode_target, decode (target side), id_to_token, check_compatible, save.
  A piece missing from vocab.json becomes <unk>. Unlike transformers'
  MarianTokenizer, the text is not Moses-punctuation-normalised first
  (transformers does that only when sacremoses is installed).
  """

  FILES = TOKENIZER_FILES

  @classmethod
  def load(cls, directory: str | Path) -> MarianTokenizer:
    """Reads `FILES` from `directory` (as `Tokenizer.load` reads tokenizer.json)."""
    return cls(directory)

  def __init__(self, directory: str | Path):
    spm = import_optional('sentencepiece')
    directory = Path(directory)
    for name in TOKENIZER_FILES:
      if not (directory / name).is_file():
        raise TokenizerError(
          f'{directory / name}: no such file; a Marian tokenizer needs {", ".join(TOKENIZER_FILES)}'
        )
    self.directory = directory
    self._source = _sentencepiece(spm, directory / 'source.spm')
    self._target = _sentencepiece(spm, directory / 'target.spm')
    self._vocab = _read_vocab(directory / 'vocab.json')
    for token in ('</s>', '<unk>', '<pad>'):
      if token not in self._vocab:
        raise TokenizerError(f'{directory / "vocab.json"} has no {token} entry')
    self._pieces = {index: piece for piece, index in self._vocab.items()}
    self.pad_id = self.bos_id = self._vocab['<pad>']
    self.eos_id, self.unk_id = self._vocab['</s>'], self._vocab['<unk>']
    # Text is text: sentencepiece returns a run of characters it does not know as one piece,
    # looked up in vocab.json (as transformers does: the vocabulary is both sides' pieces),
    # and such a run can spell '</s>' or '<pad>'. From text, those are <unk>, never EOS or PAD.
    self._text_ids = {
      piece: self.unk_id if index in (self.eos_id, self.pad_id) else index
      for piece, index in self._vocab.items()
    }

  @property
  def vocab_size(self) -> int:
    return max(self._pieces) + 1

  def _encode(self, processor, texts: Sequence[str]) -> list[list[int]]:
    if isinstance(texts, str):
      raise TypeError('encode takes a sequence of texts; wrap a single one as [text]')
    rows = []
    for text in texts:
      # A leading '>>xx<<' language code of a multilingual model is a token of its own.
      code = []
      if (
        text.startswith('>>') and (end := text.find('<<')) != -1 and text[: end + 2] in self._vocab
      ):
        code, text = [self._vocab[text[: end + 2]]], text[end + 2 :]
      rows.append(
        code
        + [self._text_ids.get(piece, self.unk_id) for piece in processor.encode(text, out_type=str)]
      )
    return rows

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Source-side ids per text (source.spm), without EOS."""
    return self._encode(self._source, texts)

  def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
    """Target-side ids per text (target.spm), without EOS: training targets."""
    return self._encode(self._target, texts)

  def decode(self, ids) -> list[str]:
    """Texts from rows of target ids: each row ends at its first EOS; PAD is dropped; <unk> shows."""
    texts = []
    for row in ids:
      row = [int(token) for token in row]
      if self.eos_id in row:
        row = row[: row.index(self.eos_id)]
      bad = [token for token in row if token not in self._pieces]
      if bad:
        raise TokenizerError(f'cannot decode ids {bad[:5]}: not in vocab.json')
      words, pieces = [], []
      for token in row:
        if token == self.unk_id:
          words += [self._target.decode_pieces(pieces), '<unk>']
          pieces = []
        elif token != self.pad_id:
          pieces.append(self._pieces[token])
      texts.append(' '.join(w for w in words + [self._target.decode_pieces(pieces)] if w))
    # As transformers: a piece the sentencepiece model lacks keeps its '▁', which becomes a space.
    return [' '.join(text.replace('▁', ' ').split()) for text in texts]

  def id_to_token(self, token_id: int) -> str:
    return self._pieces[int(token_id)]

  def check_compatible(self, config: ModelConfig) -> None:
    """Raises ConfigError unless the model's vocabulary and special ids match this tokenizer."""
    check_compatible(self, config, f'the Marian tokenizer in {self.directory}')

  def save(self, directory: str | Path) -> Path:
    """Copies source.spm, target.spm and vocab.json into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
      if (self.directory / name).resolve() != (directory / name).resolve():
        shutil.copyfile(self.directory / name, directory / name)
    return directory

  def digest(self) -> str:
    """The SHA-256 of source.spm, target.spm and vocab.json, names and bytes, in order."""
    return files_digest([self.directory / name for name in self.FILES])


def _sentencepiece(spm, path: Path):
  """The sentencepiece model in `path`, or TokenizerError naming it and what is wrong."""
  try:
    return spm.SentencePieceProcessor(model_file=str(path))
  except (RuntimeError, OSError) as error:  # sentencepiece's status: 'INTERNAL: could not parse'
    reason = str(error).replace(f' from {path}', '').replace(str(path), 'the file')  # named once
    raise TokenizerError(f'{path}: not a readable sentencepiece model ({reason})') from None


def _read_vocab(path: Path) -> dict[str, int]:
  """vocab.json (piece -> id), or TokenizerError naming the file and what is wrong."""
  vocab = read_json_object(path, TokenizerError)
  bad = next(
    ((piece, index) for piece, index in vocab.items() if not NONNEGATIVE_INT.admits(index)), None
  )
  if bad is not None:
    raise TokenizerError(
      f'{path}: the id of {bad[0]!r} must be a non-negative integer, got {json.dumps(bad[1])}'
    )
  return vocab
