"""README.md: every Python block runs as written, and the document stays a user's length."""

import importlib.util
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
# The export block loads its directory with transformers (torch) and CTranslate2.
HAS_PEERS = all(
  importlib.util.find_spec(name) is not None
  for name in ('torch', 'transformers', 'ctranslate2', 'safetensors')
)
README = ROOT / 'README.md'
MAX_LINES = 150


def python_blocks(text: str) -> list[tuple[int, str]]:
  """(first line number, code) of each ```python block, in order."""
  return [
    (text[: match.start()].count('\n') + 2, match.group(1))
    for match in re.finditer(r'^```python\n(.*?)^```', text, re.M | re.S)
  ]


def test_python_blocks_finds_each_block_and_its_line():
  text = 'intro\n```python\na = 1\n```\n```bash\nls\n```\n```python\nb = a\n```\n'
  assert python_blocks(text) == [(3, 'a = 1\n'), (9, 'b = a\n')]


def test_readme_is_at_most_150_lines():
  assert len(README.read_text().splitlines()) <= MAX_LINES


@pytest.fixture(scope='module')
def toy_run_directory(tmp_path_factory) -> Path:
  """A directory holding runs/toy, as `python train.py` leaves it (fewer steps, no scoring)."""
  directory = tmp_path_factory.mktemp('readme')
  model_config, train_config, data_config = run_preset('toy')
  train_only = datasets.DatasetDict({'train': number_translation()['train']})
  train(
    model_config,
    train_config.replace(steps=40, eval_every=40, checkpoint_every=20),
    data_config,
    directory / 'runs' / 'toy',
    dataset=train_only,
    print_fn=lambda message: None,
  )
  if HAS_PEERS:  # the export block's directories, from this run (README exports runs/multi30k)
    from ctranslate2.converters import TransformersConverter

    from flax_transformer.run.export import export_run

    export_run(directory / 'runs' / 'toy', directory / 'export' / 'm30k')
    TransformersConverter(str(directory / 'export' / 'm30k')).convert(
      str(directory / 'export' / 'm30k-ct2')
    )
  return directory


# What the comments of README's Python blocks state, as code run right after the block it is keyed
# by (its place among the blocks), in the same namespace. A comment that drifts fails here.
STATED_RESULTS = {
  0: """
import numpy as np
B, S, T = src.shape[0], src.shape[1], tgt_in.shape[1]
# model.apply: [B, T, vocab] float32; one decode_step: the logits of one position
full = model.apply(variables, src, tgt_in)
assert full.shape == (B, T, config.vocab_size) and full.dtype == np.float32, full.shape
assert logits.shape == (B, 1, config.vocab_size), logits.shape
np.testing.assert_allclose(logits[:, 0], full[:, 0], atol=1e-5)   # the cached step = the full pass
# attention weights [B, heads, T, S]: PAD columns are exactly 0
cross = np.asarray(weights['decoder/layer_1/cross_attention'])
assert cross.shape == (B, config.num_heads, T, S), cross.shape
assert (cross[..., np.asarray(src[0]) == 0] == 0).all()
np.testing.assert_allclose(cross.sum(-1), 1.0, rtol=1e-5)
# beam_search: tokens [B, L] and a score per sentence
assert tokens.ndim == 2 and tokens.shape[0] == B and scores.shape == (B,), (tokens.shape, scores.shape)
""",
  1: """
assert default_method(translator.config).describe() == 'beam search (beam 4, alpha 0.6)'
assert tokens.shape[0] == src.shape[0] and tokens.shape[1] <= 16   # Greedy(max_len=16): [B, L]
""",
  2: """
# length offsets in [-32, 32]: 65 length classes; token logits [B, T, V]
assert token_logits.shape == (src.shape[0], tgt_in.shape[1], config.vocab_size)
assert length_logits.shape == (src.shape[0], 65) and config.max_length_offset == 32
""",
}


def test_every_python_block_runs_as_written(toy_run_directory):
  blocks = python_blocks(README.read_text())
  assert len(blocks) >= 3
  needs_peers = [line for line, code in blocks if 'import ctranslate2' in code]
  assert len(needs_peers) == 1, needs_peers
  if not HAS_PEERS:  # the export block alone; CI installs them (.[pretrained-test])
    blocks = [(line, code) for line, code in blocks if 'import ctranslate2' not in code]
  # One namespace, in order, as a reader pasting them into one session would; a fresh
  # interpreter, so that nothing this test session imported makes a block pass.
  runner = '\n'.join(
    [
      'import sys',
      'namespace = {"__name__": "__main__"}',
      *(
        f'exec(compile({code + STATED_RESULTS.get(index, "")!r}, "README.md, block at line {line}", '
        '"exec"), namespace)'
        for index, (line, code) in enumerate(blocks)
      ),
      'print("all blocks ran")',
    ]
  )
  result = subprocess.run(
    [sys.executable, '-c', runner],
    cwd=toy_run_directory,
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0 and 'all blocks ran' in result.stdout, result.stderr[-3000:]
  # print(default_method(translator.config).describe()) in the tour prints what its comment says.
  assert 'beam search (beam 4, alpha 0.6)' in result.stdout
