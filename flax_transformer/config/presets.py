"""A run's settings as a whole: its three sections (`SECTIONS`) and the named runs
(`RUN_PRESETS`, `run_preset`) that train.py's `--preset` chooses from."""

from __future__ import annotations

from flax_transformer.config.data import DataConfig
from flax_transformer.config.model import ModelConfig
from flax_transformer.config.train import TrainConfig
from flax_transformer.errors import ConfigError

# The three sections of a run's settings, as config.json and train.py's options name them.
SECTIONS = {'model': ModelConfig, 'train': TrainConfig, 'data': DataConfig}
RUN_PRESETS = ('toy', 'multi30k', 'multi30k_fairseq', 'base')


def run_preset(name: str) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The (model, training, data) settings of a named run, as train.py's `--preset`.

  toy: numbers in English words -> German, generated in code; a 1M-parameter
    model that reaches ~98% exact match in a few minutes on a laptop CPU.
  multi30k: Multi30k en->de (the Hub's 'bentrevett/multi30k', or `--data DIR`);
    a 4+4-layer d=128 model, dropout 0.3, bfloat16 compute, 16,000 BPE tokens,
    packed rows (docs/multi30k.md says why each).
  base: the paper's base model and schedule on WMT14 en->de from the Hub.
  """
  if name == 'toy':
    return (
      ModelConfig(
        d_model=128, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, d_ff=512, max_len=64
      ),
      TrainConfig.toy(),
      DataConfig(source='toy', vocab_size=256),
    )
  if name == 'multi30k':
    return (
      ModelConfig(
        d_model=128,
        num_heads=4,
        num_encoder_layers=4,
        num_decoder_layers=4,
        d_ff=512,
        max_len=128,
        dropout_rate=0.3,
        dtype='bfloat16',
      ),
      TrainConfig.multi30k(),
      DataConfig(source='bentrevett/multi30k', vocab_size=16_000),
    )
  if name == 'multi30k_fairseq':
    # Wu et al. (2021)'s fairseq baseline, LividWo/Revisit-MMT README-baseline.md: its
    # transformer_tiny, 2 GPUs x 4,096 tokens an update, --lr 0.005 after 2,000 warm-up
    # updates, Adam eps 1e-8, --clip-norm 25, --patience 10 on the validation loss of each
    # epoch, the last 10 epoch checkpoints averaged (docs/multi30k.md).
    return (
      ModelConfig(
        d_model=128,
        num_heads=4,
        num_encoder_layers=4,
        num_decoder_layers=4,
        d_ff=256,
        max_len=128,
        dropout_rate=0.3,
        qkv_init_gain=2**-0.5,
      ),
      TrainConfig.multi30k_fairseq(),
      DataConfig(
        source='bentrevett/multi30k',
        vocab_size=10_000,
        normalize_punctuation=True,
        lowercase=True,
        pretokenize='moses',
      ),
    )
  if name == 'base':
    return (
      ModelConfig.base(),
      TrainConfig.paper(),
      DataConfig(source='wmt14:de-en', vocab_size=37_000),
    )
  raise ConfigError(f'unknown preset {name!r}; choose one of {", ".join(RUN_PRESETS)}')
