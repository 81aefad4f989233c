"""Nothing lost: every program pointed every wrong way at a tree of what it must not touch.

The sentinel tree (module-scoped, built once): files of another tool, a lone foreign
config.json, a Marian directory, a finished tiny run of train.py with its average-last2, the
corpus it was trained on, and symlinks to each. train.py, decode.py, distill.py and averaging
are aimed at each sentinel as the output (the sentinel itself, a symlink to it, a file inside
it, its parent, '' and '.' from inside it); each refusal must be status 2 (averaging:
CheckpointError), one line on standard error, and leave the tree byte for byte as it was.
The alias matrix aims each program's outputs (decode.py, distill.py, train.py, export.py) at
each of its inputs under every kind of name (`ALIAS_KINDS`): only a comparison of files by
identity (`outputs.same_file`) refuses the hard links.
"""

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

import decode as decode_cli
import distill as distill_cli
import train as train_cli
from flax_transformer.config import ConfigError, ModelConfig, TrainConfig
from flax_transformer.data.toy_task import number_translation
from flax_transformer.run.checkpoints import CheckpointError
from flax_transformer.run.directory import (
  RUN_FORMAT,
  WRITTEN_BY,
  NotARun,
  clear_run,
  foreign_entries,
  run_format,
)
from flax_transformer.run.loading import average_checkpoints
from flax_transformer.run.sizes import check_decoding_fits, decoding_bytes
from flax_transformer.train.loop import checkpoints_kept
from support.script_calls import call

pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')

# The tiny model of test_train_cli: one compiled training step.
OPTIONS = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--model.max_len=16',
  '--data.vocab_size=256',
  '--train.max_tokens=256',
  '--train.warmup_steps=4',
]
# The sentinels, as tree-relative paths, and a file inside each.
SENTINELS = {
  'tool': 'tool/notes.txt',
  'bare': 'bare/config.json',
  'marian': 'marian/config.json',
  'average': 'run/average-last2/config.json',
}


# support.marian_directory builds a real one where torch and transformers are installed.
REAL_MARIAN = all(
  importlib.util.find_spec(name) for name in ('torch', 'transformers', 'sentencepiece')
)


def _marian(directory: Path) -> None:
  """A random Marian directory (support.marian_directory), or its files' names alone without
  torch: no refusal below reads them."""
  if REAL_MARIAN:
    from support.marian_directory import make_marian_directory

    make_marian_directory(directory)
  else:
    directory.mkdir()
    (directory / 'config.json').write_text('{"model_type": "marian", "d_model": 32}\n')
    for name in ('source.spm', 'target.spm', 'vocab.json', 'model.safetensors'):
      (directory / name).write_bytes(b'\0' * 64)


@pytest.fixture(scope='module')
def tree(tmp_path_factory) -> Path:
  root = tmp_path_factory.mktemp('sentinels')
  numbers = number_translation(num_train=32, num_validation=4, num_test=4)
  (root / 'data').mkdir()
  for split, stem in {'train': 'train', 'validation': 'val', 'test': 'test'}.items():
    for column, lang in (('source', 'en'), ('target', 'de')):
      (root / 'data' / f'{stem}.{lang}').write_text(
        ''.join(f'{line}\n' for line in numbers[split][column])
      )
  (root / 'input.en').write_text('one\ntwo\n')
  (root / 'tool' / 'sub').mkdir(parents=True)
  (root / 'tool' / 'notes.txt').write_text('not a run\n')
  (root / 'tool' / 'config.json').write_text('{"tool": "another", "version": 3}\n')
  (root / 'tool' / 'sub' / 'data.bin').write_bytes(bytes(range(256)))
  (root / 'bare').mkdir()
  (root / 'bare' / 'config.json').write_text('{"model": "not ours"}\n')
  _marian(root / 'marian')
  status, _, err = call(
    train_cli.main,
    [
      *OPTIONS,
      '--data',
      root / 'data',
      '--workdir',
      root / 'run',
      '--steps',
      '2',
      '--train.checkpoint_every=1',
      '--average-last',
      '2',
    ],
  )
  assert status == 0, err
  (root / 'links').mkdir()
  for name in ('tool', 'bare', 'marian', 'run', 'data'):
    (root / 'links' / name).symlink_to(root / name)
  (root / 'links' / 'average').symlink_to(root / 'run' / 'average-last2')
  (root / 'links' / 'input.en').symlink_to(root / 'input.en')
  return root


def snapshot(root: Path) -> dict[str, object]:
  """Every directory's listing, every file's SHA-256 and every symlink's target."""
  state = {}
  for directory, names, files in os.walk(root):
    here = Path(directory)
    state[str(here.relative_to(root))] = sorted(names + files)
    for name in names + files:
      path = here / name
      if path.is_symlink():
        state[str(path.relative_to(root))] = f'-> {os.readlink(path)}'
      elif path.is_file():
        state[str(path.relative_to(root))] = hashlib.sha256(path.read_bytes()).hexdigest()
  return state


def _ways(sentinel: str, program: str) -> list[tuple[str, str | None]]:
  """(output, cwd) pairs aiming at `sentinel`: itself, by a symlink, a file inside it, its
  parent (the tree; an average's is its run, where train.py rightly resumes), and '' and '.'
  from inside it."""
  path = 'run/average-last2' if sentinel == 'average' else sentinel
  parent = [] if (sentinel, program) == ('average', 'train') else [(str(Path(path).parent), None)]
  return [
    (path, None),
    (f'links/{sentinel}', None),
    (SENTINELS[sentinel], None),
    *parent,
    ('', path),
    ('.', path),
  ]


def _cases():
  """(program, argv template, cwd) of every wrong way; {root} is the tree."""
  cases = []
  train = [*OPTIONS, '--data', '{root}/data', '--steps', '2']
  for sentinel in SENTINELS:
    for output, cwd in _ways(sentinel, 'train'):
      for resume in ('--resume', '--no-resume'):
        cases.append(('train', [*train, resume, '--workdir', _at(output, cwd)], cwd))
  cases += [
    ('train', [*train, '--workdir', '{root}/data/run'], None),  # inside --data
    ('train', [*train, '--workdir', '{root}/run/checkpoints', '--no-resume'], None),
    ('train', [*train, '--workdir', '', '--no-resume'], 'run/checkpoints'),
  ]
  if REAL_MARIAN:  # --init-from reads the model's config.json first
    cases += [
      (
        'train',
        [
          '--data',
          '{root}/data',
          '--steps',
          '2',
          '--workdir',
          f'{{root}}/{workdir}',
          '--init-from',
          '{root}/marian',
        ],
        None,
      )
      for workdir in ('marian', 'marian/run')
    ]
  distill = ['--checkpoint', '{root}/run', '--data', '{root}/data', '--beam-size', '1']
  ways = [way for sentinel in SENTINELS for way in _ways(sentinel, 'distill')]
  ways += [(name, None) for name in ('run', 'links/run', 'data', 'links/data')]
  for output, cwd in ways:
    for overwrite in ([], ['--overwrite']):
      cases.append(('distill', [*distill, '--output', _at(output, cwd), *overwrite], cwd))
  cases.append(
    (
      'distill',
      [
        '--checkpoint',
        '{root}/run/average-last2',
        '--data',
        '{root}/data',
        '--output',
        '{root}/run/checkpoints',
        '--overwrite',
      ],
      None,
    )
  )
  decode = ['--checkpoint', '{root}/run', '--input', '{root}/input.en', '--output']
  cases += [
    ('decode', [*decode, output], cwd)
    for output, cwd in [
      ('{root}/run/config.json', None),
      ('{root}/links/run/config.json', None),
      ('{root}/input.en', None),
      ('{root}/links/input.en', None),
      ('{root}/run/checkpoints/new.txt', None),
      ('{root}/run/average-last2/out.txt', None),
      ('{root}/tool', None),
      ('.', 'tool'),
    ]
  ]
  cases.append(
    (
      'decode',
      [
        '--checkpoint',
        '{root}/run/average-last2',
        '--input',
        '{root}/input.en',
        '--output',
        '{root}/run/config.json',
      ],
      None,
    )
  )
  ways = [way for sentinel in ('tool', 'bare', 'marian') for way in _ways(sentinel, 'average')]
  ways += [('run', None), ('links/run', None), ('run/checkpoints', None), ('run/config.json', None)]
  cases += [('average', [_at(output, cwd)], cwd) for output, cwd in ways]
  unique = {(program, tuple(argv), cwd): None for program, argv, cwd in cases}  # parents repeat
  return [
    pytest.param(program, list(argv), cwd, id=_name(program, list(argv), cwd))
    for program, argv, cwd in unique
  ]


def _name(program: str, argv: list[str], cwd: str | None) -> str:
  """'train --workdir=links/tool --no-resume', 'decode --output=. in tool', ..."""
  flag = {'train': '--workdir', 'decode': '--output', 'distill': '--output'}.get(program)
  target = argv[argv.index(flag) + 1] if flag else argv[0]
  shown = 'the tree' if target == '{root}/.' else repr(target.replace('{root}/', ''))
  words = [program, f'{flag or "output"}={shown}']
  words += [a for a in argv if a in ('--no-resume', '--overwrite', '--init-from')]
  if '{root}/run/average-last2' in argv[:2]:
    words.append('teacher=average')
  return ' '.join(words + ([f'in {cwd}'] if cwd else []))


def _at(output: str, cwd: str | None) -> str:
  """An output path template: relative to the cwd as given, else under the tree."""
  return output if cwd is not None else '{root}/' + output


PROGRAMS = {'train': train_cli.main, 'decode': decode_cli.main, 'distill': distill_cli.main}


@pytest.mark.parametrize('program, argv, cwd', _cases())
def test_every_wrong_output_is_refused_and_the_tree_is_unchanged(
  tree, program, argv, cwd, monkeypatch
):
  if cwd is not None:
    monkeypatch.chdir(tree / cwd)
  argv = [a.replace('{root}', str(tree)) for a in argv]
  before = snapshot(tree)
  if program == 'average':
    with pytest.raises(CheckpointError) as refusal:
      average_checkpoints(tree / 'run', 2, output=Path(argv[0]))
    assert '\n' not in str(refusal.value)
  else:
    status, _, err = call(PROGRAMS[program], argv)
    lines = err.strip().splitlines()
    assert (status, len(lines)) == (2, 1), err
    assert lines[0].startswith(f'{program}.py: error: '), err
  assert snapshot(tree) == before


def test_the_run_is_marked_and_the_sentinels_are_foreign(tree):
  config = json.loads((tree / 'run' / 'config.json').read_text())
  assert (config['written_by'], config['run_format']) == (WRITTEN_BY, RUN_FORMAT)
  assert config['tokenizer_files'] == ['tokenizer.json']
  assert foreign_entries(tree / 'run') == [] and run_format(tree / 'run') == RUN_FORMAT
  assert {'config.json', 'model.safetensors', 'source.spm', 'target.spm', 'vocab.json'} <= set(
    foreign_entries(tree / 'marian')
  )
  assert foreign_entries(tree / 'tool') == ['config.json', 'notes.txt', 'sub']
  assert run_format(tree / 'tool') is None


def test_an_older_run_without_the_marker_is_still_a_run_and_is_cleared(tmp_path):
  """A config.json with the three sections and no marker: a run of format 1, its files ours."""
  old = {'model': {}, 'train': {}, 'data': {}}
  (tmp_path / 'config.json').write_text(json.dumps(old))
  for name in ('tokenizer.json', 'source.spm', 'metrics.jsonl', 'run.lock'):
    (tmp_path / name).write_text('x')
  (tmp_path / 'checkpoints' / '4').mkdir(parents=True)
  (tmp_path / 'encoded').mkdir()
  assert run_format(tmp_path) == 1 and foreign_entries(tmp_path) == []
  clear_run(tmp_path)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['encoded', 'run.lock']


def test_clear_run_refuses_a_run_holding_anything_else_and_deletes_nothing(tmp_path):
  (tmp_path / 'config.json').write_text(
    json.dumps({'written_by': WRITTEN_BY, 'run_format': 2, 'tokenizer_files': ['tokenizer.json']})
  )
  for name in ('tokenizer.json', 'source.spm', 'thesis.tex'):  # a Marian file not listed
    (tmp_path / name).write_text('x')
  with pytest.raises(
    NotARun,
    match=r'holds what no run of train.py wrote: source.spm, '
    r'thesis.tex; train.py writes',
  ):
    clear_run(tmp_path)
  assert len(list(tmp_path.iterdir())) == 4


@pytest.mark.parametrize(
  'steps, every, keep, saved, kept',
  [
    (5, 200, 5, (), 1),  # only the final step
    (5, 2, 5, (), 3),  # 2, 4 and 5
    (10, 2, 3, (), 3),  # capped by keep_checkpoints
    (6, 200, 5, (2, 4), 3),  # resumed: 2 and 4 saved, 6 written
    (4, 200, 5, (2, 4), 2),  # already trained: nothing new
  ],
)
def test_checkpoints_kept_counts_what_the_run_leaves(steps, every, keep, saved, kept):
  config = TrainConfig(steps=steps, checkpoint_every=every, keep_checkpoints=keep)
  assert checkpoints_kept(config, saved) == kept


def test_the_decoding_estimate_grows_with_the_beams_squared():
  config = ModelConfig.tiny()
  one, two = (decoding_bytes(config, rows=8, beams=k, length=16) for k in (1000, 2000))
  assert 3.5 < two / one < 4.5
  check_decoding_fits(config, rows=8, beams=4, option='--beam-size')
  with pytest.raises(ConfigError, match=r'--beam-size=100000 is too large for this machine'):
    check_decoding_fits(config, rows=8, beams=100_000, option='--beam-size', memory=2**34)


@pytest.mark.parametrize(
  'argv, message',
  [
    (
      ['--train.seed=100000000000000000000'],
      'train.seed must be an integer in [0, 9223372036854775807], got 100000000000000000000',
    ),
    (['--train.packing=1'], 'train.packing (the packed row length; 0: no packing) must be'),
    (
      ['--steps', '5', '--average-last', '2'],
      '--average-last=2 needs that many checkpoints, but this run ends with 1',
    ),
    (['--devices', '99'], '--devices=99: this process has'),
  ],
)
def test_train_values_are_refused_before_work(argv, message, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  status, out, err = call(train_cli.main, [*OPTIONS, *argv, '--workdir', tmp_path / 'run'])
  assert status == 2 and message in err, err
  assert 'data:' not in out and not (tmp_path / 'run').exists()


@pytest.mark.parametrize(
  'argv, message',
  [
    (['--beam-size', '100000'], '--beam-size=100000 is too large for this machine'),
    (
      ['--method', 'mask_predict', '--length-offset', '1000000000000'],
      'argument --length-offset: must be in [-65536, 65536], got 1000000000000',
    ),
    (['--method', 'sample', '--seed', str(2**64)], '--seed: must be in'),
  ],
)
def test_decode_values_are_refused_before_work(tree, argv, message):
  status, out, err = call(decode_cli.main, ['--checkpoint', tree / 'run', *argv, 'one'])
  assert status == 2 and message in err and out == '', err


# --- files known by identity --------------------------------------------------------------------

# Each program's outputs aimed at each of its inputs: (program, argv before the output, the
# output option, the input as a tree path, 'is' (the output is the input) or a path inside it).
ALIAS_PAIRS = [
  (
    'decode',
    [
      '--checkpoint',
      '{root}/run',
      '--input',
      '{root}/input.en',
      '--reference',
      '{root}/reference.de',
    ],
    '--output',
    'input.en',
    'is',
  ),
  (
    'decode',
    [
      '--checkpoint',
      '{root}/run',
      '--input',
      '{root}/input.en',
      '--reference',
      '{root}/reference.de',
    ],
    '--output',
    'reference.de',
    'is',
  ),
  (
    'decode',
    ['--checkpoint', '{root}/run', '--input', '{root}/input.en'],
    '--output',
    'run',
    'config.json',
  ),
  (
    'distill',
    ['--checkpoint', '{root}/run', '--data', '{root}/data', '--beam-size', '1'],
    '--output',
    'data',
    'is',
  ),
  (
    'distill',
    ['--checkpoint', '{root}/run', '--data', '{root}/data', '--beam-size', '1'],
    '--output',
    'run',
    'checkpoints',
  ),
  ('train', [*OPTIONS, '--data', '{root}/data', '--steps', '2'], '--workdir', 'data', 'is'),
  ('train', [*OPTIONS, '--data', '{root}/data', '--steps', '2'], '--workdir', 'data', 'run'),
  ('export', ['{root}/run'], '--to', 'run', 'checkpoints'),
  ('export', ['{root}/run'], '--to', 'run', 'config.json'),
]
# How a name can reach a file: (kind, for files?, for directories?).
ALIAS_KINDS = [
  ('same', True, True),
  ('dotdot', True, True),
  ('relative', True, True),
  ('trailing_slash', False, True),
  ('symlink', True, True),
  ('symlink_above', True, True),
  ('hardlink', True, False),
]


def _alias(kind: str, target: str) -> tuple[str, str | None]:
  """(a name for the tree path `target` of this kind, the cwd it is relative to)."""
  names = {
    'same': '{root}/' + target,
    'dotdot': '{root}/tool/sub/../../' + target,
    'relative': target,
    'trailing_slash': '{root}/' + target + '/',
    'symlink': '{root}/aliases/' + target.replace('/', '_') + '.link',
    'symlink_above': '{root}/aliases/up/' + target,
    'hardlink': '{root}/aliases/' + target.replace('/', '_') + '.hard',
  }
  return names[kind], ('.' if kind == 'relative' else None)


def _alias_cases():
  cases = []
  for program, argv, option, source, where in ALIAS_PAIRS:
    is_file = '.' in Path(source).name
    for kind, for_files, for_directories in ALIAS_KINDS:
      if not (for_files if is_file else for_directories):
        continue
      name, cwd = _alias(kind, source)
      output = name if where == 'is' else f'{name.rstrip("/")}/{where}'
      cases.append(
        pytest.param(
          program,
          [*argv, option, output],
          cwd,
          source,
          id=f'{program} {option} {where} {source} via {kind}',
        )
      )
  return cases


@pytest.fixture(scope='module')
def aliases(tree) -> Path:
  """tree/aliases: a symlink to each input, one to the tree (up), a hard link to each file."""
  (tree / 'reference.de').write_text('eins\nzwei\n')
  directory = tree / 'aliases'
  directory.mkdir()
  (directory / 'up').symlink_to(tree)
  for source in {pair[3] for pair in ALIAS_PAIRS}:
    (directory / f'{source}.link').symlink_to(tree / source)
    if (tree / source).is_file():
      os.link(tree / source, directory / f'{source}.hard')
  return tree


PROGRAMS['export'] = __import__('export').main


@pytest.mark.parametrize('program, argv, cwd, source', _alias_cases())
def test_an_output_that_is_an_input_under_any_name_is_refused(
  aliases, program, argv, cwd, source, monkeypatch
):
  tree = aliases
  if cwd is not None:
    monkeypatch.chdir(tree)
  argv = [a.replace('{root}', str(tree)) for a in argv]
  before = snapshot(tree)
  status, _, err = call(PROGRAMS[program], argv)
  lines = err.strip().splitlines()
  assert (status, len(lines)) == (2, 1), err
  assert lines[0].startswith(f'{program}.py: error: '), err
  # The line names the output as given and the input it would overwrite.
  assert str(Path(argv[-1])) in lines[0] and str(tree / source) in lines[0], lines[0]
  assert snapshot(tree) == before
