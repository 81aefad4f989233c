"""Train a Transformer translation model; a command line over `flax_transformer.training.train`.

    python train.py                                   # the offline default: the toy task, minutes on a CPU
    python train.py --preset multi30k --data ../shared/data/multi30k --src en --tgt de \\
        --model.d_model=256 --steps 20000 --workdir runs/multi30k
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py --devices 4 --parallel pmap
    python train.py --distributed ...                 # on every host of a multi-host job

Every setting of ModelConfig, TrainConfig and DataConfig is an option
`--model.NAME=VALUE`, `--train.NAME=VALUE`, `--data.NAME=VALUE` over the preset's
values; `--help` lists them with each preset's value. A run directory that
already holds checkpoints is resumed (same batches, same dropout), unless
`--no-resume` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from flax_transformer.config import (RUN_PRESETS, ConfigError, DataConfig, ModelConfig,
                                     TrainConfig, parse_overrides, run_preset)

# ModelConfig fields the tokenizer decides: the trained vocabulary's size and its special ids.
TOKENIZER_FIELDS = ('vocab_size', 'pad_id', 'bos_id', 'eos_id', 'unk_id')
SECTIONS = (('model', ModelConfig), ('train', TrainConfig), ('data', DataConfig))


def build_parser() -> argparse.ArgumentParser:
  presets = {name: run_preset(name) for name in RUN_PRESETS}
  parser = argparse.ArgumentParser(
      prog='train.py', allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
      description=__doc__.split('\n\n')[0],
      epilog='model.vocab_size and the special token ids come from the tokenizer trained on the '
             'data (its size is at most --data.vocab_size).\nMixed precision: --bf16 computes in '
             'bfloat16 with float32 parameters, logits and loss.')
  run = parser.add_argument_group('run')
  run.add_argument('--preset', choices=RUN_PRESETS, default='toy',
                   help='named settings to start from (default: toy, offline)')
  run.add_argument('--workdir', type=Path,
                   help='run directory: config.json, tokenizer.json, checkpoints/, metrics.jsonl '
                        '(default: runs/PRESET)')
  run.add_argument('--resume', action=argparse.BooleanOptionalAction, default=True,
                   help='continue from the latest checkpoint in --workdir if there is one; '
                        '--no-resume deletes the previous run there and starts afresh')
  run.add_argument('--devices', type=_positive_int, metavar='N',
                   help='use the first N local devices (default: all devices of all processes)')
  run.add_argument('--parallel', choices=('shard_map', 'pmap'), default='shard_map',
                   help='how the step is mapped over devices (identical results)')
  run.add_argument('--average-last', type=_positive_int, default=0, metavar='K',
                   help='at the end, write WORKDIR/average-lastK, the mean of the last K '
                        'checkpoints (the paper averages 5), and report its scores')
  distributed = parser.add_argument_group(
      'multi-host', 'run the same command on every process; with --distributed alone, JAX '
      'detects the cluster (SLURM, TPU pods, Open MPI)')
  distributed.add_argument('--distributed', action='store_true',
                           help='call jax.distributed.initialize() before anything else')
  distributed.add_argument('--coordinator', metavar='HOST:PORT',
                           help='address of process 0 (implies --distributed)')
  distributed.add_argument('--num-processes', type=_positive_int, metavar='N',
                           help='how many processes take part (with --coordinator)')
  distributed.add_argument('--process-id', type=int, metavar='I',
                           help="this process's index, 0 .. N-1 (with --coordinator)")

  aliases = parser.add_argument_group('shortcuts')
  aliases.add_argument('--data', dest='data.source', metavar='SOURCE',
                       help='= --data.source: a directory of <split>.<lang> files, a '
                            'JSON/JSONL/CSV/Parquet file or directory, a Hub name, or "toy"')
  aliases.add_argument('--src', dest='data.src_lang', metavar='LANG', help='= --data.src_lang')
  aliases.add_argument('--tgt', dest='data.tgt_lang', metavar='LANG', help='= --data.tgt_lang')
  aliases.add_argument('--steps', dest='train.steps', metavar='N', help='= --train.steps')
  aliases.add_argument('--bf16', dest='model.dtype', action='store_const', const='bfloat16',
                       help='= --model.dtype=bfloat16')

  for section, cls in SECTIONS:
    group = parser.add_argument_group(f'{section} settings (value per preset: '
                                      + ' | '.join(RUN_PRESETS) + ')')
    index = [s for s, _ in SECTIONS].index(section)
    for field in dataclasses.fields(cls):
      if section == 'model' and field.name in TOKENIZER_FIELDS:
        continue
      values = ' | '.join(str(getattr(presets[name][index], field.name)) for name in RUN_PRESETS)
      group.add_argument(f'--{section}.{field.name}', dest=f'{section}.{field.name}',
                         metavar='VALUE', help=values)
  return parser


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected a positive integer, got {text!r}') from None
  if value < 1:
    raise argparse.ArgumentTypeError(f'expected a positive integer, got {text!r}')
  return value


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The preset's configs with every given override applied (raises ConfigError)."""
  configs = list(run_preset(args.preset))
  for index, (section, _) in enumerate(SECTIONS):
    assignments = {name.split('.', 1)[1]: value for name, value in vars(args).items()
                   if name.startswith(f'{section}.') and value is not None}
    configs[index] = parse_overrides(configs[index], section, assignments)
  model_config, train_config, data_config = configs
  source = Path(data_config.source).expanduser()
  if data_config.source != 'toy' and source.exists():
    # An absolute path, so a resumed run recognises its data from any directory.
    data_config = data_config.replace(source=str(source.resolve()))
  return model_config, train_config, data_config


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    model_config, train_config, data_config = configs_from_args(args)
  except ConfigError as error:
    parser.error(str(error))
  if args.coordinator or args.distributed:
    import jax
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  elif args.num_processes is not None or args.process_id is not None:
    parser.error('--num-processes and --process-id need --coordinator (or --distributed)')

  # Imported after argument checks, so --help and option errors answer at once.
  from flax_transformer.checkpoint import CheckpointError
  from flax_transformer.data import DataError
  from flax_transformer.tokenizer import TokenizerError
  from flax_transformer.training import train

  workdir = args.workdir or Path('runs') / args.preset
  try:
    train(model_config, train_config, data_config, workdir, devices=args.devices,
          parallel=args.parallel, resume=args.resume, average_last=args.average_last)
  except (CheckpointError, ConfigError, DataError, TokenizerError) as error:
    print(f'train.py: error: {error}', file=sys.stderr)
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main())
