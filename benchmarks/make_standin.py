"""A WMT14-sized English–German stand-in made offline from Multi30k's real sentences (issue #32).

Each line joins 1, 2 or 3 Multi30k training pairs drawn with replacement, the English
sentences with spaces on the source side and the German ones in the same order on the
target side, so line N of train.de still translates line N of train.en; lengths spread
from one sentence (~13 words) to three (~40), about 23 words a line on average, as news
text does. Seeded and deterministic: the same options give the same bytes.

    python -m benchmarks.make_standin --pairs 4500000 --output /tmp/wmt-standin
    # -> train.en/train.de (N lines), val.en/val.de and test.en/test.de (3,000 lines each)

The valid and test sets are drawn from Multi30k's validation and test sentences, so
they share no line with the training set. The data is read from --multi30k and never
copied anywhere else; the output directory is new or overwritten file by file.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

DEFAULT_MULTI30K = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'
# Lines written per NumPy draw: bounds memory (a block's strings) and keeps the bar moving.
_BLOCK = 50_000
# How many sentences a line joins, and with what probability (mean 2: 23 words a line).
SENTENCES_PER_LINE = (1, 2, 3)
SENTENCE_WEIGHTS = (0.3, 0.4, 0.3)
HELD_OUT_PAIRS = 3_000


def read_pairs(
  directory: Path, stem: str, src_lang: str = 'en', tgt_lang: str = 'de'
) -> tuple[np.ndarray, np.ndarray]:
  """Multi30k's `<stem>.en`/`<stem>.de` lines, stripped, as two object arrays of equal length."""
  sides = []
  for lang in (src_lang, tgt_lang):
    path = directory / f'{stem}.{lang}'
    lines = path.read_text(encoding='utf-8').split('\n')
    if lines and lines[-1] == '':
      lines.pop()
    sides.append(np.asarray([line.strip() for line in lines], dtype=object))
  if len(sides[0]) != len(sides[1]):
    raise SystemExit(
      f'{directory}/{stem}: {len(sides[0])} {src_lang} lines but {len(sides[1])} {tgt_lang} lines'
    )
  keep = (sides[0] != '') & (sides[1] != '')
  return sides[0][keep], sides[1][keep]


def write_split(
  output: Path,
  stem: str,
  sources: np.ndarray,
  targets: np.ndarray,
  lines: int,
  rng: np.random.Generator,
  desc: str,
) -> None:
  """Writes `lines` joined pairs to <output>/<stem>.en and .de, a block at a time."""
  paths = [output / f'{stem}.en', output / f'{stem}.de']
  temporaries = [path.with_name(f'.{path.name}.tmp') for path in paths]
  with (
    open(temporaries[0], 'w', encoding='utf-8', newline='\n') as src_file,
    open(temporaries[1], 'w', encoding='utf-8', newline='\n') as tgt_file,
    tqdm(
      total=lines, desc=desc, unit='pairs', unit_scale=True, dynamic_ncols=True, mininterval=0.5
    ) as bar,
  ):
    for start in range(0, lines, _BLOCK):
      count = min(_BLOCK, lines - start)
      per_line = rng.choice(SENTENCES_PER_LINE, size=count, p=SENTENCE_WEIGHTS)
      picks = rng.integers(0, len(sources), size=int(per_line.sum()))
      ends = np.cumsum(per_line)
      for side, file in ((sources, src_file), (targets, tgt_file)):
        chosen = side[picks]
        # Lines of k sentences: join slices of `chosen` (a loop per line, C-level joins).
        block = [
          ' '.join(chosen[end - k : end]) for end, k in zip(ends.tolist(), per_line.tolist())
        ]
        file.write('\n'.join(block))
        file.write('\n')
      bar.update(count)
  for temporary, path in zip(temporaries, paths):
    os.replace(temporary, path)


def make_standin(
  output: str | Path,
  pairs: int = 4_500_000,
  seed: int = 0,
  multi30k: str | Path = DEFAULT_MULTI30K,
  held_out: int = HELD_OUT_PAIRS,
) -> Path:
  """Writes the stand-in into `output` (created); returns it."""
  multi30k, output = Path(multi30k), Path(output)
  if not (multi30k / 'train.en').is_file():
    raise SystemExit(f'{multi30k}: no train.en; point --multi30k at the Multi30k directory')
  output.mkdir(parents=True, exist_ok=True)
  rng = np.random.default_rng(seed)
  train = read_pairs(multi30k, 'train')
  held = [
    np.concatenate(parts)
    for parts in zip(read_pairs(multi30k, 'val'), read_pairs(multi30k, 'test_2016_flickr'))
  ]
  # Valid and test draw from disjoint halves of the held-out sentences.
  order = rng.permutation(len(held[0]))
  halves = (order[: len(order) // 2], order[len(order) // 2 :])
  write_split(output, 'train', *train, pairs, rng, 'train')
  for stem, half in zip(('val', 'test'), halves):
    write_split(output, stem, held[0][half], held[1][half], held_out, rng, stem)
  return output


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split('\n\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    '--pairs',
    type=int,
    default=4_500_000,
    help='training pairs (lines) to write (default 4,500,000, WMT14 en-de)',
  )
  parser.add_argument('--output', required=True, help='directory to write into (created)')
  parser.add_argument('--seed', type=int, default=0, help='random seed (default 0)')
  parser.add_argument(
    '--multi30k',
    default=str(DEFAULT_MULTI30K),
    help=f'the Multi30k directory (default {DEFAULT_MULTI30K})',
  )
  parser.add_argument(
    '--held-out',
    type=int,
    default=HELD_OUT_PAIRS,
    help='lines in each of val and test (default 3,000)',
  )
  args = parser.parse_args(argv)
  if args.pairs < 1 or args.held_out < 1:
    parser.error('--pairs and --held-out must be positive')
  path = make_standin(args.output, args.pairs, args.seed, args.multi30k, args.held_out)
  print(
    f'wrote {args.pairs:,} training pairs and {args.held_out:,} valid/test pairs to {path}',
    file=sys.stderr,
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
