"""flax-transformer-bench's files: the reports as JSON (`--json`) and CSV rows (`--csv`), and
tokens/s plotted against batch size (`--plot`, matplotlib).

    write_outputs(reports, args)    # args.json, args.csv: paths or None
    plot(reports, 'batch', ['method'], Path('decode.png'), 'base')

A report is any of the bench's reports (`to_dict()`): a JSON file holds
`{'program', 'command', 'environment', 'reports': [report.to_dict(), ...]}` (`environment`:
machine, load, versions, device); a CSV row is one report's
dict flattened (`flatten`: nested keys joined by '.', lists such as every round's time
left out).
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path

from flax_transformer.bench.environment import environment

# The command's name (command.py), recorded in its JSON files.
PROGRAM = 'flax-transformer-bench'


def write_outputs(reports: list, args: argparse.Namespace) -> None:
  rows = [report.to_dict() for report in reports]
  if args.json:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
      json.dumps(
        {
          'program': PROGRAM,
          'command': args.command,
          'environment': environment(),
          'reports': rows,
        },
        indent=2,
      )
      + '\n'
    )
    print(f'wrote {args.json}')
  if args.csv:
    flat = [flatten(row) for row in rows]
    columns = list(dict.fromkeys(key for row in flat for key in row))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open('w', newline='') as out:
      writer = csv.DictWriter(out, fieldnames=columns)
      writer.writeheader()
      writer.writerows(flat)
    print(f'wrote {args.csv}')


def flatten(row: dict, prefix: str = '') -> dict:
  """{'timing': {'median_s': x}} -> {'timing.median_s': x}; lists (every round's time) left
  out of a CSV row."""
  flat = {}
  for key, value in row.items():
    if isinstance(value, dict):
      flat.update(flatten(value, f'{prefix}{key}.'))
    elif not isinstance(value, list):
      flat[f'{prefix}{key}'] = value
  return flat


def plot(reports: list, x: str, series: list[str], path: Path, title: str) -> None:
  """tokens/s against `x` per series (and compiled memory beside, for steps)."""
  try:
    import matplotlib

    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    raise SystemExit(
      f'{PROGRAM}: --plot needs matplotlib: pip install "flax_transformer[plot]"'
    ) from None
  rows = [report.to_dict() for report in reports]
  groups = {}
  for row in rows:
    groups.setdefault(' '.join(str(row[key]) for key in series), []).append(row)
  memory = any(row.get('memory') for row in rows)
  figure, axes = plt.subplots(
    1, 2 if memory else 1, figsize=(11 if memory else 6, 4), squeeze=False
  )
  for label, group in groups.items():
    group.sort(key=lambda row: row[x])
    axes[0][0].plot(
      [row[x] for row in group], [row['tokens_per_s'] for row in group], 'o-', label=label
    )
    if memory:
      axes[0][1].plot(
        [row[x] for row in group],
        [(row['memory'] or {}).get('total', float('nan')) / 2**20 for row in group],
        'o-',
        label=label,
      )
  axes[0][0].set(xlabel=x, ylabel='tokens/s', title=title)
  axes[0][0].legend(fontsize=8)
  if memory:
    axes[0][1].set(xlabel=x, ylabel='compiled memory per device (MiB)', title='memory')
  figure.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  figure.savefig(path, dpi=120)
  print(f'wrote {path}')
