"""BPE-dropout in the training batches (`data.bpe_dropout`): each pair's ids resampled
(`tokenizer.bpe_dropout`) when its batch is assembled, as a pure function of (seed, epoch,
pair), so a resumed run draws the same segmentations and a process that builds only its rows
of a batch builds the same rows as one that builds it all.

Axis legend: N pairs, P the pairs of one batch (or of one process's rows of it).

    resegmenting = Resegmenting(tokenizer.bpe_dropout(0.1), seed=1)
    batcher = Batcher(corpus, 8192, 1, resegmenting=resegmenting)   # data.batcher

A resampled sentence is longer than its plain one (about 1.3 times at rate 0.1 on Multi30k),
so pairs are put in length buckets by the mean of `PLANNING_DRAWS` draws of their resampled
length, not their plain one: a batch of a bucket then holds about as many tokens as its
token budget says. A sentence still longer than its batch's rows in some epoch gets its plain
ids back from its last word on until it fits (`BpeDropout.resegment`'s limits); `describe`
says how often that happened in the planning draws.
"""

from __future__ import annotations

import numpy as np

from flax_transformer.data.batching import EncodedCorpus
from flax_transformer.data.plans import token_spans
from flax_transformer.data.preprocessing import unwrap
from flax_transformer.errors import TokenizerError
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.tokenizer.bpe_dropout import BpeDropout, mix

# Draws of each pair the length buckets are planned on (one of Multi30k's 29,000 costs about
# 1.5 s), of at most this many pairs (a larger corpus: a sample, `Resegmenting._plan`).
PLANNING_DRAWS = 2
PLANNING_PAIRS = 100_000
# The planning draws' epochs: far from any epoch a run reaches.
_PLANNING_EPOCH = 2**62
_SIDES = ('src', 'tgt')


def resegmenting_of(tokenizer, rate: float, seed: int) -> Resegmenting | None:
  """`data.bpe_dropout`'s resampling for a run's tokenizer (seen through its preprocessing
  or not), None at rate 0; TokenizerError for a tokenizer without BPE merges."""
  if not rate:
    return None
  inner = unwrap(tokenizer)
  if not isinstance(inner, Tokenizer):
    raise TokenizerError(
      f'BPE-dropout resamples the merges of a BPE tokenizer; a {type(inner).__name__} has '
      'none (a Marian model brings SentencePiece)'
    )
  return Resegmenting(inner.bpe_dropout(rate), seed)


class Resegmenting:
  """Resamples the pairs of training batches with `dropout` (module docstring)."""

  def __init__(self, dropout: BpeDropout, seed: int):
    self.dropout, self.seed = dropout, int(seed)
    self._planned: tuple[EncodedCorpus, np.ndarray, np.ndarray, list] | None = None

  def keys(self, example_ids: np.ndarray, epoch: int, side: str) -> np.ndarray:
    """uint64 [P]: the key of each pair's side in `epoch`, what its draws are a hash of."""
    base = mix(mix(np.uint64(self.seed) + np.uint64(1)) ^ np.uint64(epoch))
    pairs = mix(base ^ np.asarray(example_ids).astype(np.uint64))
    return mix(pairs ^ np.uint64(_SIDES.index(side) + 1))

  def planned_lengths(self, corpus: EncodedCorpus) -> np.ndarray:
    """int64 [N]: the padded length each pair is bucketed by, max(m' + 1, n' + 1) for the
    mean resampled lengths m', n' of `PLANNING_DRAWS` draws (at most `corpus.max_len`)."""
    return self._plan(corpus)[1]

  def corpus_of(
    self, corpus: EncodedCorpus, pairs: np.ndarray, epoch: int, length: int
  ) -> EncodedCorpus:
    """The P `pairs` of `corpus`, resampled for `epoch`, each side within `length` tokens
    (EOS included), as a corpus of their own (pair i is pairs[i])."""
    pairs = np.asarray(pairs, np.int64)
    example_ids = np.asarray(corpus.example_ids)[pairs]
    sides, limits = {}, np.full(len(pairs), length - 1, np.int64)
    for side in _SIDES:
      ids, offsets = getattr(corpus, f'{side}_ids'), getattr(corpus, f'{side}_offsets')
      sides[side] = self._resampled(
        ids, offsets, pairs, self.keys(example_ids, epoch, side), limits
      )
    return EncodedCorpus(
      src_ids=sides['src'][0],
      src_offsets=sides['src'][1],
      tgt_ids=sides['tgt'][0],
      tgt_offsets=sides['tgt'][1],
      example_ids=example_ids,
      max_len=corpus.max_len,
      num_dropped=0,
      pad_id=corpus.pad_id,
      bos_id=corpus.bos_id,
    )

  def describe(self, corpus: EncodedCorpus, length_buckets) -> str:
    """One line for logs: the rate, how much longer pairs are, and how often a planning
    draw was longer than its bucket (cut back to fit)."""
    _, planned, drawn_pairs, draws = self._plan(corpus)
    bucket = np.asarray(length_buckets)[np.searchsorted(length_buckets, planned[drawn_pairs])]
    cut = np.mean([lengths > bucket for lengths in draws])
    return (
      f'BPE-dropout {self.dropout.rate:g} (data.bpe_dropout): pairs resampled each epoch, '
      f'{planned.sum() / corpus.lengths.sum():.2f}x their plain padded length, bucketed by '
      f'it; {cut:.1%} of sentences longer than their rows in the planning draws (plain ids '
      'back from their last word until they fit)'
    )

  def _plan(self, corpus: EncodedCorpus) -> tuple[EncodedCorpus, np.ndarray, np.ndarray, list]:
    """(corpus, planned lengths [N], the pairs drawn, each draw's lengths of each side of
    them), memoised. A corpus of more than `PLANNING_PAIRS` pairs draws a seeded sample of
    them; every other pair is planned at its plain length times the sample's mean growth at
    that plain length (WMT14's 4.5M pairs would take minutes to draw whole)."""
    if self._planned is not None and self._planned[0] is corpus:
      return self._planned
    plain = corpus.lengths
    pairs = np.arange(len(corpus))
    if len(corpus) > PLANNING_PAIRS:
      pairs = np.sort(np.random.default_rng(self.seed).choice(pairs, PLANNING_PAIRS, False))
    example_ids = np.asarray(corpus.example_ids)[pairs]
    means, draws = [], []
    for side in _SIDES:
      ids, offsets = getattr(corpus, f'{side}_ids'), getattr(corpus, f'{side}_offsets')
      side_draws = []
      for draw in range(PLANNING_DRAWS):
        keys = self.keys(example_ids, _PLANNING_EPOCH + draw, side)
        side_draws.append(np.diff(self._resampled(ids, offsets, pairs, keys, None)[1]))
      means.append(np.ceil(np.mean(side_draws, axis=0)).astype(np.int64))
      draws += side_draws
    # A draw may merge more than plain BPE does; a pair is never planned shorter than plainly.
    drawn = np.clip(np.maximum(*means), plain[pairs], corpus.max_len)
    growth = _growth_by_length(plain[pairs], drawn, corpus.max_len)[plain]
    planned = np.clip(np.rint(plain * growth).astype(np.int64), plain, corpus.max_len)
    planned[pairs] = drawn
    self._planned = (corpus, planned, pairs, draws)
    return self._planned

  def _resampled(
    self,
    ids: np.ndarray,
    offsets: np.ndarray,
    pairs: np.ndarray,
    keys: np.ndarray,
    limits: np.ndarray | None,
  ) -> tuple[np.ndarray, np.ndarray]:
    """(int32 ids, int64 offsets [P + 1]) of one side of `pairs`, each sentence resampled
    before its final token (EOS), which stays."""
    ids, offsets = np.asarray(ids), np.asarray(offsets)
    starts, ends = offsets[pairs], offsets[pairs + 1]
    lengths = ends - starts - 1  # without EOS
    pair, place = token_spans(lengths)
    words = ids[starts[pair] + place]
    new_ids, new_lengths = self.dropout.resegment(words, lengths, keys, limits)
    new_offsets = np.zeros(len(pairs) + 1, np.int64)
    np.cumsum(new_lengths + 1, out=new_offsets[1:])
    out = np.empty(new_offsets[-1], np.int32)
    eos_at = new_offsets[1:] - 1
    body = np.ones(len(out), bool)
    body[eos_at] = False
    out[body] = new_ids
    out[eos_at] = ids[ends - 1]
    return out, new_offsets


def _growth_by_length(plain: np.ndarray, drawn: np.ndarray, max_len: int) -> np.ndarray:
  """float [max_len + 1]: the mean of drawn / plain lengths of the pairs of each plain length,
  the mean of all at the lengths none has."""
  size = max_len + 1
  counts = np.bincount(plain, minlength=size)
  sums = np.bincount(plain, drawn / np.maximum(plain, 1), minlength=size)
  overall = sums.sum() / max(counts.sum(), 1)
  return np.where(counts > 0, sums / np.maximum(counts, 1), overall)
