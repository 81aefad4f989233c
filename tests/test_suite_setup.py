"""How the suite itself runs (tests/conftest.py, tests/support/environment.py): the order of
its files, the workers it starts, and the XLA_FLAGS its child processes inherit."""

import os
from pathlib import Path
from types import SimpleNamespace

import conftest

from support.environment import xla_flags

TESTS = Path(__file__).resolve().parent


def test_the_slowest_files_named_exist_once_each():
  # A renamed or deleted file would silently drop out of the order.
  named = conftest.SLOWEST_FILES
  assert len(set(named)) == len(named)
  assert [name for name in named if not (TESTS / name).is_file()] == []


def test_child_processes_keep_the_suites_flags_and_replace_their_own(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=8')
  flags = xla_flags(
    '--xla_force_host_platform_device_count=2', '--xla_backend_optimization_level=0'
  )
  assert flags == (
    '--xla_cpu_max_isa=AVX2 --xla_force_host_platform_device_count=2 '
    '--xla_backend_optimization_level=0'
  )
  monkeypatch.delenv('XLA_FLAGS')
  assert xla_flags('--xla_force_host_platform_device_count=4') == (
    '--xla_force_host_platform_device_count=4'
  )


def test_workers_one_per_core_for_the_suite_and_none_for_one_file(monkeypatch):
  monkeypatch.delenv('PYTEST_XDIST_AUTO_NUM_WORKERS', raising=False)
  cores = len(os.sched_getaffinity(0))

  def workers(*args):
    return conftest.pytest_xdist_auto_num_workers(SimpleNamespace(args=list(args)))

  assert workers(str(TESTS)) is None  # xdist's rule: a worker per core
  assert workers(str(TESTS / 'test_masks.py')) == 0
  assert (
    workers(f'{TESTS / "test_masks.py"}::test_padding_mask_shape', str(TESTS / 'test_masks.py'))
    == 0
  )  # one file, however named
  assert workers(str(TESTS / 'test_masks.py'), str(TESTS / 'test_bounds.py')) == min(cores, 2)


def test_the_session_shares_one_compilation_cache():
  # Set before jax was imported, so this process, its xdist siblings and the processes that
  # tests start all read and write the same directory.
  import jax

  directory = os.environ['JAX_COMPILATION_CACHE_DIR']
  assert directory == os.environ['FLAX_TRANSFORMER_TEST_COMPILATION_CACHE']
  assert jax.config.jax_compilation_cache_dir == directory and Path(directory).is_dir()


# --- README's test command runs after README's install: optional packages skip, saying how --------

ROOT = TESTS.parent


def optional_modules() -> set[str]:
  """The packages of pyproject.toml's extras that '.[test]' does not install (nor the core),
  by their import names."""
  import re
  import tomllib

  project = tomllib.loads((ROOT / 'pyproject.toml').read_text())['project']
  name = lambda requirement: re.match(r'[A-Za-z0-9_.-]+', requirement).group(0).lower()
  extras = project['optional-dependencies']
  installed = {name(r) for r in project['dependencies'] + extras['test']}
  wanted = {name(r) for extra, reqs in extras.items() if extra != 'test' for r in reqs}
  return {module.replace('-', '_') for module in wanted - installed - {'flax_transformer'}}


def unguarded_imports(source: str, optional: set[str], helper: bool = False) -> list[str]:
  """The imports of `optional` packages that would fail under '.[test]' instead of skipping:
  any at a module's top level; inside a function, any whose file neither skips on it
  (pytest.importorskip, importlib.util.find_spec) nor is a helper whose callers do. And every
  importorskip of one whose reason does not name the pip command that brings it."""
  import ast

  tree = ast.parse(source)
  found = []
  top_level = {id(node) for node in tree.body}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names = [alias.name.split('.')[0] for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [node.module.split('.')[0]]
    else:
      names = []
    for module in set(names) & optional:
      guarded = f"importorskip('{module}'" in source or (
        'find_spec(' in source and f"'{module}'" in source
      )
      if id(node) in top_level or not (guarded or helper):
        found.append(f'line {node.lineno}: import {module}')
    is_skip = (
      isinstance(node, ast.Call)
      and isinstance(node.func, ast.Attribute)
      and node.func.attr == 'importorskip'
    )
    if is_skip and node.args and isinstance(node.args[0], ast.Constant):
      reason = ' '.join(
        str(k.value.value) for k in node.keywords if isinstance(k.value, ast.Constant)
      )
      if node.args[0].value in optional and 'pip install' not in reason:
        found.append(
          f'line {node.lineno}: importorskip({node.args[0].value!r}) names no pip command'
        )
  return found


def test_optional_packages_are_the_peers():
  # sentencepiece and safetensors are in '.[test]': their tests run under README's command.
  assert {'torch', 'transformers', 'ctranslate2'} <= optional_modules()
  assert not {'sentencepiece', 'safetensors', 'matplotlib', 'jax'} & optional_modules()


def test_the_rule_finds_bare_and_silent_imports_of_optional_packages():
  optional = {'torch'}
  assert unguarded_imports('import torch\n', optional) == ['line 1: import torch']
  assert unguarded_imports('def f():\n  from torch import nn\n', optional) == [
    'line 2: import torch'
  ]
  assert unguarded_imports('def f():\n  import torch\n', optional, helper=True) == []
  silent = "import pytest\ntorch = pytest.importorskip('torch')\n"
  assert unguarded_imports(silent, optional) == [
    "line 2: importorskip('torch') names no pip command"
  ]
  fine = "import pytest\ntorch = pytest.importorskip('torch', reason='pip install torch')\n"
  assert unguarded_imports(fine + 'def f():\n  import torch\n', optional) == []


def test_no_test_fails_for_want_of_a_package_outside_the_test_extra():
  optional = optional_modules()
  found = {
    str(path.relative_to(ROOT)): problems
    for path in sorted(TESTS.rglob('*.py'))
    if (problems := unguarded_imports(path.read_text(), optional, helper='support' in path.parts))
  }
  assert found == {}
