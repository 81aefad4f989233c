"""Translation quality of a trained Multi30k run, and its learning curves.

  python -m benchmarks.multi30k evaluate --workdir runs/multi30k      # val + test_2016 scores -> JSON
  python -m benchmarks.multi30k plot --workdir runs/multi30k          # val loss / BLEU vs time -> PNG
  python -m benchmarks.multi30k compare --workdirs runs/a,runs/b --steps 3000   # runs side by side

`evaluate` decodes the validation and test splits from the last checkpoint and
from the mean of the last K (each K of `--average-last`, 5 by default). An
autoregressive run is decoded with greedy search and beam search (4, at each
length penalty of `--alphas`, the paper's 0.6 by default); a cmlm run with
mask-predict at T = 1, 4 and 10 passes, with length beams 1 and 3, and at T = 1
and 10 on a fixed-length canvas cut at the first EOS. Each output
is scored with sacreBLEU on detokenized output (default 13a tokenizer): cased
BLEU, lowercased BLEU (`-lc`) and chrF, signatures included, and the published scores' own
metric: lowercased BLEU of Moses-tokenised text (sacremoses, then sacreBLEU tokenize='none'). Model selection
uses validation scores only; the test row of the chosen variant is the reported
result. Results: benchmarks/results/multi30k_<src><tgt>[_cmlm].json.

`compare` puts runs that differ in their tokenizer side by side up to a common
step, from their logs alone: validation BLEU and chrF at each BLEU evaluation,
and validation loss per *sentence* (the per-token loss times the validation
targets' token count under each run's own tokenizer, EOS included), which,
unlike loss per token, does not change with the vocabulary. Also each
tokenizer's subwords per training sentence, the median seconds per step, and
the training clock at each evaluation (runs whose steps cost differently
compare at equal time too).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import textwrap
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from flax_transformer.decode.methods import BeamSearch, DecodingMethod, Greedy, MaskPredict

DEFAULT_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'
RESULTS = Path(__file__).resolve().parent / 'results'


def searches(
  alphas: list[float], beams: list[int] = (4,), forms: list[str] = ('gnmt',)
) -> dict[str, DecodingMethod]:
  """Greedy, and each beam size at each length penalty alpha of each form: {'greedy': ...,
  'beam4-a0.6': ... (GNMT's penalty), 'beam5-a1-fairseq': ... (fairseq's, its --lenpen 1)}."""
  return {
    'greedy': Greedy(),
    **{
      f'beam{beam}-a{alpha:g}' + ('' if form == 'gnmt' else f'-{form}'): BeamSearch(
        beam_size=beam, alpha=alpha, penalty_form=form
      )
      for beam in beams
      for form in forms
      for alpha in alphas
    },
  }


def mask_predict_searches() -> dict[str, DecodingMethod]:
  """Mask-predict as the CMLM paper reports it: T = 1, 4, 10 passes, length beams 1 and 3;
  and the alternative to a predicted length, a fixed canvas cut at the first EOS (T = 1, 10)."""
  return {
    **{
      f'mask-predict-T{passes}-l{beam}': MaskPredict(iterations=passes, length_beam=beam)
      for passes in (1, 4, 10)
      for beam in (1, 3)
    },
    **{
      f'mask-predict-T{passes}-fixed': MaskPredict(iterations=passes, length_beam=1, length='fixed')
      for passes in (1, 10)
    },
  }


def score(hypotheses: list[str], references: list[str], language: str | None = None) -> dict:
  """Cased and lowercased sacreBLEU (13a) and chrF of detokenized output, with signatures
  (`evaluation.corpus_scores`, as train.py and decode.py report them).

  With the target `language`, also 'bleu_tok': the published Multi30k scores' own metric,
  tokenized BLEU (`evaluation.tokenized_bleu`: both sides punctuation-normalised,
  lowercased and Moses-tokenized by sacremoses, then sacreBLEU with tokenize='none').
  """
  from flax_transformer.train.evaluation import corpus_scores

  values, signatures = corpus_scores(hypotheses, references, language)
  values.pop('exact_match')
  return {**values, 'signatures': signatures}


def read_metrics(workdir: Path) -> list[dict]:
  path = workdir / 'metrics.jsonl'
  if not path.is_file():
    raise SystemExit(f'{path}: no metrics log; is {workdir} a training run directory?')
  from flax_transformer.run.metrics_log import MetricsLog

  return MetricsLog.read(path)  # a line cut short at the end (a run killed) is dropped


def step_clock(lines: list[dict]) -> dict[int, float]:
  """Step -> elapsed training seconds, from the training lines (validation lines carry no clock).

  Logs written before the clock carried on over a resume restart it at each resume: a
  line whose clock is behind the one before it starts a new process, whose seconds
  are added to those reached at the step it resumed from (the line before it).
  """
  clock, offset, previous = {}, 0.0, None
  for m in lines:
    if 'elapsed_s' not in m:
      continue
    if previous is not None and m['elapsed_s'] < previous['elapsed_s']:
      offset = clock[previous['step']]
    clock[m['step']] = m['elapsed_s'] + offset
    previous = m
  return clock


def training_summary(workdir: Path) -> dict:
  """Steps and wall-clock seconds of the run, from its metrics log."""
  lines = read_metrics(workdir)
  timed = [m for m in lines if 'elapsed_s' in m]
  return {
    'steps': max(m['step'] for m in lines),
    'train_seconds': max(step_clock(timed).values()) if timed else None,
  }


def evaluate(args) -> dict:
  from flax_transformer.data.corpus import load_parallel
  from flax_transformer.decode.translator import Translator
  from flax_transformer.nn.model import count_params
  from flax_transformer.run.directory import saved_steps

  workdir = Path(args.workdir)
  config = common.read_run_config(workdir)
  known = {'last', 'best', 'ema', *(f'average-last{k}' for k in args.average_last)}
  unknown = [w for w in args.weights or () if w not in known]
  if unknown:
    raise SystemExit(
      f'--weights {",".join(unknown)}: not one of {", ".join(sorted(known))} (an '
      'average-lastK needs K in --average-last)'
    )
  data_config = config.get('data', {})
  src, tgt = data_config.get('src_lang', 'en'), data_config.get('tgt_lang', 'de')
  if not Path(args.data).exists():
    raise SystemExit(f'{args.data}: no Multi30k directory there (pass --data DIR)')
  # The validation and test sets the run chose (data.valid_split, data.test_split), if it did.
  dataset = load_parallel(
    str(args.data),
    src,
    tgt,
    valid_split=data_config.get('valid_split'),
    test_split=data_config.get('test_split'),
  )
  splits = {
    name: (list(dataset[name]['source']), list(dataset[name]['target']))
    for name in ('validation', 'test')
  }
  cmlm = config.get('model', {}).get('kind') == 'cmlm'
  variants = (
    mask_predict_searches() if cmlm else searches(args.alphas, args.beams, args.penalty_forms)
  )
  # A lowercased run is chosen by tokenized BLEU (its cased BLEU only counts its case errors).
  select = args.select or ('bleu_tok' if data_config.get('lowercase') else 'bleu')
  rows = []
  name = f'multi30k_{src}{tgt}{"_cmlm" if cmlm else ""}.json'
  output_path = Path(args.output or RESULTS / name)
  saved = saved_steps(workdir)
  if not saved:
    raise SystemExit(f'{workdir}: no checkpoints yet (a run stopped before its first save?)')
  short = [k for k in args.average_last if k > len(saved)]
  if short:  # a run stopped (or early) before it kept that many
    print(
      f'average-last{",".join(map(str, short))} left out: the run kept {len(saved)} checkpoints'
    )
  weight_sets = [
    ('last', workdir, 0),
    *((f'average-last{k}', workdir, k) for k in args.average_last if k <= len(saved)),
  ]
  if args.best and (workdir / 'best').is_dir():
    weight_sets.append(('best', workdir / 'best', 0))
  if (workdir / 'ema').is_dir():  # the parameters' moving average (train.ema_decay)
    weight_sets.append(('ema', workdir / 'ema', 0))
  if args.weights:
    weight_sets = [w for w in weight_sets if w[0] in args.weights]
  for weights, directory, average_last in weight_sets:
    translator = Translator.from_checkpoint(directory, average_last=average_last)
    for search_name, search in variants.items():
      for split, (sources, references) in splits.items():
        start = time.perf_counter()
        hypotheses = translator.translate(sources, search, batch_size=args.batch_size)
        seconds = time.perf_counter() - start
        row = {
          'weights': weights,
          'search': search_name,
          'split': split,
          'sentences': len(sources),
          'decode_seconds': seconds,
          **score(hypotheses, references, tgt),
        }
        rows.append(row)
        # Each row as it comes: a budget that stops the evaluation keeps what it scored.
        common.write_json(
          output_path,
          {'benchmark': 'multi30k', 'partial': True, 'workdir': str(workdir), 'rows': rows},
        )
        print(
          f'{weights:>16s} {search_name:>11s} {split:>10s}: BLEU {row["bleu"]:5.2f}  '
          f'lowercased {row["bleu_lc"]:5.2f}  tokenized {row["bleu_tok"]:5.2f}  '
          f'ratio {row["length_ratio"]:.3f}  chrF {row["chrf"]:5.2f}  ({seconds:.0f} s)',
          flush=True,
        )
  validation = [r for r in rows if r['split'] == 'validation']
  best = max(validation, key=lambda r: r[select])
  selected = next(
    r
    for r in rows
    if r['split'] == 'test' and r['weights'] == best['weights'] and r['search'] == best['search']
  )
  print(
    f'selected on validation {select}: {best["weights"]} + {best["search"]}; test_2016 BLEU '
    f'{selected["bleu"]:.2f}, lowercased {selected["bleu_lc"]:.2f}, tokenized '
    f'{selected["bleu_tok"]:.2f}, chrF {selected["chrf"]:.2f}'
  )
  print(f'  {selected["signatures"]}')
  translator = Translator.from_checkpoint(workdir)
  result = {
    'benchmark': 'multi30k',
    'machine': common.machine_info(os.cpu_count()),
    'direction': f'{src}-{tgt}',
    'workdir': str(workdir),
    'config': config,
    'parameters': count_params(translator.variables['params']),
    **training_summary(workdir),
    'rows': rows,
    'selected': {'weights': best['weights'], 'search': best['search'], 'by': select},
  }
  output = common.write_json(output_path, result)
  print(f'wrote {output}')
  return result


def seconds_at(clock: dict[int, float], step: int) -> float | None:
  """The training clock at `step`, interpolated between the logged steps around it (a
  validation every 72 steps falls between lines logged every 50); None outside them."""
  steps = sorted(clock)
  if not steps or not steps[0] <= step <= steps[-1]:
    return clock.get(step)
  return float(np.interp(step, steps, [clock[s] for s in steps]))


def bleu_key(lines: list[dict]) -> str:
  """The validation BLEU a run's curve shows: tokenized BLEU when its log has it (the
  literature's metric), else cased sacreBLEU (logs written before tokenized BLEU existed)."""
  return 'val_bleu_tok' if any('val_bleu_tok' in m for m in lines) else 'val_bleu'


def time_to_bleu(lines: list[dict], target: float) -> dict | None:
  """{'step', 'minutes'} of the first validation BLEU (`bleu_key`) at or above `target`, with the
  training clock's minutes at that step; None if the run never reached it."""
  clock, key = step_clock(lines), bleu_key(lines)
  for m in lines:
    if m.get(key, -1.0) >= target:
      seconds = seconds_at(clock, m['step'])
      return {
        'step': m['step'],
        'minutes': None if seconds is None else seconds / 60,
        'metric': key,
        'value': m[key],
      }
  return None


def curve_sources(path: Path) -> list[tuple[str, list[dict]]]:
  """(label, metrics lines) of each curve at `path`: a run directory's log, or each run of a
  `compare` JSON (its validations, and a clock of the seconds per step it measured on its
  host), so that a run whose directory is gone is still drawn beside new ones. A compare
  file's loss is its per-token loss without label smoothing, a log's is smoothed: `plot` says
  so when a figure holds both (compare the run first to draw it alike)."""
  if path.suffix != '.json':
    return [(path.name, read_metrics(path))]
  try:
    runs = json.loads(path.read_text())['runs']
  except (OSError, ValueError, KeyError) as error:
    raise SystemExit(f'{path}: not a `compare` JSON file ({error})') from None
  curves = []
  for run in runs:
    lines = [{'step': 0, 'elapsed_s': 0.0}]
    lines.append({'step': run['steps'], 'elapsed_s': run['steps'] * run['seconds_per_step']})
    for step, values in sorted(run['evaluations'].items(), key=lambda item: int(item[0])):
      line = {'step': int(step), 'val_loss': values['val_loss_per_token']}
      line.update({k: values[k] for k in ('val_bleu', 'val_bleu_tok') if k in values})
      lines.append(line)
    curves.append((f'{Path(run["workdir"]).name} ({path.name})', lines))
  return curves


def plot(args) -> None:
  """Validation loss and BLEU against training time (or steps, `--against steps`), one PNG;
  several runs on one figure."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  entries = [Path(entry) for entry in args.workdir.split(',')]
  sources = [curve for entry in entries for curve in curve_sources(entry)]
  if len({entry.suffix == '.json' for entry in entries}) > 1:
    print(
      'note: the losses differ in kind: a compare file holds the loss without label smoothing, '
      "a run's log the smoothed one; compare the runs first to draw them alike"
    )
  figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=90)
  keys = set()
  for index, (label, lines) in enumerate(sources):
    elapsed, key, color = step_clock(lines), bleu_key(lines), f'C{index}'
    keys.add(key)

    def minutes(step, elapsed=elapsed):
      if getattr(args, 'against', 'minutes') == 'steps':
        return step
      seconds = seconds_at(elapsed, step)
      return None if seconds is None else seconds / 60

    loss = [(minutes(m['step']), m['val_loss']) for m in lines if 'val_loss' in m]
    bleu = [(minutes(m['step']), m[key]) for m in lines if key in m]
    train = [(minutes(m['step']), m['loss']) for m in lines if 'loss' in m and 'elapsed_s' in m]
    name = label if len(sources) > 1 else 'validation'
    if len(sources) == 1:
      left.plot(*zip(*train), color='0.7', linewidth=1, label='training (smoothed labels)')
    left.plot(*zip(*loss), marker='o', markersize=2, color=color, label=name)
    if bleu:
      right.plot(*zip(*bleu), marker='o', markersize=2, color=color, label=label)
    if args.target is not None:
      reached = time_to_bleu(lines, args.target)
      print(
        f'{label}: validation {key} >= {args.target:g} '
        + (
          f'at step {reached["step"]}, {reached["minutes"]:.0f} min of training'
          if reached and reached['minutes'] is not None
          else 'not reached'
        )
      )
  x_label = {'minutes': 'training time (minutes)', 'steps': 'training steps'}[
    getattr(args, 'against', 'minutes')
  ]
  left.set(xlabel=x_label, ylabel='loss per target token', ylim=(1, 6))
  left.legend(fontsize=8)
  names = {'val_bleu_tok': 'tokenized BLEU', 'val_bleu': 'BLEU, cased'}
  right.set(
    xlabel=x_label,
    ylabel=f'validation {" / ".join(names[k] for k in sorted(keys))} (greedy)',
  )
  if args.target is not None and right.has_data():
    right.axhline(args.target, color='0.5', linewidth=0.8, linestyle='--')
  if len(sources) > 1:
    right.legend(fontsize=8)
  for axis in (left, right):
    axis.grid(alpha=0.3)
  labels = ', '.join(label for label, _ in sources)
  # Wrapped: several runs' labels are wider than the figure (the legends name each one).
  figure.suptitle(textwrap.fill(args.title or f'{labels}: Multi30k', 120), fontsize=10)
  figure.tight_layout()
  output = Path(args.output or RESULTS / f'{Path(args.workdir.split(",")[0]).stem}.png')
  figure.savefig(output)
  print(f'wrote {output} ({os.path.getsize(output) / 1024:.0f} KB)')


def tokens_per_sentence(tokenizer, texts: list[str]) -> float:
  """Mean subword tokens per text, EOS included (as the model sees a target)."""
  return sum(len(ids) + 1 for ids in tokenizer.encode(texts)) / len(texts)


def seconds_per_step(lines: list[dict]) -> float | None:
  """Median over the log's training intervals of seconds per step.

  A median, so that intervals that include a validation pass or a pause do not count.
  """
  timed = sorted(step_clock(lines).items())
  rates = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(timed, timed[1:])]
  return statistics.median(rates) if rates else None


def compare(args) -> dict:
  """Runs side by side up to `--steps`, from their logs and tokenizers (no decoding)."""
  from flax_transformer.data.corpus import load_parallel
  from flax_transformer.tokenizer import Tokenizer

  runs, datasets = [], {}
  for workdir in map(Path, args.workdirs):
    config = common.read_run_config(workdir)
    data_config = config.get('data', {})
    src, tgt = data_config.get('src_lang', 'en'), data_config.get('tgt_lang', 'de')
    if (src, tgt) not in datasets:
      datasets[src, tgt] = load_parallel(str(args.data), src, tgt)
    dataset = datasets[src, tgt]
    tokenizer = Tokenizer.load(workdir)
    val_tokens = tokens_per_sentence(tokenizer, list(dataset['validation']['target']))
    lines = [m for m in read_metrics(workdir) if m['step'] <= args.steps]
    clock = step_clock(lines)
    evaluations = {}
    for m in lines:
      if 'val_ppl' not in m and 'val_bleu' not in m:
        continue  # a training line
      evaluation = evaluations.setdefault(m['step'], {})
      seconds = seconds_at(clock, m['step'])  # between logged lines: interpolated
      if seconds is not None:
        evaluation['elapsed_s'] = seconds
      if 'val_ppl' in m:
        evaluation['val_loss_per_sentence'] = math.log(m['val_ppl']) * val_tokens
        evaluation['val_loss_per_token'] = math.log(m['val_ppl'])
        if 'val_accuracy' in m:
          evaluation['val_token_accuracy'] = m['val_accuracy']
      if 'val_bleu' in m:
        evaluation.update(val_bleu=m['val_bleu'], val_chrf=m['val_chrf'])
        if 'val_bleu_tok' in m:  # runs since 2026-12-03 score as the literature does too
          evaluation['val_bleu_tok'] = m['val_bleu_tok']
    train = dataset['train']
    run = {
      'workdir': str(workdir),
      'direction': f'{src}-{tgt}',
      'requested_vocab_size': data_config.get('vocab_size'),
      'vocab_size': tokenizer.vocab_size,
      'source_tokens_per_sentence': tokens_per_sentence(tokenizer, list(train['source'])),
      'target_tokens_per_sentence': tokens_per_sentence(tokenizer, list(train['target'])),
      'seconds_per_step': seconds_per_step(lines),
      'steps': max((m['step'] for m in lines), default=0),
      'evaluations': {step: evaluations[step] for step in sorted(evaluations)},
    }
    runs.append(run)
    print(
      f'{workdir}: vocabulary {run["vocab_size"]:,}, '
      f'{run["source_tokens_per_sentence"]:.1f} + {run["target_tokens_per_sentence"]:.1f} '
      f'tokens per training pair, {run["seconds_per_step"] or float("nan"):.2f} s per step'
    )
    for step, values in run['evaluations'].items():
      text = (
        f'  step {step:>5d} ({values.get("elapsed_s", float("nan")) / 60:5.1f} min): val loss '
        f'{values.get("val_loss_per_sentence", float("nan")):6.2f} per sentence'
      )
      if 'val_token_accuracy' in values:
        text += f', token accuracy {values["val_token_accuracy"]:.1%}'
      if 'val_bleu' in values:
        text += f', BLEU {values["val_bleu"]:5.2f}, chrF {values["val_chrf"]:5.2f}'
      if 'val_bleu_tok' in values:
        text += f', tokenized BLEU {values["val_bleu_tok"]:5.2f}'
      print(text)
  result = {
    'benchmark': 'multi30k-compare',
    'machine': common.machine_info(os.cpu_count()),
    'up_to_step': args.steps,
    'runs': runs,
  }
  if args.output:
    print(f'wrote {common.write_json(Path(args.output), result)}')
  return result


def comma_separated(cast):
  """An argparse type: 'A,B,C' -> [cast(A), cast(B), cast(C)]."""
  return lambda text: [cast(item) for item in text.split(',')]


def main() -> None:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.multi30k',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  commands = parser.add_subparsers(dest='command', required=True)
  scores = commands.add_parser('evaluate', help='BLEU variants on val and test_2016')
  scores.add_argument('--workdir', required=True, help='the run directory of train.py')
  scores.add_argument('--data', default=str(DEFAULT_DATA), help='the Multi30k directory')
  scores.add_argument(
    '--average-last',
    type=comma_separated(int),
    default=[5],
    help='checkpoints to average, e.g. 5,10 (each a variant; the run must keep that many)',
  )
  scores.add_argument('--batch-size', type=int, default=64)
  scores.add_argument(
    '--alphas',
    type=comma_separated(float),
    default=[0.6],
    help='beam length penalties to score, e.g. 0.6,1.0,1.5,2.0 '
    '(chosen on validation like the rest)',
  )
  scores.add_argument(
    '--beams', type=comma_separated(int), default=[4], help='beam sizes to score, e.g. 4,5'
  )
  scores.add_argument(
    '--penalty-forms',
    type=comma_separated(str),
    default=['gnmt'],
    help="length penalties to score with each alpha: gnmt, fairseq (|Y|^alpha, fairseq's "
    '--lenpen), or both, e.g. gnmt,fairseq',
  )
  scores.add_argument(
    '--best',
    action=argparse.BooleanOptionalAction,
    default=True,
    help="also WORKDIR/best, the run's best validation checkpoint, if it has one",
  )
  scores.add_argument(
    '--weights',
    type=comma_separated(str),
    help='only these weights, e.g. average-last10,best (default: last, each average, best and ema)',
  )
  scores.add_argument(
    '--select',
    choices=('bleu', 'bleu_lc', 'bleu_tok', 'chrf'),
    help='validation score that selects the reported variant (default: '
    'bleu_tok for a lowercased run, else bleu)',
  )
  scores.add_argument(
    '--output', help='JSON file (default benchmarks/results/multi30k_<src><tgt>[_cmlm].json)'
  )
  curves = commands.add_parser('plot', help='validation loss and BLEU against training time')
  curves.add_argument(
    '--workdir',
    required=True,
    help='run directories, comma-separated (one curve each), or `compare` JSON files '
    '(a curve for each run in one, its clock from the seconds per step it measured)',
  )
  curves.add_argument(
    '--target',
    type=float,
    help='a validation BLEU to reach: print the training minutes each run took',
  )
  curves.add_argument('--output', help='PNG file (default benchmarks/results/<workdir name>.png)')
  curves.add_argument('--title')
  curves.add_argument(
    '--against',
    choices=('minutes', 'steps'),
    default='minutes',
    help='the x axis: training minutes (default) or training steps',
  )
  side_by_side = commands.add_parser('compare', help='runs side by side up to a common step')
  side_by_side.add_argument(
    '--workdirs', required=True, type=comma_separated(str), help='run directories, comma-separated'
  )
  side_by_side.add_argument('--steps', type=int, required=True, help='compare up to this step')
  side_by_side.add_argument('--data', default=str(DEFAULT_DATA), help='the Multi30k directory')
  side_by_side.add_argument('--output', help='JSON file (default: print only)')
  args = parser.parse_args()
  forms = getattr(args, 'penalty_forms', [])
  if not set(forms) <= {'gnmt', 'fairseq'}:
    scores.error(f'--penalty-forms: gnmt or fairseq, got {",".join(forms)}')
  from flax_transformer.errors import Error

  try:
    {'evaluate': evaluate, 'plot': plot, 'compare': compare}[args.command](args)
  except Error as error:  # the library's own refusals: a corpus, a checkpoint, in one line
    raise SystemExit(f'benchmarks.multi30k {args.command}: {error}') from None


if __name__ == '__main__':
  main()
