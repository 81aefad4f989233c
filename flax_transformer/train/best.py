"""The best checkpoint so far and early stopping (fairseq's --best-checkpoint-metric, --patience).

After each validation of `train.best_metric` (the loss every `eval_every` steps, or BLEU every
`bleu_every`), a better score than any before writes the parameters to WORKDIR/best, a
decodable copy of the run (config.json marked with the step and score, the tokenizer, one
params-only checkpoint), so `decode.py --checkpoint WORKDIR/best` and `export.py WORKDIR/best`
take it like an average. It is written beside, into WORKDIR/.best.tmp, then moved into place:
a crash leaves the previous best or the new one, never half of one. A resumed run reads the
score back from WORKDIR/best/config.json, so the comparison goes on where it stopped.

With `train.patience` N > 0, training stops after N validations in a row without a better
score; the validations counted are those after the best step at the metric's cadence, so a
resumed run counts the same ones.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import jax

from flax_transformer.config import TrainConfig
from flax_transformer.run.config_file import read_marker
from flax_transformer.run.directory import BEST_DIR, BEST_KEY, saved_steps
from flax_transformer.run.loading import write_params_run


@dataclasses.dataclass(frozen=True)
class BestScore:
  """The best validation score of a run: its metric ('loss' or 'bleu'), value and step."""

  metric: str
  value: float
  step: int

  def improved_by(self, value: float) -> bool:
    return value < self.value if self.metric == 'loss' else value > self.value


def read_best(workdir: str | Path) -> BestScore | None:
  """WORKDIR/best's score as recorded in its config.json, or None (no best written yet)."""
  workdir = Path(workdir)
  _finish_interrupted_move(workdir)
  content = read_marker(workdir / BEST_DIR)
  record = (content or {}).get(BEST_KEY)
  if not isinstance(record, dict):
    return None
  return BestScore(
    metric=str(record['metric']), value=float(record['value']), step=int(record['step'])
  )


def _finish_interrupted_move(workdir: Path) -> None:
  """A crash between removing the old best and moving the new one in leaves only the new one
  in .best.tmp, complete (its checkpoint finished: orbax names it by its step only then):
  move it into place."""
  staged, best = workdir / f'.{BEST_DIR}.tmp', workdir / BEST_DIR
  if (
    jax.process_index() == 0
    and not best.exists()
    and read_marker(staged) is not None
    and saved_steps(staged)
  ):
    os.replace(staged, best)


class BestCheckpoint:
  """Keeps WORKDIR/best and counts the validations since it (module docstring)."""

  def __init__(self, workdir: Path, config: TrainConfig):
    self.workdir, self.config = workdir, config
    saved = read_best(workdir)
    self.best = saved if saved is not None and saved.metric == config.best_metric else None

  @property
  def cadence(self) -> int:
    return self.config.eval_every if self.config.best_metric == 'loss' else self.config.bleu_every

  def validations_since_best(self, step: int) -> int:
    """Validations of the metric after the best step up to `step` (none before a best)."""
    if self.best is None:
      return 0
    return step // self.cadence - self.best.step // self.cadence

  def exhausted(self, step: int) -> bool:
    """Whether `train.patience` validations have passed without improvement by `step`."""
    return bool(self.config.patience) and self.validations_since_best(step) >= self.config.patience

  def consider(self, step: int, value: float, params) -> bool:
    """Records the score validated at `step`; writes WORKDIR/best when it is the best so far.
    Returns whether it was."""
    if self.best is not None and not self.best.improved_by(value):
      return False
    self.best = BestScore(self.config.best_metric, float(value), step)
    staged = self.workdir / f'.{BEST_DIR}.tmp'
    # The old best is removed only once the new one is complete beside it.
    write_params_run(
      self.workdir, staged, [step], params, extra={BEST_KEY: dataclasses.asdict(self.best)}
    )
    if jax.process_index() == 0:
      shutil.rmtree(self.workdir / BEST_DIR, ignore_errors=True)
      os.replace(staged, self.workdir / BEST_DIR)
    return True

  def describe(self) -> str:
    if self.best is None:
      return 'no best checkpoint yet'
    return (
      f'best validation {self.best.metric} {self.best.value:.4g} at step {self.best.step} '
      f'({self.workdir / BEST_DIR})'
    )
