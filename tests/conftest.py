"""What the test files share: import paths, and the fixtures more than one file needs.

Import paths, set here once, before any test file is imported:
  * the repository root, first: this checkout's `flax_transformer` (ahead of any
    installed copy), `benchmarks`, and the scripts train.py and decode.py, which
    the tests import as `import train as train_cli`, `import decode as decode_cli`;
  * tests/, for the helpers of tests/support/: `from support.<module> import ...`.
"""

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
for path in (TESTS, ROOT):  # ROOT ends up first
  if str(path) in sys.path:
    sys.path.remove(str(path))
  sys.path.insert(0, str(path))


# --- data -----------------------------------------------------------------------------

MULTI30K = ROOT.parent / 'shared' / 'data' / 'multi30k'


@pytest.fixture(scope='session')
def multi30k_dir() -> Path:
  """The Multi30k corpus as <split>.<lang> files beside the checkout; skips the test without it."""
  if not MULTI30K.is_dir():
    pytest.skip(f'Multi30k not found at {MULTI30K}')
  return MULTI30K
