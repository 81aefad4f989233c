"""tools/mutate.py stays usable: every mutant's snippet is still found exactly once in the library.

The mutants themselves are not run here (a pytest run each; docs/contributing.md); this keeps a
refactor from silently turning them into errors.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutant_still_applies():
  result = subprocess.run(
    [sys.executable, 'tools/mutate.py', '--check'],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=120,
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  applied, total = map(int, re.search(r'(\d+) of (\d+) mutants apply', result.stdout).groups())
  assert applied == total >= 40
