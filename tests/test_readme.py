"""README.md: every Python block runs as written, and the document stays a user's length."""

import re
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from flax_transformer.config import run_preset
from flax_transformer.data.toy_task import number_translation
from flax_transformer.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / 'README.md'
MAX_LINES = 250


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, code) of each ```python block, in order."""
  return [(text[:match.start()].count('\n') + 2, match.group(1))
          for match in re.finditer(r'^```python\n(.*?)^```', text, re.M | re.S)]


def test_python_blocks_finds_each_block_and_its_line():
  text = 'intro\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n'
  assert python_blocks(text) == [(3, 'a = 1\n'), (9, 'b = a\n')]


def test_readme_is_at_most_250_lines():
  assert len(README.read_text().splitlines()) <= MAX_LINES


@pytest.fixture(scope='module')
def toy_run_directory(tmp_path_factory) -> Path:
  """A directory holding runs/toy, as `python train.py` leaves it (fewer steps, no scoring)."""
  directory = tmp_path_factory.mktemp('readme')
  model_config, train_config, data_config = run_preset('toy')
  train_only = datasets.DatasetDict({'train': number_translation()['train']})
  train(model_config, train_config.replace(steps=40, eval_every=40, checkpoint_every=20),
        data_config, directory / 'runs' / 'toy', dataset=train_only,
        print_fn=lambda message: None)
  return directory


def test_every_python_block_runs_as_written(toy_run_directory):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 3
  # One namespace, in order, as a reader pasting them into one session would; a fresh
  # interpreter, so that nothing this test session imported makes a block pass.
  runner = '\n'.join([
      'import sys', 'namespace = {"__name__": "__main__"}',
      *(f'exec(compile({code!r}, "README.md, block at line {line}", "exec"), namespace)'
        for line, code in blocks),
      'print("all blocks ran")'])
  result = subprocess.run([sys.executable, '-c', runner], cwd=toy_run_directory,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and 'all blocks ran' in result.stdout, result.stderr[-3000:]
