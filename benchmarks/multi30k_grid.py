"""Multi30k quality runs one after another within a time budget: train, then evaluate each.

  python -m benchmarks.multi30k_grid --runs fairseq-ende-s1,fairseq-ende-s2 --budget 3600
  python -m benchmarks.multi30k_grid --runs A,B,C --parallel --budget 540   # all at once, a GPU
  python -m benchmarks.multi30k_grid --list                       # the recipes by name

Each recipe is train.py's options (a preset and overrides); `--runs` picks them in the order
given. A run is trained (`train.py ... --average-last 10`), then scored by
`benchmarks.multi30k evaluate` on validation and test_2016 from the mean of its last 10
checkpoints and from its best validation checkpoint, greedy and beam 4 and 5 at length
penalties 0.6, 1.0 and 1.5; the variant is chosen on validation. Each stage runs in a process
of its own and is stopped (SIGTERM, its state saved) when the budget runs out, so a GPU lent for
minutes returns what it finished. `--parallel` trains every run at once, then evaluates every
one at once: a GPU lent for minutes runs these small models far below its capacity, and one at a
time would leave it waiting on each run's host side and compiling. Results: `--results DIR/<run>.json` (multi30k evaluate's) and
`<run>.metrics.jsonl` (the curve), `grid.json`, what ran, how long, and how it ended, and
`seeds.json`: per recipe, every seed's scores of the checkpoint and search chosen on validation,
and their mean and spread (`python -m benchmarks.multi30k_grid --summarize DIR` rebuilds it from
a results directory, e.g. after runs made over several leases).

The recipes (docs/multi30k.md says what each measured):
  fairseq-*: the fairseq anchor (preset multi30k_fairseq) as Wu et al. (2021) ran it;
  dff512-*, packed-*, attdrop-*, patience20-*: one change each to it, candidates for this
    library's own recipe on the same data;
  multi30k-*: the default preset (raw, cased text);
  wsd4k-*, linear4k-*, anchor4k-*: 4,000 updates (half the anchor's) on a schedule that ends,
    and the anchor's own stopped there: the headline rows of issue 61.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks import common
from benchmarks.multi30k import DEFAULT_DATA

ROOT = Path(__file__).resolve().parents[1]
DE_EN = ['--data.src_lang', 'de', '--data.tgt_lang', 'en']


def four_thousand_updates(schedule: str) -> list[str]:
  """The headline's recipe (#61): 4,000 updates of the anchor + d_ff 512 on `schedule`, one
  that ends at the last update (`wsd` or `linear`), warm-up 400 to a peak of 0.0025."""
  return [
    *('--preset', 'multi30k_fairseq', '--model.d_ff', '512', '--steps', '4000'),
    *('--train.schedule', schedule, '--train.warmup_steps', '400', '--train.peak_lr', '0.0025'),
    *('--train.ema_decay', '0.995', '--train.patience', '0'),
    *('--train.checkpoint_every', '100', '--train.eval_every', '100', '--train.bleu_every', '500'),
    *('--model.loss_chunk', '1024'),  # the same loss, fused: as the runs were made
  ]


WSD_4K = four_thousand_updates('wsd')
LINEAR_4K = four_thousand_updates('linear')
RECIPES = {
  'fairseq-ende-s1': ['--preset', 'multi30k_fairseq'],
  'fairseq-ende-s2': ['--preset', 'multi30k_fairseq', '--train.seed', '2'],
  'fairseq-deen-s1': ['--preset', 'multi30k_fairseq', *DE_EN],
  'fairseq-deen-s2': ['--preset', 'multi30k_fairseq', '--train.seed', '2', *DE_EN],
  # Candidates for this library's own recipe, each one change to the anchor, to be chosen on
  # validation (none is yet: docs/multi30k.md).
  'dff512-ende-s1': ['--preset', 'multi30k_fairseq', '--model.d_ff', '512'],
  'dff512-ende-s2': ['--preset', 'multi30k_fairseq', '--model.d_ff', '512', '--train.seed', '2'],
  'packed-ende-s1': ['--preset', 'multi30k_fairseq', '--train.packing', '64'],
  'attdrop-ende-s1': ['--preset', 'multi30k_fairseq', '--model.attention_dropout_rate', '0.1'],
  'patience20-ende-s1': ['--preset', 'multi30k_fairseq', '--train.patience', '20'],
  # Why the anchor's En->De stalled at d_ff 256 (docs/multi30k.md): the preset's query/key/value
  # initialisation before 2026-12-05 (gain 1, the stall), then the other hypotheses, one change each.
  'gain1-ende-s1': ['--preset', 'multi30k_fairseq', '--model.qkv_init_gain', '1'],
  'fairseq-ende-s3': ['--preset', 'multi30k_fairseq', '--train.seed', '3'],
  'lr0025-ende-s1': ['--preset', 'multi30k_fairseq', '--train.peak_lr', '0.0025'],
  'warmup4k-ende-s1': ['--preset', 'multi30k_fairseq', '--train.warmup_steps', '4000'],
  'drop01-ende-s1': ['--preset', 'multi30k_fairseq', '--model.dropout_rate', '0.1'],
  'dff384-ende-s1': ['--preset', 'multi30k_fairseq', '--model.d_ff', '384'],
  'beta999-ende-s1': ['--preset', 'multi30k_fairseq', '--train.adam_b2', '0.999'],
  # The default preset, raw cased text.
  'multi30k-ende-s0': ['--preset', 'multi30k'],
  # This library's recipe for the headline (#61): half the anchor's updates on a schedule that
  # ends (docs/multi30k.md, "4,000 updates"); its seeds, its other direction, and the anchor's own
  # schedule stopped at the same 4,000 updates (the same-compute comparison).
  'wsd4k-ende-s1': WSD_4K,
  'wsd4k-ende-s2': [*WSD_4K, '--train.seed', '2'],
  'wsd4k-ende-s3': [*WSD_4K, '--train.seed', '3'],
  'wsd4k-deen-s1': [*WSD_4K, *DE_EN],
  # The same on raw cased text (what a user reads; scored by cased sacreBLEU): the candidate
  # for the default `multi30k` preset.
  'wsd4k-cased-ende-s1': [
    *WSD_4K,
    *('--data.normalize_punctuation', 'false', '--data.lowercase', 'false'),
    *('--data.pretokenize', 'none'),
  ],
  'anchor4k-ende-s1': ['--preset', 'multi30k_fairseq', '--steps', '4000'],
  # The same updates decayed linearly to zero from the warm-up's end (Bergsma et al. 2025), the
  # headline's next lever: docs/multi30k.md, "4,000 updates, decayed linearly".
  'linear4k-ende-s1': LINEAR_4K,
  'linear4k-ende-s2': [*LINEAR_4K, '--train.seed', '2'],
}
EVALUATE = [
  '--average-last',
  '10',
  '--weights',
  'average-last10,best',
  '--beams',
  '4,5',
  '--alphas',
  '0.6,1.0,1.5',
]


# What a seed summary reports, per split: `benchmarks.multi30k evaluate`'s scores.
METRICS = ('bleu_tok', 'bleu_lc', 'bleu', 'chrf')


def selected_rows(result: dict) -> dict[str, dict]:
  """{split: scores} of the weights and search a run's evaluation chose on validation."""
  chosen = result['selected']
  return {
    row['split']: row
    for row in result['rows']
    if (row['weights'], row['search']) == (chosen['weights'], chosen['search'])
  }


def seed_summary(results: dict[str, dict]) -> dict[str, dict]:
  """Per recipe (a run's name less its `-sN` seed): its runs, steps and chosen variants, and per
  split and metric the seeds' values, mean, standard deviation (n - 1; None for one seed),
  least and most."""
  recipes: dict[str, dict] = {}
  for name, result in sorted(results.items()):
    recipe = recipes.setdefault(
      re.sub(r'-s\d+$', '', name), {'runs': [], 'steps': [], 'chosen': []}
    )
    recipe['runs'].append(name)
    recipe['steps'].append(result.get('steps'))
    recipe['chosen'].append(f'{result["selected"]["weights"]} {result["selected"]["search"]}')
    for split, row in selected_rows(result).items():
      for metric in METRICS:
        recipe.setdefault(split, {}).setdefault(metric, {'values': []})['values'].append(
          row[metric]
        )
  for recipe in recipes.values():
    for split in ('validation', 'test'):
      for stats in recipe.get(split, {}).values():
        values = np.asarray(stats['values'], np.float64)
        stats.update(
          mean=float(values.mean()),
          std=float(values.std(ddof=1)) if len(values) > 1 else None,
          min=float(values.min()),
          max=float(values.max()),
        )
  return recipes


def summary_table(recipes: dict[str, dict], metric: str = 'bleu_tok') -> str:
  """One line per recipe: seeds, steps, and `metric` on test and validation (mean ± sd)."""
  lines = [f'{"recipe":>16s} seeds {"steps":>11s} {"test " + metric:>20s} {"validation":>14s}']
  for name, recipe in recipes.items():
    cells = []
    for split in ('test', 'validation'):
      stats = recipe.get(split, {}).get(metric)
      spread = '' if stats is None or stats['std'] is None else f' ± {stats["std"]:.2f}'
      cells.append('n/a' if stats is None else f'{stats["mean"]:.2f}{spread}')
    steps = '/'.join(str(step) for step in recipe['steps'])
    lines.append(
      f'{name:>16s} {len(recipe["runs"]):5d} {steps:>11s} {cells[0]:>20s} {cells[1]:>14s}'
    )
  return '\n'.join(lines)


def summarize(results_dir: Path) -> dict[str, dict]:
  """seed_summary of every evaluation in `results_dir`, written to its seeds.json and printed."""
  if not results_dir.is_dir():
    raise SystemExit(f'{results_dir}: no such results directory')
  results = {}
  for path in sorted(results_dir.glob('*.json')):
    if path.name not in ('grid.json', 'seeds.json'):
      result = common.read_json(path, 'an evaluation of benchmarks.multi30k')
      if isinstance(result, dict) and 'selected' in result:
        results[path.stem] = result
  if not results:
    raise SystemExit(
      f'{results_dir}: no evaluations there (the JSON files benchmarks.multi30k evaluate writes)'
    )
  recipes = seed_summary(results)
  common.write_json(results_dir / 'seeds.json', recipes)
  print(summary_table(recipes), flush=True)
  return recipes


def run_stages(
  commands: list[list[str]], logs: list[Path], deadline: float, env: dict[str, str] | None = None
) -> list[dict]:
  """Runs `commands` at once (each to its log) until each ends or `deadline`, then SIGTERM and
  60 s grace (a training run saves its step) before SIGKILL."""
  start = time.monotonic()
  processes = []
  for command, log in zip(commands, logs):
    with log.open('a') as out:
      out.write(f'$ {" ".join(command)}\n')
      out.flush()
      processes.append(
        subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
      )
  seconds, ended = [None] * len(processes), [None] * len(processes)
  while any(code is None for code in seconds):
    for i, process in enumerate(processes):
      if seconds[i] is None and process.poll() is not None:
        seconds[i] = time.monotonic() - start
        ended[i] = ended[i] or (
          'finished' if process.returncode == 0 else f'failed ({process.returncode})'
        )
      elif seconds[i] is None and time.monotonic() > deadline and ended[i] is None:
        process.terminate()
        ended[i] = 'stopped at the budget'
      elif seconds[i] is None and time.monotonic() > deadline + 60:
        process.kill()
    time.sleep(0.5)
  return [
    {
      'command': command,
      'seconds': seconds[i],
      'exit_code': processes[i].returncode,
      'ended': ended[i],
    }
    for i, command in enumerate(commands)
  ]


def run_stage(command: list[str], log: Path, deadline: float) -> dict:
  """Runs `command` (output to `log`) until it ends or `deadline`, then SIGTERM and 60 s grace."""
  return run_stages([command], [log], deadline)[0]


def main() -> None:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.multi30k_grid',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--runs', default='fairseq-ende-s1', help='recipes, comma-separated')
  parser.add_argument('--data', default=str(DEFAULT_DATA), help='the Multi30k directory')
  parser.add_argument('--workroot', default='runs/grid', help='where the run directories go')
  parser.add_argument(
    '--results',
    default=str(ROOT / 'benchmarks' / 'results' / 'grid'),
    help='where the JSON results and curves go',
  )
  parser.add_argument('--budget', type=float, default=3 * 3600, help='seconds for all the runs')
  parser.add_argument(
    '--evaluate-seconds',
    type=float,
    default=120,
    help="seconds kept back from training for each run's evaluation",
  )
  parser.add_argument(
    '--evaluate',
    default=' '.join(EVALUATE),
    help="options of benchmarks.multi30k evaluate (default: %(default)s); 'none': train only",
  )
  parser.add_argument(
    '--parallel',
    action='store_true',
    help='train all the runs at once, then evaluate them all at once (a GPU)',
  )
  parser.add_argument('--list', action='store_true', help='print the recipes and exit')
  parser.add_argument(
    '--summarize',
    type=Path,
    metavar='DIR',
    help="a results directory's seeds.json (mean and spread per recipe), and exit",
  )
  args, extra = parser.parse_known_args()
  if args.list:
    for name, options in RECIPES.items():
      print(f'{name:>20s}: train.py {" ".join(options)}')
    return
  if args.summarize is not None:
    if not args.summarize.is_dir():
      parser.error(f'{args.summarize}: no results directory there')
    summarize(args.summarize)
    return
  names = args.runs.split(',')
  unknown = [name for name in names if name not in RECIPES]
  if unknown:
    parser.error(f'unknown recipe {unknown[0]!r}; known: {", ".join(RECIPES)}')
  if not Path(args.data).is_dir():
    parser.error(f'{args.data}: no Multi30k directory there (pass --data DIR)')
  deadline = time.monotonic() + args.budget
  results, workroot = Path(args.results), Path(args.workroot)
  results.mkdir(parents=True, exist_ok=True)
  grid = {
    'benchmark': 'multi30k-grid',
    'machine': common.machine_info(os.cpu_count()),
    'budget_s': args.budget,
    'runs': {},
  }
  workdirs = {name: workroot / name for name in names}
  logs = {name: results / f'{name}.log' for name in names}

  def train_command(name):
    return [
      sys.executable,
      'train.py',
      *RECIPES[name],
      *extra,
      '--data',
      args.data,
      '--workdir',
      str(workdirs[name]),
      '--average-last',
      '10',
    ]

  def evaluate_command(name):
    return [
      sys.executable,
      '-m',
      'benchmarks.multi30k',
      'evaluate',
      '--workdir',
      str(workdirs[name]),
      '--data',
      args.data,
      *args.evaluate.split(),
      '--output',
      str(results / f'{name}.json'),
    ]

  def collect(name):
    """Copies the run's curve to the results; whether there is anything to evaluate."""
    if (workdirs[name] / 'metrics.jsonl').is_file():
      shutil.copy(workdirs[name] / 'metrics.jsonl', results / f'{name}.metrics.jsonl')
    return args.evaluate.strip() != 'none' and (workdirs[name] / 'checkpoints').is_dir()

  if args.parallel:
    # Each process takes GPU memory as it needs it, not 75% of it at its start.
    env = {**os.environ, 'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'}
    trained = run_stages(
      [train_command(name) for name in names],
      [logs[n] for n in names],
      deadline - args.evaluate_seconds,
      env,
    )
    for name, train in zip(names, trained):
      grid['runs'][name] = {'train': train}
    common.write_json(results / 'grid.json', grid)
    scored = [name for name in names if collect(name)]
    for name, evaluation in zip(
      scored,
      run_stages([evaluate_command(n) for n in scored], [logs[n] for n in scored], deadline, env),
    ):
      grid['runs'][name]['evaluate'] = evaluation
  for name in [] if args.parallel else names:
    if time.monotonic() > deadline - 2 * args.evaluate_seconds:
      grid['runs'][name] = {'ended': 'not started: the budget ran out'}
      continue
    entry = grid['runs'][name] = {
      'train': run_stage(train_command(name), logs[name], deadline - args.evaluate_seconds)
    }
    if collect(name):
      entry['evaluate'] = run_stage(evaluate_command(name), logs[name], deadline)
    common.write_json(results / 'grid.json', grid)
    print(f'{name}: {json.dumps({k: v.get("ended") for k, v in entry.items()})}', flush=True)
  common.write_json(results / 'grid.json', grid)
  summarize(results)


if __name__ == '__main__':
  main()
