"""Training-step throughput: our jit-compiled step against PyTorch peers and the matmul peak.

    python -m benchmarks.train_step                 # the full suite, ~25 minutes on 2 CPU cores
    python -m benchmarks.train_step --quick         # small config only, a few minutes
    python -m benchmarks.train_step --sections table --configs base --dtypes float32

Sections (`--sections`, default all):
  table    base and small configs, float32 and bfloat16: our step (median after
           compilation, compile time apart), target tokens/s, achieved GFLOP/s
           from `train_flops`, the fraction of the measured matmul peak, and the
           same step in PyTorch `nn.Transformer` and Hugging Face `MarianMTModel`
           (see benchmarks/peers.py), timed in interleaved rounds, with the
           speed-up ours / peer pair by pair.
  scaling  our step at sequence lengths 32..256 with tokens per batch fixed, and at
           doubling batch sizes.
  devices  the data-parallel step on 1, 2 and 4 simulated CPU devices (a child
           process with --xla_force_host_platform_device_count=4) against a plain
           `jax.jit` step with no mapping, same global batch.

Setting (the issue's): batch 32 x 32 source + 32 target tokens, every row full
(so target tokens = 32 * 32), dropout 0.1, label smoothing 0.1, Adam on the
paper's schedule, vocabulary 8000, random weights. Both frameworks compute on
the same cores (`--threads`, default all). The peak is the faster of JAX's and
PyTorch's 2048^3 matmul in the same run (bfloat16 with float32 accumulation).
Results go to benchmarks/results/train_step_cpu[_quick].json (gpu.sh: train_step_gpu*.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common, first_preset

SECTIONS = ('table', 'scaling', 'devices')
DTYPES = ('float32', 'bfloat16')


@dataclasses.dataclass(frozen=True)
class Shape:
  """One batch: `batch` rows of `src_len` source and `tgt_len` target tokens."""
  batch: int
  src_len: int
  tgt_len: int

  @property
  def target_tokens(self) -> int:
    return self.batch * self.tgt_len

  def __str__(self):
    return f'{self.batch}x{self.src_len}+{self.tgt_len}'


SHAPE = Shape(batch=32, src_len=32, tgt_len=32)


def model_configs():
  """The benchmarked model sizes, vocabulary 8000 (imported late: JAX starts after pinning)."""
  from flax_transformer.config import ModelConfig
  base = ModelConfig.base(vocab_size=8000, max_len=256)
  return {
      'base': base,
      # The first multi30k preset's shape: d=256, 3+3 layers, 4 heads of 64, d_ff=1024.
      'small': base.replace(**first_preset.MODEL),
      'big': ModelConfig.big(vocab_size=8000, max_len=256),
  }


def train_flops(config, shape: Shape) -> int:
  """Matmul FLOPs of one training step (2 per multiply-add), forward and backward.

  With B rows, S source and T target tokens, D = d_model, F = d_ff, V = vocab,
  N_e / N_d encoder / decoder layers, the forward pass multiplies

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D          Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BT(4D^2 + 2DF) + 4BT^2 D          masked self-attention, FFN
                    + 2BT(2D^2) + 2BS(2D^2) + 4BTSD    cross-attention: Q, O on T; K, V on S
    output          2BTDV                              logits against the shared embedding

  and the backward pass multiplies twice as much (for every matmul, the
  gradients of both operands). The causal mask does not halve QK^T: the masked
  half is computed and then masked, in our step and in the peers'. Not counted:
  the embedding lookups and their scatter-add gradient, softmax, LayerNorm,
  dropout and Adam (elementwise; under 1% of the total at the benchmarked shapes).
  """
  B, S, T = shape.batch, shape.src_len, shape.tgt_len
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  encoder = common.encoder_layer_flops(config, B, S)
  decoder = (2 * B * T * (4 * D * D + 2 * D * F) + 4 * B * T * T * D
             + 2 * B * T * 2 * D * D + 2 * B * S * 2 * D * D + 4 * B * T * S * D)
  forward = (config.num_encoder_layers * encoder + config.num_decoder_layers * decoder
             + 2 * B * T * D * V)
  return 3 * forward


def synthetic_batch(config, shape: Shape, seed: int = 0):
  """Random full-length rows: `src` ends with EOS, `tgt_in` = BOS + `tgt_out`[:-1]; no PAD."""
  import numpy as np

  from flax_transformer.data.batching import Batch
  src, tgt_in, tgt_out = synthetic_arrays(config, shape, seed)
  return Batch(src=src, tgt_in=tgt_in, tgt_out=tgt_out,
               example_ids=np.arange(shape.batch, dtype=np.int32))


def synthetic_arrays(config, shape: Shape, seed: int = 0):
  """`synthetic_batch`'s (src [B, S], tgt_in [B, T], tgt_out [B, T]) as NumPy int32, no library import.

  `config` needs only vocab_size and the special ids: the peers' worker
  processes (benchmarks/solo_worker.py) pass a plain namespace.
  """
  import numpy as np

  rng = np.random.default_rng(seed)
  first = config.unk_id + 1  # ordinary tokens only
  src = rng.integers(first, config.vocab_size, (shape.batch, shape.src_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  tgt_out = rng.integers(first, config.vocab_size, (shape.batch, shape.tgt_len)).astype(np.int32)
  tgt_out[:, -1] = config.eos_id
  tgt_in = np.concatenate([np.full((shape.batch, 1), config.bos_id, np.int32), tgt_out[:, :-1]], 1)
  return src, tgt_in, tgt_out


class OurStep:
  """`train.make_parallel_step` on `devices`, compiled ahead of time, on one fixed batch.

  `compile_s` is tracing + lowering + XLA compilation; `step()` runs one update
  (state buffers donated, as in training) and waits for it.
  """

  def __init__(self, model_config, train_config, shape: Shape, devices, mode: str = 'shard_map'):
    import jax

    from flax_transformer import train
    from flax_transformer.nn.model import Transformer
    model = Transformer(model_config)
    optimizer = train.make_optimizer(train_config, model_config)
    parallel = train.DataParallel(devices=devices, mode=mode)
    state = parallel.replicate(train.create_train_state(model, optimizer, seed=0))
    batch = parallel.shard_batch(synthetic_batch(model_config, shape))
    start = time.perf_counter()
    compiled = train.make_parallel_step(model, optimizer, train_config, parallel).lower(
        state, batch).compile()
    self.compile_s = time.perf_counter() - start
    self._state = state

    def step():
      self._state, metrics = compiled(self._state, batch)
      jax.block_until_ready((self._state, metrics))

    self.step = step


class PlainStep:
  """The reference single-device step a user would write: `jax.jit`, no mapping, no metrics.

  Loss, gradient and Adam update from the library's public pieces
  (`label_smoothed_cross_entropy`, `make_optimizer`), the same model and batch,
  state donated. The gap to `OurStep` on one device is the cost of the mapped
  step's psums and its metrics (NLL, accuracy, gradient norm).
  """

  def __init__(self, model_config, train_config, shape: Shape):
    import jax
    import jax.numpy as jnp

    from flax_transformer import train
    from flax_transformer.nn.model import Transformer
    model = Transformer(model_config)
    optimizer = train.make_optimizer(train_config, model_config)
    state = train.create_train_state(model, optimizer, seed=0)
    batch = jax.device_put(synthetic_batch(model_config, shape))
    base_key = jax.random.key(train_config.seed)

    @functools.partial(jax.jit, donate_argnums=0)
    def plain_step(state, batch):
      def loss_fn(params):
        logits = model.apply({'params': params}, batch.src, batch.tgt_in, train=True,
                             rngs={'dropout': jax.random.fold_in(base_key, state.step)})
        loss_sum, tokens = train.label_smoothed_cross_entropy(
            logits, batch.tgt_out, train_config.label_smoothing, model_config.pad_id)
        return loss_sum / jnp.maximum(tokens, 1.0)

      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      return state.replace(step=state.step + 1, opt_state=opt_state,
                           params=jax.tree.map(jnp.add, state.params, updates)), loss

    start = time.perf_counter()
    compiled = plain_step.lower(state, batch).compile()
    self.compile_s = time.perf_counter() - start
    self._state = state

    def step():
      self._state, loss = compiled(self._state, batch)
      jax.block_until_ready((self._state, loss))

    self.step = step


def throughput(config, shape: Shape, seconds: float, peak_gflops: float | None) -> dict:
  gflops = train_flops(config, shape) / seconds / 1e9
  return {'step_ms': seconds * 1e3, 'target_tokens_per_s': shape.target_tokens / seconds,
          'gflops': gflops, 'fraction_of_peak': gflops / peak_gflops if peak_gflops else None}


# --- sections -------------------------------------------------------------------

def run_table(args, configs, peaks, peers_ok, bar) -> list[dict]:
  """Ours and the peers on every (config, dtype): one interleaved timing per pair."""
  import jax

  from benchmarks import peers
  from flax_transformer.config import TrainConfig
  train_config = TrainConfig(label_smoothing=0.1)
  rows = []
  for name in args.configs:
    for dtype in args.dtypes:
      config = configs[name].replace(dtype=dtype)
      batch = synthetic_batch(config, args.shape)
      ours = OurStep(config, train_config, args.shape, jax.devices()[:1])
      contenders = {'ours': ours.step}
      for peer in peers_ok:
        contenders[peer] = peers.PeerStep(peer, config, train_config, batch.src, batch.tgt_in,
                                          batch.tgt_out).step
      bar.set_postfix_str(f'{name} {dtype}')
      timed = common.interleaved_medians(contenders, rounds=args.rounds, warmup=args.warmup,
                                         progress=lambda: bar.update(1))
      for framework, timing in timed.items():
        row = {'section': 'table', 'config': name, 'dtype': dtype, 'framework': framework,
               'shape': str(args.shape),
               'compile_s': ours.compile_s if framework == 'ours' else None,
               **throughput(config, args.shape, timing['median_s'], peaks[dtype]['gflops']),
               'times_s': timing['times_s']}
        if framework != 'ours':
          row['speedup_ours'] = timing['median_s'] / timed['ours']['median_s']
        rows.append(row)
      del contenders, ours
  return rows


def scaling_shapes(tokens: int, lengths, batches, length: int) -> list[Shape]:
  shapes = [Shape(tokens // n, n, n) for n in lengths]
  shapes += [Shape(b, length, length) for b in batches if Shape(b, length, length) not in shapes]
  return shapes


def run_scaling(args, configs, peaks, bar) -> list[dict]:
  import jax

  from flax_transformer.config import TrainConfig
  config = configs[args.scaling_config]
  rows = []
  for shape in scaling_shapes(args.shape.target_tokens, args.lengths, args.batches,
                              args.shape.tgt_len):
    bar.set_postfix_str(f'scaling {shape}')
    ours = OurStep(config, TrainConfig(label_smoothing=0.1), shape, jax.devices()[:1])
    timing = common.interleaved_medians({'ours': ours.step}, rounds=args.rounds,
                                        warmup=args.warmup, progress=lambda: bar.update(1))['ours']
    rows.append({'section': 'scaling', 'config': args.scaling_config, 'dtype': config.dtype,
                 'framework': 'ours', 'shape': str(shape), 'compile_s': ours.compile_s,
                 **throughput(config, shape, timing['median_s'], peaks[config.dtype]['gflops']),
                 'times_s': timing['times_s']})
  return rows


def run_devices_child(args) -> list[dict]:
  """In the child process (simulated devices): the mapped step on each count against plain jit.

  One count at a time, each timed in interleaved rounds with the plain step, so
  that only one mapped state (replicated on every device) is alive at once.
  """
  import jax

  from flax_transformer.config import TrainConfig
  config = model_configs()[args.devices_config]
  train_config = TrainConfig(label_smoothing=0.1)
  plain = PlainStep(config, train_config, args.shape)
  rows = []
  for count in args.device_counts:
    mapped = OurStep(config, train_config, args.shape, jax.devices()[:count])
    timed = common.interleaved_medians({'plain_jit': plain.step, 'mapped': mapped.step},
                                       rounds=args.rounds, warmup=args.warmup)
    plain_s = timed['plain_jit']['median_s']
    for name, timing, compile_s in (('plain_jit', timed['plain_jit'], plain.compile_s),
                                    (f'shard_map_{count}', timed['mapped'], mapped.compile_s)):
      if name == 'plain_jit' and rows:
        continue  # timed again beside each count; reported once, from the first
      rows.append({'section': 'devices', 'config': args.devices_config, 'dtype': config.dtype,
                   'framework': name, 'shape': str(args.shape), 'compile_s': compile_s,
                   **throughput(config, args.shape, timing['median_s'], None),
                   'overhead_vs_plain': timing['median_s'] / plain_s - 1,
                   'times_s': timing['times_s']})
    del mapped
  return rows


def run_devices(args, bar) -> list[dict]:
  """Spawns the child: the simulated device count must be set before JAX starts."""
  count = max(args.device_counts)
  env = dict(os.environ)
  env['XLA_FLAGS'] = f'{env.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={count}'
  command = [sys.executable, '-m', 'benchmarks.train_step', '--devices-child',
             '--devices-config', args.devices_config, '--rounds', str(args.rounds),
             '--warmup', str(args.warmup), '--shape', str(args.shape).replace('+', 'x'),
             '--device-counts', ','.join(map(str, args.device_counts))]
  if args.threads:
    command += ['--threads', str(args.threads)]
  bar.set_postfix_str(f'devices 1..{count} (child process)')
  done = subprocess.run(command, env=env, capture_output=True, text=True)
  bar.update(1)
  if done.returncode:
    # Reported, not raised: the sections already measured are still written out.
    print(f'benchmarks.train_step: the devices section failed (exit {done.returncode}'
          f'{", killed: out of memory?" if done.returncode == -9 else ""}):\n{done.stderr[-2000:]}',
          file=sys.stderr)
    return []
  return json.loads(done.stdout.strip().splitlines()[-1])


# --- report -------------------------------------------------------------------

def format_rows(rows: list[dict]) -> str:
  head = (f'{"section":8s} {"config":6s} {"dtype":9s} {"framework":12s} {"shape":12s} '
          f'{"step ms":>9s} {"compile s":>9s} {"tok/s":>8s} {"GFLOP/s":>8s} {"% peak":>7s} '
          f'{"ours x":>7s}')
  lines = [head, '-' * len(head)]
  for r in rows:
    extra = r.get('speedup_ours', r.get('overhead_vs_plain'))
    if 'speedup_ours' in r:
      extra = f'{r["speedup_ours"]:6.2f}x'
    elif 'overhead_vs_plain' in r:
      extra = f'{r["overhead_vs_plain"]:+6.1%}'
    else:
      extra = ''
    compile_s = f'{r["compile_s"]:9.1f}' if r['compile_s'] is not None else f'{"-":>9s}'
    peak = f'{r["fraction_of_peak"]:7.1%}' if r['fraction_of_peak'] is not None else f'{"-":>7s}'
    lines.append(f'{r["section"]:8s} {r["config"]:6s} {r["dtype"]:9s} {r["framework"]:12s} '
                 f'{r["shape"]:12s} {r["step_ms"]:9.1f} {compile_s} '
                 f'{r["target_tokens_per_s"]:8.0f} {r["gflops"]:8.1f} {peak} {extra:>7s}')
  return '\n'.join(lines)


def format_peaks(peaks: dict, size: int) -> str:
  parts = []
  for dtype, entry in peaks.items():
    found = ', '.join(f'{k} {v["gflops"]:.0f}' for k, v in entry.items() if k != 'gflops')
    parts.append(f'{dtype} {entry["gflops"]:.0f} GFLOP/s ({found})')
  return f'matmul peak {size}^3: ' + '; '.join(parts)


# --- command line ---------------------------------------------------------------

def _csv(kind):
  return lambda text: tuple(kind(x) for x in text.split(',') if x)


def _shape(text: str) -> Shape:
  try:
    batch, src_len, tgt_len = (int(x) for x in text.lower().split('x'))
  except ValueError:
    raise argparse.ArgumentTypeError(f'--shape must be BATCHxSRCxTGT like 32x32x32, got {text!r}')
  return Shape(batch, src_len, tgt_len)


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.train_step',
                                   description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='small config, float32, fewer rounds: checks that it all runs')
  parser.add_argument('--sections', type=_csv(str), default=SECTIONS,
                      help=f'comma-separated subset of {",".join(SECTIONS)}')
  parser.add_argument('--configs', type=_csv(str), default=('base', 'small'))
  parser.add_argument('--dtypes', type=_csv(str), default=DTYPES)
  parser.add_argument('--shape', type=_shape, default=SHAPE, help='BATCHxSRCxTGT (default 32x32x32)')
  parser.add_argument('--peers', type=_csv(str), default=('torch', 'marian'),
                      help='PyTorch peers to run beside ours; empty for none')
  parser.add_argument('--rounds', type=int, default=5, help='timed steps per contender')
  parser.add_argument('--warmup', type=int, default=2, help='untimed steps per contender')
  parser.add_argument('--threads', type=int, help='cores for both frameworks (default: all)')
  parser.add_argument('--lengths', type=_csv(int), default=(32, 64, 128, 256))
  parser.add_argument('--batches', type=_csv(int), default=(8, 16, 32, 64))
  parser.add_argument('--scaling-config', default='base')
  parser.add_argument('--devices-config', default='base')
  parser.add_argument('--device-counts', type=_csv(int), default=(1, 2, 4))
  parser.add_argument('--peak-size', type=int, default=2048)
  parser.add_argument('--output',
                      help='JSON file (default benchmarks/results/train_step_cpu[_quick].json)')
  parser.add_argument('--devices-child', action='store_true', help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.quick:
    args.configs, args.dtypes, args.rounds, args.warmup = ('small',), ('float32',), 3, 1
    args.lengths, args.batches = (32, 64), (16, 32)
    args.scaling_config = args.devices_config = 'small'
  known = ('base', 'small', 'big')
  for option, values, choices in (('--sections', args.sections, SECTIONS),
                                  ('--configs', args.configs, known),
                                  ('--dtypes', args.dtypes, DTYPES),
                                  ('--peers', args.peers, ('torch', 'marian')),
                                  ('--scaling-config', (args.scaling_config,), known),
                                  ('--devices-config', (args.devices_config,), known)):
    for value in values:
      if value not in choices:
        parser.error(f'{option}: unknown value {value!r}; choose from {", ".join(choices)}')
  for option in ('rounds', 'warmup', 'peak_size'):
    if getattr(args, option) < (0 if option == 'warmup' else 1):
      parser.error(f'--{option.replace("_", "-")} must be positive, got {getattr(args, option)}')
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cores = common.pin_threads(args.threads)
  except ValueError as error:
    print(f'benchmarks.train_step: error: {error}', file=sys.stderr)
    return 2
  if args.devices_child:
    print(json.dumps(run_devices_child(args)))
    return 0

  from tqdm import tqdm

  from benchmarks import peers
  configs = model_configs()
  peers_ok = []
  if 'table' in args.sections:
    for peer in args.peers:
      reason = peers.available(peer)
      if reason:
        print(reason, file=sys.stderr)
      else:
        peers_ok.append(peer)
  if peers_ok:
    common.torch_threads(len(cores))
  load_at_start = [round(x, 2) for x in os.getloadavg()]
  peaks = common.measure_peaks(DTYPES, bool(peers_ok), args.peak_size)
  print(format_peaks(peaks, args.peak_size))

  timed_steps = args.rounds + args.warmup
  total = 0
  if 'table' in args.sections:
    total += len(args.configs) * len(args.dtypes) * (1 + len(peers_ok)) * args.rounds
  if 'scaling' in args.sections:
    total += len(scaling_shapes(args.shape.target_tokens, args.lengths, args.batches,
                                args.shape.tgt_len)) * args.rounds
  if 'devices' in args.sections:
    total += 1
  output = Path(args.output) if args.output else common.RESULTS / (
      'train_step_cpu_quick.json' if args.quick else 'train_step_cpu.json')
  rows = []
  sections = {'table': lambda: run_table(args, configs, peaks, peers_ok, bar),
              'scaling': lambda: run_scaling(args, configs, peaks, bar),
              'devices': lambda: run_devices(args, bar)}
  with tqdm(total=total, desc=f'train-step benchmark ({timed_steps} steps per cell)',
            unit='step', file=sys.stderr) as bar:
    for name in SECTIONS:
      if name in args.sections:
        rows += sections[name]()
        # After every section, so that a later failure loses nothing measured.
        path = write_results(output, args, configs, cores, load_at_start, peaks, rows)
  print(format_rows(rows))
  print(f'wrote {path}')
  return 0


def write_results(output: Path, args, configs, cores, load_at_start, peaks, rows) -> Path:
  return common.write_json(output, {
      'benchmark': 'train_step', 'machine': common.machine_info(len(cores)),
      'accelerator': common.accelerator_info(), 'load_average_at_start': load_at_start,
      'settings': {'shape': dataclasses.asdict(args.shape), 'rounds': args.rounds,
                   'warmup': args.warmup, 'label_smoothing': 0.1, 'dropout_rate': 0.1,
                   'configs': {name: dataclasses.asdict(configs[name]) for name in configs}},
      'flops_formula': train_flops.__doc__, 'peaks': peaks, 'rows': rows})


if __name__ == '__main__':
  sys.exit(main())
