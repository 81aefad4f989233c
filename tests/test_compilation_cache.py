"""JAX's persistent compilation cache in train.py (cli/compilation_cache.py): on by default,
where the setting, JAX_COMPILATION_CACHE_DIR or the per-user default says, and a restart
that compiles nothing."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from flax_transformer.cli import compilation_cache
from flax_transformer.cli import train as train_cli
from flax_transformer.config import ConfigError
from support.script_calls import usage_error

ROOT = Path(__file__).resolve().parents[1]
TINY = [
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
  '--model.d_ff=64',
  '--train.eval_every=2',
]
SUMMARY = re.compile(r'^compilation cache (.+): (\d+) programs read, (\d+) compiled$', re.M)


def test_the_setting_comes_first_then_the_environment_then_the_per_user_default(tmp_path):
  environ = {'JAX_COMPILATION_CACHE_DIR': str(tmp_path / 'env'), 'HOME': str(tmp_path)}
  assert compilation_cache.location(str(tmp_path / 'set'), environ) == (tmp_path / 'set', 'setting')
  assert compilation_cache.location('off', environ) == (None, 'setting')
  assert compilation_cache.location('OFF ', environ) == (None, 'setting')
  assert compilation_cache.location(None, environ) == (tmp_path / 'env', 'environment')
  environ['JAX_COMPILATION_CACHE_DIR'] = ''  # set but empty: not a directory
  assert compilation_cache.location(None, environ) == (
    Path.home() / '.cache' / 'flax_transformer' / 'jax',
    'default',
  )
  environ['XDG_CACHE_HOME'] = str(tmp_path / 'xdg')
  assert compilation_cache.location(None, environ) == (
    tmp_path / 'xdg' / 'flax_transformer' / 'jax',
    'default',
  )


@pytest.fixture
def keep_jax_cache_settings():
  """enable() sets JAX's global flags; the suite's shared cache must survive the test."""
  names = ('jax_enable_compilation_cache', 'jax_compilation_cache_dir')
  saved = {name: getattr(jax.config, name) for name in names}
  yield
  for name, value in saved.items():
    jax.config.update(name, value)


def test_a_directory_that_cannot_be_made_is_refused_or_skipped_by_where_it_came_from(
  tmp_path, keep_jax_cache_settings
):
  blocker = tmp_path / 'a-file'
  blocker.write_text('')
  with pytest.raises(
    ConfigError,
    match=rf'--compilation-cache={blocker}/jax: cannot use it as '
    r"the compilation cache \(.*\); give another directory, or 'off'",
  ):
    compilation_cache.enable(str(blocker / 'jax'), {})
  with pytest.raises(ConfigError, match=rf'JAX_COMPILATION_CACHE_DIR={blocker}/jax: cannot'):
    compilation_cache.enable(None, {'JAX_COMPILATION_CACHE_DIR': str(blocker / 'jax')})
  # The default place (a read-only or odd home) never stops a run: it runs without a cache.
  cache = compilation_cache.enable(None, {'XDG_CACHE_HOME': str(blocker)})
  assert cache.directory is None and not jax.config.jax_enable_compilation_cache
  assert cache.summary().startswith(
    f'compilation cache: off ({blocker}/flax_transformer/jax cannot be made: '
  )
  assert compilation_cache.enable('off', {}).summary() == 'compilation cache: off'


def test_train_refuses_a_cache_directory_it_cannot_make(tmp_path):
  blocker = tmp_path / 'a-file'
  blocker.write_text('')
  err = usage_error(
    train_cli.main,
    ['--workdir', str(tmp_path / 'run'), '--compilation-cache', str(blocker / 'jax')],
  )
  assert f'--compilation-cache={blocker}/jax: cannot use it as the compilation cache' in err
  assert not (tmp_path / 'run').exists()


def _train(workdir: Path, steps: int, environ: dict, *options: str) -> tuple[int, int, str]:
  done = subprocess.run(
    [sys.executable, 'train.py', '--workdir', str(workdir), '--steps', str(steps), *TINY, *options],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=600,
    env=environ,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  [(directory, read, compiled)] = SUMMARY.findall(done.stdout)
  return int(read), int(compiled), directory


def test_a_resumed_run_compiles_nothing(tmp_path):
  cache_dir = tmp_path / 'jax-cache'
  environ = {**os.environ, 'PYTHONPATH': str(ROOT)}
  environ.pop('JAX_COMPILATION_CACHE_DIR', None)
  environ['XDG_CACHE_HOME'] = str(tmp_path / 'never-used')
  read, compiled, directory = _train(
    tmp_path / 'run', 2, environ, '--compilation-cache', str(cache_dir)
  )
  assert (read, directory) == (0, str(cache_dir)) and compiled >= 3  # step, eval, decoding
  assert len(list(cache_dir.iterdir())) >= compiled
  # The same run resumed, the cache named by the environment: every program is read.
  environ['JAX_COMPILATION_CACHE_DIR'] = str(cache_dir)
  read_again, compiled_again, directory = _train(tmp_path / 'run', 4, environ)
  assert (compiled_again, directory) == (0, str(cache_dir))
  assert read_again >= 2  # at least the training step and the evaluation; nothing compiled
  assert not (tmp_path / 'never-used').exists()
