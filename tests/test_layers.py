"""The package's plan, read from its imports: layers that only point down, and no circle.

Each subpackage is a layer; a module may import from its own layer and the ones
below it, never from a layer above (`LAYERS`, bottom first). The package's own
`__init__` is the public facade and may name anything (it loads the upper layers
lazily). Imports are read with `ast`, so an import inside a function counts too.
"""

import ast
from pathlib import Path

import pytest

from flax_transformer.tokenizer import TextTokenizer, Tokenizer

PACKAGE = Path(__file__).resolve().parents[1] / 'flax_transformer'
LAYERS = (
  'errors',
  'config',
  'signals',
  'files',
  'nn',
  'tokenizer',
  'data',
  'pretrained',
  'run',
  'decode',
  'train',
  'cli',
  'bench',
)


def module_name(path: Path) -> str:
  parts = path.relative_to(PACKAGE.parent).with_suffix('').parts
  return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def imported_modules(path: Path) -> set[str]:
  """The flax_transformer modules `path` imports: `from a.b import c` counts a.b.c when c is
  a module, else a.b."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      for alias in node.names:
        submodule = f'{node.module}.{alias.name}'
        found.add(submodule if submodule in MODULES else node.module)
  return {name for name in found if name in MODULES}


MODULES = {module_name(path): path for path in PACKAGE.rglob('*.py')}
IMPORTS = {name: imported_modules(path) for name, path in MODULES.items()}


def layer(name: str) -> int | None:
  """The index in LAYERS of a module's layer; None for the package facade."""
  parts = name.split('.')
  return None if len(parts) == 1 else LAYERS.index(parts[1])


def test_every_module_sits_in_a_layer():
  strays = [name for name in MODULES if name.count('.') >= 1 and name.split('.')[1] not in LAYERS]
  assert not strays, f'modules outside the layers {LAYERS}: {strays}'


@pytest.mark.parametrize('name', sorted(name for name in MODULES if layer(name) is not None))
def test_imports_point_down(name):
  upward = sorted(
    other for other in IMPORTS[name] if layer(other) is None or layer(other) > layer(name)
  )
  assert not upward, f'{name} (layer {LAYERS[layer(name)]}) imports from above it: {upward}'


def test_no_import_circle():
  """Depth-first search over module imports (the facade left out: it imports lazily)."""
  graph = {
    name: {
      other
      for other in IMPORTS[name]
      if layer(other) is not None
      and not (MODULES[other].name == '__init__.py' and name.startswith(other + '.'))
    }
    for name in MODULES
    if layer(name) is not None
  }
  state = {}

  def visit(name, path):
    state[name] = 'open'
    for other in sorted(graph[name]):
      if state.get(other) == 'open':
        pytest.fail('import circle: ' + ' -> '.join(path[path.index(other) :] + [other]))
      if other not in state:
        visit(other, path + [other])
    state[name] = 'done'

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])


def test_the_checker_sees_an_upward_import(tmp_path):
  """The reader above would catch a model that imports the training side."""
  path = tmp_path / 'model.py'
  path.write_text('def f():\n  from flax_transformer.train.losses import loss_sums\n')
  assert imported_modules(path) == {'flax_transformer.train.losses'}
  assert layer('flax_transformer.train.losses') > layer('flax_transformer.nn.model')


def test_both_tokenizers_satisfy_the_protocol(tmp_path):
  pytest.importorskip('sentencepiece')
  from flax_transformer.pretrained.marian import MarianTokenizer

  assert isinstance(Tokenizer.train(['a b c', 'b c d'], 16), TextTokenizer)
  for cls in (Tokenizer, MarianTokenizer):
    members = [name for name in dir(TextTokenizer) if not name.startswith('_')]
    missing = [name for name in members if not hasattr(cls, name)]
    assert not missing, f'{cls.__name__} lacks {missing} of TextTokenizer'


def test_docs_architecture_places_every_module():
  """docs/architecture.md has a section per layer naming each of its modules."""
  text = (PACKAGE.parent / 'docs' / 'architecture.md').read_text()
  sections = {
    heading.split('`')[1].strip('/').removesuffix('.py'): body
    for heading, _, body in (part.partition('\n') for part in text.split('\n## ')[1:])
    if heading.startswith('`')
  }
  missing = []
  for name in MODULES:
    parts = name.split('.')
    if len(parts) == 3 and parts[2] != '__init__':
      if f'`{parts[2]}`' not in sections.get(parts[1], ''):
        missing.append(name)
    elif len(parts) == 2 and parts[1] not in sections:
      missing.append(name)
  assert not missing, f'docs/architecture.md does not place {missing}'
