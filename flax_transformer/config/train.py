"""The training run's settings: `TrainConfig` and its presets.

Optimisation, batching and bookkeeping; `TrainConfig.paper()` (the base model's schedule),
`.multi30k()`, `.multi30k_fairseq()` and `.toy()` take overrides. The scheduled-sampling
settings are checked against the schedule that reads them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from flax_transformer.config.settings import (
  CADENCE,
  NONNEGATIVE,
  NONNEGATIVE_INT,
  NUMBER,
  OBJECTIVE,
  OPTIMIZER,
  POSITIVE,
  POSITIVE_INT,
  SEED,
  UNIT_INTERVAL,
  Bounds,
  check_fields,
  setting,
)
from flax_transformer.errors import ConfigError

# Batches of 8,192 tokens in one epoch of Multi30k's 29,000 training pairs, preprocessed as the
# multi30k_fairseq preset does: its validations and checkpoints come once an epoch.
MULTI30K_FAIRSEQ_EPOCH = 72


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Optimisation, batching and bookkeeping of a training run.

  A step is one batch of about `max_tokens` tokens: with `grad_accum_steps` K,
  the optimizer updates once every K steps and the learning-rate schedule
  counts those updates.
  """

  # The optimizer: seed, batches, learning-rate schedule, Adam, clipping, decay.
  seed: int = setting(
    0, 'seed of the parameters, batch order and dropout', bounds=SEED, lifetime=OPTIMIZER
  )
  max_tokens: int = setting(
    25_000,
    'padded tokens per batch and side (a batch of length-L rows '
    "holds max_tokens // L rows; the paper's held about 25k)",
    bounds=POSITIVE_INT,
    lifetime=OPTIMIZER,
  )
  packing: int = setting(
    0,
    'pack several sentence pairs into each row of this many positions '
    '(segment masks keep them apart; longer pairs go to the larger length '
    'buckets, packed there too); 0: one pair per row',
    bounds=NONNEGATIVE_INT,
    lifetime=OPTIMIZER,
  )
  warmup_steps: int = setting(
    4000, 'updates of linear learning-rate warmup', bounds=POSITIVE_INT, lifetime=OPTIMIZER
  )
  lr_scale: float = setting(
    1.0,
    "factor on the paper's rate d_model^-0.5 * min(n^-0.5, n * warmup_steps^-1.5), n = update + 1",
    bounds=POSITIVE,
    lifetime=OPTIMIZER,
  )
  peak_lr: float | None = setting(
    None,
    'the peak learning rate, reached after warmup_steps '
    'and decayed as the inverse square root of the update '
    "(fairseq's --lr with inverse_sqrt): the paper's schedule "
    "scaled to this peak; none: the paper's peak, "
    '(d_model * warmup_steps)^-0.5 * lr_scale',
    bounds=POSITIVE,
    lifetime=OPTIMIZER,
  )
  schedule: Literal['inverse_sqrt', 'linear', 'wsd'] = setting(
    'inverse_sqrt',
    "the learning rate after warmup_steps: inverse_sqrt, the paper's (and fairseq's) decay as "
    'the inverse square root of the update, which never ends; linear, a straight line to zero '
    'at the last update (train.steps); wsd, warmup-stable-decay: the peak held, then a '
    'cooldown to zero over the last train.cooldown_fraction of the updates, shaped 1 - sqrt',
    lifetime=OPTIMIZER,
  )
  cooldown_fraction: float = setting(
    0.2,
    'train.schedule=wsd: the share of the updates, at the end, over which the rate falls '
    'from its peak to zero',
    bounds=Bounds(low=0, high=1, low_open=True),
    lifetime=OPTIMIZER,
  )
  ema_decay: float = setting(
    0.0,
    'keep an exponential moving average of the parameters with this decay (per update; its '
    'first updates decay less, min(decay, (1 + n) / (10 + n))), in the checkpoints and, at '
    "the end, as WORKDIR/ema, decoded and exported like WORKDIR/best; 0: none (the paper's)",
    bounds=UNIT_INTERVAL,
    lifetime=OPTIMIZER,
  )
  adam_b1: float = setting(0.9, 'Adam beta1', bounds=UNIT_INTERVAL, lifetime=OPTIMIZER)
  adam_b2: float = setting(0.98, 'Adam beta2', bounds=UNIT_INTERVAL, lifetime=OPTIMIZER)
  adam_eps: float = setting(1e-9, 'Adam epsilon', bounds=POSITIVE, lifetime=OPTIMIZER)
  max_grad_norm: float | None = setting(
    None,
    'clip the global gradient norm to this; none: no clipping (the paper)',
    bounds=POSITIVE,
    lifetime=OPTIMIZER,
  )
  weight_decay: float = setting(
    0.0,
    'decoupled (AdamW) decay of weight matrices and embeddings; 0: plain Adam (the paper)',
    bounds=NONNEGATIVE,
    lifetime=OPTIMIZER,
  )
  grad_accum_steps: int = setting(
    1, 'batches accumulated per optimizer update', bounds=POSITIVE_INT, lifetime=OPTIMIZER
  )

  # The objective: what is minimised, and what the best checkpoint is chosen by.
  label_smoothing: float = setting(
    0.1, 'label smoothing epsilon', bounds=UNIT_INTERVAL, lifetime=OBJECTIVE
  )
  best_metric: Literal['loss', 'bleu'] = setting(
    'loss',
    'what WORKDIR/best keeps: the parameters of the lowest validation loss (every '
    'eval_every steps) or the highest validation tokenized BLEU (every bleu_every steps)',
    lifetime=OBJECTIVE,
  )
  length_loss_weight: float = setting(
    0.1,
    "cmlm: weight of the length classifier's "
    'cross-entropy (per sentence) beside the masked-token '
    "loss (fairseq's CMLM: 0.1)",
    bounds=NONNEGATIVE,
    lifetime=OBJECTIVE,
  )
  eos_fill_rate: float = setting(
    0.1,
    'cmlm: fraction of target rows whose PAD positions are '
    'filled with EOS while training, for fixed-length '
    'decoding',
    bounds=UNIT_INTERVAL,
    lifetime=OBJECTIVE,
  )
  scheduled_sampling: Literal['off', 'linear', 'exponential', 'inverse_sigmoid'] = setting(
    'off',
    'off: teacher forcing (the paper); else scheduled sampling (Mihaylova & Martins '
    '2019): a second decoder pass fed, per token, the first pass prediction with probability '
    '1 - eps_i, where eps_i, the gold-token probability at step i, decays as in Bengio et al. '
    '2015: linear min(1, max(eps, k - c*i)), exponential k^i, inverse_sigmoid k/(k + exp(i/k))',
    lifetime=OBJECTIVE,
  )
  scheduled_sampling_k: float = setting(
    1.0,
    'scheduled sampling: k of the decay (linear: the '
    'start, > 1 holds eps_i at 1 for (k - 1) / c steps; '
    'exponential: 0 < k <= 1; inverse_sigmoid: k >= 1)',
    bounds=NUMBER,
    lifetime=OBJECTIVE,
  )
  scheduled_sampling_c: float = setting(
    1e-4,
    'scheduled sampling, linear: the decrease of the gold-token probability per step',
    bounds=NUMBER,
    lifetime=OBJECTIVE,
  )
  scheduled_sampling_eps: float = setting(
    0.0,
    'scheduled sampling, linear: the lowest gold-token probability, in [0, 1]',
    bounds=NUMBER,
    lifetime=OBJECTIVE,
  )
  scheduled_sampling_choice: Literal['argmax', 'sample'] = setting(
    'argmax',
    "scheduled sampling: the first pass's prediction is its argmax, or a token "
    'sampled from its softmax',
    lifetime=OBJECTIVE,
  )

  # The cadence: how long and how often (a resumed run may change it).
  steps: int = setting(
    100_000,
    'batches to train on (with accumulation K: steps / K updates)',
    bounds=POSITIVE_INT,
    lifetime=CADENCE,
  )
  time_budget: str | None = setting(
    None,
    'wall-clock time for the whole run, e.g. 90m, 2h, 1h30m, 5400s: after compiling and '
    'timing a few steps, a validation and a decoding, train.steps is fixed so that training, '
    'its validations and the final evaluation end inside it (recorded in config.json; a '
    'resume keeps those steps); none: train.steps as given',
    lifetime=CADENCE,
  )
  log_every: int = setting(
    100,
    'steps between lines of training metrics (bar and metrics.jsonl)',
    bounds=POSITIVE_INT,
    lifetime=CADENCE,
  )
  eval_every: int = setting(
    1000, 'steps between validation losses', bounds=POSITIVE_INT, lifetime=CADENCE
  )
  checkpoint_every: int = setting(
    1000, 'steps between checkpoints (and one at the end)', bounds=POSITIVE_INT, lifetime=CADENCE
  )
  keep_checkpoints: int = setting(
    5,
    'checkpoints kept on disk, the newest (the paper averages the last 5)',
    bounds=POSITIVE_INT,
    lifetime=CADENCE,
  )
  bleu_every: int = setting(
    0,
    'steps between validation BLEU scores; 0: only at the end',
    bounds=NONNEGATIVE_INT,
    lifetime=CADENCE,
  )
  patience: int = setting(
    0,
    'stop after this many validations of train.best_metric without '
    "improvement (fairseq's --patience); 0: train to train.steps",
    bounds=NONNEGATIVE_INT,
    lifetime=CADENCE,
  )
  prefetch: int = setting(
    2,
    'batches built ahead by a background thread (and put on the '
    'devices) while the devices run a step; 0: built between steps',
    bounds=NONNEGATIVE_INT,
    lifetime=CADENCE,
  )
  profile: str | None = setting(
    None,
    'START,STOP: a jax.profiler trace of the steps after '
    'step START up to step STOP, in WORKDIR/profile '
    '(TensorBoard or Perfetto); none: no trace',
    lifetime=CADENCE,
  )

  def __post_init__(self):
    check_fields(self, 'train')
    _check_scheduled_sampling(self)
    _ = self.time_budget_s  # raises ConfigError for a malformed train.time_budget
    profile = self.profile_steps  # raises ConfigError for a malformed train.profile
    if profile is not None and profile[0] >= self.steps:
      raise ConfigError(
        f'train.profile={self.profile} starts after the last step (train.steps='
        f'{self.steps}): no step would be traced'
      )
    if self.peak_lr is not None and self.lr_scale != 1.0:
      raise ConfigError(
        f'train.peak_lr={self.peak_lr} sets the peak itself; train.lr_scale='
        f"{self.lr_scale} scales the paper's peak: set one of them"
      )
    if self.schedule != 'inverse_sqrt' and self.warmup_steps >= self.total_updates:
      raise ConfigError(
        f'train.schedule={self.schedule} ends at the last update ({self.total_updates} '
        f'updates: train.steps={self.steps}, train.grad_accum_steps={self.grad_accum_steps}); '
        f'train.warmup_steps={self.warmup_steps} leaves no update after the warm-up'
      )
    if self.best_metric == 'bleu' and not self.bleu_every:
      raise ConfigError(
        'train.best_metric=bleu needs validation BLEU during training: set train.bleu_every'
      )

  @property
  def time_budget_s(self) -> float | None:
    """train.time_budget in seconds ('1h30m' -> 5400.0); None without one."""
    if self.time_budget is None:
      return None
    text = self.time_budget.strip().lower()
    parts = re.findall(r'(\d+(?:\.\d+)?)\s*([hms])', text)
    if not parts or re.sub(r'(\d+(?:\.\d+)?)\s*([hms])', '', text).strip():
      raise ConfigError(
        f'train.time_budget must be a duration such as 90m, 2h, 1h30m or 5400s, got '
        f'{self.time_budget!r}'
      )
    seconds = sum(float(number) * {'h': 3600, 'm': 60, 's': 1}[unit] for number, unit in parts)
    if seconds <= 0:
      raise ConfigError(f'train.time_budget must be longer than 0 s, got {self.time_budget!r}')
    return seconds

  @property
  def total_updates(self) -> int:
    """The optimizer updates in train.steps: where a schedule that ends (linear, wsd) reaches
    zero."""
    return max(1, self.steps // self.grad_accum_steps)

  @property
  def profile_steps(self) -> tuple[int, int] | None:
    """train.profile as (START, STOP), 0 <= START < STOP; None when not profiling."""
    if self.profile is None:
      return None
    parts = self.profile.split(',')
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
      raise ConfigError(
        f'train.profile must be START,STOP (two step numbers, e.g. 10,15), got {self.profile!r}'
      )
    start, stop = (int(part) for part in parts)
    if start >= stop:
      raise ConfigError(
        f'train.profile={self.profile}: STOP must be after START (the steps '
        'after START up to STOP are traced)'
      )
    return start, stop

  def replace(self, **overrides) -> TrainConfig:
    return dataclasses.replace(self, **overrides)

  @classmethod
  def paper(cls, **overrides) -> TrainConfig:
    """The base model's schedule (§5.2-5.4): 100k steps of 25k tokens, warmup 4000."""
    return cls(**overrides)

  @classmethod
  def multi30k(cls, **overrides) -> TrainConfig:
    """Multi30k: 8,000 batches of 4k tokens per side, pairs packed into rows of 64 (~76
    epochs), a shorter warmup than the paper's, a checkpoint every 250 steps and the last 10
    kept for averaging (docs/multi30k.md: how it was chosen, and what it scores)."""
    defaults = dict(
      steps=8000,
      max_tokens=4096,
      warmup_steps=1000,
      packing=64,
      log_every=50,
      eval_every=500,
      checkpoint_every=250,
      keep_checkpoints=10,
      bleu_every=1000,
    )
    return cls(**{**defaults, **overrides})

  @classmethod
  def multi30k_fairseq(cls, **overrides) -> TrainConfig:
    """Wu et al. (2021)'s fairseq baseline on Multi30k (`--preset multi30k_fairseq`): 8,000
    updates of 8,192 tokens, --lr 0.005 after 2,000 warm-up updates, an epoch checkpoint and
    validation, patience 10, the last 10 epochs kept for averaging."""
    defaults = dict(
      seed=1,
      steps=8000,
      max_tokens=8192,
      warmup_steps=2000,
      peak_lr=0.005,
      adam_eps=1e-8,
      max_grad_norm=25.0,
      log_every=50,
      eval_every=MULTI30K_FAIRSEQ_EPOCH,
      checkpoint_every=MULTI30K_FAIRSEQ_EPOCH,
      keep_checkpoints=10,
      patience=10,
      bleu_every=5 * MULTI30K_FAIRSEQ_EPOCH,
    )
    return cls(**{**defaults, **overrides})

  @classmethod
  def toy(cls, **overrides) -> TrainConfig:
    """The offline default (`python train.py`): minutes on a laptop CPU."""
    defaults = dict(
      steps=400,
      max_tokens=2048,
      warmup_steps=200,
      log_every=50,
      eval_every=200,
      checkpoint_every=200,
    )
    return cls(**{**defaults, **overrides})


def _check_scheduled_sampling(config: TrainConfig) -> None:
  """Raises ConfigError naming the train.scheduled_sampling_* setting that is out of range for
  the chosen schedule, or that the schedule does not read."""
  schedule, k = config.scheduled_sampling, config.scheduled_sampling_k
  defaults = TrainConfig.__dataclass_fields__
  unread = {
    'off': ('k', 'c', 'eps', 'choice'),
    'linear': (),
    'exponential': ('c', 'eps'),
    'inverse_sigmoid': ('c', 'eps'),
  }[schedule]
  for name in unread:
    field = f'scheduled_sampling_{name}'
    if getattr(config, field) != defaults[field].default:
      raise ConfigError(
        f'train.{field}={getattr(config, field)!r} is not read with '
        f'train.scheduled_sampling={schedule!r}'
      )
  # Numbers, each (check_fields); their ranges depend on the schedule.
  numbers = {name: getattr(config, f'scheduled_sampling_{name}') for name in ('k', 'c', 'eps')}
  ranges = {
    'linear': (
      k >= 0 and numbers['c'] >= 0 and 0 <= numbers['eps'] <= 1,
      'k >= 0, c >= 0 and 0 <= eps <= 1',
    ),
    'exponential': (0 < k <= 1, '0 < k <= 1'),
    'inverse_sigmoid': (k >= 1, 'k >= 1'),
  }
  valid, rule = ranges.get(schedule, (True, ''))
  if not valid:
    values = ', '.join(f'train.scheduled_sampling_{n}={v!r}' for n, v in numbers.items())
    raise ConfigError(f'train.scheduled_sampling={schedule!r} needs {rule}; got {values}')
