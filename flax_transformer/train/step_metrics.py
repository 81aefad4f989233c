"""The training steps' metrics on their way to the log.

`MetricBuffer` keeps them between two log lines, `summarize` makes an interval's line
(per-token loss, ppl, accuracy, rates), and `check_finite` counts the steps skipped for a
non-finite loss or gradient against --skip-nonfinite.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from flax_transformer.errors import NonFiniteError
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.train.metrics import length_metrics, token_metrics
from flax_transformer.train.parallel import DataParallel


class MetricBuffer:
  """The training steps' metrics between two log lines.

  They stay on the device (`pending`) until a log line or a save needs them,
  then wait on the host (`fetched`) for the interval's log line. Steps whose
  loss or gradient was not finite are noted in `skipped`.
  """

  def __init__(self, data_parallel: DataParallel):
    self.data_parallel = data_parallel
    self.pending: list = []
    self.fetched: list[dict] = []
    self.skipped: list[int] = []
    self.interval_start = time.perf_counter()

  def add(self, metrics) -> None:
    self.pending.append(metrics)

  def fetch(self) -> list[dict]:
    """Brings the pending metrics to the host; returns them (they also join the interval)."""
    new, self.pending = self.data_parallel.unreplicate(self.pending), []
    self.fetched += new
    return new

  def summary(self) -> dict[str, float]:
    """The interval's log line (see `summarize`), after which a new interval starts."""
    values = summarize(self.fetched, time.perf_counter() - self.interval_start)
    self.fetched, self.interval_start = [], time.perf_counter()
    return values


def metrics_of_sums(sums: dict[str, float]) -> dict[str, float]:
  """Loss, ppl, accuracy per token (masked token for cmlm), plus a cmlm model's length metrics."""
  return {**token_metrics(sums), **(length_metrics(sums) if 'sentences' in sums else {})}


def summarize(metrics: list[dict], seconds: float) -> dict[str, float]:
  """Per-step metrics of one logging interval -> per-token loss, ppl, accuracy, rates.

  Skipped steps (non-finite loss or gradient) are left out of the averages and
  counted as nonfinite_steps, a key present only when there were some.
  tokens_per_s counts every target token (a cmlm step's target_tokens, not
  only its masked ones).
  """
  good = [m for m in metrics if not m['nonfinite']]
  values = {}
  if good:
    sums = {name: float(np.sum([m[name] for m in good])) for name in good[0]}
    values = {
      **metrics_of_sums(sums),
      'learning_rate': float(good[-1]['learning_rate']),
      'grad_norm': float(np.mean([m['grad_norm'] for m in good])),
    }
  tokens = 'target_tokens' if 'target_tokens' in metrics[0] else 'tokens'
  values['tokens_per_s'] = float(np.sum([m[tokens] for m in metrics])) / seconds
  if len(good) < len(metrics):
    values['nonfinite_steps'] = len(metrics) - len(good)
  return values


def check_finite(
  metrics: list[dict],
  first_step: int,
  skipped: list[int],
  limit: int,
  checkpoints: Checkpoints,
  say: Callable[[str], None],
) -> None:
  """Notes the steps among `metrics` (steps first_step, first_step + 1, ...) that were skipped.

  Raises NonFiniteError once `skipped` holds more than `limit` steps, after the
  saves under way have finished, naming the last checkpoint.
  """
  for step, values in enumerate(metrics, start=first_step):
    if not values['nonfinite']:
      continue
    skipped.append(step)
    what = (
      f'step {step}: the loss or the gradient is not finite (loss sum '
      f'{float(values["loss_sum"])}, gradient norm {float(values["grad_norm"])}); its '
      'update was not applied'
    )
    if len(skipped) <= limit:
      say(f'{what}, skipped ({len(skipped)} of at most {limit}, --skip-nonfinite)')
      continue
    checkpoints.close()
    latest = checkpoints.latest_step()
    kept = (
      f'the last checkpoint, {checkpoints.directory / str(latest)}, holds the last good parameters'
      if latest is not None
      else 'no checkpoint was saved before it'
    )
    count = (
      f'; {len(skipped)} such steps ({", ".join(map(str, skipped))}), more than '
      f'--skip-nonfinite={limit} allows'
      if limit
      else ''
    )
    raise NonFiniteError(
      f'{what}{count}. Training stopped; {kept}. Usual causes: a learning rate too high for '
      'the model (--train.lr_scale, --train.warmup_steps), bfloat16 overflow, corrupt data. '
      'To skip such steps and go on, pass --skip-nonfinite N.',
      step,
    )
