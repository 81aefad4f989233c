"""Training: objectives, the optimizer, the data-parallel step, the loop and distillation.

Layer 7 (above everything but `cli` and `bench`). Modules: `losses` (label-smoothed
cross-entropy and additive sums), `cmlm_objective` (the conditional masked LM's
inputs and loss), `metrics` (sums -> loss, ppl, accuracy), `optimizer` (Adam on
the paper's schedule), `scheduled_sampling`, `step` (one update, per device),
`parallel` (`DataParallel`: shard_map or pmap), `setup` (a run before its first
step), `step_metrics` (each step's metrics on the way to the log), `report` (the
translation scores), `loop` (`train`: the whole run), `evaluation` (BLEU and chrF), `interruption` (SIGTERM/SIGINT), `distributed`
(multi-host start-up), `distill` (sequence-level distillation).
"""

import importlib

# Public name -> its module. Loaded on first use, not here: `train.distributed` must start
# JAX's processes (and silence progress bars off process 0) before anything imports tqdm or
# `datasets`, which read their settings when imported.
_EXPORTS = {
  'label_smoothed_cross_entropy': 'losses',
  'loss_sums': 'losses',
  'token_losses': 'losses',
  'length_metrics': 'metrics',
  'token_metrics': 'metrics',
  'make_optimizer': 'optimizer',
  'make_schedule': 'optimizer',
  'transformer_schedule': 'optimizer',
  'ending_schedule': 'optimizer',
  'DataParallel': 'parallel',
  'TrainState': 'step',
  'create_train_state': 'step',
  'eval_step': 'step',
  'make_parallel_eval': 'step',
  'make_parallel_step': 'step',
  'train_step': 'step',
  'train': 'loop',
}


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = sorted(_EXPORTS)
