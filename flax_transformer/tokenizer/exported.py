"""The tokenizer of a directory written by `pretrained.export`, read back by this library.

Our `Tokenizer` with the ids the export gave the special tokens: PAD is the last id,
and the decoder starts from it (bos_id = pad_id), as in every Marian directory. Its
files are transformers' fast tokenizer: tokenizer.json (with a post-processor that
appends EOS, which `encode` leaves out, as ours does) and tokenizer_config.json.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers

from flax_transformer.errors import TokenizerError
from flax_transformer.tokenizer import word_memo
from flax_transformer.tokenizer.subword import FILE_NAME, SPECIAL_TOKENS, Tokenizer

CONFIG_FILE = 'tokenizer_config.json'


class ExportedTokenizer(Tokenizer):
  """`Tokenizer` over an exported tokenizer.json, its special ids read from the file."""

  FILES = (FILE_NAME, CONFIG_FILE)

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    memo_words: int = word_memo.MEMO_WORDS,
    directory: Path | None = None,
  ):
    ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
      raise TokenizerError(f'{directory or "the tokenizer"}: has no {", ".join(missing)}')
    pad, _, eos, unk = (ids[token] for token in SPECIAL_TOKENS)
    self.pad_id = self.bos_id = pad  # the decoder starts from PAD (config.json's start)
    self.eos_id, self.unk_id = eos, unk
    super().__init__(backend, memo_words, directory)

  def _check_special_ids(self, backend: tokenizers.Tokenizer) -> None:
    pass  # read from the file, not fixed (__init__)

  def __reduce__(self):
    return type(self), (self._backend, self.memo_words, self.directory)

  @classmethod
  def load(cls, directory: str | Path) -> ExportedTokenizer:
    """Reads DIRECTORY/tokenizer.json and checks tokenizer_config.json names our special tokens."""
    directory = Path(directory)
    for name in cls.FILES:
      if not (directory / name).is_file():
        raise TokenizerError(
          f'{directory / name}: no such file; an exported tokenizer has {" and ".join(cls.FILES)}'
        )
    try:
      names = json.loads((directory / CONFIG_FILE).read_text(encoding='utf-8'))
      backend = tokenizers.Tokenizer.from_file(str(directory / FILE_NAME))
    except (OSError, ValueError) as error:
      raise TokenizerError(f'{directory}: not a readable exported tokenizer ({error})') from None
    except Exception as error:  # the Rust side raises a bare Exception
      raise TokenizerError(
        f'{directory / FILE_NAME}: not a valid tokenizer file ({error})'
      ) from None
    expected = dict(zip(('pad_token', 'bos_token', 'eos_token', 'unk_token'), SPECIAL_TOKENS))
    wrong = {
      key: names.get(key)
      for key, token in expected.items()
      if isinstance(names, dict) and names.get(key) != token
    }
    if not isinstance(names, dict) or wrong:
      raise TokenizerError(
        f'{directory / CONFIG_FILE}: special tokens {wrong or names!r} are not '
        f'the ones flax_transformer exports ({expected})'
      )
    return cls(backend, directory=directory)

  def save(self, directory: str | Path) -> Path:
    """Copies tokenizer.json and tokenizer_config.json into `directory`; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if self.directory is None:
      raise TokenizerError('an ExportedTokenizer not read from a directory cannot be saved')
    for name in self.FILES:
      if (self.directory / name).resolve() != (directory / name).resolve():
        shutil.copyfile(self.directory / name, directory / name)
    return directory
