"""docs/results.md: its numbers come from the results files under benchmarks/results/ (README.md quotes its headline numbers).

README cites only the write-ups (docs/multi30k.md, docs/benchmarks.md, ...); the mapping below names, for each row of
its "## Results" tables (the Multi30k BLEU/chrF table, the tokenized-BLEU table and the speed table), the results file(s) and record(s) the
row's numbers come from. A number shown "a" must be what every value it stands for rounds to at the decimals shown;
a range "a–b" (two runs, or both dtypes) must be the min and the max of the values it covers, rounded the same way.
Cells holding "x / y" or "mean ± sd" are checked part by part. Derived numbers (a percentage of a fraction) are derived here from
the file. Pure text and JSON reading.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import multi30k_grid

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / 'benchmarks' / 'results'
# The tables live in docs/results.md; README.md states their headline numbers and links there.
README = ROOT / 'docs' / 'results.md'

NUMBER = re.compile(r'\d+(?:,\d{3})*(?:\.\d+)?')  # 4,451 and 40.58; not the comma after "last 10,"


def _load(name: str) -> dict:
  return json.loads((RESULTS / name).read_text())


# ---------------------------------------------------------------------------------------------------------------
# README parsing


def results_tables(text: str) -> dict[str, dict[str, list[str]]]:
  """The tables of README's "## Results" section, keyed "bleu", "tokenized" and "speed": row label -> the other
  cells."""
  section = text.split('\n## Results\n', 1)[1].split('\n## ', 1)[0]
  tables, current = [], []
  for line in section.splitlines() + ['']:
    if line.startswith('|'):
      current.append(line)
    elif current:
      tables.append(current)
      current = []
  out = {}
  for table in tables:
    header = table[0]
    kind = (
      'tokenized'
      if 'tokenized BLEU' in header
      else 'bleu'
      if 'BLEU' in header
      else 'speed'
      if 'ours / peer' in header
      else None
    )
    assert kind is not None, f'a table in ## Results this test does not know: {header}'
    rows = {}
    for line in table[2:]:
      cells = [c.strip() for c in line.strip().strip('|').split('|')]
      rows[cells[0]] = cells[1:]
    out[kind] = rows
  return out


def _decimals(shown: str) -> int:
  return len(shown.split('.', 1)[1]) if '.' in shown else 0


def _rounds_to(value: float, shown: str) -> bool:
  return f'{value:.{_decimals(shown)}f}' == shown.replace(',', '')


def check_part(part: str, values: list[float]) -> str | None:
  """None when `part` (one number or a range a–b) matches `values`; else what is wrong."""
  numbers = NUMBER.findall(part.replace('**', ''))
  assert values, f'no values for {part!r}'
  lo, hi = min(values), max(values)
  if len(numbers) == 1:
    ok = _rounds_to(lo, numbers[0]) and _rounds_to(hi, numbers[0])
  elif len(numbers) == 2 and '–' in part:
    ok = _rounds_to(lo, numbers[0]) and _rounds_to(hi, numbers[1])
  else:
    return f'{part!r}: cannot read it as one number or a range'
  return None if ok else f'{part!r}: the files give {lo!r} .. {hi!r}'


def check_row(cells: list[str], spec: dict[int, list[list[float]] | str]) -> list[str]:
  """Every numeric cell against its values (a str in the spec: the text the file's record stands for, exactly);
  a numeric cell without a spec is a failure too."""
  problems = []
  for i, cell in enumerate(cells):
    has_number = bool(NUMBER.search(cell.replace('**', '')))
    if i not in spec:
      if has_number:
        problems.append(f'cell {i} {cell!r} has a number but no results file mapped to it')
      continue
    if isinstance(spec[i], str):
      if cell != spec[i]:
        problems.append(f"cell {i} {cell!r}: the file's record is {spec[i]!r}")
      continue
    parts = [p.strip() for p in re.split(' / | ± ', cell.replace('**', ''))]
    if len(parts) != len(spec[i]):
      problems.append(f'cell {i} {cell!r}: {len(parts)} parts, the mapping has {len(spec[i])}')
      continue
    for part, values in zip(parts, spec[i]):
      problem = check_part(part, values)
      if problem:
        problems.append(f'cell {i}: {problem}')
  return problems


# ---------------------------------------------------------------------------------------------------------------
# The mapping: README row label -> results file and record


# Multi30k table: (file, weights, search) of the test_2016 record; columns weights | BLEU | BLEU lowercased | chrF.
BLEU_ROWS = {
  'En→De, greedy': ('multi30k_ende_d128.json', 'average-last10', 'greedy'),
  'En→De, beam 4, alpha 1.5': ('multi30k_ende_d128.json', 'average-last10', 'beam4-a1.5'),
  'En→De, the wsd recipe at 4,000 updates on raw cased text (one seed, not adopted), beam 4, alpha 1.5': (
    'multi30k_s4000/wsd4k-cased-ende-s1.json',
    'last',
    'beam4-a1.5',
  ),
  'De→En (first preset), greedy': ('multi30k_deen.json', 'average-last5', 'greedy'),
  'De→En (first preset), beam 4, alpha 1.0': ('multi30k_deen.json', 'average-last5', 'beam4-a1'),
  'En→De cmlm (first preset, distilled data), mask-predict, 1 iteration, 1 length': (
    'multi30k_ende_cmlm.json',
    'last',
    'nat-T1-l1',
  ),
  'En→De cmlm (first preset, distilled data), mask-predict, 10 iterations, length beam 3': (
    'multi30k_ende_cmlm.json',
    'last',
    'nat-T10-l3',
  ),
}
WEIGHTS_SHOWN = {
  'average-last10': 'mean of last 10',
  'average-last5': 'mean of last 5',
  'last': 'last',
}


def bleu_record(name: str, weights: str, search: str) -> dict:
  matches = [
    r
    for r in _load(name)['rows']
    if r['split'] == 'test' and r['weights'] == weights and r['search'] == search
  ]
  assert len(matches) == 1, (name, weights, search, len(matches))
  return matches[0]


def bleu_spec(label: str) -> dict[int, list[list[float]] | str]:
  record = bleu_record(*BLEU_ROWS[label])
  return {
    0: WEIGHTS_SHOWN[record['weights']],
    1: [[record['bleu']]],
    2: [[record['bleu_lc']]],
    3: [[record['chrf']]],
  }


# The tokenized-BLEU table (the literature's metric): one run's evaluation (its variant chosen on validation) or a
# seeds summary of `benchmarks.multi30k_grid` (with each seed's evaluation, for its training time); columns updates |
# training minutes | weights, search | validation | test_2016. The row says its host.
SEARCH_SHOWN = {'beam5-a1-fairseq': "beam 5, fairseq's alpha 1"}
TOKENIZED_ROWS = {
  "the anchor's schedule (inverse square root), one seed, AMD Zen 5": 'multi30k_fairseq_dff512_4451.json',
  'wsd at peak 0.0025, a 100-minute budget, one seed, AMD Zen 4': 'multi30k_budget100m.json',
  'wsd at peak 0.0025, two seeds (mean ± sd), AMD Zen 4': (
    'multi30k_s4000/seeds.json',
    'wsd4k-ende',
  ),
  'linear decay from peak 0.0025, one seed (not adopted), AMD Zen 4': (
    'multi30k_s4000/linear4k-ende-s1.json'
  ),
}


def chosen_shown(weights: str, search: str) -> str:
  return f'{WEIGHTS_SHOWN[weights]}, {SEARCH_SHOWN[search]}'


def tokenized_spec(label: str) -> dict[int, list[list[float]] | str]:
  source = TOKENIZED_ROWS[label]
  if isinstance(source, tuple):  # a seeds summary: mean and spread over the recipe's seeds
    name, recipe = source
    summary = _load(name)[recipe]
    # every seed chose the same variant, or the row would say which
    (chosen,) = set(summary['chosen'])
    seeds = [_load(f'{Path(name).parent}/{run}.json') for run in summary['runs']]
    return {
      0: [summary['steps']],
      1: [[seed['train_seconds'] / 60 for seed in seeds]],
      2: chosen_shown(*chosen.split(' ')),
      3: [[summary['validation']['bleu_tok']['mean']], [summary['validation']['bleu_tok']['std']]],
      4: [[summary['test']['bleu_tok']['mean']], [summary['test']['bleu_tok']['std']]],
    }
  result = _load(source)
  selected = result['selected']
  assert selected['by'] == 'bleu_tok', (source, selected)
  chosen = multi30k_grid.selected_rows(result)  # {split: the chosen variant's scores}
  return {
    0: [[result['steps']]],
    1: [[result['train_seconds'] / 60]],
    2: chosen_shown(selected['weights'], selected['search']),
    3: [[chosen['validation']['bleu_tok']]],
    4: [[chosen['test']['bleu_tok']]],
  }


SOLO = ('solo.json', 'solo_2.json')  # the speed table's two runs


def solo(task: str, dtypes: tuple[str, ...], contender: str, key: str) -> list[float]:
  """`key` of `contender` over both runs and the dtypes named."""
  values = []
  for name in SOLO:
    for record in _load(name)['results']:
      if record['task'] == task and record['dtype'] in dtypes:
        values.append(record['contenders'][contender][key])
  assert len(values) == 2 * len(dtypes), (task, dtypes, contender, key)
  return values


def cmlm_speedup(batch: int) -> list[float]:
  rows = [
    r
    for r in _load('cmlm_speed.json')['rows']
    if r['batch'] == batch and r['method'] == 'mask-predict T=1 l=1'
  ]
  assert len(rows) == 1
  return [rows[0]['speedup_vs_greedy']]


def gpu_share() -> list[float]:
  rows = [
    r
    for r in _load('train_step_gpu.json')['rows']
    if r['config'] == 'big'
    and r['dtype'] == 'bfloat16'
    and r['framework'] == 'ours'
    and r['shape'].startswith('768x')
  ]
  assert len(rows) == 1
  return [100 * rows[0]['fraction_of_peak']]  # shown as a percentage


def batch_rates(key: str, kind: str, scale: float = 1e6) -> list[float]:
  """benchmarks/data_pipeline.py's host batch rate (shown in millions of tokens/s) or ratio."""
  return [_load('data_pipeline.json')['batches'][f'{kind}_{key}'] / scale]


def first_step_s(name: str) -> float:
  """benchmarks/data_pipeline.py's first run: seconds from the command to its first training step."""
  return _load(name)['first_run']['first_step_s']


F32, BF16, BOTH = ('float32',), ('bfloat16',), ('float32', 'bfloat16')

# Speed table: columns ours | fastest peer | ours / peer; cell index -> one value list per " / " part.
SPEED_ROWS = {
  'training step, batch 32 × (32 + 32) tokens, float32': lambda: {
    0: [solo('train', F32, 'ours', 'median_s')],
    1: [solo('train', F32, 'flaxmarian', 'median_s')],
    2: [solo('train', F32, 'ours', 'speedup_over_fastest_peer')],
  },
  "the same in bfloat16 compute (a CPU with bfloat16 instructions), vs the peer's float32 step": lambda: {
    0: [solo('train', BF16, 'ours', 'median_s')],
    1: [solo('train', F32, 'flaxmarian', 'median_s')],
    2: [[_load(name)['bfloat16_step_over_fastest_peer_float32'] for name in SOLO]],
  },
  'greedy decoding, 32 sources, 32 new tokens, float32 / `--dtype bfloat16`': lambda: {
    0: [solo('greedy', BOTH, 'ours', 'tokens_per_s')],
    1: [solo('greedy', BOTH, 'flaxmarian', 'tokens_per_s')],
    2: [
      solo('greedy', F32, 'ours', 'speedup_over_fastest_peer'),
      solo('greedy', BF16, 'ours', 'speedup_over_fastest_peer'),
    ],
  },
  'beam 4, the same, float32 / `--dtype bfloat16`': lambda: {
    0: [solo('beam4', BOTH, 'ours', 'tokens_per_s')],
    1: [solo('beam4', BOTH, 'flaxmarian', 'tokens_per_s')],
    2: [
      solo('beam4', F32, 'ours', 'speedup_over_fastest_peer'),
      solo('beam4', BF16, 'ours', 'speedup_over_fastest_peer'),
    ],
  },
  'greedy with the KV cache vs re-running the decoder (in one process)': lambda: {
    2: [[_load('decode.json')['speedups']['greedy_over_naive']]],
  },
  "mask-predict (1 iteration, 1 length) vs greedy, the first Multi30k preset's size, batch 1 / batch 64": lambda: {
    2: [cmlm_speedup(1), cmlm_speedup(64)],
  },
  'one GPU (H200, 2026-11-29): big model, bfloat16 training step, 768 rows, share of the matmul peak': lambda: {
    2: [gpu_share()]
  },
  'raw text → first training step, 4.5M-pair stand-in, base preset (tokenizer, encoding, compiling), vs this '
  'library before ([input side](input_pipeline.md#the-input-side-at-the-papers-scale))': lambda: {
    0: [[first_step_s('data_pipeline.json')]],
    1: [[first_step_s('data_pipeline_2026-12-02.json')]],
    2: [[first_step_s('data_pipeline_2026-12-02.json') / first_step_s('data_pipeline.json')]],
  },
  'host batches of 25,000 tokens from the 4.5M-pair cache, bucketed / packed, real target tokens/s, vs this '
  "library's Python-loop batchers before": lambda: {
    0: [batch_rates('ours_tokens_per_s', 'bucketed'), batch_rates('ours_tokens_per_s', 'packed')],
    1: [
      batch_rates('before_tokens_per_s', 'bucketed'),
      batch_rates('before_tokens_per_s', 'packed'),
    ],
    2: [
      batch_rates('ours_over_before', 'bucketed', scale=1),
      batch_rates('ours_over_before', 'packed', scale=1),
    ],
  },
}


def specs() -> dict[str, dict[str, dict[int, list[list[float]]]]]:
  return {
    'bleu': {label: bleu_spec(label) for label in BLEU_ROWS},
    'tokenized': {label: tokenized_spec(label) for label in TOKENIZED_ROWS},
    'speed': {label: make() for label, make in SPEED_ROWS.items()},
  }


# ---------------------------------------------------------------------------------------------------------------
# Tests


@pytest.fixture(scope='module')
def tables():
  return results_tables(README.read_text())


@pytest.fixture(scope='module')
def all_specs():
  return specs()


MAPPINGS = {'bleu': BLEU_ROWS, 'tokenized': TOKENIZED_ROWS, 'speed': SPEED_ROWS}


@pytest.mark.parametrize('kind', list(MAPPINGS))
def test_every_row_is_mapped(tables, kind):
  mapping = MAPPINGS[kind]
  assert set(tables[kind]) == set(mapping), (
    f'README rows without a results file: {sorted(set(tables[kind]) - set(mapping))}; '
    f'mapped rows README no longer has: {sorted(set(mapping) - set(tables[kind]))}'
  )


@pytest.mark.parametrize('label', list(BLEU_ROWS))
def test_bleu_row_matches_its_file(tables, all_specs, label):
  assert check_row(tables['bleu'][label], all_specs['bleu'][label]) == []


@pytest.mark.parametrize('label', list(TOKENIZED_ROWS))
def test_tokenized_row_matches_its_file(tables, all_specs, label):
  assert check_row(tables['tokenized'][label], all_specs['tokenized'][label]) == []


@pytest.mark.parametrize('label', list(SPEED_ROWS))
def test_speed_row_matches_its_files(tables, all_specs, label):
  assert check_row(tables['speed'][label], all_specs['speed'][label]) == []


def test_the_peer_is_the_fastest_peer():
  """The speed table's peer column is FlaxMarian's: in every record it is read from, no other peer is faster."""
  for name in SOLO:
    for record in _load(name)['results']:
      if record['task'] == 'train' and record['dtype'] == 'bfloat16':
        continue  # that row compares against the peer's float32 step, by its own words
      medians = {
        c: v['median_s'] for c, v in record['contenders'].items() if c != 'ours' and 'median_s' in v
      }
      assert min(medians, key=medians.get) == 'flaxmarian', (
        name,
        record['task'],
        record['dtype'],
        medians,
      )


def _mutations(text: str):
  """For each number in a cell of the tables: README's text with that number's last digit changed."""
  tables = results_tables(text)
  lines = text.splitlines(keepends=True)
  for kind, rows in tables.items():
    for label, cells in rows.items():
      for i, cell in enumerate(cells):
        for match in NUMBER.finditer(cell):
          number = match.group()
          last = len(number) - 1
          changed = number[:last] + str((int(number[last]) + 1) % 10)
          new_cell = cell[: match.start()] + changed + cell[match.end() :]
          row_index = next(j for j, line in enumerate(lines) if line.startswith(f'| {label} |'))
          row = lines[row_index].replace(f'| {cell} |', f'| {new_cell} |', 1)
          assert row != lines[row_index]
          yield (
            kind,
            label,
            i,
            number,
            changed,
            ''.join(lines[:row_index] + [row] + lines[row_index + 1 :]),
          )


def test_an_edited_number_fails(all_specs):
  """Negative check: change the last digit of any number of any table and its row no longer matches its file."""
  text = README.read_text()
  count = 0
  for kind, label, i, number, changed, edited in _mutations(text):
    cells = results_tables(edited)[kind][label]
    assert cells[i] != results_tables(text)[kind][label][i]
    problems = check_row(cells, all_specs[kind][label])
    assert problems, f'{kind} row {label!r}: {number} -> {changed} went unnoticed'
    count += 1
  assert count >= 50, count  # every number of every table was tried
