"""A/B timings of one speed lever: our step or decoder before and after it, side by side in one process.

    python -m benchmarks.ab --lever decode_dtype --rounds 5
    python -m benchmarks.ab --lever fused_qkv --parts train_float32,greedy

The "before" variant is traced with the lever switched off (the library's code
patched back to what it was, `patched`), the "after" variant with the library as
it is; both are compiled ahead of time and then timed in interleaved rounds
(`interleaved_wall_and_cpu`), so load from elsewhere hits both alike; the
process's CPU time is reported beside the wall time. Setting:
the issue's base model (d=512, 6+6 layers, 8 heads, d_ff 2048, vocabulary 8,000);
training step batch 32 x (32 + 32); greedy and beam 4 decoding of 32 sources of
32 tokens, 32 new tokens forced. Prints medians and the speed-up; writes no file
(the numbers go to docs/benchmarks.md's "What made the difference").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

from benchmarks import common, workloads

PARTS = ('train_float32', 'train_bfloat16', 'greedy', 'beam4')
BATCH, SOURCE_LEN, NEW_TOKENS = 32, 32, 32


@contextlib.contextmanager
def patched(*replacements):
  """Sets (object, attribute, value) triples for the duration; restores them after."""
  saved = [(obj, name, getattr(obj, name)) for obj, name, _ in replacements]
  try:
    for obj, name, value in replacements:
      setattr(obj, name, value)
    yield
  finally:
    for obj, name, value in saved:
      setattr(obj, name, value)


def train_step_fn(dtype: str):
  """One compiled training step (`workloads.OurStep` on one device)."""
  import jax

  from flax_transformer.config import TrainConfig

  return workloads.OurStep(
    workloads.model_config('base', dtype=dtype), TrainConfig(), workloads.SHAPE, jax.devices()[:1]
  ).step


def decoder_fn(beam_size: int, dtype: str = 'float32', cast_params: bool = False):
  """Compiled greedy (beams == 1) or beam search on random base-model weights; 32 tokens forced.

  The loop `autoregressive.greedy` and `beam_search` run, from the module's public
  pieces (`model_step_fn`, then `decode_loop` or `beam_loop`), compiled ahead of
  time here so that a lever's "before" variant is traced while it is patched in.
  cast_params: hand the decoder bfloat16 matrices (as `Translator(dtype='bfloat16')` does).
  """
  import jax
  import numpy as np

  from flax_transformer.decode import autoregressive
  from flax_transformer.decode.methods import BeamSearch
  from flax_transformer.nn.backend import compute_dtype
  from flax_transformer.nn.model import Transformer

  config = workloads.model_config('base', dtype=dtype, dropout_rate=0.0)
  src = workloads.decode_sources(config, BATCH, SOURCE_LEN)
  params = jax.jit(Transformer(config).init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
  variables = {'params': params}
  if cast_params:
    variables = jax.device_put(autoregressive.cast_matrices(variables, compute_dtype(config)))
  limits = np.full(BATCH, NEW_TOKENS, np.int32)
  loop = autoregressive.LoopConfig.for_model(config, NEW_TOKENS, min_len=NEW_TOKENS)

  def run(variables, src, limits):
    step_fn, cache = autoregressive.model_step_fn(config, variables, src, loop.max_len, beam_size)
    if beam_size == 1:
      return autoregressive.decode_loop(
        step_fn, autoregressive.argmax_pick, cache, limits, loop
      ).tokens[:, : loop.max_len]
    state = autoregressive.beam_loop(
      step_fn, cache, limits, loop, BeamSearch(beam_size=beam_size, alpha=0.6)
    )
    return state.finished_tokens[:, :, : loop.max_len], state.finished_scores

  compiled = jax.jit(run).lower(variables, src, limits).compile()
  return lambda: jax.block_until_ready(compiled(variables, src, limits))


def part_fn(part: str):
  if part.startswith('train_'):
    return train_step_fn(part.removeprefix('train_'))
  return decoder_fn(1 if part == 'greedy' else int(part.removeprefix('beam')))


def lever_decode_dtype(parts):
  """float32 decoding against bfloat16 (matrices cast at each use, and cast once up front)."""
  from flax_transformer.decode import autoregressive

  contenders = {}
  for part in parts:
    beam_size = 1 if part == 'greedy' else int(part.removeprefix('beam'))
    contenders[f'{part}/float32'] = decoder_fn(beam_size)
    with patched((autoregressive, 'cast_matrices', lambda variables, dtype: variables)):
      contenders[f'{part}/bfloat16_cast_per_use'] = decoder_fn(beam_size, 'bfloat16')
    contenders[f'{part}/bfloat16_cast_once'] = decoder_fn(beam_size, 'bfloat16', cast_params=True)
  return contenders


def lever_fused_qkv(parts):
  """A decoding step's self-attention Q, K, V as three [D, D] products against one [D, 3D]."""
  contenders = {}
  for part in parts:
    with patched(unfused_qkv()):
      contenders[f'{part}/unfused'] = part_fn(part)
    contenders[f'{part}/fused'] = part_fn(part)
  return contenders


def unfused_qkv():
  """The patch that switches the fused Q/K/V product off: `project_qkv` with fuse=False always."""
  from flax_transformer.nn.attention import MultiHeadAttention

  project_qkv = MultiHeadAttention.project_qkv
  return (
    MultiHeadAttention,
    'project_qkv',
    lambda self, inputs, fuse=False: project_qkv(self, inputs, fuse=False),
  )


LEVERS = {
  'decode_dtype': (lever_decode_dtype, ('greedy', 'beam4')),
  'fused_qkv': (lever_fused_qkv, ('greedy', 'beam4')),
}


def interleaved_wall_and_cpu(contenders, rounds: int) -> tuple[dict, dict]:
  """`common.interleaved_medians`' rounds, recording each call's wall and process CPU seconds.

  The CPU time (all of XLA's threads) counts the work done; on a machine shared
  with other jobs it moves far less than the wall time, which waits for the cores.
  """
  for fn in contenders.values():
    fn()
  wall, cpu = ({name: [] for name in contenders} for _ in range(2))
  for _ in range(rounds):
    for name, fn in contenders.items():
      start_wall, start_cpu = time.perf_counter(), time.process_time()
      fn()
      wall[name].append(time.perf_counter() - start_wall)
      cpu[name].append(time.process_time() - start_cpu)
  return wall, cpu


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.ab', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('--lever', required=True, choices=sorted(LEVERS))
  parser.add_argument(
    '--parts',
    type=lambda text: text.split(','),
    help=f"comma-separated, of {','.join(PARTS)} (default: the lever's own)",
  )
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--threads', type=int, help='cores to compute on (default: all)')
  args = parser.parse_args(argv)
  if args.parts and not set(args.parts) <= set(PARTS):
    parser.error(f'argument --parts: choose from {",".join(PARTS)}, got {",".join(args.parts)}')
  if args.rounds < 1:
    parser.error(f'argument --rounds: must be >= 1, got {args.rounds}')
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  common.pin_threads(args.threads)
  build, default_parts = LEVERS[args.lever]
  start = time.perf_counter()
  contenders = build(args.parts or default_parts)
  print(
    f'compiled {len(contenders)} contenders in {time.perf_counter() - start:.0f} s; '
    f'load average {os.getloadavg()[0]:.2f}',
    file=sys.stderr,
  )
  wall, cpu = interleaved_wall_and_cpu(contenders, args.rounds)
  first = {}
  for name in contenders:
    group = name.split('/')[0]
    first.setdefault(group, (statistics.median(wall[name]), statistics.median(cpu[name])))
    wall_s, cpu_s = statistics.median(wall[name]), statistics.median(cpu[name])
    print(
      f'{name:40s} wall median {wall_s * 1e3:7.1f} ms (min {min(wall[name]) * 1e3:7.1f})  '
      f'CPU median {cpu_s * 1e3:7.1f} ms (min {min(cpu[name]) * 1e3:7.1f})  '
      f'speed-up vs first of its part: wall {first[group][0] / wall_s:.3f}x, '
      f'CPU {first[group][1] / cpu_s:.3f}x'
    )
  print(
    f'{args.rounds} rounds; load average at the end {os.getloadavg()[0]:.2f}; '
    f'{time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}'
  )
  return 0


if __name__ == '__main__':
  sys.exit(main())
