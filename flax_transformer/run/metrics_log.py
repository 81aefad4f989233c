"""Training metrics as JSON lines (WORKDIR/metrics.jsonl), and to TensorBoard when installed.

Each line is one JSON object with a "step" and scalar values, e.g.

    {"step": 100, "loss": 4.12, "ppl": 48.3, "accuracy": 0.31, "learning_rate": 0.0007, ...}
    {"step": 500, "val_loss": 3.05, "val_ppl": 15.2, "val_accuracy": 0.52}

TensorBoard logging needs `tensorboardX` (`pip install tensorboardX`); without it
only the JSON lines are written. The project does not depend on it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from flax_transformer.files import write_lines_atomically


class MetricsLog:
  """Appends metrics to a JSON-lines file; on resume, forgets lines past the resumed step.

  A run stopped after its last checkpoint logged steps it will now repeat; those
  lines are dropped so the file reads as one run. The file is rewritten through a
  rename, so a crash then leaves the old or the new file, never a truncated one.
  `elapsed_s` is the training clock the kept lines reached (their last `elapsed_s`,
  0 for a new run), so a resumed run's clock carries on from it.
  """

  def __init__(
    self, path: str | Path, resume_step: int = 0, tensorboard_dir: str | Path | None = None
  ):
    self.path = Path(path)
    self.path.parent.mkdir(parents=True, exist_ok=True)
    kept = [line for line in self.read(self.path) if line['step'] <= resume_step]
    self.elapsed_s = max((line['elapsed_s'] for line in kept if 'elapsed_s' in line), default=0.0)
    write_lines_atomically(self.path, (json.dumps(line) + '\n' for line in kept))
    self._file = self.path.open('a')
    self._tensorboard = _tensorboard_writer(tensorboard_dir) if tensorboard_dir else None

  @staticmethod
  def read(path: str | Path) -> list[dict]:
    """All lines of a metrics file ([] when it does not exist).

    A last line without its newline (a write cut short by a full disk or a
    crash) is left out; a malformed line elsewhere raises ValueError naming it.
    """
    path = Path(path)
    if not path.is_file():
      return []
    text = path.read_text()
    lines = text.split('\n')
    if not text.endswith('\n'):
      lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
      if line.strip():
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError as error:
          raise ValueError(
            f'{path}, line {number}: not a JSON object ({error}); delete the line'
          ) from None
    return records

  def write(self, step: int, values: Mapping[str, float]) -> None:
    self._file.write(
      json.dumps({'step': int(step), **{k: float(v) for k, v in values.items()}}) + '\n'
    )
    self._file.flush()
    if self._tensorboard is not None:
      for name, value in values.items():
        self._tensorboard.add_scalar(name, float(value), int(step))

  def close(self) -> None:
    self._file.close()
    if self._tensorboard is not None:
      self._tensorboard.close()


def _tensorboard_writer(directory: str | Path):
  """A tensorboardX SummaryWriter, or None when tensorboardX is not installed."""
  try:
    from tensorboardX import SummaryWriter
  except ImportError:
    return None
  return SummaryWriter(str(directory))
