"""Scheduled sampling against teacher forcing on Multi30k: BLEU, and the train/test mismatch.

  python -m benchmarks.scheduled_sampling --workdirs /work/runs/ss-off,/work/runs/ss-on --step 2000

For each run directory, at checkpoint `--step` (the latest when omitted; every
run is evaluated at the same step), on validation and test_2016:

- cased sacreBLEU (13a; lowercased BLEU and chrF beside it) of greedy search
  and of beam search (4, alpha 0.6), the parameters of that one checkpoint;
- the mismatch that scheduled sampling addresses, as two token accuracies over
  the reference positions (EOS included): under teacher forcing (position t
  predicted from the reference prefix, as in training) and free-running (the
  greedy output's token t against the reference's token t, the output reading
  its own earlier tokens, as at test time; positions past the output's end
  count as wrong). The gap between them is how much the model's own mistakes
  cost it.

Results: benchmarks/results/scheduled_sampling.json, one entry per run and step
(`WORKDIR@STEP`): a run evaluated again replaces its entry and leaves the
others, so runs can be evaluated as each finishes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import jax
import numpy as np

from benchmarks import common
from benchmarks.multi30k import DEFAULT_DATA, RESULTS, comma_separated, score, training_summary
from flax_transformer.decode.methods import BeamSearch, Greedy

BATCH = 64  # sentences per decoding batch
WIDTH = 8  # padded lengths are multiples of this, to bound the compiles


def positionwise_correct(output: np.ndarray, reference: np.ndarray) -> int:
  """How many reference positions t hold the same token in `output` (ids [L], EOS-terminated,
  any padding after) and `reference` (ids [T], EOS last); output positions past L count wrong."""
  length = min(len(output), len(reference))
  return int(np.sum(output[:length] == reference[:length]))


def pad_rows(rows: list[np.ndarray], pad_id: int, height: int) -> np.ndarray:
  """int32 [height, W]: the rows left-aligned, W the longest rounded up to WIDTH."""
  width = -(-max(len(row) for row in rows) // WIDTH) * WIDTH
  out = np.full((height, width), pad_id, np.int32)
  for i, row in enumerate(rows):
    out[i, : len(row)] = row
  return out


def mismatch(translator, sources: list[str], references: list[str]) -> dict:
  """Teacher-forced and free-running greedy token accuracies, and the greedy translations."""
  config, tokenizer = translator.config, translator.tokenizer
  src_ids = translator.encode(sources).ids
  refs = [
    np.array(ids[: config.max_len - 1] + [config.eos_id], np.int32)
    for ids in tokenizer.encode(references)
  ]
  forward = jax.jit(functools.partial(translator.model.apply, translator.variables))
  hypotheses, counts = [''] * len(sources), {'teacher_forced': 0, 'free_running': 0}
  order = sorted(range(len(sources)), key=lambda i: -len(src_ids[i]))
  for start in range(0, len(order), BATCH):
    rows = order[start : start + BATCH]
    src = pad_rows([src_ids[i] for i in rows], config.pad_id, BATCH)  # [B, S]
    tgt_out = pad_rows([refs[i] for i in rows], config.pad_id, BATCH)  # [B, T]
    tgt_in = np.concatenate([np.full((BATCH, 1), config.bos_id, np.int32), tgt_out[:, :-1]], 1)
    tgt_in = np.where(tgt_in == config.eos_id, config.pad_id, tgt_in)  # <s> y1..yn
    predicted = np.argmax(np.asarray(forward(src, tgt_in)), -1)  # [B, T]
    real = tgt_out != config.pad_id
    counts['teacher_forced'] += int(np.sum((predicted == tgt_out) & real))
    output = Greedy().run(translator.model, translator.variables, src)  # [B, L]
    for row, index in enumerate(rows):
      counts['free_running'] += positionwise_correct(output[row], refs[index])
    for index, text in zip(rows, tokenizer.decode(output[: len(rows)])):
      hypotheses[index] = text
  tokens = sum(len(ref) for ref in refs)
  return {
    'reference_tokens': tokens,
    'teacher_forced_accuracy': counts['teacher_forced'] / tokens,
    'free_running_accuracy': counts['free_running'] / tokens,
    'greedy_hypotheses': hypotheses,
  }


def evaluate_run(workdir: Path, step: int | None, splits: dict) -> dict:
  """One run's scores on each split: BLEU greedy and beam, and the two token accuracies."""
  from flax_transformer.decode.translator import Translator

  translator = Translator.from_checkpoint(workdir, step=step)
  result = {}
  for split, (sources, references) in splits.items():
    measured = mismatch(translator, sources, references)
    beam = translator.translate(sources, BeamSearch(beam_size=4, alpha=0.6), batch_size=BATCH)
    result[split] = {
      'teacher_forced_accuracy': measured['teacher_forced_accuracy'],
      'free_running_accuracy': measured['free_running_accuracy'],
      'reference_tokens': measured['reference_tokens'],
      'greedy': score(measured['greedy_hypotheses'], references),
      'beam4-a0.6': score(beam, references),
    }
    values = result[split]
    print(
      f'{workdir.name:>12s} {split:>10s}: BLEU greedy {values["greedy"]["bleu"]:5.2f}, '
      f'beam4 {values["beam4-a0.6"]["bleu"]:5.2f}; token accuracy teacher-forced '
      f'{values["teacher_forced_accuracy"]:.1%}, free-running '
      f'{values["free_running_accuracy"]:.1%}',
      flush=True,
    )
  return result


def main() -> None:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.scheduled_sampling',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument(
    '--workdirs',
    required=True,
    type=comma_separated(str),
    help='run directories of train.py, comma-separated',
  )
  parser.add_argument(
    '--step', type=int, help='the checkpoint to evaluate in every run (default: the latest)'
  )
  parser.add_argument('--data', default=str(DEFAULT_DATA), help='the Multi30k directory')
  parser.add_argument(
    '--sentences', type=int, help='only the first N of each split (a quick check; default: all)'
  )
  parser.add_argument('--output', default=str(RESULTS / 'scheduled_sampling.json'))
  args = parser.parse_args()
  from flax_transformer.data.corpus import load_parallel
  from flax_transformer.run.checkpoints import Checkpoints
  from flax_transformer.run.directory import read_config

  dataset = load_parallel(args.data, 'en', 'de')
  splits = {
    name: (
      list(dataset[name]['source'])[: args.sentences],
      list(dataset[name]['target'])[: args.sentences],
    )
    for name in ('validation', 'test')
  }
  output = Path(args.output)
  runs = json.loads(output.read_text())['runs'] if output.is_file() else {}
  for workdir in map(Path, args.workdirs):
    train_config = read_config(workdir)[1]
    step = args.step or Checkpoints(workdir, read_only=True).latest_step()
    runs[f'{workdir}@{step}'] = {
      'scheduled_sampling': {
        name: value
        for name, value in vars(train_config).items()
        if name.startswith('scheduled_sampling')
      },
      'evaluated_step': step,
      **training_summary(workdir),
      'machine': common.machine_info(os.cpu_count()),
      'scores': evaluate_run(workdir, step, splits),
    }
  result = {'benchmark': 'scheduled_sampling', 'runs': runs}
  print(f'wrote {common.write_json(output, result)}')


if __name__ == '__main__':
  main()
