"""Train a Transformer translation model; a command line over `flax_transformer.training.train`.

    python train.py                                   # the offline default: the toy task, minutes on a CPU
    python train.py --preset multi30k --data ../shared/data/multi30k --src en --tgt de \\
        --model.d_model=256 --steps 20000 --workdir runs/multi30k
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python train.py --devices 4 --parallel pmap
    python train.py --objective cmlm                  # a non-autoregressive model (mask-predict)
    python train.py --distributed ...                 # every host of a TPU pod, SLURM or MPI job
    python train.py --coordinator HOST:PORT --num-processes N --process-id I ...    # any cluster

Every setting of ModelConfig, TrainConfig and DataConfig is an option
`--model.NAME=VALUE`, `--train.NAME=VALUE`, `--data.NAME=VALUE` over the preset's
values; `--help` lists them with each preset's value. A run directory that
already holds checkpoints is resumed (same batches, same dropout), unless
`--no-resume` is given.

Exit status:
  0    trained to --steps (and evaluated);
  1    an error in the data, the run directory or a write (disk full, no
       permission), with a one-line message; checkpoints already written stay;
  2    a bad option or setting, refused before any work;
  3    a step's loss or gradient was not finite (more than --skip-nonfinite
       times); the message names the step, the checkpoints on disk are the
       ones saved before it;
  130  SIGINT (Ctrl-C), 143 SIGTERM: the step reached was saved first (after a
       second Ctrl-C, or before training started, nothing new is saved); run
       the same command to resume.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import signal
import sys
from pathlib import Path

from flax_transformer.config import (RUN_PRESETS, ConfigError, DataConfig, ModelConfig,
                                     TrainConfig, parse_overrides, run_preset)

# ModelConfig fields the tokenizer decides: the trained vocabulary's size and its special ids.
TOKENIZER_FIELDS = ('vocab_size', 'pad_id', 'bos_id', 'eos_id', 'unk_id')
SECTIONS = (('model', ModelConfig), ('train', TrainConfig), ('data', DataConfig))
# One line per setting for --help; config.py's comments say more.
SETTING_HELP = {
    'model.d_model': 'model width D',
    'model.num_heads': 'attention heads (must divide d_model)',
    'model.num_encoder_layers': 'encoder layers N',
    'model.num_decoder_layers': 'decoder layers N',
    'model.d_ff': 'inner width of the feed-forward layers',
    'model.dropout_rate': 'dropout on embeddings and every sub-layer output',
    'model.attention_dropout_rate': 'dropout on the attention weights',
    'model.max_len': 'longest source or target in tokens (longer training pairs are dropped)',
    'model.activation': 'relu or gelu',
    'model.norm_placement': 'post (the paper) or pre LayerNorm',
    'model.share_embeddings': 'one embedding matrix for source, target and output (true/false)',
    'model.attention_radius': 'restricted self-attention window, or none',
    'model.dtype': 'compute dtype: float32 or bfloat16 (parameters and loss stay float32)',
    'model.kind': 'autoregressive (the paper) or cmlm (non-autoregressive, mask-predict)',
    'model.max_length_offset': 'cmlm: the length classifier predicts target - source length '
                               'within +- this',
    'model.nat_decoder_input': 'cmlm: MASKed positions are fed the MASK embedding (mask) or the '
                               'source token at the same relative position (uniform_copy)',
    'train.seed': 'seed of the parameters, batch order and dropout',
    'train.steps': 'batches to train on (with accumulation K: steps / K updates)',
    'train.max_tokens': 'padded tokens per batch and side',
    'train.warmup_steps': 'updates of linear learning-rate warmup',
    'train.lr_scale': 'factor on the paper\'s d_model^-0.5 * min(n^-0.5, n * warmup^-1.5)',
    'train.adam_b1': 'Adam beta1',
    'train.adam_b2': 'Adam beta2',
    'train.adam_eps': 'Adam epsilon',
    'train.label_smoothing': 'label smoothing epsilon',
    'train.max_grad_norm': 'clip the global gradient norm to this, or none',
    'train.weight_decay': 'decoupled weight decay of matrices and embeddings (0: Adam)',
    'train.grad_accum_steps': 'batches accumulated per optimizer update',
    'train.log_every': 'steps between lines of training metrics (bar and metrics.jsonl)',
    'train.eval_every': 'steps between validation losses',
    'train.checkpoint_every': 'steps between checkpoints (and one at the end)',
    'train.keep_checkpoints': 'checkpoints kept on disk (the newest)',
    'train.bleu_every': 'steps between validation BLEU scores (0: only at the end)',
    'train.length_loss_weight': 'cmlm: weight of the length loss (per sentence) beside the '
                                'masked-token loss',
    'train.eos_fill_rate': 'cmlm: fraction of target rows padded with EOS instead of PAD, for '
                           'fixed-length decoding',
    'data.source': 'toy, a directory or table file of parallel text, or a Hub dataset',
    'data.src_lang': 'source language code (file suffix or column)',
    'data.tgt_lang': 'target language code (file suffix or column)',
    'data.vocab_size': 'size of the shared subword vocabulary to train',
    'data.tokenizer': 'bpe or unigram',
}


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
  run.add_argument('--skip-nonfinite', type=_nonnegative_int, default=0, metavar='N',
                   help='skip up to N steps whose loss or gradient is not finite (their '
                        'updates are not applied) before stopping; default 0: stop at the first')
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
  aliases.add_argument('--objective', dest='model.kind', choices=('autoregressive', 'cmlm'),
                       help='= --model.kind: autoregressive (the paper: predict each next '
                            'token) or cmlm (non-autoregressive: mask a random number of target '
                            'tokens, predict them all at once from the rest, plus '
                            '--train.length_loss_weight times a target-length loss; BLEU '
                            'decodes with mask-predict, as decode.py --method nat)')
  aliases.add_argument('--bf16', dest='model.dtype', action='store_const', const='bfloat16',
                       help='= --model.dtype=bfloat16')

  for section, cls in SECTIONS:
    group = parser.add_argument_group(f'{section} settings (value per preset: '
                                      + ' | '.join(RUN_PRESETS) + ')')
    index = [s for s, _ in SECTIONS].index(section)
    for field in dataclasses.fields(cls):
      if section == 'model' and field.name in TOKENIZER_FIELDS:
        continue
      option = f'{section}.{field.name}'
      values = ' | '.join(str(getattr(presets[name][index], field.name)) for name in RUN_PRESETS)
      group.add_argument(f'--{option}', dest=option, metavar='VALUE',
                         help=f'{SETTING_HELP[option]} [{values}]')
  return parser


def _positive_int(text: str) -> int:
  return _int_at_least(text, 1, 'a positive integer')


def _nonnegative_int(text: str) -> int:
  return _int_at_least(text, 0, 'a non-negative integer')


def _int_at_least(text: str, low: int, kind: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected {kind}, got {text!r}') from None
  if value < low:
    raise argparse.ArgumentTypeError(f'expected {kind}, got {text!r}')
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


def _check_distributed_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
  """Flag mistakes answered at once, rather than by a coordinator that never hears from them."""
  if args.coordinator is not None:
    host, _, port = args.coordinator.rpartition(':')
    if not host or not port.isdigit():
      parser.error(f'--coordinator must be HOST:PORT (the address of process 0), got '
                   f'{args.coordinator!r}')
  if (args.process_id is not None and args.num_processes is not None
      and not 0 <= args.process_id < args.num_processes):
    parser.error(f'--process-id={args.process_id} is outside 0 .. {args.num_processes - 1} '
                 f'(--num-processes={args.num_processes})')


def _start_distributed(coordinator: str | None, num_processes: int | None,
                       process_id: int | None) -> None:
  """`jax.distributed.initialize`; what is None, JAX detects (TPU pods, SLURM, Open MPI)."""
  import jax
  # Collectives between CPU processes need an implementation: gloo (TCP, built into
  # jaxlib) unless one is chosen in the environment (e.g. mpi). Only the CPU backend
  # reads this; GPU and TPU collectives are unaffected.
  if 'JAX_CPU_COLLECTIVES_IMPLEMENTATION' not in os.environ:
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator, num_processes, process_id,
                             coordinator_bind_address=_loopback_bind_address(coordinator))
  if jax.process_index() != 0:
    # Process 0 reports for all. Set before anything imports tqdm, which reads it once:
    # this also silences the data loading bars of `datasets` and of encode_corpus.
    os.environ['TQDM_DISABLE'] = '1'


def _loopback_bind_address(coordinator: str | None) -> str | None:
  """The coordinator address itself when it is a loopback one, else None.

  JAX's coordinator listens on every interface by default; one reached at
  127.0.0.1 or localhost serves this machine only, so it listens there alone and
  a rehearsal on one machine opens no port to the network. Any other address is
  left to the default, as process 0 may be reached by a name or NAT address that
  is not one of its own interfaces.
  """
  if coordinator is None:
    return None
  host = coordinator.rpartition(':')[0].strip('[]')
  try:
    loopback = ipaddress.ip_address(host).is_loopback
  except ValueError:
    loopback = host == 'localhost'
  return coordinator if loopback else None


def _report_failed_write(message: str) -> None:
  """Prints `message` as a line of its own; as a program, the last line printed.

  When one file of a checkpoint cannot be written, orbax (0.12) closes the save's
  event loop while tensorstore still finishes the save's other writes, and each
  of those prints an "Event loop is closed" traceback from tensorstore's threads,
  until the process ends. They may stop part way through a line, so the message
  starts with a newline and goes out in one write; when train.py is the program,
  whatever those threads print afterwards is discarded, so that the message is
  not buried under them.
  """
  real_stderr = sys.stderr
  if __name__ == '__main__':
    sys.stderr = open(os.devnull, 'w')  # traceback printing looks up sys.stderr each time
  real_stderr.write(f'\n{message}\n')
  real_stderr.flush()
  if __name__ == '__main__':
    # ... and a traceback already part printed holds the file descriptor.
    os.dup2(sys.stderr.fileno(), real_stderr.fileno())


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    model_config, train_config, data_config = configs_from_args(args)
  except ConfigError as error:
    parser.error(str(error))
  if args.coordinator or args.distributed:
    _check_distributed_flags(parser, args)
    try:
      _start_distributed(args.coordinator, args.num_processes, args.process_id)
    except ValueError as error:  # JAX names the first setting it could neither read nor detect
      parser.error(f'jax.distributed.initialize: {error} JAX detects the cluster on TPU pods and '
                   'under SLURM or Open MPI; elsewhere give --coordinator HOST:PORT, '
                   '--num-processes N and --process-id I')
  elif args.num_processes is not None or args.process_id is not None:
    parser.error('--num-processes and --process-id need --coordinator (or --distributed)')

  # Imported after argument checks, so --help and option errors answer at once (and after
  # jax.distributed.initialize, which must come before anything touches the devices).
  from flax_transformer.checkpoint import CheckpointError, WriteError
  from flax_transformer.data import DataError
  from flax_transformer.interruption import Interrupted
  from flax_transformer.tokenizer import TokenizerError
  from flax_transformer.training import NonFiniteError, check_settings, train

  try:
    check_settings(model_config, train_config, data_config, args.average_last,
                   args.skip_nonfinite)
  except ConfigError as error:
    parser.error(str(error))
  workdir = args.workdir or Path('runs') / args.preset
  try:
    train(model_config, train_config, data_config, workdir, devices=args.devices,
          parallel=args.parallel, resume=args.resume, average_last=args.average_last,
          skip_nonfinite=args.skip_nonfinite)
  except WriteError as error:  # a full disk or an unwritable --workdir; names the path
    _report_failed_write(f'train.py: error: {error}')
    return 1
  except (CheckpointError, ConfigError, DataError, TokenizerError, OSError) as error:
    print(f'train.py: error: {error}', file=sys.stderr)
    return 1
  except NonFiniteError as error:
    print(f'train.py: error: {error}', file=sys.stderr)
    return 3
  except Interrupted as stop:
    print(f'train.py: {stop}', file=sys.stderr)
    return stop.exit_code
  except KeyboardInterrupt:
    # A second Ctrl-C, or one outside the training loop (loading, final evaluation).
    print(f'train.py: interrupted by SIGINT, nothing more saved; the checkpoints in {workdir} '
          'are complete: run the same command to resume from the latest', file=sys.stderr)
    return 128 + signal.SIGINT
  return 0


if __name__ == '__main__':
  sys.exit(main())
