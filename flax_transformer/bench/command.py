"""flax-transformer-bench (python -m flax_transformer.bench): time train.py's step, decoding,
and the matmul peak, from the command line.

    flax-transformer-bench step --preset base --shape 64x32+32 --peak measure
    flax-transformer-bench step --workdir runs/multi30k              # a run's own settings
    flax-transformer-bench decode --preset base --methods greedy,beam --batches 1,32
    flax-transformer-bench peak --dtype bfloat16
    flax-transformer-bench sweep --preset base --batches 16,32,64 --length 32 \\
        --kernels einsum,xla --remats none,layer --json sweep.json --plot sweep.png

Settings are train.py's: `--preset` and any `--model.X` / `--train.X` option (the vocabulary
is the preset's `data.vocab_size`). Results print as a table; `--json`, `--csv` and `--plot`
(matplotlib) write them. Bad options and shapes are refused in one line, before anything is
compiled (exit 2).
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from flax_transformer.bench.shape_mix import shape_argument
from flax_transformer.bench.writers import PROGRAM, output_problems, plot, write_outputs
from flax_transformer.cli import compilation_cache
from flax_transformer.cli.failures import REFUSED, Failure, add_debug_option, run_program
from flax_transformer.cli.options import add_setting_options, configs_from_args
from flax_transformer.config import RUN_PRESETS, ConfigError
from flax_transformer.nn.backend import compute_dtype


def comma_list(kind):
  def parse(text: str):
    try:
      values = [kind(item) for item in text.split(',') if item]
    except ValueError:
      raise argparse.ArgumentTypeError(
        f'{text!r}: expected comma-separated {kind.__name__} values'
      ) from None
    if not values:
      raise argparse.ArgumentTypeError('expected at least one value')
    return values

  return parse


def positive_ints(text: str) -> list[int]:
  values = comma_list(int)(text)
  if any(value < 1 for value in values):
    raise argparse.ArgumentTypeError(f'{text!r}: every value must be a positive integer')
  return values


def positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f'{text!r}: expected a positive integer')
  return value


def peak_argument(text: str):
  if text in ('measure', 'none'):
    return text
  try:
    value = float(text)
  except ValueError:
    value = -1.0
  if value <= 0:
    raise argparse.ArgumentTypeError(f"{text!r}: 'measure', 'none' or the peak in TFLOP/s")
  return value * 1e12


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  commands = parser.add_subparsers(dest='command', required=True, metavar='COMMAND')
  helps = {
    'step': "time train.py's training step for these settings",
    'decode': 'time decoding (greedy, beam, sample, mask_predict)',
    'peak': "time this backend's matmul peak",
    'sweep': 'time the step over a grid of batch sizes, kernels, remat policies, dtypes',
  }
  parsers = {
    name: commands.add_parser(name, help=text, description=text) for name, text in helps.items()
  }
  for name, sub in parsers.items():
    add_debug_option(sub)
    sub.add_argument(
      '--rounds',
      type=positive_int,
      default=10 if name != 'decode' else 5,
      metavar='N',
      help='timed calls after warm-up (default %(default)s)',
    )
    sub.add_argument('--warmup', type=int, default=2, help='untimed calls first (default 2)')
    sub.add_argument('--json', type=Path, metavar='FILE', help='write the reports as JSON')
    sub.add_argument('--csv', type=Path, metavar='FILE', help='write the reports as CSV rows')
    sub.add_argument('--compilation-cache', metavar='DIR', help=compilation_cache.HELP)
    if name == 'peak':
      sub.add_argument('--dtype', default='float32', help='float32, bfloat16 or float16')
      sub.add_argument(
        '--size',
        type=int,
        help='the square matmul side (default: 1024 on a CPU, 8192 on an accelerator)',
      )
      sub.add_argument('--iterations', type=int, default=8, help='products per timed call')
      continue
    _add_settings_options(sub, name)
  return parser


def _add_settings_options(sub: argparse.ArgumentParser, name: str) -> None:
  """What `step`, `decode` and `sweep` take beside the timing options: the settings, and each
  command's own shapes and outputs."""
  sub.add_argument(
    '--preset',
    choices=RUN_PRESETS,
    help="train.py's preset the settings start from (default base; not with --workdir)",
  )
  sub.add_argument(
    '--workdir', type=Path, help='a run directory of train.py: its model and training settings'
  )
  add_setting_options(sub)
  {'step': _add_step_options, 'sweep': _add_sweep_options, 'decode': _add_decode_options}[name](sub)


def _add_mapping_options(sub: argparse.ArgumentParser) -> None:
  """How `step` and `sweep` map the training step over devices, and what MFU is measured against."""
  sub.add_argument('--devices', type=int, help='devices to map the step over (default all)')
  sub.add_argument('--parallel', choices=('shard_map', 'pmap'), default='shard_map')
  sub.add_argument(
    '--pair-len',
    type=int,
    default=16,
    help='packed rows: tokens per side of each pair (default 16)',
  )
  sub.add_argument(
    '--peak',
    type=peak_argument,
    default='none',
    help="MFU against: 'measure' (this backend's matmul peak, timed first), "
    "a number of TFLOP/s, or 'none' (the datasheet's only)",
  )


def _add_step_options(sub: argparse.ArgumentParser) -> None:
  _add_mapping_options(sub)
  sub.add_argument(
    '--matmul-bound',
    action='store_true',
    help="also time the step's matrix products alone (from its jaxpr, each compiled on its "
    'own) and report the step as a multiple of their sum, the products by time first',
  )
  sub.add_argument(
    '--breakdown',
    type=int,
    nargs='?',
    const=10,
    default=0,
    metavar='N',
    help="also profile 3 steps and list the step's N operations that take most time "
    '(default 10): their kind, shape and the JAX operation each came from',
  )
  sub.add_argument(
    '--shape',
    type=shape_argument,
    help='rows x source + target positions, e.g. 64x32+32 (default: '
    'train.max_tokens at length 64, or at train.packing); or several with their batches, as '
    "train.py's log names an epoch's (1024x8:2,512x16:13): each timed, and their mean weighted "
    'by batches',
  )


def _add_sweep_options(sub: argparse.ArgumentParser) -> None:
  _add_mapping_options(sub)
  sub.add_argument('--batches', type=positive_ints, required=True, metavar='ROWS,...')
  sub.add_argument('--length', type=int, default=32, help='positions per side (default 32)')
  sub.add_argument(
    '--kernels',
    type=comma_list(str),
    metavar='K,...',
    help="model.attention_kernel values (default: the settings' own)",
  )
  sub.add_argument(
    '--remats',
    type=comma_list(str),
    metavar='R,...',
    help="model.remat values (default: the settings' own)",
  )
  sub.add_argument(
    '--dtypes',
    type=comma_list(str),
    metavar='D,...',
    help="model.dtype values (default: the settings' own)",
  )
  sub.add_argument(
    '--loss-chunks',
    type=comma_list(str),
    metavar='N,...',
    help="model.loss_chunk values, 0 the whole batch (default: the settings' own)",
  )
  sub.add_argument(
    '--plot',
    type=Path,
    metavar='FILE.png',
    help='tokens/s against batch size, and compiled memory (matplotlib)',
  )


def _add_decode_options(sub: argparse.ArgumentParser) -> None:
  sub.add_argument(
    '--methods',
    type=comma_list(str),
    default=['greedy', 'beam'],
    help='decoding methods, comma-separated (default greedy,beam)',
  )
  sub.add_argument('--batches', type=positive_ints, default=[32], metavar='N,...')
  sub.add_argument('--src-len', type=int, default=32, help='source tokens (default 32)')
  sub.add_argument(
    '--new-tokens', type=int, default=32, help='output tokens per sentence (default 32)'
  )
  sub.add_argument(
    '--plot',
    type=Path,
    metavar='FILE.png',
    help='tokens/s against batch size per method (matplotlib)',
  )


def settings(parser: argparse.ArgumentParser, args: argparse.Namespace):
  """(model config, train config): the run's or the preset's, with the options applied."""
  try:
    if args.workdir is not None:
      from flax_transformer.config import parse_overrides
      from flax_transformer.errors import CheckpointError
      from flax_transformer.run.config_file import read_config, read_marker

      if not (args.workdir / 'config.json').is_file():
        parser.error(f'--workdir {args.workdir}: no config.json there (not a run of train.py)')
      marked = read_marker(args.workdir)
      if marked is None and '"model_type"' in (args.workdir / 'config.json').read_text():
        parser.error(
          f"--workdir {args.workdir}: {args.workdir / 'config.json'} is a Hugging Face model's "
          '(a Marian export?), not a run of train.py'
        )
      try:
        model_config, train_config, _ = read_config(args.workdir)
      except CheckpointError as error:  # damaged, or another program's (a Marian export)
        parser.error(f'--workdir {args.workdir}: {error}')
      for section, index in (('model', 0), ('train', 1)):
        given = {
          k.split('.', 1)[1]: v
          for k, v in vars(args).items()
          if k.startswith(f'{section}.') and v is not None
        }
        if index == 0:
          model_config = parse_overrides(model_config, section, given)
        else:
          train_config = parse_overrides(train_config, section, given)
      return model_config, train_config
    model_config, train_config, data_config = configs_from_args(args)
    given_vocab = getattr(args, 'model.vocab_size', None)
    if given_vocab is None:
      model_config = model_config.replace(vocab_size=data_config.vocab_size)
    return model_config, train_config
  except ConfigError as error:
    parser.error(str(error))


def check_methods(parser, names: list[str], model_config) -> list:
  """The decoding methods `names` name, each refused in one line unless it decodes this model."""
  from flax_transformer.decode.methods import method_from_name

  methods = []
  for name in names:
    try:
      method = method_from_name(name)
      method.check_model(model_config)
    except ConfigError as error:
      parser.error(f'--methods {name}: {error}')
    methods.append(method)
  return methods


def main(argv: list[str] | None = None) -> int:
  """The program; argv None reads sys.argv. Failures: one line and a status."""
  return run_program(PROGRAM, lambda: _main(argv), argv, lambda error: None)


def _main(argv: list[str] | None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.warmup < 0:
    parser.error(f'--warmup must be 0 or more, got {args.warmup}')
  problems = output_problems(args)  # before any work: a refused output loses none
  if problems:
    parser.error('; '.join(problems))
  if getattr(args, 'workdir', None) is not None:
    given = [o for o, d in (('--preset', 'preset'), ('--data', 'data.source')) if getattr(args, d)]
    if given:
      parser.error(
        f"{' and '.join(given)} with --workdir: the settings are the run's ({args.workdir}/"
        f'config.json); give one or the other'
      )
  if getattr(args, 'preset', 'given') is None:
    args.preset = 'base'  # the bench's default: the paper's base model
  try:  # as train.py does: a compile the cache serves says so in the report
    compilation_cache.enable(args.compilation_cache)
  except ConfigError as error:
    parser.error(str(error))
  if args.command == 'peak':
    return _peak(parser, args)
  model_config, train_config = settings(parser, args)
  if args.command == 'decode':
    return _decode(parser, args, model_config, args.rounds)
  return _steps(parser, args, model_config, train_config)


def _peak(parser, args) -> int:
  from flax_transformer.bench.peaks import measure_peak

  if args.dtype not in ('float32', 'bfloat16', 'float16'):
    parser.error(f'--dtype {args.dtype!r}: choose float32, bfloat16 or float16')
  if (args.size is not None and args.size < 1) or args.iterations < 1:
    parser.error('--size and --iterations must be positive')
  report = measure_peak(args.dtype, args.size, args.iterations, args.rounds, args.warmup)
  print(report.table())
  write_outputs([report], args)
  return 0


def _steps(parser, args, model_config, train_config) -> int:
  """`step` and `sweep`: every cell checked, then each compiled and timed in turn."""
  cells = _cells(parser, args, model_config, train_config)
  peak = args.peak
  if peak == 'measure':
    from flax_transformer.bench.peaks import measure_peak

    peak = measure_peak(compute_dtype(model_config).name)
    print(peak.table())
  peak = None if peak == 'none' else peak
  reports = _time_cells(args, cells, peak)
  if len(reports) == 1:
    print(reports[0].table())
    if reports[0].matmul_bound is not None:
      print('the products that take most of the bound:\n' + reports[0].matmul_bound.table())
    if reports[0].breakdown is not None:
      print(reports[0].breakdown.table(args.breakdown))
  else:
    from flax_transformer.bench.comparison import reports_table

    # Labels as resolved ('auto' names what it chose here).
    print(
      reports_table(
        {
          f'{r.shape} {r.attention_kernel} {r.remat} {r.dtype} chunk {r.loss_chunk}': r
          for r in reports
        }
      )
    )
  if args.command == 'step' and len(reports) > 1:
    from flax_transformer.bench.shape_mix import MixReport

    reports.append(MixReport(args.shape, list(reports)))
    print(reports[-1].table())
  write_outputs(reports, args)
  if args.command == 'sweep' and args.plot:
    plot(
      reports,
      'rows',
      ['attention_kernel', 'remat', 'dtype', 'loss_chunk'],
      args.plot,
      f'{reports[0].model}, length {args.length}',
    )
  return 0


def _time_cells(args, cells: dict, peak) -> list:
  """Each cell compiled and timed in turn (with its matmul bound when asked); the reports so
  far are written after each, so a cell refused later keeps them."""
  from tqdm.auto import tqdm

  from flax_transformer.bench.step import TrainingStep
  from flax_transformer.bench.timing import time_rounds

  reports = []
  with tqdm(
    total=len(cells) * (args.rounds + 1), desc=args.command, unit='call', disable=len(cells) == 1
  ) as bar:
    for label, (model, train, shape) in cells.items():
      try:
        step = TrainingStep(
          model, train, shape, devices=args.devices, parallel=args.parallel, pair_len=args.pair_len
        )
      except ConfigError as error:  # compiled, and too large to run here: the cells before stay
        raise Failure(
          f'{label}: {error}'
          + (f' (the {len(reports)} cells before are written)' if reports else ''),
          REFUSED,
        ) from error
      bar.update(1)
      for _ in range(args.warmup):
        step.run()

      def timed():
        step.run()
        bar.update(1)

      timing = time_rounds(timed, args.rounds, 0)
      bound = step.matmul_bound() if getattr(args, 'matmul_bound', False) else None
      profile = step.breakdown() if getattr(args, 'breakdown', 0) else None
      reports.append(step.report(timing, peak, bound, profile))
      bar.set_postfix_str(label)
      write_outputs(reports, args, quiet=True)  # each cell as it finishes: a later failure keeps it
  return reports


def _cells(parser, args, model_config, train_config) -> dict:
  """{label: (model config, train config, shape)}, every one checked before any compiles."""
  from flax_transformer.bench.flops import BatchShape
  from flax_transformer.bench.step import check_step

  if args.command == 'step':
    shapes = args.shape.shapes if args.shape else (None,)
    grid = {f'step {s or ""}'.strip(): (model_config, train_config, s) for s in shapes}
  else:
    if args.length < 1:
      parser.error(f'--length must be positive, got {args.length}')
    grid = {}
    for rows, kernel, remat, dtype, chunk in itertools.product(
      args.batches,
      args.kernels or [model_config.attention_kernel],
      args.remats or [model_config.remat],
      args.dtypes or [model_config.dtype],
      args.loss_chunks or [str(model_config.loss_chunk)],
    ):
      from flax_transformer.config import parse_overrides

      overrides = {'attention_kernel': kernel, 'remat': remat, 'dtype': dtype, 'loss_chunk': chunk}
      try:
        model = parse_overrides(model_config, 'model', overrides)
      except ConfigError as error:
        parser.error(str(error))
      grid[f'{rows} {kernel} {remat} {dtype} loss_chunk {chunk}'] = (
        model,
        train_config,
        BatchShape(rows, args.length, args.length),
      )
  if args.pair_len < 1:
    parser.error(f'--pair-len must be positive, got {args.pair_len}')
  checked = {}
  for label, (model, train, shape) in grid.items():
    try:
      shape, _ = check_step(model, train, shape, args.devices)
    except (ValueError, ConfigError) as error:
      parser.error(str(error))
    checked[label] = (model, train, shape)
  return checked


def _decode(parser, args, model_config, rounds: int) -> int:
  from flax_transformer.bench.decoding import Decoding
  from flax_transformer.bench.timing import alternating_rounds

  for name, value in (('--src-len', args.src_len), ('--new-tokens', args.new_tokens)):
    if not 1 <= value <= model_config.max_len:
      parser.error(
        f'{name} must be between 1 and model.max_len={model_config.max_len}, got {value}'
      )
  methods = check_methods(parser, args.methods, model_config)
  reports = []
  from tqdm.auto import tqdm

  for batch in args.batches:
    contenders = {}
    for name, method in zip(args.methods, methods):
      contenders[name] = Decoding(
        model_config, method, batch=batch, src_len=args.src_len, new_tokens=args.new_tokens
      )
    with tqdm(total=rounds * len(contenders), desc=f'decode batch {batch}', unit='call') as bar:
      timings = alternating_rounds(
        {n: c.run for n, c in contenders.items()}, rounds, args.warmup, bar.update
      )
    for name, decoding in contenders.items():
      report = decoding.report(timings[name])
      reports.append(report)
      print(report.table())
  write_outputs(reports, args)
  if args.plot:
    plot(reports, 'batch', ['method'], args.plot, reports[0].model)
  return 0
