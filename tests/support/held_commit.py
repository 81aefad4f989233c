"""train.py whose checkpoint of one step is written but never committed: test_interruption.py.

    python tests/support/held_commit.py STEP [train.py options]

orbax writes checkpoint STEP into `checkpoints/STEP.orbax-checkpoint-tmp`, as
always, and then, where it would rename that directory to `checkpoints/STEP`,
waits for an hour instead. Every other checkpoint is committed as usual. The
test kills the process while it waits, which places the kill inside the
window that matters: after the checkpoint's files have started to appear,
before the rename that makes it a checkpoint.
"""

import asyncio
import runpy
import sys
from pathlib import Path

from orbax.checkpoint._src.path import atomicity

held_step = sys.argv.pop(1)
commit = atomicity.AtomicRenameTemporaryPath.finalize


async def finalize(self):
  if self.get_final().name == held_step:
    await asyncio.sleep(3600)
  await commit(self)


atomicity.AtomicRenameTemporaryPath.finalize = finalize
script = Path(__file__).resolve().parents[2] / 'train.py'
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name='__main__')
