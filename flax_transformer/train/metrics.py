"""Training metrics from additive loss sums: what the loop logs and the progress bar shows.

The step returns sums (`losses.loss_sums`, `cmlm_objective.cmlm_loss_sums`) so that
they add up over devices and steps; these turn any number of them into means.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


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
