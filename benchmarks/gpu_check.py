"""The GPU check: every accelerator figure the project reports, in one command.

    bash benchmarks/gpu.sh                          # on a GPU: installs what is missing, runs this
    python -m benchmarks.gpu_check --tiny --output-dir /tmp/check   # every part on a CPU, tiny

Parts, in this order, each written as soon as it is done to OUTPUT_DIR/gpu_check_<part>.json
(default benchmarks/results), each bounded by its share of `--budget-s` (cells past it are
recorded as skipped, never silently dropped):

  numerics  the fused kernel (cudnn on a GPU, xla elsewhere) against our einsum: the base
            model's logits and every gradient, bfloat16 and float32, on padded rows;
            largest difference over largest value.
  mfu       training-step model FLOPs utilisation, bfloat16, base and big, for each attention
            kernel and each remat policy, at 768 rows x 32+32 tokens and at 390 x 64+64
            (24,960 target tokens, the paper's 25k): FLOPs (`bench.flops.train_flops`) over the
            median step time, against the card's measured bfloat16 matmul peak (8192^3) and
            its datasheet peak; compile time and compiled temporary memory beside.
  decode    greedy and beam-4 tokens/s, base bfloat16, 32 new tokens from 32-token sources, at
            batch 32 and 256.
  input     the 4.5M-pair stand-in (`make_standin`): train.py encodes it (its first step is
            timed, `data_pipeline.first_step`), then the host's seconds to build one batch of
            25,000 tokens (bucketed and packed) against the device's seconds for a step of that
            size: the input never waits while host < device (batches are built ahead).
  multi30k  `train.py --preset multi30k` to its end, then decode.py (beam 4) on test_2016:
            wall times, and BLEU cased and lowercased (sacreBLEU 13a, detokenized).

`--tiny` runs every part with a tiny model and shapes, two rounds, 2,000 stand-in pairs and a
2-step Multi30k run: tests/test_benchmarks.py runs it, so the check cannot rot before a GPU
is at hand. Medians of `--rounds` timed calls after warm-up; one process, one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, accelerator_info, machine_info, write_json
from benchmarks.workloads import Shape

PARTS = ('numerics', 'mfu', 'decode', 'input', 'multi30k')
DEFAULT_MULTI30K = ROOT.parent / 'shared' / 'data' / 'multi30k'
# Dense bfloat16 tensor-core peaks from the datasheets (FLOP/s), by device_kind substring.
# Each part's share of the budget; the multi30k run takes what the others leave.
BUDGET_SHARES = {'numerics': 0.05, 'mfu': 0.4, 'decode': 0.1, 'input': 0.15}


@dataclasses.dataclass(frozen=True)
class Setting:
  """What the check runs: the GPU's sizes, or `TINY`'s for a CPU test."""

  models: tuple[str, ...] = ('base', 'big')
  shapes: tuple[Shape, ...] = (Shape(768, 32, 32), Shape(390, 64, 64))
  remats: tuple[str, ...] = ('none', 'layer', 'dots')
  # True: every kernel with every remat; False: kernel i with remat i only (the tiny check's
  # three cells still run each kernel and each policy)
  full_grid: bool = True
  decode_batches: tuple[int, ...] = (32, 256)
  source_len: int = 32
  new_tokens: int = 32
  rounds: int = 10
  warmup: int = 3
  peak_size: int = 8192
  standin_pairs: int = 4_500_000
  input_max_tokens: int = 25_000
  input_steps: int = 50
  # train.py options beside the part's own (the tiny setting shrinks the model and the run)
  input_options: tuple[str, ...] = ()
  multi30k_options: tuple[str, ...] = ()


TINY_MODEL = (
  '--model.d_model=32',
  '--model.num_heads=4',
  '--model.d_ff=64',
  '--model.num_encoder_layers=1',
  '--model.num_decoder_layers=1',
)
TINY = Setting(
  models=('tiny',),
  shapes=(Shape(4, 8, 8),),
  full_grid=False,
  decode_batches=(2,),
  source_len=6,
  new_tokens=4,
  rounds=2,
  warmup=1,
  peak_size=256,
  standin_pairs=2000,
  input_max_tokens=512,
  input_steps=4,
  input_options=(*TINY_MODEL, '--data.vocab_size=300'),
  multi30k_options=(
    *TINY_MODEL,
    '--data.vocab_size=300',
    '--steps=2',
    '--train.max_tokens=256',
    '--train.bleu_every=0',
    '--model.max_len=24',
    '--train.packing=24',
  ),
)


def fused_kernel() -> str:
  """The fused kernel this backend runs: cuDNN's on a GPU, JAX's xla implementation elsewhere."""
  import jax

  return 'cudnn' if jax.default_backend() == 'gpu' else 'xla'


def model_config(name: str, **overrides):
  from benchmarks import workloads
  from flax_transformer.config import ModelConfig

  if name == 'tiny':
    return ModelConfig.tiny(vocab_size=64, num_encoder_layers=1, num_decoder_layers=1, **overrides)
  return workloads.model_config(name, **overrides)


def median_seconds(fn, setting: Setting) -> float:
  """The median of `setting.rounds` timed calls of `fn`, after `setting.warmup` untimed ones."""
  from flax_transformer import bench

  return bench.time_rounds(fn, setting.rounds, setting.warmup).median_s


# --- numerics -----------------------------------------------------------------------------


def numerics(setting: Setting, deadline: float) -> dict:
  """The fused kernel's logits and gradients against einsum's, per dtype, on padded rows."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from flax_transformer.nn.build import build_model

  shape = setting.shapes[0]
  config = model_config(setting.models[0], dropout_rate=0.0)
  rng = np.random.default_rng(0)
  src, tgt = (
    rng.integers(4, config.vocab_size, (shape.batch, length)).astype(np.int32)
    for length in (shape.src_len, shape.tgt_len)
  )
  for rows, length in ((src, shape.src_len), (tgt, shape.tgt_len)):  # right-padded rows
    for row, keep in zip(rows, rng.integers(1, length + 1, shape.batch)):
      row[keep:] = config.pad_id
  tgt[:, 0] = config.bos_id
  params = jax.jit(build_model(config).init)(jax.random.key(0), src, tgt)['params']
  results = {'shape': str(shape), 'model': setting.models[0], 'fused': fused_kernel()}
  for dtype in ('bfloat16', 'float32'):
    if time.monotonic() > deadline:
      results[dtype] = {'skipped': 'time budget'}
      continue
    computed = {}
    for kernel in ('einsum', fused_kernel()):
      if kernel == 'cudnn' and dtype == 'float32':
        kernel = 'xla'  # cuDNN's kernel takes bfloat16 only; float32 compares JAX's own
      model = build_model(config.replace(dtype=dtype, attention_kernel=kernel))

      def loss(params, model=model):
        logits = model.apply({'params': params}, src, tgt)
        return jnp.mean(jnp.tanh(logits)), logits

      grads, logits = jax.jit(jax.grad(loss, has_aux=True))(params)
      computed[kernel] = (logits, grads)
    (einsum_logits, einsum_grads), (logits, grads) = computed.values()
    largest = lambda tree: max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))
    differences = jax.tree.map(lambda a, b: jnp.abs(a - b), grads, einsum_grads)
    results[dtype] = {
      'kernel': list(computed)[1],
      'logits_max_difference_over_largest': float(jnp.max(jnp.abs(logits - einsum_logits)))
      / largest(einsum_logits),
      'gradients_max_difference_over_largest': largest(differences) / largest(einsum_grads),
    }
  return results


# --- mfu ----------------------------------------------------------------------------------


def step_cell(
  name: str, shape: Shape, kernel: str, remat: str, setting: Setting, peak: float
) -> dict:
  """One training step's report (`flax_transformer.bench`): median time, TFLOP/s, MFU against
  the measured and the datasheet peak, compile time and compiled temporaries."""
  from flax_transformer import bench
  from flax_transformer.config import TrainConfig

  config = model_config(name, dtype='bfloat16', attention_kernel=kernel, remat=remat)
  step = bench.TrainingStep(config, TrainConfig(), shape, devices=1)
  report = step.report(bench.time_rounds(step.run, setting.rounds, setting.warmup), peak)
  cell = {
    'model': name,
    'shape': str(shape),
    'target_tokens': shape.target_tokens,
    'kernel': kernel,
    'remat': remat,
    'median_s': report.timing.median_s,
    'tflops': report.flops_per_s / 1e12,
    'compile_s': round(report.compilation.seconds, 2),
    'temp_gib': None if report.memory is None else report.memory.temporaries / 2**30,
    'mfu_of_measured_peak': report.mfu,
  }
  if report.datasheet_mfu is not None:
    cell['mfu_of_datasheet_peak'] = report.datasheet_mfu
  return cell


def mfu(setting: Setting, deadline: float) -> dict:
  """Every (model, shape, kernel, remat) cell, the default first; MFU against both peaks."""
  import jax

  from flax_transformer import bench

  peak = bench.measure_peak('bfloat16', setting.peak_size, iterations=20, rounds=5).flops_per_s
  datasheet = bench.datasheet_peak(jax.devices()[0].device_kind, 'bfloat16')
  fused = fused_kernel()
  # Most telling first, so that a short budget skips the least: the default kernel without
  # remat, then einsum, then the remat policies with each kernel.
  pairs = (
    [(fused, 'none'), ('einsum', 'none')]
    + [
      (kernel, remat) for kernel in (fused, 'einsum') for remat in setting.remats if remat != 'none'
    ]
    if setting.full_grid
    else [(('einsum', fused)[min(i, 1)], remat) for i, remat in enumerate(setting.remats)]
  )
  cells = []
  for kernel, remat in pairs:
    for name in setting.models:
      for shape in setting.shapes:
        if time.monotonic() > deadline:
          cells.append(
            {
              'model': name,
              'shape': str(shape),
              'kernel': kernel,
              'remat': remat,
              'skipped': 'time budget',
            }
          )
          continue
        cell = step_cell(name, shape, kernel, remat, setting, peak)
        cells.append(cell)
        print(json.dumps(cell), flush=True)
        gc.collect()
  return {
    'matmul_peak_tflops': peak / 1e12,
    'peak_size': setting.peak_size,
    'datasheet_peak_tflops': datasheet and datasheet / 1e12,
    'cells': cells,
  }


# --- decode -------------------------------------------------------------------------------


def decode(setting: Setting, deadline: float) -> dict:
  """Greedy and beam 4 tokens/s (new tokens of every sentence) at each batch size, as
  `flax_transformer.bench.decode_report` measures them."""
  from flax_transformer import bench
  from flax_transformer.decode.methods import BeamSearch, Greedy

  config = model_config(setting.models[0], dtype='bfloat16', dropout_rate=0.0)
  n, cells = setting.new_tokens, []
  for batch in setting.decode_batches:
    for search, method in (('greedy', Greedy()), ('beam4', BeamSearch(beam_size=4))):
      if time.monotonic() > deadline:
        cells.append({'search': search, 'batch': batch, 'skipped': 'time budget'})
        continue
      report = bench.decode_report(
        config,
        method,
        batch=batch,
        src_len=setting.source_len,
        new_tokens=n,
        rounds=setting.rounds,
        warmup=setting.warmup,
      )
      cells.append(
        {
          'search': search,
          'batch': batch,
          'median_s': report.timing.median_s,
          'tokens_per_s': report.tokens_per_s,
          'compile_s': round(report.compilation.seconds, 2),
        }
      )
  return {
    'model': setting.models[0],
    'source_len': setting.source_len,
    'new_tokens': n,
    'cells': cells,
  }


# --- input --------------------------------------------------------------------------------


def input_side(setting: Setting, deadline: float, data: Path, scratch: Path) -> dict:
  """Host seconds per batch from the encoded stand-in against device seconds per step."""
  from benchmarks import data_pipeline, make_standin

  standin, workdir = scratch / 'standin', scratch / 'standin-run'
  start = time.perf_counter()
  make_standin.main(
    ['--pairs', str(setting.standin_pairs), '--output', str(standin), '--multi30k', str(data)]
  )
  results = {'pairs': setting.standin_pairs, 'standin_s': round(time.perf_counter() - start, 2)}
  command = [
    sys.executable,
    'train.py',
    '--preset',
    'base',
    '--data',
    str(standin),
    '--workdir',
    str(workdir),
    '--train.log_every=1',
    '--train.eval_every=100000',
    f'--train.max_tokens={setting.input_max_tokens}',
    *setting.input_options,
  ]
  results['first_run'] = data_pipeline.first_step(
    command, workdir, max(deadline - time.monotonic(), 60)
  )
  results.update(host_and_device(setting, workdir))
  return results


def host_and_device(setting: Setting, workdir: Path) -> dict:
  """Median and 90th-percentile host seconds of `local_batch_at` (+ device_put), bucketed and
  packed, and the step's device seconds at the bucketed batches' most frequent shape."""
  import jax

  from benchmarks.data_pipeline import load_only_cache
  from flax_transformer import bench
  from flax_transformer.config import TrainConfig
  from flax_transformer.data.batcher import Batcher
  from flax_transformer.data.plans import BestFit
  from flax_transformer.run.directory import read_config

  corpus = load_only_cache(workdir / 'encoded')
  tokens = setting.input_max_tokens
  results = {}
  for kind, batcher in (
    ('bucketed', Batcher(corpus, tokens, 0, row_multiple=2)),
    ('packed', Batcher(corpus, tokens, 0, BestFit(64), row_multiple=2)),
  ):
    batcher.batch_at(0)  # the epoch's plan, built once an epoch
    host, shapes = [], []
    for step in range(1, setting.input_steps + 1):
      start = time.perf_counter()
      batch = batcher.local_batch_at(step, 0, 1)
      jax.block_until_ready(jax.device_put(batch))
      host.append(time.perf_counter() - start)
      shapes.append(batch.src.shape)
    results[f'{kind}_host_s_per_batch'] = statistics.median(host)
    results[f'{kind}_host_s_per_batch_p90'] = statistics.quantiles(host, n=10)[-1]
    results[f'{kind}_most_frequent_shape'] = list(statistics.mode(shapes))
  rows, length = results['bucketed_most_frequent_shape']
  model_config = read_config(workdir)[0]
  step = bench.TrainingStep(model_config, TrainConfig(), Shape(rows, length, length), devices=1)
  results['device_s_per_step'] = median_seconds(step.run, setting)
  results['device_step_shape'] = str(Shape(rows, length, length))
  results['host_over_device'] = results['bucketed_host_s_per_batch'] / results['device_s_per_step']
  return results


# --- multi30k -----------------------------------------------------------------------------


def multi30k(setting: Setting, deadline: float, data: Path, scratch: Path) -> dict:
  """train.py --preset multi30k to its end, then beam-4 decoding of test_2016 and its BLEU."""
  import sacrebleu

  workdir, output = scratch / 'multi30k-run', scratch / 'test_2016.hyp'
  command = [
    sys.executable,
    'train.py',
    '--preset',
    'multi30k',
    '--data',
    str(data),
    '--data.test_split',
    'test_2016_flickr',
    '--workdir',
    str(workdir),
    *setting.multi30k_options,
  ]
  start = time.perf_counter()
  status, stdout, stderr = run_until(command, deadline)
  results = {
    'command': ' '.join(command[1:]),
    'train_wall_s': time.perf_counter() - start,
    'train_status': status,
    'score_lines': [line for line in stdout.splitlines() if 'BLEU' in line],
  }
  if status == 143:  # SIGTERM at the budget: the run saved its step
    logged = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
    return {
      **results,
      'stopped': 'time budget; the preset alone: bash benchmarks/gpu.sh '
      '--parts multi30k --budget-s 600',
      'last_logged': logged[-1] if logged else None,
      'bleu_logged': [line for line in logged if 'val_bleu' in line],
    }
  if status:
    return {**results, 'failed': 'train.py', 'stderr': stderr[-2000:]}
  start = time.perf_counter()
  subprocess.run(
    [
      sys.executable,
      'decode.py',
      '--checkpoint',
      str(workdir),
      '--input',
      str(data / 'test_2016_flickr.en'),
      '--output',
      str(output),
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    check=True,
  )
  results['decode_wall_s'] = time.perf_counter() - start
  hypotheses = output.read_text(encoding='utf-8').splitlines()
  references = (data / 'test_2016_flickr.de').read_text(encoding='utf-8').splitlines()
  results['test_2016_bleu'] = sacrebleu.corpus_bleu(hypotheses, [references]).score
  results['test_2016_bleu_lowercased'] = sacrebleu.corpus_bleu(
    hypotheses, [references], lowercase=True
  ).score
  return results


def run_until(command: list[str], deadline: float, least_s: float = 30) -> tuple[int, str, str]:
  """(status, stdout, stderr) of `command`, sent SIGTERM at `deadline` (monotonic), or after
  `least_s` if that is later, if still running; a train.py then saves its step and exits 143."""
  with tempfile.TemporaryFile('w+') as out, tempfile.TemporaryFile('w+') as err:
    process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err, text=True)
    try:
      process.wait(timeout=max(deadline - time.monotonic(), least_s))
    except subprocess.TimeoutExpired:
      process.send_signal(signal.SIGTERM)
      process.wait()
    out.seek(0)
    err.seek(0)
    return process.returncode, out.read(), err.read()


# --- the command --------------------------------------------------------------------------


def run_part(part: str, setting: Setting, deadline: float, args, scratch: Path) -> dict:
  if part in ('input', 'multi30k') and not (args.multi30k / 'train.en').is_file():
    return {'skipped': f'no Multi30k corpus at {args.multi30k} (--multi30k DIR)'}
  if part == 'input':
    return input_side(setting, deadline, args.multi30k, scratch)
  if part == 'multi30k':
    return multi30k(setting, deadline, args.multi30k, scratch)
  return {'numerics': numerics, 'mfu': mfu, 'decode': decode}[part](setting, deadline)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--tiny', action='store_true', help='every part, tiny (a CPU test)')
  parser.add_argument('--parts', default=','.join(PARTS), help=f'of {",".join(PARTS)}')
  parser.add_argument(
    '--budget-s',
    type=float,
    default=450,
    help='seconds for all parts (default 450: the check within 8 minutes); '
    'the multi30k run takes what the others leave',
  )
  parser.add_argument('--output-dir', type=Path, default=RESULTS)
  parser.add_argument('--multi30k', type=Path, default=DEFAULT_MULTI30K)
  args = parser.parse_args(argv)
  args.parts = args.parts.split(',')
  unknown = set(args.parts) - set(PARTS)
  if unknown:
    parser.error(f'unknown part(s) {", ".join(sorted(unknown))}; choose from {", ".join(PARTS)}')
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  setting = TINY if args.tiny else Setting()
  started = time.monotonic()
  header = {
    'machine': machine_info(os.cpu_count()),
    'accelerator': accelerator_info(),
    'tiny': args.tiny,
    'budget_s': args.budget_s,
  }
  failed = []
  with tempfile.TemporaryDirectory(prefix='gpu-check-') as scratch:
    spent = 0.0
    for part in args.parts:
      share = BUDGET_SHARES.get(part, 1.0)
      deadline = (
        started + spent + share * args.budget_s if part != 'multi30k' else started + args.budget_s
      )
      begin = time.monotonic()
      try:
        results = run_part(part, setting, deadline, args, Path(scratch))
      except Exception as error:  # noqa: BLE001 -- one part's failure must not cost the others
        results = {
          'failed': f'{type(error).__name__}: {error}'[:2000],
          'traceback': traceback.format_exc()[-4000:],
        }
      spent = time.monotonic() - started
      path = write_json(
        args.output_dir / f'gpu_check_{part}.json',
        {**header, 'part': part, 'wall_s': round(time.monotonic() - begin, 1), 'results': results},
      )
      print(f'{part}: {time.monotonic() - begin:.0f} s -> {path}', flush=True)
      if results.get('failed'):
        failed.append(part)
  if failed:
    print(f'gpu_check: failed: {", ".join(failed)} (see their JSON)', file=sys.stderr)
  return 1 if failed else 0


if __name__ == '__main__':
  sys.exit(main())
