"""Training metrics from additive loss sums, and the record of a run's latest scores.

The step returns sums (`losses.loss_sums`, `cmlm_objective.cmlm_loss_sums`) so that
they add up over devices and steps; these turn any number of them into means.
`ScoreRecord` is what a run's scores become as it trains: the latest value of each, and
WORKDIR/metrics.jsonl (process 0's) once the run has restored its checkpoint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from flax_transformer.run.metrics_log import MetricsLog


def token_metrics(sums: Mapping[str, float]) -> dict[str, float]:
  """Sums from any number of steps -> loss (label-smoothed, per token), ppl, accuracy.

  Perplexity is exp of the plain negative log-likelihood per token: smoothing is
  a training device, not part of the model's probability of the reference.
  For a cmlm model the tokens are the masked target positions.
  """
  tokens = max(float(sums['tokens']), 1.0)
  return {
    'loss': float(sums['loss_sum']) / tokens,
    'ppl': float(np.exp(min(float(sums['nll_sum']) / tokens, 100.0))),
    'accuracy': float(sums['correct']) / tokens,
  }


def length_metrics(sums: Mapping[str, float]) -> dict[str, float]:
  """A cmlm model's sums -> length_loss (NLL of the true length class per sentence) and
  length_accuracy (the fraction of sentences whose length class is the classifier's argmax)."""
  sentences = max(float(sums['sentences']), 1.0)
  return {
    'length_loss': float(sums['length_loss_sum']) / sentences,
    'length_accuracy': float(sums['length_correct']) / sentences,
  }


@dataclasses.dataclass
class ScoreRecord:
  """The latest value of every metric a run has logged, and the log they are written to.

  The log is attached once the run's checkpoint is restored (`MetricsLog` forgets lines
  past the resumed step), so nothing in WORKDIR is rewritten before; until then, and on
  processes other than 0, values are only kept.
  """

  scores: dict[str, float] = dataclasses.field(default_factory=dict)
  log: MetricsLog | None = None

  def attach(self, log: MetricsLog | None) -> None:
    self.log = log

  @property
  def elapsed_s(self) -> float:
    """The training clock the log reached (0 without one): a resumed run's carries on."""
    return self.log.elapsed_s if self.log is not None else 0.0

  def record(self, step: int, values: dict[str, float]) -> None:
    """Keeps `values` as the latest scores and logs them at `step`."""
    self.scores.update(values)
    if self.log is not None:
      self.log.write(step, values)

  def close(self) -> None:
    if self.log is not None:
      self.log.close()
