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


# What matplotlib's savefig writes, by suffix (its default backends' formats).
PLOT_FORMATS = frozenset(
  {'.png', '.pdf', '.svg', '.svgz', '.jpg', '.jpeg', '.eps', '.ps', '.tif', '.tiff', '.webp'}
)


def output_problems(args: argparse.Namespace) -> list[str]:
  """What would stop `--json`, `--csv` or `--plot` from being written, found before any work:
  a directory in the file's place, a parent that is a file or cannot be written, one path for
  two outputs, a plot format matplotlib cannot write, matplotlib missing."""
  import importlib.util
  import tempfile

  outputs = {
    option: path
    for option in ('json', 'csv', 'plot')
    if (path := getattr(args, option, None)) is not None
  }
  problems = []
  for option, path in outputs.items():
    name = f'--{option} {path}'
    if path.is_dir():
      problems.append(f'{name} is a directory; name a file')
      continue
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
      parent = parent.parent
    if not parent.is_dir():
      problems.append(f'{name}: {parent} is a file, not a directory')
    else:
      try:  # a probe, not os.access: root passes os.access where writing still fails (/proc)
        tempfile.TemporaryFile(dir=parent).close()
      except OSError as error:
        problems.append(f'{name}: {parent} cannot be written ({error.strerror or error})')
  resolved = {}
  for option, path in outputs.items():
    other = resolved.setdefault(path.resolve(), option)
    if other != option:
      problems.append(f'--{other} and --{option} name the same file, {path}')
  if 'plot' in outputs:
    if outputs['plot'].suffix.lower() not in PLOT_FORMATS:
      problems.append(
        f'--plot {outputs["plot"]}: matplotlib writes {", ".join(sorted(PLOT_FORMATS))}, not '
        f'{outputs["plot"].suffix or "a file without a suffix"}'
      )
    if importlib.util.find_spec('matplotlib') is None:
      problems.append('--plot needs matplotlib: pip install "flax_transformer[plot]"')
  return problems


def write_outputs(reports: list, args: argparse.Namespace, quiet: bool = False) -> None:
  """Writes `reports` to args.json and args.csv (each replaced whole, so a sweep can write
  the cells finished so far); says so unless `quiet`."""
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
    if not quiet:
      print(f'wrote {args.json}')
  if args.csv:
    flat = [flatten(row) for row in rows]
    columns = list(dict.fromkeys(key for row in flat for key in row))
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with args.csv.open('w', newline='') as out:
      writer = csv.DictWriter(out, fieldnames=columns)
      writer.writeheader()
      writer.writerows(flat)
    if not quiet:
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
