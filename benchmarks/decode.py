"""Decoding speed on CPU: the cached engine against a naive no-cache loop and Hugging Face Marian.

    python -m benchmarks.decode            # the issue's setting; about 15 minutes on 2 cores
    python -m benchmarks.decode --quick    # small shapes, a few minutes: checks that it all runs

Setting: the paper's base model (d=512, 6+6 layers, 8 heads, d_ff=2048, 37k vocabulary)
with random weights, a batch of 32 sources of 32 tokens, 32 new tokens forced
(EOS banned until then), float32. Every number is the median of several runs
after a warm-up run that compiles. Tokens/s counts output tokens of the returned
sequences (batch * new tokens), for beam search too.

Measured:
  greedy, beam 4     `flax_transformer.decoding.greedy` / `beam_search`
  naive              greedy with no cache: the whole decoder re-runs on the
                     output buffer at every step (one jit-compiled loop)
  per-step cost      greedy at 16, 64 and 256 output tokens: time / tokens
  loop design        one plain scan over all steps with a done mask, against a
                     scan over chunks of k steps inside a while loop that exits
                     once all rows are done: rows end at token 32 of an 82-token
                     budget (source + 50), and, for the overhead, no row ends early
  Marian             `MarianMTModel.generate` (PyTorch) at identical dimensions,
                     greedy and beam 4, the same forced length

Both frameworks get the same CPUs: the process is pinned to the first --threads
cores before JAX or PyTorch start, and PyTorch gets `torch.set_num_threads`.
PyTorch and transformers are optional (`pip install torch==2.13.0 transformers`,
the CPU build); without them the Marian rows are skipped with a message. The
library never imports them. Results go to benchmarks/results/decode[_quick].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / 'results'


@dataclasses.dataclass(frozen=True)
class Setting:
  batch: int
  source_len: int
  new_tokens: int
  runs: int            # timed runs per measurement (after one warm-up)
  naive_runs: int
  per_step_lengths: tuple[int, ...]
  chunk_sizes: tuple[int, ...]
  model: dict          # ModelConfig overrides


FULL = Setting(batch=32, source_len=32, new_tokens=32, runs=5, naive_runs=2,
               per_step_lengths=(16, 64, 256), chunk_sizes=(1, 4, 8, 16), model={})
QUICK = Setting(batch=8, source_len=16, new_tokens=16, runs=3, naive_runs=2,
                per_step_lengths=(16, 64), chunk_sizes=(4, 8),
                model=dict(num_encoder_layers=2, num_decoder_layers=2, vocab_size=8000))


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='small shapes, fewer runs')
  parser.add_argument('--threads', type=int, default=len(os.sched_getaffinity(0)),
                      help='CPU cores for both frameworks (default: all available)')
  parser.add_argument('--skip-marian', action='store_true', help='measure only this library')
  parser.add_argument('--output', type=Path, help='JSON results file')
  return parser.parse_args(argv)


def median_seconds(run, runs: int) -> float:
  """Median wall time of `runs` calls of `run()` after one warm-up call (which compiles)."""
  run()
  times = []
  for _ in range(runs):
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv=None) -> int:
  args = parse_args(argv)
  setting = QUICK if args.quick else FULL
  cores = sorted(os.sched_getaffinity(0))
  if not 1 <= args.threads <= len(cores):
    print(f'benchmarks.decode: error: --threads must be in [1, {len(cores)}], got {args.threads}',
          file=sys.stderr)
    return 2
  # Before JAX starts: XLA sizes its CPU thread pool from the affinity mask.
  os.sched_setaffinity(0, cores[:args.threads])

  import jax
  import numpy as np
  from tqdm import tqdm

  from flax_transformer import ModelConfig, Transformer, decoding

  config = ModelConfig.base(dropout_rate=0.0, **setting.model)
  model = Transformer(config)
  rng = np.random.default_rng(0)
  src = rng.integers(4, config.vocab_size, (setting.batch, setting.source_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  params = jax.jit(model.init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
  n = setting.new_tokens
  forced = dict(max_len=n, min_len=n)

  def greedy(**settings):
    return lambda: jax.block_until_ready(decoding.greedy(model, params, src, **settings))

  def beam(**settings):
    return lambda: jax.block_until_ready(decoding.beam_search(model, params, src, **settings))

  marian = marian_runner(config, src, n, args.threads, skip=args.skip_marian)
  budget = setting.source_len + decoding.EXTRA_OUTPUT_TOKENS
  cases = [
      ('greedy', greedy(**forced), setting.runs),
      ('beam4', beam(beam_size=4, **forced), setting.runs),
      ('naive_greedy', naive_greedy(model, params, src, n), setting.naive_runs),
      *[(f'greedy_{length}', greedy(max_len=length, min_len=length), setting.runs)
        for length in setting.per_step_lengths],
      # Loop design. Plain scan: one chunk as long as the budget, no early exit.
      ('ends_early/greedy_plain_scan', greedy_ending_at(model, params, src, n, budget, budget),
       setting.runs),
      *[(f'ends_early/greedy_chunk{k}', greedy_ending_at(model, params, src, n, budget, k),
         setting.runs) for k in setting.chunk_sizes],
      ('ends_early/beam4_plain_scan', beam_ending_at(model, params, src, n, budget, budget),
       setting.runs),
      ('ends_early/beam4_chunk8', beam_ending_at(model, params, src, n, budget, 8), setting.runs),
      ('runs_to_the_end/greedy_plain_scan', greedy(steps_per_check=n, **forced), setting.runs),
      *[(f'runs_to_the_end/greedy_chunk{k}', greedy(steps_per_check=k, **forced), setting.runs)
        for k in setting.chunk_sizes],
  ]
  if marian:
    cases += [('marian_greedy', lambda: marian(1), setting.runs),
              ('marian_beam4', lambda: marian(4), setting.runs)]

  # Other processes on the same cores slow both frameworks (PyTorch's threads the most):
  # the load average is saved with the numbers.
  load_before = os.getloadavg()
  seconds = {}
  for name, run, runs in tqdm(cases, desc='decode benchmark', unit='case', file=sys.stderr):
    seconds[name] = median_seconds(run, runs)

  report = summarize(seconds, setting, n)
  print_report(report)
  output = args.output or RESULTS / ('decode_quick.json' if args.quick else 'decode.json')
  output.parent.mkdir(parents=True, exist_ok=True)
  output.write_text(json.dumps(dict(
      setting=dataclasses.asdict(setting), threads=args.threads, cpu=cpu_name(),
      load_average_1_5_15min=dict(before=load_before, after=os.getloadavg()),
      versions=versions(), seconds=seconds, **report), indent=2) + '\n')
  print(f'wrote {output}')
  return 0


def summarize(seconds: dict[str, float], setting: Setting, n: int) -> dict:
  tokens = setting.batch * n
  rate = lambda name: tokens / seconds[name]
  report = {
      'tokens_per_second': {name: rate(name) for name in
                            ('greedy', 'beam4', 'naive_greedy', 'marian_greedy', 'marian_beam4')
                            if name in seconds},
      'ms_per_step': {length: 1e3 * seconds[f'greedy_{length}'] / length
                      for length in setting.per_step_lengths},
      'loop_design_seconds': {name: value for name, value in seconds.items()
                              if name.startswith(('ends_early/', 'runs_to_the_end/'))},
  }
  ratios = {'greedy_over_naive': seconds['naive_greedy'] / seconds['greedy']}
  if 'marian_greedy' in seconds:
    ratios['greedy_over_marian_greedy'] = seconds['marian_greedy'] / seconds['greedy']
    ratios['beam4_over_marian_beam4'] = seconds['marian_beam4'] / seconds['beam4']
  report['speedups'] = ratios
  return report


def print_report(report: dict):
  print('tokens/s:', ', '.join(f'{k} {v:.0f}' for k, v in report['tokens_per_second'].items()))
  print('greedy ms per step by output length:',
        ', '.join(f'{k}: {v:.1f}' for k, v in report['ms_per_step'].items()))
  print('loop design (s):', ', '.join(f'{k} {v:.2f}'
                                      for k, v in report['loop_design_seconds'].items()))
  print('speedups:', ', '.join(f'{k} {v:.2f}x' for k, v in report['speedups'].items()))


# --- the contenders -------------------------------------------------------------


def naive_greedy(model, params, src, n):
  """Greedy with no cache: the whole decoder re-runs over the `[B, n]` output buffer each step."""
  import jax
  import jax.numpy as jnp

  from flax_transformer import masks
  from flax_transformer.model import Transformer

  config = model.config
  variables = {'params': params}

  @jax.jit
  def run(src):
    memory = model.apply(variables, src, method=Transformer.encode)
    src_mask = masks.padding_mask(src, config.pad_id)
    tgt_in = jnp.full((src.shape[0], n), config.pad_id, jnp.int32).at[:, 0].set(config.bos_id)
    out = jnp.zeros((src.shape[0], n), jnp.int32)

    def step(position, buffers):
      tgt_in, out = buffers
      logits = model.apply(variables, tgt_in, memory, src_mask, method=Transformer.decode)
      logits = jax.lax.dynamic_index_in_dim(logits, position, axis=1, keepdims=False)
      # The same rule as the engine: no PAD or BOS, no EOS before n tokens.
      banned = jnp.array([config.pad_id, config.bos_id, config.eos_id])
      token = jnp.argmax(logits.at[:, banned].set(-jnp.inf), axis=-1).astype(jnp.int32)
      tgt_in = jax.lax.dynamic_update_index_in_dim(tgt_in, token, jnp.minimum(position + 1, n - 1),
                                                   axis=1)
      return tgt_in, out.at[:, position].set(token)

    return jax.lax.fori_loop(0, n, step, (tgt_in, out))[1]

  return lambda: jax.block_until_ready(run(src))


def _force_eos_at(step_fn, position_of_eos: int, eos_id: int):
  """Wraps a step function so that every row's best token at `position_of_eos` is EOS."""
  import jax.numpy as jnp

  def wrapped(tokens, cache, position):
    logits, cache = step_fn(tokens, cache, position)
    boost = jnp.where((jnp.arange(logits.shape[-1]) == eos_id) & (position == position_of_eos),
                      1e4, 0.0)
    return logits + boost, cache

  return wrapped


def greedy_ending_at(model, params, src, n, budget, steps_per_check):
  """Greedy over a `budget`-token buffer where every row ends with EOS as token n."""
  import jax

  from flax_transformer import decoding
  config = model.config
  loop = decoding.LoopConfig.for_model(config, budget, min_len=n - 1,
                                       steps_per_check=steps_per_check)
  limits = jax.numpy.full((src.shape[0],), budget, jax.numpy.int32)

  @jax.jit
  def run(params, src):
    step_fn, cache = decoding.model_step_fn(config, {'params': params}, src, budget)
    state = decoding.decode_loop(_force_eos_at(step_fn, n - 1, config.eos_id),
                                 decoding.argmax_pick, cache, limits, loop)
    return state.tokens, state.position

  return lambda: jax.block_until_ready(run(params, src))


def beam_ending_at(model, params, src, n, budget, steps_per_check):
  """Beam 4 over a `budget`-token buffer where every hypothesis ends with EOS as token n."""
  import jax

  from flax_transformer import decoding
  config = model.config
  beam = decoding.BeamConfig(beam_size=4, alpha=0.6)
  loop = decoding.LoopConfig.for_model(config, budget, min_len=n - 1,
                                       steps_per_check=steps_per_check)
  limits = jax.numpy.full((src.shape[0],), budget, jax.numpy.int32)

  @jax.jit
  def run(params, src):
    step_fn, cache = decoding.model_step_fn(config, {'params': params}, src, budget, 4)
    state = decoding.beam_loop(_force_eos_at(step_fn, n - 1, config.eos_id), cache, limits,
                               loop, beam)
    return state.finished_tokens, state.position

  return lambda: jax.block_until_ready(run(params, src))


def marian_runner(config, src, n, threads, skip):
  """`run(num_beams)` generating n tokens with an identically sized Marian, or None."""
  if skip:
    print('Marian: skipped (--skip-marian)', file=sys.stderr)
    return None
  try:
    import torch
    from transformers import MarianConfig, MarianMTModel
  except ImportError as error:
    print(f'Marian: skipped, PyTorch/transformers not installed ({error.name}); install the CPU '
          'build with `pip install torch==2.13.0 transformers`', file=sys.stderr)
    return None
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  marian_config = MarianConfig(
      vocab_size=config.vocab_size, d_model=config.d_model, encoder_layers=config.num_encoder_layers,
      decoder_layers=config.num_decoder_layers, encoder_attention_heads=config.num_heads,
      decoder_attention_heads=config.num_heads, encoder_ffn_dim=config.d_ff,
      decoder_ffn_dim=config.d_ff, max_position_embeddings=config.max_len,
      activation_function='relu', scale_embedding=True, dropout=0.0,
      pad_token_id=config.pad_id, eos_token_id=config.eos_id,
      decoder_start_token_id=config.bos_id, forced_eos_token_id=None)
  marian = MarianMTModel(marian_config).eval()
  input_ids = torch.as_tensor(src, dtype=torch.long)

  def run(num_beams):
    with torch.inference_mode():
      out = marian.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            num_beams=num_beams, do_sample=False, max_new_tokens=n,
                            min_new_tokens=n)
    assert out.shape[1] == n + 1, out.shape  # the start token + n new ones
    return out

  return run


def cpu_name() -> str:
  try:
    for line in Path('/proc/cpuinfo').read_text().splitlines():
      if line.startswith('model name'):
        return line.split(':', 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
  import importlib.metadata
  found = {}
  for name in ('jax', 'jaxlib', 'flax', 'torch', 'transformers'):
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


if __name__ == '__main__':
  sys.exit(main())
