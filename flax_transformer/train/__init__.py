"""Training: objectives, the optimizer, the data-parallel step, the loop and distillation.

Layer 6 (above everything but `cli`). Modules: `losses` (label-smoothed
cross-entropy and additive sums), `cmlm_objective` (the conditional masked LM's
inputs and loss), `metrics` (sums -> loss, ppl, accuracy), `optimizer` (Adam on
the paper's schedule), `scheduled_sampling`, `step` (one update, per device),
`parallel` (`DataParallel`: shard_map or pmap), `loop` (`train`: the whole run),
`evaluation` (BLEU and chrF), `interruption` (SIGTERM/SIGINT), `distributed`
(multi-host start-up), `distill` (sequence-level distillation).
"""

from flax_transformer.train.losses import label_smoothed_cross_entropy, loss_sums, token_losses
from flax_transformer.train.metrics import length_metrics, token_metrics
from flax_transformer.train.optimizer import make_optimizer, make_schedule, transformer_schedule
from flax_transformer.train.parallel import DataParallel
from flax_transformer.train.step import (TrainState, create_train_state, eval_step,
                                         make_parallel_eval, make_parallel_step, train_step)

__all__ = [
    'DataParallel', 'TrainState', 'create_train_state', 'eval_step', 'label_smoothed_cross_entropy',
    'length_metrics', 'loss_sums', 'make_optimizer', 'make_parallel_eval', 'make_parallel_step',
    'make_schedule', 'token_losses', 'token_metrics', 'train_step', 'transformer_schedule',
]
