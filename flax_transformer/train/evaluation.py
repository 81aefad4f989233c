"""Translation scores of a split: decoded across processes, scored with sacreBLEU.

    values, report = translation_scores(translator, dataset['test'], Greedy())
    values    # {'bleu': ..., 'chrf': ..., 'exact_match': ...}
    report    # {'signature': sacreBLEU's signatures, 'samples': the first translations,
              #  'bleu_left_out': why BLEU says nothing here, or ''}
    describe_scores(values, report)   # 'BLEU 37.06, chrF 62.50, exact match 12.3%'

BLEU is the geometric mean of 1- to 4-gram precisions, so references that all have
fewer than 4 words (the toy task's German numbers are single words) give BLEU 0
whatever the output: such a report leaves BLEU out and says why (metrics.jsonl
still records the value), and chrF and exact match tell the quality.

Every process calls these together: process p of P decodes sentences p, p + P,
p + 2P, ... (each sentence once, and shares of alike length mix even when the
corpus is sorted by length), then the translations are gathered everywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import datasets
import jax
import numpy as np
import sacrebleu
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from flax_transformer.data.preprocessing import moses_tokenized
from flax_transformer.decode.methods import DecodingMethod, Greedy
from flax_transformer.decode.translator import Translator

# Sentences per decoding batch when computing BLEU.
DECODE_BATCH = 128
# Translations shown in a report.
NUM_SAMPLES = 5
# BLEU's longest n-gram: a reference with fewer words has none of that order.
BLEU_MAX_ORDER = 4


def translation_scores(
  translator: Translator,
  split: datasets.Dataset,
  method: DecodingMethod,
  progress: str | None = None,
  lang: str | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
  """Decodes a split's sources with `method`: ({'bleu', 'bleu_lc', 'chrf', 'exact_match'},
  {'signature', 'samples'}), with 'bleu_tok' (`tokenized_bleu`) when `lang`, the target
  language, is given.

  progress: the label of a progress bar (sentences, rate, ETA) over this process's share;
  None shows none.

  chrF is reported beside BLEU because BLEU's 4-grams say little about one-word
  outputs such as the toy task's German numbers (`bleu_left_out`).
  """
  sources, references = list(split['source']), list(split['target'])
  index, count = jax.process_index(), jax.process_count()
  with tqdm(
    total=len(sources[index::count]),
    desc=progress,
    unit='sentences',
    leave=False,
    disable=progress is None,
    dynamic_ncols=True,
  ) as bar:
    hypotheses = translate_across_processes(translator, sources, method=method, on_batch=bar.update)
  values, signatures = corpus_scores(hypotheses, references, lang)
  samples = '\n'.join(
    f'  source:    {s}\n  reference: {r}\n  output:    {h}'
    for s, r, h in list(zip(sources, references, hypotheses))[:NUM_SAMPLES]
  )
  return values, {
    'signature': signatures,
    'samples': samples,
    'bleu_left_out': bleu_left_out(references, sacrebleu.metrics.BLEU().tokenizer),
  }


def corpus_scores(
  hypotheses: Sequence[str], references: Sequence[str], lang: str | None = None
) -> tuple[dict[str, float], str]:
  """({'bleu', 'bleu_lc', 'chrf', 'exact_match'}, and 'bleu_tok' and 'length_ratio' when
  `lang` is given, the signatures in one line): sacreBLEU cased and lowercased (13a) and chrF
  on the text as given, and `tokenized_bleu` in the target language `lang` with its tokens
  of output per reference token (fairseq's "ratio": below 1, BLEU's brevity penalty applies)."""
  bleu, bleu_lc, chrf = sacrebleu_metrics()
  values = {
    'bleu': bleu.corpus_score(hypotheses, [references]).score,
    'bleu_lc': bleu_lc.corpus_score(hypotheses, [references]).score,
    'chrf': chrf.corpus_score(hypotheses, [references]).score,
    'exact_match': float(np.mean([h == r for h, r in zip(hypotheses, references)])),
  }
  signature = (
    f'BLEU {bleu.get_signature()}, BLEU lowercased {bleu_lc.get_signature()}, '
    f'chrF {chrf.get_signature()}'
  )
  if lang is not None:
    score, tokenized_signature = tokenized_bleu(hypotheses, references, lang)
    values['bleu_tok'] = score.score
    values['length_ratio'] = score.sys_len / score.ref_len
    signature += f', tokenized BLEU {tokenized_signature}'
  return values, signature


def sacrebleu_metrics() -> tuple[
  sacrebleu.metrics.BLEU, sacrebleu.metrics.BLEU, sacrebleu.metrics.CHRF
]:
  """The text-as-given scores every report gives: BLEU cased and lowercased (13a), chrF."""
  return (
    sacrebleu.metrics.BLEU(),
    sacrebleu.metrics.BLEU(lowercase=True),
    sacrebleu.metrics.CHRF(),
  )


def tokenized_bleu(
  hypotheses: Sequence[str], references: Sequence[str], lang: str
) -> tuple[sacrebleu.metrics.bleu.BLEUScore, str]:
  """BLEU as fairseq-era papers report it on Multi30k ("tokenized BLEU"): hypotheses and
  references punctuation-normalised, lowercased and Moses-tokenized in `lang` (sacremoses,
  escape off), scored by sacreBLEU with no tokenizer of its own. Returns the score and its
  signature, which names that preprocessing."""
  bleu = sacrebleu.metrics.BLEU(tokenize='none', force=True)
  score = bleu.corpus_score(moses_tokenized(hypotheses, lang), [moses_tokenized(references, lang)])
  import sacremoses

  return score, (
    f'{bleu.get_signature()}|pre:moses-norm+lc+tok-{lang}|sacremoses:{sacremoses.__version__}'
  )


def bleu_left_out(references: Sequence[str], tokenize: Callable[[str], str]) -> str:
  """Why BLEU is meaningless for these references (each has fewer than 4 words after
  BLEU's tokenization: no 4-grams, so BLEU is 0 by definition), or ''."""
  longest = max((len(tokenize(reference).split()) for reference in references), default=0)
  if longest >= BLEU_MAX_ORDER:
    return ''
  words = 'single words' if longest <= 1 else f'at most {longest} words'
  return (
    f'BLEU left out: the references are {words}, with no {BLEU_MAX_ORDER}-grams, so BLEU '
    'is 0 whatever the output'
  )


def score_lines(
  hypotheses: Sequence[str], references: Sequence[str], lang: str | None
) -> list[str]:
  """decode.py --reference's report: sacreBLEU's BLEU cased and lowercased and chrF, then the
  tokenized BLEU in the target language `lang` (or why it is missing), each with its signature."""
  lines = []
  for metric in sacrebleu_metrics():
    score = metric.corpus_score(hypotheses, [references])
    lines.append(f'{score}  signature: {metric.get_signature()}')
  if lang is None:
    return [*lines, 'tokenized BLEU: not computed, the target language is unknown (--target-lang)']
  score, signature = tokenized_bleu(hypotheses, references, lang)
  return [*lines, f'tokenized {score}  signature: {signature}']


def describe_scores(values: dict[str, float], report: dict[str, str]) -> str:
  """'BLEU 37.06, chrF 62.50, exact match 12.3%', or without BLEU and why (`bleu_left_out`)."""
  scores = f'chrF {values["chrf"]:.2f}, exact match {values["exact_match"]:.1%}'
  if report.get('bleu_left_out'):
    return f'{scores} ({report["bleu_left_out"]})'
  lowercased = f', lowercased {values["bleu_lc"]:.2f}' if 'bleu_lc' in values else ''
  tokenized = f', tokenized BLEU {values["bleu_tok"]:.2f}' if 'bleu_tok' in values else ''
  return f'BLEU {values["bleu"]:.2f}{lowercased}{tokenized}, {scores}'


def translate_across_processes(
  translator: Translator,
  sentences: Sequence[str],
  batch_size: int = DECODE_BATCH,
  method: DecodingMethod = Greedy(),
  on_batch: Callable[[int], object] | None = None,
) -> list[str]:
  """Translations of `sentences` (greedy by default) in their order, on every process.

  Call it on every process (it gathers across them); with one process it is
  `translator.translate(sentences, method)`. on_batch: as `Translator.translate`'s, for
  this process's share.
  """
  index, count = jax.process_index(), jax.process_count()
  share = translator.translate(
    list(sentences[index::count]), method, batch_size=batch_size, on_batch=on_batch
  )
  translations = [''] * len(sentences)
  for process, texts in enumerate(_allgather_texts(share)):
    translations[process::count] = texts
  return translations


def _allgather_texts(texts: list[str]) -> list[list[str]]:
  """Each process's list of strings -> every process's list, on every process, in process order.

  Collectives move arrays of one shape everywhere, so the strings travel as
  UTF-8 bytes in a zero-padded uint8 `[P, rows, bytes]` array with their byte
  lengths `[P, rows]`, after a first exchange agrees on the rows (the longest
  list) and the bytes (the longest string).
  """
  if jax.process_count() == 1:
    return [list(texts)]
  encoded = [text.encode() for text in texts]
  sizes = multihost_utils.process_allgather(
    np.array([len(encoded), max(map(len, encoded), default=0)], np.int32)
  )  # [P, 2]
  rows, width = max(int(sizes[:, 0].max()), 1), max(int(sizes[:, 1].max()), 1)
  data, lengths = np.zeros((rows, width), np.uint8), np.zeros(rows, np.int32)
  for row, raw in enumerate(encoded):
    data[row, : len(raw)] = np.frombuffer(raw, np.uint8)
    lengths[row] = len(raw)
  data, lengths = multihost_utils.process_allgather((data, lengths))  # [P, rows, bytes], [P, rows]
  return [
    [data[p, r, : lengths[p, r]].tobytes().decode() for r in range(sizes[p, 0])]
    for p in range(len(sizes))
  ]
