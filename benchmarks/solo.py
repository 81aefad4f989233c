"""Each framework alone: our training step and decoders against the peers, one process each.

    python -m benchmarks.solo                  # the issue's setting; ~10-15 minutes on 2 CPU cores
    python -m benchmarks.solo --quick          # a tiny model, to check that it all runs
    python -m benchmarks.solo --peer-python flaxmarian=VENV/bin/python   # make_peer_env.sh VENV
    python -m benchmarks.solo --contenders ours --tasks train --model big --shape 768x32x32
                                               # our step alone, e.g. on a GPU (gpu.sh)

Contenders (`--contenders`): ours, marian (Hugging Face MarianMTModel, PyTorch,
eager), flaxmarian (FlaxMarianMTModel, transformers < 5, JAX: an environment of
its own, see docs/benchmarks.md (Method) and make_peer_env.sh) and torch
(nn.Transformer, training step only). Each runs in its own worker process
(benchmarks/solo_worker.py) under the python `--peer-python` names (default:
this one); a peer whose python lacks its packages is skipped with a message.

For every task (training step per `--train-dtypes`, greedy and beam 4 per
`--decode-dtypes`) each worker builds, compiles and warms up in turn, then the
orchestrator asks the workers for one timed call each, round after round, so
that only one process computes at a time and a burst of outside load hits all
alike; the others block on stdin. Numbers are medians of `--rounds` calls;
build and first-call (compile) times are reported apart.

Setting: the paper's base model (d=512, 6+6 layers, 8 heads, d_ff 2048;
`--model small` or `big`: `workloads.model_config`), vocabulary 8,000, random
weights. Training step: batch 32 x (32 + 32) tokens (`--shape`), dropout 0.1,
label smoothing 0.1, Adam on the paper's schedule. Decoding: 32 sources of 32
tokens, 32 new tokens forced (EOS banned until then); tokens/s = batch x new
tokens / time. Each worker also times its own framework's matmul peak, in
alternating rounds as well: 4096^3 (`--peak-size`), and rows 1024 (the step's
32 x 32 tokens), 32 and 128 (greedy and beam 4 decode steps) times the model's
weights [D, F], [F, D], [D, D] and [D, V], float32 and bfloat16 (float32
accumulation); only the shapes of the tasks run. GFLOP/s divide the
analytic matmul FLOPs (`bench.flops.train_flops`, `bench.flops.decode_flops`) by the
median time; each is read against (a) the 4096^3 peak and (b) the FLOP-weighted
peak at the task's own shapes (`weighted_peak`).

Results: benchmarks/results/solo[_quick][_MODEL][_partial].json (machine, each env's versions,
load average at start and end, settings, every timed call).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common
from benchmarks.workloads import (
  MODELS,
  Shape,
  decode_flop_classes,
  model_config,
  train_flop_classes,
)
from flax_transformer.bench.flops import decode_flops, train_flops

CONTENDERS = ('ours', 'marian', 'flaxmarian', 'torch', 'ctranslate2')
DTYPES = ('float32', 'bfloat16')
# Decoding may also be timed in int8, CTranslate2's usual CPU setting (the others: not timed).
DECODE_DTYPES = (*DTYPES, 'int8')
TASKS = ('train', 'greedy', 'beam4')
REPO = Path(__file__).resolve().parent.parent
ENV_HINT = {
  'flaxmarian': 'bash benchmarks/make_peer_env.sh VENV (outside the repository), then '
  '--peer-python flaxmarian=VENV/bin/python',
  'marian': "pip install -e '.[bench]' (torch, transformers)",
  'torch': "pip install -e '.[bench]' (torch)",
  'ctranslate2': "pip install -e '.[pretrained-test]' (ctranslate2, torch, transformers)",
  'ours': 'pip install -e .',
}


@dataclasses.dataclass(frozen=True)
class Setting:
  model: tuple[tuple[str, object], ...]  # overrides of `workloads.model_config`'s
  shape: Shape  # the training step's batch
  batch: int  # decoding: sources ...
  source_len: int  # ... of this many tokens ...
  new_tokens: int  # ... and this many forced new ones
  rounds: int
  warmup: int
  peak_size: int


FULL = Setting(
  model=(),
  shape=Shape(32, 32, 32),
  batch=32,
  source_len=32,
  new_tokens=32,
  rounds=5,
  warmup=2,
  peak_size=4096,
)
QUICK = Setting(
  model=(
    ('vocab_size', 512),
    ('d_model', 64),
    ('num_heads', 4),
    ('d_ff', 128),
    ('num_encoder_layers', 2),
    ('num_decoder_layers', 2),
  ),
  shape=Shape(4, 8, 8),
  batch=4,
  source_len=8,
  new_tokens=8,
  rounds=2,
  warmup=1,
  peak_size=256,
)


# --- FLOPs by matmul shape ----------------------------------------------------------------


def weighted_peak(classes: dict, peaks: dict) -> float:
  """GFLOP/s of the whole task if each class ran at its shape's peak {(rows, K, N): GFLOP/s}.

  Total FLOPs over the sum of FLOPs / peak: a FLOP-weighted harmonic mean.
  """
  return sum(classes.values()) / sum(flops / peaks[key] for key, flops in classes.items())


def peak_shapes(config, setting: Setting, tasks=TASKS) -> list[tuple[int, int, int]]:
  """The matmuls each worker times: size^3, and the (rows, K, N) classes of `tasks`."""
  shapes = {(setting.peak_size,) * 3}
  for task, classes in task_classes(config, setting).items():
    if task in tasks:
      shapes.update(classes)
  return sorted(shapes)


def task_classes(config, setting: Setting) -> dict[str, dict]:
  """{task: FLOP classes} for 'train', 'greedy' and 'beam4'."""
  decode = lambda beam_size: decode_flop_classes(
    config, setting.batch, setting.source_len, setting.new_tokens, beam_size
  )
  return {
    'train': train_flop_classes(config, setting.shape),
    'greedy': decode(1),
    'beam4': decode(4),
  }


# --- the workers ---------------------------------------------------------------------------


class Worker:
  """One contender's process (benchmarks/solo_worker.py): a request out, one JSON line back.

  `start` returns None when the contender cannot run under `python`; `skip_reason`
  then says what is missing and how to make the environment.
  """

  def __init__(self, contender: str, python: str, threads: int | None, log):
    self.contender, self.python, self.log = contender, python, log
    env = {
      **os.environ,
      'PYTHONPATH': os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
      ),
    }
    command = [python, '-m', 'benchmarks.solo_worker', contender]
    if threads:
      command += ['--threads', str(threads)]
    try:
      self.process = subprocess.Popen(
        command,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
        cwd=REPO,
      )
    except OSError as error:
      self.process, self.skip_reason = None, f'{contender} skipped: cannot run {python}: {error}'
      return
    first = self.receive()
    self.hello = first.get('hello')
    self.skip_reason = None if self.hello else skip_message(contender, python, first)

  def receive(self) -> dict:
    line = self.process.stdout.readline()
    if not line:
      return {'error': f'{self.contender} worker exited (code {self.process.wait()})'}
    return json.loads(line)

  def ask(self, **request) -> dict:
    if self.process.poll() is not None:
      return {'error': f'{self.contender} worker is gone (code {self.process.returncode})'}
    self.process.stdin.write(json.dumps(request) + '\n')
    self.process.stdin.flush()
    return self.receive()

  def close(self):
    if self.process and self.process.poll() is None:
      self.process.stdin.write(json.dumps({'op': 'quit'}) + '\n')
      self.process.stdin.close()
      self.process.wait(timeout=60)


def skip_message(contender: str, python: str, first: dict) -> str:
  """'flaxmarian skipped: /usr/bin/python lacks transformers<5 (found 5.2); make it: ...'."""
  if 'missing' in first:
    return (
      f'{contender} skipped: {python} lacks {", ".join(first["missing"])}; '
      f'make it: {ENV_HINT[contender]}'
    )
  return f'{contender} skipped: its worker under {python} failed: {first.get("error")}'


def parse_peer_python(text: str) -> dict[str, str]:
  """'marian=/a/bin/python,flaxmarian=/b/bin/python' -> {contender: python}."""
  pythons = {}
  for item in filter(None, text.split(',')):
    name, sep, path = item.partition('=')
    if not sep or name not in CONTENDERS or not path:
      raise argparse.ArgumentTypeError(
        f'--peer-python takes NAME=PYTHON pairs with NAME in {", ".join(CONTENDERS)}, got {item!r}'
      )
    pythons[name] = path
  return pythons


# --- the run -------------------------------------------------------------------------------


def time_peaks(workers: list[Worker], shapes, rounds: int, bar) -> tuple[dict, dict]:
  """Every worker's matmuls at `shapes`, both dtypes, one call each per round in alternation.

  Returns ({contender: {dtype: {'MxKxN': median GFLOP/s}}}, {contender: every timed call}).
  """
  times, flops = collections.defaultdict(list), {}
  for _ in range(rounds):
    for worker in workers:
      bar.set_postfix_str(f'matmul peaks: {worker.contender}')
      answer = worker.ask(op='peaks', shapes=shapes, dtypes=list(DTYPES), repeats=1)
      for p in answer.get('peaks', []):
        key = (worker.contender, p['dtype'], shape_key(p['m'], p['k'], p['n']))
        times[key] += p['times_s']
        flops[key] = p['flops']
      bar.update(1)
  peaks, record = {}, {}
  for (name, dtype, shape), ts in times.items():
    peaks.setdefault(name, {}).setdefault(dtype, {})[shape] = flops[name, dtype, shape] / (
      statistics.median(ts) * 1e9
    )
    record.setdefault(name, {}).setdefault(dtype, {})[shape] = ts
  return peaks, record


def build_request(task: str, dtype: str, config_dict: dict, setting: Setting) -> dict:
  request = {
    'op': 'build',
    'task': task,
    'dtype': dtype,
    'model': config_dict,
    'warmup': setting.warmup,
  }
  if task == 'train':
    from flax_transformer.config import TrainConfig

    train = dataclasses.asdict(TrainConfig(label_smoothing=0.1))
    request.update(
      shape=dataclasses.astuple(setting.shape),
      train={
        key: train[key]
        for key in ('lr_scale', 'warmup_steps', 'adam_b1', 'adam_b2', 'adam_eps', 'label_smoothing')
      },
    )
  else:
    request.update(
      batch=setting.batch, source_len=setting.source_len, new_tokens=setting.new_tokens
    )
  return request


def time_task(workers: list[Worker], request: dict, rounds: int, bar) -> dict:
  """Builds the task in every worker in turn, then `rounds` rounds of one timed call each."""
  cells = {}
  for worker in workers:
    bar.set_postfix_str(f'{request["task"]} {request["dtype"]}: {worker.contender} compiles')
    answer = worker.ask(**request)
    cells[worker.contender] = {key: answer[key] for key in answer if key != 'built'}
    if not answer.get('built'):
      bar.update(rounds)
  built = [w for w in workers if 'setup_s' in cells[w.contender]]
  for worker in built:
    cells[worker.contender]['times_s'] = []
  bar.set_postfix_str(f'{request["task"]} {request["dtype"]}: timed rounds')
  for _ in range(rounds):
    for worker in built:
      answer = worker.ask(op='time')
      if 'seconds' in answer:
        cells[worker.contender]['times_s'].append(round(answer['seconds'], 6))
      else:
        cells[worker.contender]['error'] = answer.get('error')
      bar.update(1)
  for worker in built:
    worker.ask(op='drop')
  return cells


# --- the report ----------------------------------------------------------------------------


def shape_key(m: int, k: int, n: int) -> str:
  return f'{m}x{k}x{n}'


def summarize_cell(
  cell: dict, task: str, dtype: str, config, setting: Setting, peaks: dict | None
) -> dict:
  """Adds median, tokens/s, GFLOP/s and the fractions of both peaks to one contender's timings."""
  if not cell.get('times_s'):
    return cell
  median = statistics.median(cell['times_s'])
  if task == 'train':
    flops, tokens = train_flops(config, setting.shape), setting.shape.target_tokens
  else:
    beam_size = 4 if task == 'beam4' else 1
    flops = decode_flops(config, setting.batch, setting.source_len, setting.new_tokens, beam_size)
    tokens = setting.batch * setting.new_tokens
  gflops = flops / median / 1e9
  cell = {
    **cell,
    'median_s': median,
    'min_s': min(cell['times_s']),
    'tokens_per_s': tokens / median,
    'gflops': gflops,
  }
  if peaks:
    by_shape = peaks[dtype]
    shaped = {key: by_shape[shape_key(*key)] for key in task_classes(config, setting)[task]}
    cell['weighted_peak_gflops'] = weighted_peak(task_classes(config, setting)[task], shaped)
    cell['fraction_of_peak'] = gflops / by_shape[shape_key(*(setting.peak_size,) * 3)]
    cell['fraction_of_weighted_peak'] = gflops / cell['weighted_peak_gflops']
  return cell


def add_ratios(cells: dict) -> None:
  """ours' speed over the fastest peer's (peer median time / ours), on ours' cell."""
  peers = [c['median_s'] for name, c in cells.items() if name != 'ours' and 'median_s' in c]
  if peers and 'median_s' in cells.get('ours', {}):
    cells['ours']['speedup_over_fastest_peer'] = min(peers) / cells['ours']['median_s']


def bfloat16_over_peer_float32(results: list[dict]) -> float | None:
  """Our bfloat16 step's speed over the fastest peer's float32 step (the issue's target: 2x)."""
  cells = {(r['task'], r['dtype']): r['contenders'] for r in results}
  ours = cells.get(('train', 'bfloat16'), {}).get('ours', {})
  peers = [
    c['median_s']
    for name, c in cells.get(('train', 'float32'), {}).items()
    if name != 'ours' and 'median_s' in c
  ]
  return min(peers) / ours['median_s'] if peers and 'median_s' in ours else None


def format_table(results: list[dict], peaks: dict, size: int) -> str:
  head = (
    f'{"task":7s} {"dtype":9s} {"contender":11s} {"median s":>9s} {"tok/s":>8s} '
    f'{"GFLOP/s":>8s} {"% peak":>7s} {"% shape":>7s} {"build s":>8s} {"ours x":>7s}'
  )
  lines = [head, '-' * len(head)]
  for entry in results:
    for name, cell in entry['contenders'].items():
      prefix = f'{entry["task"]:7s} {entry["dtype"]:9s} {name:11s}'
      if 'median_s' not in cell:
        lines.append(f'{prefix} {cell.get("unsupported") or cell.get("error", "not timed")}')
        continue
      frac = lambda key: f'{cell[key]:7.1%}' if key in cell else f'{"-":>7s}'
      ratio = cell.get('speedup_over_fastest_peer')
      build_s = cell['setup_s'] + cell['first_call_s']
      lines.append(
        f'{prefix} {cell["median_s"]:9.3f} {cell["tokens_per_s"]:8.0f} '
        f'{cell["gflops"]:8.1f} {frac("fraction_of_peak")} '
        f'{frac("fraction_of_weighted_peak")} {build_s:8.1f} '
        f'{f"{ratio:6.2f}x" if ratio else "":>7s}'
      )
  for name, by_dtype in peaks.items():
    lines.append(
      f'{name} matmul peak {size}^3: '
      + ', '.join(
        f'{dtype} {values[shape_key(size, size, size)]:.0f}' for dtype, values in by_dtype.items()
      )
      + ' GFLOP/s'
    )
  across = bfloat16_over_peer_float32(results)
  if across:
    lines.append(f"ours' bfloat16 step over the fastest peer's float32 step: {across:.2f}x")
  lines.append(
    f'% peak: of the {size}^3 matmul peak; % shape: of the FLOP-weighted peak at the '
    "task's own matmul shapes; build s: build, compile and first call; "
    "ours x: ours' speed over the fastest peer's"
  )
  return '\n'.join(lines)


# --- command line --------------------------------------------------------------------------


def _shape(text: str) -> Shape:
  try:
    batch, src_len, tgt_len = (int(x) for x in text.lower().split('x'))
  except ValueError:
    raise argparse.ArgumentTypeError(
      f'--shape must be BATCHxSRCxTGT like 32x32x32, got {text!r}'
    ) from None
  return Shape(batch, src_len, tgt_len)


def _csv(choices):
  def parse(text):
    values = tuple(x for x in text.split(',') if x)
    for value in values:
      if value not in choices:
        raise argparse.ArgumentTypeError(
          f'unknown value {value!r}; choose from {", ".join(choices)}'
        )
    return values

  return parse


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.solo', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('--quick', action='store_true', help='a tiny model and batch, 2 rounds')
  parser.add_argument(
    '--model',
    choices=MODELS,
    default='base',
    help="base (default), small (the first multi30k preset's size) or big; "
    'vocabulary 8,000 (workloads.model_config)',
  )
  parser.add_argument(
    '--shape', type=_shape, help="the training step's batch, BATCHxSRCxTGT (default 32x32x32)"
  )
  parser.add_argument(
    '--contenders',
    type=_csv(CONTENDERS),
    default=CONTENDERS,
    help=f'comma-separated subset of {",".join(CONTENDERS)}',
  )
  parser.add_argument(
    '--peer-python',
    type=parse_peer_python,
    default={},
    help='NAME=PYTHON,...: the python each contender runs under '
    '(default: this one), e.g. flaxmarian=VENV/bin/python',
  )
  parser.add_argument(
    '--train-dtypes',
    type=_csv(DTYPES),
    default=DTYPES,
    help='training-step dtypes (bfloat16: bfloat16 compute, float32 parameters)',
  )
  parser.add_argument(
    '--decode-dtypes',
    type=_csv(DECODE_DTYPES),
    default=DTYPES,
    help='bfloat16 decoding is timed for the JAX contenders only, int8 for CTranslate2 only',
  )
  parser.add_argument(
    '--tasks', type=_csv(TASKS), default=TASKS, help=f'comma-separated subset of {",".join(TASKS)}'
  )
  parser.add_argument('--rounds', type=int, help='timed calls per contender and task (default 5)')
  parser.add_argument('--warmup', type=int, help='untimed calls after the first (default 2)')
  parser.add_argument(
    '--peak-size', type=int, help='N of the N^3 matmul peak GFLOP/s are read against (default 4096)'
  )
  parser.add_argument('--threads', type=int, help='cores for every contender (default: all)')
  parser.add_argument(
    '--output',
    type=Path,
    help='JSON file (default benchmarks/results/solo[_quick][_MODEL][_partial].json)',
  )
  args = parser.parse_args(argv)
  for option, low in (('rounds', 1), ('warmup', 0), ('peak_size', 1)):
    value = getattr(args, option)
    if value is not None and value < low:
      parser.error(f'--{option.replace("_", "-")} must be at least {low}, got {value}')
  return args


def run_tasks(args, workers, config, setting, peaks, bar, save) -> list[dict]:
  config_dict = dataclasses.asdict(config)
  todo = [
    (task, dtype)
    for task in args.tasks
    for dtype in (args.train_dtypes if task == 'train' else args.decode_dtypes)
  ]
  results = []
  for task, dtype in todo:
    request = build_request(task, dtype, config_dict, setting)
    cells = time_task(workers, request, setting.rounds, bar)
    cells = {
      name: summarize_cell(cell, task, dtype, config, setting, peaks.get(name))
      for name, cell in cells.items()
    }
    add_ratios(cells)
    results.append(
      {'task': task, 'dtype': dtype, 'load_average': list(os.getloadavg()), 'contenders': cells}
    )
    save(results)
  return results


def main(argv=None) -> int:
  args = parse_args(argv)
  setting = QUICK if args.quick else FULL
  given = {
    'rounds': args.rounds,
    'warmup': args.warmup,
    'peak_size': args.peak_size,
    'shape': args.shape,
  }
  setting = dataclasses.replace(setting, **{k: v for k, v in given.items() if v is not None})
  from tqdm import tqdm

  config = model_config(args.model, **dict(setting.model))
  load_at_start = [round(x, 2) for x in os.getloadavg()]
  log = tempfile.TemporaryFile('w+')
  workers = []
  for name in args.contenders:
    worker = Worker(name, args.peer_python.get(name, sys.executable), args.threads, log)
    if worker.skip_reason:
      print(worker.skip_reason, file=sys.stderr)
    else:
      workers.append(worker)
  if not workers:
    print('benchmarks.solo: error: no contender can run (see above)', file=sys.stderr)
    return 2
  # A partial run never overwrites the full one's file.
  chosen = (args.contenders, args.tasks, args.train_dtypes, args.decode_dtypes)
  partial = [set(c) for c in chosen] != [
    set(CONTENDERS),
    set(TASKS),
    set(DTYPES),
    set(DTYPES),
  ] or any(v is not None for v in (args.shape, args.warmup, args.peak_size))
  model = '' if args.model == 'base' else f'_{args.model}'
  output = args.output or common.RESULTS / (
    f'solo{"_quick" * args.quick}{model}{"_partial" * partial}.json'
  )
  record = {
    'benchmark': 'solo',
    'machine': common.machine_info(args.threads or os.cpu_count()),
    'load_average_at_start': load_at_start,
    'setting': dataclasses.asdict(setting),
    'model': dataclasses.asdict(config),
    'command': ' '.join(sys.argv),
    'environments': {w.contender: w.hello for w in workers},
  }
  save = lambda results: common.write_json(
    output,
    {
      **record,
      'peaks': peaks,
      'results': results,
      'bfloat16_step_over_fastest_peer_float32': bfloat16_over_peer_float32(results),
      'load_average_at_end': list(os.getloadavg()),
    },
  )
  shapes = peak_shapes(config, setting, args.tasks)
  tasks = sum(len(args.train_dtypes if t == 'train' else args.decode_dtypes) for t in args.tasks)
  peaks, results = {}, []
  try:
    with tqdm(
      total=len(workers) * (1 + tasks) * setting.rounds,
      desc='solo benchmark',
      unit='call',
      file=sys.stderr,
    ) as bar:
      peaks, record['peak_times'] = time_peaks(workers, shapes, setting.rounds, bar)
      results = run_tasks(args, workers, config, setting, peaks, bar, save)
  finally:
    for worker in workers:
      worker.close()
    if any('error' in c for r in results for c in r['contenders'].values()):
      log.seek(0)
      print(f'worker errors; their stderr ends:\n{log.read()[-3000:]}', file=sys.stderr)
  path = save(results)
  print(format_table(results, peaks, setting.peak_size))
  print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
