"""One subword vocabulary shared by source and target (paper §5.1), on Hugging Face `tokenizers`.

SentencePiece-style: text is NFKC-normalised, every space becomes '▁' and starts
a new word, and the decoder turns '▁' back into spaces, so for ordinary text
(NFKC-stable, single spaces, no leading or trailing space)

    decode(encode([s])) == [s]

which matters because BLEU is computed on the decoded strings. The special
tokens have fixed ids, the same as `ModelConfig`'s defaults:

    <pad> 0    <s> (BOS) 1    </s> (EOS) 2    <unk> 3

Text is text: a special token's string in a sentence ('forty </s> two') is encoded
as the pieces of its characters, like any other word, never as the special id
(`special_tokens_as_text`). The special ids come only from the code that adds them
(EOS after each sentence, PAD in batches), so text cannot end a sentence early or
hide from the masks as padding.

    train = ds['train']  # [:] reads a column as a list, far faster than iterating it
    tokenizer = Tokenizer.train(train['source'][:] + train['target'][:], 8000)
    ids = tokenizer.encode(['Ein Hund läuft.'])        # [[...]], no specials added
    tokenizer.decode([ids[0] + [Tokenizer.eos_id, 0]])  # ['Ein Hund läuft.']
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence, Sized
from pathlib import Path
from typing import Literal

import numpy as np
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from flax_transformer.config import ModelConfig
from flax_transformer.errors import TokenizerError
from flax_transformer.files import files_digest, write_atomically
from flax_transformer.tokenizer import word_memo
from flax_transformer.tokenizer.bpe_dropout import BpeDropout
from flax_transformer.tokenizer.protocol import check_compatible

FILE_NAME = 'tokenizer.json'
SPECIAL_TOKENS = ('<pad>', '<s>', '</s>', '<unk>')  # index = id


# Distinct words whose BPE pieces `tokenizers` remembers while encoding without the word memo
# (about 600 MB at a million words of about ten characters).
BPE_CACHE_WORDS = 1_000_000


class Tokenizer:
  """Subword tokenizer with fixed special ids; wraps a `tokenizers.Tokenizer`."""

  FILES = (FILE_NAME,)
  pad_id = 0
  bos_id = 1
  eos_id = 2
  unk_id = 3

  def __init__(
    self,
    backend: tokenizers.Tokenizer,
    memo_words: int = word_memo.MEMO_WORDS,
    directory: Path | None = None,
  ):
    """Wraps a trained backend; use `Tokenizer.train` or `Tokenizer.load` to get one.

    memo_words: distinct words whose ids `encode` remembers (`word_memo`; the same ids,
      several times faster on a corpus); 0 sends every line through `tokenizers`.
    directory: where its files are (set by `load` and `save`; None for one just trained).
    """
    self.directory = directory
    self._check_special_ids(backend)
    config = json.loads(backend.to_str())  # parsed once here: a large vocabulary takes long
    self._encoder = special_tokens_as_text(backend, config)
    self._memo = (
      word_memo.WordMemo(self._encoder, memo_words, config)
      if memo_words and word_memo.applies_to(self._encoder, config)
      else None
    )
    # Without the memo, BPE's own cache of 10,000 words is what spares a corpus's frequent
    # words their merges; a corpus has many more (WMT14: hundreds of thousands), so it is
    # made larger. With the memo every distinct word reaches BPE once, so it would only
    # hold copies (about 600 MB at a million words). The ids are the same either way.
    if (
      self._memo is None
      and isinstance(self._encoder.model, models.BPE)
      and hasattr(self._encoder.model, '_resize_cache')
    ):
      self._encoder.model._resize_cache(BPE_CACHE_WORDS)
    self._backend = backend
    self.memo_words = memo_words

  def _check_special_ids(self, backend: tokenizers.Tokenizer) -> None:
    """Raises TokenizerError unless `backend` gives each special token this class's id."""
    for token_id, token in enumerate(SPECIAL_TOKENS):
      if backend.token_to_id(token) != token_id:
        raise TokenizerError(
          f'special token {token} must have id {token_id}, the tokenizer '
          f'gives it {backend.token_to_id(token)}'
        )

  def __reduce__(self):
    # Pickled (for a pool's workers) as its backend and settings: unpickling runs __init__,
    # which sets what tokenizer.json does not hold (the BPE cache's size, special tokens as
    # text). The memo is not sent; each process fills its own.
    return type(self), (self._backend, self.memo_words, self.directory)

  @classmethod
  def train(
    cls,
    texts: Iterable[str],
    vocab_size: int,
    model: Literal['bpe', 'unigram'] = 'bpe',
    progress: bool = False,
  ) -> Tokenizer:
    """Learns a vocabulary of at most `vocab_size` pieces, specials included.

    Pass source and target training text together for one shared vocabulary.
    A small corpus may yield fewer pieces than asked; `vocab_size` reports the
    real size.

    'bpe' is deterministic: the same texts give the same `tokenizer.json` (the
    known BPE non-determinism, huggingface/tokenizers#1794, needs a
    continuing-subword prefix, which we do not use). 'unigram' is not bit-exact
    across runs in tokenizers 0.23: its EM iterates hash maps, so pieces of equal
    frequency can trade scores and ids. Either way, a run saves its tokenizer and
    a resumed run loads that file rather than training again.

    progress: show the trainer's own progress bars (its stages, each with counts and time).
    """
    if vocab_size <= len(SPECIAL_TOKENS):
      raise TokenizerError(
        f'vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}'
      )
    if model == 'bpe':
      backend = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
      trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=progress
      )
    elif model == 'unigram':
      backend = tokenizers.Tokenizer(models.Unigram())
      trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        unk_token='<unk>',
        show_progress=progress,
      )
    else:
      raise TokenizerError(f"tokenizer model must be 'bpe' or 'unigram', got {model!r}")
    backend.normalizer = normalizers.NFKC()
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(
      texts, trainer, length=len(texts) if isinstance(texts, Sized) else None
    )
    return cls(_without_learned_copies_of_special_tokens(backend))

  @classmethod
  def load(cls, directory: str | Path) -> Tokenizer:
    """Reads `<directory>/tokenizer.json` as written by `save`."""
    path = Path(directory) / FILE_NAME
    if not path.is_file():
      raise TokenizerError(
        f'{path}: no such file; train a tokenizer first (train.py saves '
        f'one beside its checkpoints) or point to the directory holding it'
      )
    try:
      backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as error:  # the Rust side raises a bare Exception
      raise TokenizerError(
        f'{path}: not a valid tokenizer file ({error}); delete it and train again'
      ) from error
    return cls(backend, directory=Path(directory))

  def save(self, directory: str | Path) -> Path:
    """Writes `<directory>/tokenizer.json` (creating the directory); returns its path.

    Through a temporary file and a rename: a crash leaves no half-written file.
    """
    path = Path(directory) / FILE_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, writer=self._backend.save)
    self.directory = Path(directory)
    return path

  def digest(self) -> str:
    """The SHA-256 of tokenizer.json where it was loaded from or last saved to, name and bytes
    (`files.files_digest`): the corpus cache's key."""
    if self.directory is None:
      raise TokenizerError('a tokenizer has a digest once saved: call save(directory) first')
    return files_digest([self.directory / name for name in self.FILES])

  @property
  def vocab_size(self) -> int:
    return self._backend.get_vocab_size()

  def encode(self, texts: Sequence[str]) -> list[list[int]]:
    """Token ids per text, without BOS/EOS; unknown characters become <unk>."""
    ids, lengths = self.encode_flat(texts)
    return [row.tolist() for row in np.split(ids, np.cumsum(lengths)[:-1])] if len(lengths) else []

  def encode_flat(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [sum of lengths], lengths int64 [texts]): `encode`'s rows joined, without
    building a Python list per text (what the corpus cache stores)."""
    if isinstance(texts, str):
      raise TypeError('encode takes a sequence of texts; wrap a single one as [text]')
    if self._memo is not None:
      return self._memo.encode(texts)
    return word_memo.encode_lines(self._encoder, list(texts))

  def encode_target(self, texts: Sequence[str]) -> list[list[int]]:
    """Target-side ids: the same as `encode`, the vocabulary being shared (a Marian tokenizer's
    sides have their own subword models)."""
    return self.encode(texts)

  def decode(self, ids: Sequence[Sequence[int]] | np.ndarray) -> list[str]:
    """Texts from rows of ids, e.g. model output `[B, T]`.

    Each row ends at its first EOS (later tokens are ignored); PAD and BOS are
    dropped anywhere; <unk> decodes to the text '<unk>'.
    """
    rows = []
    for row in ids:
      row = [int(token) for token in row]
      if self.eos_id in row:
        row = row[: row.index(self.eos_id)]
      bad = [token for token in row if not 0 <= token < self.vocab_size]
      if bad:
        raise TokenizerError(
          f'cannot decode ids {bad[:5]}: outside the vocabulary [0, {self.vocab_size})'
        )
      rows.append([token for token in row if token not in (self.pad_id, self.bos_id)])
    # skip_special_tokens=False keeps <unk> visible; PAD/BOS/EOS are already gone.
    return self._backend.decode_batch(rows, skip_special_tokens=False)

  def id_to_token(self, token_id: int) -> str:
    return self._backend.id_to_token(token_id)

  def bpe_dropout(self, rate: float) -> BpeDropout:
    """This tokenizer's merges resampled at `rate` (`bpe_dropout`); TokenizerError unless
    its model is BPE. The merges are those it encodes with (`special_tokens_as_text`: none
    that spells a special token), so no draw makes a special id out of text."""
    return BpeDropout.of(self._encoder, rate)

  def check_compatible(self, config: ModelConfig) -> None:
    """Raises ConfigError unless the model's vocabulary and special ids match this tokenizer."""
    check_compatible(self, config)


def special_tokens_as_text(
  backend: tokenizers.Tokenizer, config: dict | None = None
) -> tokenizers.Tokenizer:
  """A tokenizer for encoding with `backend`'s ids that never gives a special id for text, and
  the same ids as `backend` for any text without a special token's string (module docstring).

  Text reaches a special id three ways, each closed here: `tokenizers` matches added tokens
  in the raw text (`encode_special_tokens` turns that off; tokenizer.json does not hold it,
  so it is set on every backend we wrap, loaded or unpickled); a BPE merge can spell one
  ('</s' + '>' when the training text held '</s>'): such merges are dropped; a unigram
  model holds them as pieces, with the best score there is: their strings become ones no
  word can hold (two '▁': Metaspace starts a word at each). Lowering their scores instead
  would not do: a unigram model prices an unknown character below its lowest score. The
  copy only encodes; `backend` stays what is saved, decoded and named.

  config: `backend`'s tokenizer.json, parsed, if at hand; it is changed in place to the
    returned tokenizer's (its model's merges or pieces only).
  """
  config = config if config is not None else json.loads(backend.to_str())
  model = config['model']
  specials = set(SPECIAL_TOKENS)
  changed = False
  if model.get('type') == 'BPE':
    prefix = model.get('continuing_subword_prefix') or ''
    merges = [merge for merge in model['merges'] if _merged(merge, prefix) not in specials]
    changed, model['merges'] = len(merges) != len(model['merges']), merges
  elif model.get('type') == 'Unigram':
    for entry in model['vocab']:
      if entry[0] in specials:
        entry[0], changed = 2 * word_memo.METASPACE + entry[0], True
  encoder = tokenizers.Tokenizer.from_str(json.dumps(config)) if changed else backend
  encoder.encode_special_tokens = True
  return encoder


def _merged(merge: list[str] | str, prefix: str) -> str:
  """The token a BPE merge makes (`merges` holds [left, right] pairs, or 'left right' in
  files of older `tokenizers`)."""
  left, right = merge if isinstance(merge, list) else merge.split(' ', 1)
  return left + right.removeprefix(prefix)


def _without_learned_copies_of_special_tokens(
  backend: tokenizers.Tokenizer,
) -> tokenizers.Tokenizer:
  """A just-trained unigram model without the pieces it learnt that spell a special token
  (training text holding '</s>' gives a second '</s>' piece, which takes the name's id);
  the pieces after it move up one id. Other models are returned as they are."""
  config = json.loads(backend.to_str())
  model = config['model']
  if model.get('type') != 'Unigram':
    return backend
  reserved = len(SPECIAL_TOKENS)
  vocab = model['vocab'][:reserved] + [
    entry for entry in model['vocab'][reserved:] if entry[0] not in SPECIAL_TOKENS
  ]
  if len(vocab) == len(model['vocab']):
    return backend
  model['vocab'] = vocab
  for token in config['added_tokens']:
    token['id'] = SPECIAL_TOKENS.index(token['content'])
  return tokenizers.Tokenizer.from_str(json.dumps(config))
