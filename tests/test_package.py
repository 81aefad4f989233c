"""The package's shape: short functions, thin programs, and an inference path without training code."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from flax_transformer import DataConfig, ModelConfig, TrainConfig
from flax_transformer.nn.build import build_model
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import write_config
from flax_transformer.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 500
MAX_PROGRAM_LINES = 150
PROGRAMS = ('train', 'decode', 'distill', 'export')


def code_lines(function: ast.FunctionDef, lines: list[str]) -> int:
  """Non-blank, non-comment lines of a function's body, its docstring left out."""
  body = function.body
  has_docstring = (
    isinstance(body[0], ast.Expr)
    and isinstance(body[0].value, ast.Constant)
    and isinstance(body[0].value.value, str)
  )
  if has_docstring and len(body) == 1:
    return 0
  first = body[1].lineno if has_docstring else body[0].lineno
  # Decorators and the signature sit before `first`; the body ends at the function's end.
  return sum(
    1
    for line in lines[first - 1 : function.end_lineno]
    if line.strip() and not line.strip().startswith('#')
  )


def test_code_lines_counts_the_body_without_docstring_comments_or_blanks():
  source = 'def f(x):\n  """Doc.\n\n  More."""\n  # why\n  y = x\n\n  return y\n'
  (function,) = ast.parse(source).body
  assert code_lines(function, source.splitlines()) == 2


def test_no_library_function_is_longer_than_60_lines():
  too_long = []
  for path in sorted((ROOT / 'flax_transformer').rglob('*.py')):
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        count = code_lines(node, source.splitlines())
        if count > MAX_FUNCTION_LINES:
          too_long.append(f'{path.relative_to(ROOT)}:{node.lineno} {node.name}: {count} lines')
  assert not too_long, too_long


def test_no_library_module_is_longer_than_500_lines():
  # A module over 500 lines holds more than one job: split it where its jobs part (House III).
  too_long = [
    f'{path.relative_to(ROOT)}: {count} lines'
    for path in sorted((ROOT / 'flax_transformer').rglob('*.py'))
    if (count := len(path.read_text().splitlines())) > MAX_MODULE_LINES
  ]
  assert not too_long, too_long


@pytest.mark.parametrize(
  'program',
  [
    'train.py',
    'decode.py',
    'distill.py',
    'export.py',
    'flax_transformer/cli/train.py',
    'flax_transformer/cli/decode.py',
    'flax_transformer/cli/distill.py',
    'flax_transformer/cli/export.py',
  ],
)
def test_programs_are_thin(program):
  assert len((ROOT / program).read_text().splitlines()) < MAX_PROGRAM_LINES


def test_every_program_is_an_installed_command():
  import tomllib

  scripts = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']['scripts']
  # The four programs, and the benchmarking command of flax_transformer.bench.
  assert scripts == {
    **{f'flax-transformer-{name}': f'flax_transformer.cli.{name}:main' for name in PROGRAMS},
    'flax-transformer-bench': 'flax_transformer.bench.command:main',
  }
  for name in PROGRAMS:
    assert f'from flax_transformer.cli.{name} import main' in (ROOT / f'{name}.py').read_text()


@pytest.fixture(scope='module')
def untrained_run(tmp_path_factory) -> Path:
  """A run directory holding a tiny model's initial parameters: config, tokenizer, checkpoint."""
  workdir = tmp_path_factory.mktemp('untrained')
  tokenizer = Tokenizer.train(['one two three', 'eins zwei drei'] * 20, 40, 'bpe')
  tokenizer.save(workdir)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size)
  write_config(workdir, config, TrainConfig.toy(), DataConfig())
  tokens = jax.numpy.ones((1, 4), jax.numpy.int32)
  params = build_model(config).init(jax.random.key(0), tokens, tokens)['params']
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(1, jax.device_get(params))
  checkpoints.close()
  return workdir


def test_decoding_imports_neither_optax_nor_the_training_step(untrained_run):
  # A fresh interpreter: what the test session imported does not count.
  script = f"""
import json, sys
from flax_transformer.cli.decode import main
status = main(['--checkpoint', {str(untrained_run)!r}, '--method', 'greedy', 'one two'])
loaded = [name for name in sys.modules if name.split('.')[0] == 'optax'
          or name in ('flax_transformer.train.step', 'flax_transformer.train.loop')]
print(json.dumps({{'status': status, 'loaded': loaded}}))
"""
  result = subprocess.run(
    [sys.executable, '-c', script], capture_output=True, text=True, cwd=ROOT, timeout=300
  )
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report == {'status': 0, 'loaded': []}, result.stderr[-2000:]


HEAVY = ('jax', 'jaxlib', 'flax', 'optax', 'orbax', 'datasets', 'tensorstore')


@pytest.mark.parametrize(
  'statement',
  [
    'import flax_transformer.config',
    'import flax_transformer.errors',
    'from flax_transformer import ModelConfig, TrainConfig, ConfigError',
    "from flax_transformer.cli.train import main; main(['--help'])",
    "from flax_transformer.cli.decode import main; main(['--help'])",
    'from flax_transformer.decode import METHODS, BeamSearch, default_method',
  ],
)
def test_settings_errors_and_help_load_no_jax(statement):
  # A fresh interpreter, so that nothing the test session imported counts.
  script = f"""
import contextlib, io, json, sys
with contextlib.redirect_stdout(io.StringIO()):
  try:
    {statement}
  except SystemExit:
    pass
heavy = sorted({{name.split('.')[0] for name in sys.modules}} & set({HEAVY!r}))
print(json.dumps(heavy))
"""
  result = subprocess.run(
    [sys.executable, '-c', script], capture_output=True, text=True, cwd=ROOT, timeout=120
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_lazy_root_answers_every_public_name():
  import flax_transformer
  from flax_transformer.decode import METHODS

  assert all(getattr(flax_transformer, name) is not None for name in flax_transformer.__all__)
  assert {cls.__name__ for cls in METHODS.values()} <= set(flax_transformer.__all__)
  with pytest.raises(AttributeError, match='has no attribute'):
    flax_transformer.NoSuchName  # noqa: B018


def test_no_library_module_imports_another_ones_private_name():
  # A name another module needs is part of its interface: public, documented as such.
  private = []
  for path in sorted((ROOT / 'flax_transformer').rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('flax_transformer'):
        private += [
          f'{path.relative_to(ROOT)}: {node.module}.{alias.name}'
          for alias in node.names
          if alias.name.startswith('_') and not alias.name.startswith('__')
        ]
  assert private == []


def _defined_names(path: Path) -> set[str]:
  """The names a module defines at its top level (functions, classes, assignments)."""
  names = set()
  for node in ast.parse(path.read_text()).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.Assign):
      names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
      names.add(node.target.id)
  return names


def test_library_modules_import_each_name_from_where_it_is_defined():
  # A module that merely passes a name on (a compatibility re-export) is for users; the library
  # imports from the defining module, or from a subpackage's face (its __init__.py).
  passed_on = []
  for path in sorted((ROOT / 'flax_transformer').rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if not (
        isinstance(node, ast.ImportFrom) and (node.module or '').startswith('flax_transformer')
      ):
        continue
      source = ROOT.joinpath(*node.module.split('.')).with_suffix('.py')
      if not source.is_file():
        continue  # a package: its face
      defined = _defined_names(source)
      passed_on += [
        f'{path.relative_to(ROOT)}: {node.module}.{alias.name}'
        for alias in node.names
        if alias.name not in defined
        and not ROOT.joinpath(*node.module.split('.'), alias.name).exists()
      ]
  assert passed_on == []
