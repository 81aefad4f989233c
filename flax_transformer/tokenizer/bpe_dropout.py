"""BPE-dropout (Provilkov et al., 2020): a trained BPE tokenizer's segmentation resampled with
each merge skipped at a rate, so that training sees a word in many segmentations.

Axis legend: N sentences, K their tokens, W their words, A the words resampled (those of more
than one character), C a word's symbols (characters, then merged pieces).

    dropout = BpeDropout.of(backend, rate=0.1)   # a `tokenizers` backend whose model is BPE
    ids, lengths = dropout.resegment(ids, lengths, keys)   # flat ids [K] of N sentences, keys [N]

The merge rule is subword-nmt's `apply_bpe.encode` with dropout, the one the paper names:
starting from a word's characters, each round keeps every adjacent pair that has a merge with
probability 1 - rate, merges the best-ranked kept pair at each of its kept places from the
left (never overlapping: x x x -> xx x), and the word is done when a round keeps none. At
rate 0 it is plain BPE, the same ids as `tokenizers` (tests/test_bpe_dropout.py checks every
word of a corpus) for merges in the order they were learned (others are refused) and for the
merges the tokenizer encodes with (`subword.Tokenizer.bpe_dropout`: none that spells a special
token). Every word of a batch advances one round at a time together, as arrays.

`tokenizers`' own BPE dropout draws from an unseeded thread generator
(huggingface/tokenizers#644), so its segmentations cannot be drawn again on resume. Here the
draw of round r at symbol place c of word w of a sentence is a hash of (the sentence's key,
w, r, c): a sentence's segmentation is a pure function of its key, whichever batch, process
or thread resamples it.

It works on ids, not text: a word is a token that starts with '▁' (Metaspace) and the tokens
after it up to the next such one, so it runs on an encoded corpus. A word with a special
token or `<unk>` in it (a character outside the vocabulary) keeps its ids.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import tokenizers

from flax_transformer.errors import TokenizerError

METASPACE = '▁'
SPECIAL_PIECES = ('<pad>', '<s>', '</s>', '<unk>')
# The BPE options the merge rule here implements; a tokenizer.json with others is refused.
_PLAIN_BPE = {
  'continuing_subword_prefix': None,
  'end_of_word_suffix': None,
  'byte_fallback': False,
  'ignore_merges': False,
}
_NO_RANK = np.iinfo(np.int64).max
# The word lengths (characters) that bound each group merged together (`_merge_rounds`).
_GROUP_WIDTHS = (4, 6, 8, 11, 16)


class BpeDropout:
  """Resamples the BPE segmentation of encoded sentences (module docstring).

  vocab: piece -> id; merges: (left piece, right piece) in rank order (first merged first);
  rate: the probability that a merge is skipped where it applies, in [0, 1] (0: plain BPE);
  special: pieces that are never spelt out (a word holding one keeps its ids): the special
    tokens, `<unk>` and a tokenizer's other added tokens.
  """

  def __init__(
    self,
    vocab: Mapping[str, int],
    merges: Sequence[tuple[str, str]],
    rate: float,
    special: Iterable[str] = SPECIAL_PIECES,
  ):
    if not 0 <= rate <= 1:
      raise TokenizerError(f'the BPE-dropout rate must be in [0, 1], got {rate}')
    _check_merge_order(merges)
    self.rate = float(rate)
    special = set(special)
    size = max(vocab.values()) + 1
    pieces = [''] * size
    for piece, token in vocab.items():
      pieces[token] = piece
    self._size = size
    self._merges = _MergeTable(
      [vocab[a] * size + vocab[b] for a, b in merges], [vocab[a + b] for a, b in merges]
    )
    self._starts_word = np.array([piece.startswith(METASPACE) for piece in pieces])
    # Each piece spelt in single-character ids (CSR); a special piece, or one with a
    # character outside the vocabulary, cannot be.
    spelling = [[vocab.get(character, -1) for character in piece] for piece in pieces]
    self._spellable = np.array(
      [piece not in special and -1 not in ids for piece, ids in zip(pieces, spelling)]
    )
    self._spelling_lengths = np.array([len(ids) for ids in spelling], np.int64)
    self._spelling_starts = np.concatenate([[0], np.cumsum(self._spelling_lengths)[:-1]])
    self._spelling = np.array([i for ids in spelling for i in ids], np.int64)

  @classmethod
  def of(cls, backend: tokenizers.Tokenizer, rate: float) -> BpeDropout:
    """The dropout of a `tokenizers` backend whose model is plain BPE and whose words start
    at '▁' (Metaspace, as `subword.Tokenizer.train` makes them), else TokenizerError."""
    config = json.loads(backend.to_str())
    model, words = config['model'], config.get('pre_tokenizer') or {}
    if model['type'] != 'BPE':
      raise TokenizerError(
        f'BPE-dropout resamples the merges of a BPE model; this tokenizer is {model["type"]} '
        '(data.tokenizer=bpe trains one with them)'
      )
    unusual = {
      name: model.get(name) for name, plain in _PLAIN_BPE.items() if model.get(name, plain) != plain
    }
    if unusual:
      raise TokenizerError(f'BPE-dropout supports plain BPE; this tokenizer sets {unusual}')
    if (words.get('type'), words.get('replacement'), words.get('split')) != (
      'Metaspace',
      METASPACE,
      True,
    ):
      raise TokenizerError(
        "BPE-dropout finds words by their leading '▁' (a Metaspace pre-tokenizer that splits); "
        f'this tokenizer pre-tokenizes with {words.get("type")}'
      )
    merges = [tuple(m.split(' ')) if isinstance(m, str) else tuple(m) for m in model['merges']]
    added = [token['content'] for token in config.get('added_tokens') or ()]
    special = {*SPECIAL_PIECES, *added, *([model['unk_token']] if model.get('unk_token') else [])}
    return cls(model['vocab'], merges, rate, special)

  def resegment(
    self,
    ids: np.ndarray,
    lengths: np.ndarray,
    keys: np.ndarray,
    limits: np.ndarray | None = None,
  ) -> tuple[np.ndarray, np.ndarray]:
    """N sentences resampled: (ids [K'], lengths [N]).

    ids: [K] the sentences' ids, flat, no BOS/EOS; lengths: [N] tokens of each.
    keys: uint64 [N], what each sentence's draws are a hash of (module docstring).
    limits: [N] the most tokens each sentence may have (None: no limit); from its last word
      back, words get their given ids again until it fits (ValueError if its given ids are
      longer).
    """
    ids, lengths = np.asarray(ids, np.int64), np.asarray(lengths, np.int64)
    words = _Words(ids, lengths, self._starts_word)
    unspellable = (~self._spellable[ids]).astype(np.float64)
    spellable = np.bincount(words.of_token, unspellable, words.count) == 0
    characters = np.bincount(words.of_token, self._spelling_lengths[ids], words.count)
    # A word of single characters has no merge to skip, so it stays as it is.
    resampled = np.flatnonzero(spellable & (characters > words.lengths))
    characters = characters[resampled].astype(np.int64)
    spelt = self._spelt(ids, words, resampled)
    new_lengths, pieces = words.lengths.copy(), np.zeros(0, np.int64)
    if len(resampled):
      word_keys = _word_keys(keys, words)[resampled]
      new_lengths[resampled], pieces = self._merge_rounds(spelt, characters, word_keys)
    if limits is not None:
      reverted = _to_revert(words, new_lengths, np.asarray(limits, np.int64))
      keep = ~np.isin(resampled, reverted)
      pieces = pieces[np.repeat(keep, new_lengths[resampled])]
      new_lengths[reverted] = words.lengths[reverted]
      resampled = resampled[keep]
    return words.assemble(ids, new_lengths, resampled, pieces)

  def _spelt(self, ids: np.ndarray, words: _Words, chosen: np.ndarray) -> np.ndarray:
    """The `chosen` words spelt in character ids, one after another, flat."""
    tokens = ids[np.isin(words.of_token, chosen)]
    token, place = _token_spans(self._spelling_lengths[tokens])
    return self._spelling[self._spelling_starts[tokens][token] + place]

  def _merge_rounds(
    self, spelt: np.ndarray, widths: np.ndarray, keys: np.ndarray
  ) -> tuple[np.ndarray, np.ndarray]:
    """A words (`spelt`: their characters flat, `widths` [A] of each) merged round by round
    until each keeps no pair: (lengths [A], their pieces flat).

    Words of similar length go together, as [words, characters] arrays only as wide as the
    widest still merging: a word is done within as many rounds as it has characters, and
    most are short.
    """
    starts = np.cumsum(widths) - widths
    group_of = np.searchsorted(_GROUP_WIDTHS, widths)
    finished = []  # (indices into A, their rows)
    for group in np.unique(group_of):
      active = np.flatnonzero(group_of == group)
      width = int(widths[active].max())
      rows = np.full((len(active), width), -1, np.int64)
      row, column = _token_spans(widths[active])
      rows[row, column] = spelt[starts[active][row] + column]
      row_keys = keys[active]
      for round_index in itertools.count():
        merged = self._merge_round(rows, row_keys, round_index) if rows.shape[1] > 1 else None
        if merged is None:
          break
        rows, progressed = merged
        finished.append((active[~progressed], rows[~progressed]))
        active, rows, row_keys = active[progressed], rows[progressed], row_keys[progressed]
        rows = rows[:, : int((rows >= 0).sum(axis=1).max(initial=0))]
      finished.append((active, rows))
    lengths = np.zeros(len(widths), np.int64)
    for indices, rows in finished:
      lengths[indices] = (rows >= 0).sum(axis=1)
    offsets = np.cumsum(lengths) - lengths
    pieces = np.empty(int(lengths.sum()), np.int64)
    for indices, rows in finished:
      row, column = np.nonzero(rows >= 0)
      pieces[offsets[indices][row] + column] = rows[row, column]
    return lengths, pieces

  def _merge_round(self, rows: np.ndarray, keys: np.ndarray, round_index: int):
    """One round over [A, C] rows: (rows after it, [A] whether each merged), None if none did."""
    left, right = rows[:, :-1], rows[:, 1:]
    found = self._merges.find(np.where(right >= 0, left * self._size + right, -1))
    kept = (found >= 0) & (draws(keys, round_index, left.shape[1]) >= self.rate)
    rank = np.where(kept, found, _NO_RANK)  # a merge's index in the table is its rank
    best = rank.min(axis=1, keepdims=True)
    progressed = best[:, 0] < _NO_RANK
    if not progressed.any():
      return None
    chosen = (rank == best) & progressed[:, None]
    # Of a run of adjacent chosen places (the same pair repeated: x x x), every other one
    # from the run's start, as subword-nmt's left-to-right scan merges them.
    place = np.arange(chosen.shape[1])
    starts = chosen & ~np.pad(chosen, ((0, 0), (1, 0)))[:, :-1]
    run_start = np.maximum.accumulate(np.where(starts, place, -1), axis=1)
    merge = chosen & ((place - run_start) % 2 == 0)
    rows = rows.copy()
    rows[:, :-1] = np.where(merge, self._merges.merged[np.maximum(found, 0)], left)
    removed = np.pad(merge, ((0, 0), (1, 0)))  # the right symbol of each merge
    return _compacted(rows, ~removed & (rows >= 0)), progressed


def _check_merge_order(merges: Sequence[tuple[str, str]]) -> None:
  """TokenizerError unless every merge comes after the merges that make its parts: the merge
  rule applies a round's best pair at all its places before any pair it creates, which is
  BPE's own order only then (a trained tokenizer's merges always are; an edited file's may not)."""
  made_at = {}
  for rank, (left, right) in enumerate(merges):
    made_at.setdefault(left + right, rank)
  for rank, (left, right) in enumerate(merges):
    for part in (left, right):
      if made_at.get(part, -1) > rank:
        raise TokenizerError(
          f'BPE merge {rank} ({left!r} + {right!r}) comes before merge {made_at[part]}, which '
          f'makes {part!r}: BPE-dropout needs merges in the order they were learned'
        )


class _MergeTable:
  """Pair keys (left id * vocabulary size + right id) -> their merge's rank, looked up for a
  whole array at once: open addressing in NumPy arrays, Fibonacci-hashed (a dict would be a
  Python call per pair, np.searchsorted twice as slow).

  keys: [M] in rank order; merged: [M] the id each merge makes.
  """

  _MULTIPLIER = np.uint64(0x9E3779B97F4A7C15)

  def __init__(self, keys: Sequence[int], merged: Sequence[int]):
    self.merged = np.asarray(merged, np.int64).reshape(-1)
    bits = max(4 * len(keys), 16).bit_length()  # at most a quarter full
    self._mask, self._shift = (1 << bits) - 1, np.uint64(64 - bits)
    self._keys = np.full(1 << bits, -1, np.int64)
    self._ranks = np.full(1 << bits, -1, np.int64)
    for rank, (key, slot) in enumerate(zip(keys, self._slots(np.asarray(keys, np.int64)))):
      while self._keys[slot] != -1:
        slot = (slot + 1) & self._mask
      self._keys[slot], self._ranks[slot] = key, rank

  def _slots(self, keys: np.ndarray) -> np.ndarray:
    with np.errstate(over='ignore'):
      return ((keys.astype(np.uint64) * self._MULTIPLIER) >> self._shift).astype(np.int64)

  def find(self, keys: np.ndarray) -> np.ndarray:
    """The rank of each key's merge, -1 where there is none (and for key -1)."""
    flat = keys.ravel()
    found = np.full(flat.shape, -1, np.int64)
    pending = np.flatnonzero(flat >= 0)
    slots = self._slots(flat[pending])
    while len(pending):
      stored = self._keys[slots]
      hit = stored == flat[pending]
      found[pending[hit]] = self._ranks[slots[hit]]
      probing = ~hit & (stored != -1)
      pending, slots = pending[probing], (slots[probing] + 1) & self._mask
    return found.reshape(keys.shape)


class _Words:
  """The words of N flat sentences: which word each token is in, each word's sentence, its
  place in that sentence and its tokens."""

  def __init__(self, ids: np.ndarray, lengths: np.ndarray, starts_word: np.ndarray):
    sentence_start = np.zeros(len(ids), bool)
    sentence_start[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
    starts = starts_word[ids] | sentence_start
    self.of_token = np.cumsum(starts) - 1  # [K]
    self.count = int(starts.sum())
    self.sentence = np.repeat(np.arange(len(lengths)), lengths)[starts]  # [W]
    self.lengths = np.bincount(self.of_token, minlength=self.count)  # [W] tokens in each
    first = np.searchsorted(self.sentence, np.arange(len(lengths)))
    self.place = np.arange(self.count) - first[self.sentence]  # [W] within its sentence
    self.num_sentences = len(lengths)

  def assemble(
    self, ids: np.ndarray, new_lengths: np.ndarray, resampled: np.ndarray, pieces: np.ndarray
  ) -> tuple[np.ndarray, np.ndarray]:
    """(ids, lengths [N]) with the `resampled` words' tokens replaced by `pieces` (theirs,
    flat, in order), the other words' as they were."""
    out = np.zeros(int(new_lengths.sum()), np.int64)
    starts = np.cumsum(new_lengths) - new_lengths
    is_resampled = np.zeros(self.count, bool)
    is_resampled[resampled] = True
    kept = ~is_resampled[self.of_token]
    old_starts = np.cumsum(self.lengths) - self.lengths
    within = np.arange(len(ids)) - old_starts[self.of_token]
    out[starts[self.of_token[kept]] + within[kept]] = ids[kept]
    word, place = _token_spans(new_lengths[resampled])
    out[starts[resampled][word] + place] = pieces
    sentence_lengths = np.bincount(self.sentence, new_lengths, self.num_sentences)
    return out.astype(np.int32), sentence_lengths.astype(np.int64)


def _to_revert(words: _Words, new_lengths: np.ndarray, limits: np.ndarray) -> np.ndarray:
  """The words to give their former ids back so that each sentence fits its limit: from its
  last word back, those that grew, until the sentence fits (ValueError for a sentence whose
  given ids do not fit)."""
  totals = np.bincount(words.sentence, new_lengths, words.num_sentences)
  reverted = []
  for sentence in np.flatnonzero(totals > limits):
    excess = totals[sentence] - limits[sentence]
    for word in np.flatnonzero(words.sentence == sentence)[::-1]:
      if excess <= 0:
        break
      if new_lengths[word] > words.lengths[word]:
        reverted.append(word)
        excess -= new_lengths[word] - words.lengths[word]
    if excess > 0:  # its given ids alone are longer than its limit
      given = int(words.lengths[words.sentence == sentence].sum())
      raise ValueError(
        f'sentence {sentence} has {given} ids, more than its limit {limits[sentence]}'
      )
  return np.array(sorted(reverted), np.int64)


def _word_keys(keys: np.ndarray, words: _Words) -> np.ndarray:
  """uint64 [W]: each word's key, from its sentence's key and its place in the sentence."""
  sentence_keys = np.asarray(keys, np.uint64)[words.sentence]
  return mix(sentence_keys ^ mix(words.place.astype(np.uint64) + np.uint64(1)))


def draws(keys: np.ndarray, round_index: int, width: int) -> np.ndarray:
  """float64 [A, width] in [0, 1): the uniform draws of one round at each symbol place."""
  counter = (np.uint64(round_index) << np.uint64(32)) | np.arange(width, dtype=np.uint64)
  bits = mix(np.asarray(keys, np.uint64)[:, None] ^ mix(counter + np.uint64(1))[None, :])
  return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-53


def mix(x: np.ndarray) -> np.ndarray:
  """SplitMix64's finaliser, elementwise on uint64 (wrapping): a well-spread hash."""
  x = np.asarray(x, np.uint64)
  with np.errstate(over='ignore'):  # the wrap is the hash (a scalar would warn of it)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return x ^ (x >> np.uint64(31))


def _token_spans(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """For sum(counts) entries: the item each belongs to and its place within it (the data
  layer's `plans.token_spans`, which this layer, below it, cannot import)."""
  counts = np.asarray(counts, np.int64)
  items = np.repeat(np.arange(len(counts)), counts)
  return items, np.arange(int(counts.sum())) - (np.cumsum(counts) - counts)[items]


def _compacted(rows: np.ndarray, keep: np.ndarray) -> np.ndarray:
  """[A, C] rows with the kept entries moved left, in order, -1 after them."""
  width = rows.shape[1]
  kept = np.flatnonzero(keep)
  column = (np.cumsum(keep, axis=1) - 1).ravel()[kept]
  out = np.full_like(rows, -1)
  out.ravel()[kept // width * width + column] = rows.ravel()[kept]
  return out
