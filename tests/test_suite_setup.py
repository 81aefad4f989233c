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
