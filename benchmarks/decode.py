"""Decoding speed on CPU: the cached engine against a naive no-cache loop and Hugging Face Marian.

    python -m benchmarks.decode            # the issue's setting; ~20 minutes on 2 busy cores
    python -m benchmarks.decode --quick    # smaller model and shapes, ~3 minutes
    python -m benchmarks.decode --groups headline,matmul_ceiling   # some groups only

Setting: the paper's base model (d=512, 6+6 layers, 8 heads, d_ff=2048, 37k vocabulary)
with random weights, a batch of 32 sources of 32 tokens, 32 new tokens forced
(EOS banned until then), float32. Tokens/s counts the returned output tokens
(batch * new tokens), for beam search too. Numbers are medians over rounds in
which the contenders of a group run in turn (`common.interleaved_medians`), after
a warm-up call that compiles. In the headline group, GFLOP/s divide the same
analytic model FLOPs (`decode_flops`) by each contender's time, against a 2048^3
float32 matmul timed in the same run (the faster of JAX and PyTorch): how close
each comes to the machine, and what share of it 2x Marian's speed would take.

Groups:
  headline      greedy and beam 4 (`flax_transformer.decode.autoregressive`) and
                `MarianMTModel.generate` (PyTorch) at identical dimensions,
                greedy and beam 4, the same forced length
  naive         greedy with no cache: the whole decoder re-runs over the output
                buffer at every step (one jit-compiled loop)
  per_step      greedy at 16, 64 and 256 output tokens: seconds / tokens
  ends_early    loop design when every row ends with EOS as token 32 of an
                82-token budget (source + 50): one plain scan over all 82 steps
                with a done mask, against chunks of k steps inside a while loop
                that exits once every row is done
  runs_to_end   the same designs when no row ends early: the price of the checks
  matmul_ceiling  the decode steps' weight matmuls alone (`step_matmuls`) at greedy's
                and beam 4's row counts: the fastest any decoder on XLA's CPU dots
                could run its steps, as a share of the peak

Both frameworks get the same cores (`common.pin_threads` before JAX starts,
`common.torch_threads` for PyTorch), and PyTorch's OpenMP threads wait passively
(see `marian_generate`). PyTorch and transformers are optional
(`pip install -e .[bench]`); without them the Marian rows are skipped with a
message. Results: benchmarks/results/decode[_quick].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from benchmarks import common


@dataclasses.dataclass(frozen=True)
class Setting:
  batch: int
  source_len: int
  new_tokens: int
  rounds: int                        # timed calls per contender
  naive_rounds: int
  per_step_lengths: tuple[int, ...]
  chunk_sizes: tuple[int, ...]       # steps_per_check values of the loop-design groups
  model: tuple[tuple[str, int], ...]  # ModelConfig.base overrides


FULL = Setting(batch=32, source_len=32, new_tokens=32, rounds=5, naive_rounds=2,
               per_step_lengths=(16, 64, 256), chunk_sizes=(1, 4, 8, 16), model=())
QUICK = Setting(batch=8, source_len=16, new_tokens=16, rounds=3, naive_rounds=2,
                per_step_lengths=(16, 64), chunk_sizes=(4, 8),
                model=(('num_encoder_layers', 2), ('num_decoder_layers', 2), ('vocab_size', 8000)))


GROUPS = ('headline', 'naive', 'per_step', 'ends_early', 'runs_to_end', 'matmul_ceiling')


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true', help='smaller model and shapes, fewer rounds')
  parser.add_argument('--threads', type=int, help='cores for both frameworks (default: all)')
  parser.add_argument('--skip-marian', action='store_true', help='measure only this library')
  parser.add_argument('--groups', type=lambda text: text.split(','), default=list(GROUPS),
                      help=f'comma-separated groups to run (default: all of {",".join(GROUPS)})')
  parser.add_argument('--output', type=Path, help='JSON results file')
  args = parser.parse_args(argv)
  unknown = sorted(set(args.groups) - set(GROUPS))
  if unknown:
    parser.error(f'unknown group(s) {", ".join(unknown)}; choose from {", ".join(GROUPS)}')
  return args


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    cores = common.pin_threads(args.threads)  # before JAX starts
  except ValueError as error:
    print(f'benchmarks.decode: error: {error}', file=sys.stderr)
    return 2
  setting = QUICK if args.quick else FULL

  import jax
  import numpy as np
  from tqdm import tqdm

  from flax_transformer import ModelConfig, Transformer
  from flax_transformer.decode import autoregressive

  config = ModelConfig.base(dropout_rate=0.0, **dict(setting.model))
  model = Transformer(config)
  src = np.random.default_rng(0).integers(4, config.vocab_size,
                                          (setting.batch, setting.source_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  params = jax.jit(model.init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
  n = setting.new_tokens
  budget = setting.source_len + autoregressive.EXTRA_OUTPUT_TOKENS

  def greedy(length=n, **settings):
    return lambda: jax.block_until_ready(
        autoregressive.greedy(model, params, src, max_len=length, min_len=length, **settings))

  headline = {'greedy': greedy(),
              'beam4': lambda: jax.block_until_ready(
                  autoregressive.beam_search(model, params, src, beam_size=4, max_len=n, min_len=n))}
  marian = ('headline' in args.groups
            and marian_generate(config, src, n, len(cores), skip=args.skip_marian))
  if marian:
    headline.update(marian_greedy=lambda: marian(1), marian_beam4=lambda: marian(4))
  # Built only for the groups that run: the naive loop and the ceiling make their own arrays.
  groups = {
      'headline': lambda: (headline, setting.rounds),
      'naive': lambda: ({'naive_greedy': naive_greedy(model, params, src, n)},
                        setting.naive_rounds),
      'per_step': lambda: ({f'greedy_{length}': greedy(length)
                            for length in setting.per_step_lengths}, setting.rounds),
      'ends_early': lambda: ({'greedy_plain_scan': ending_at(model, params, src, n, budget, budget),
                      **{f'greedy_chunk{k}': ending_at(model, params, src, n, budget, k)
                         for k in setting.chunk_sizes},
                      'beam4_plain_scan': ending_at(model, params, src, n, budget, budget, 4),
                      'beam4_chunk8': ending_at(model, params, src, n, budget, 8, 4)},
                     setting.rounds),
      'runs_to_end': lambda: ({'greedy_plain_scan': greedy(steps_per_check=n),
                       **{f'greedy_chunk{k}': greedy(steps_per_check=k)
                          for k in setting.chunk_sizes}}, setting.rounds),
      'matmul_ceiling': lambda: ({name: on_rows(step_matmuls(config, n), rows, config.d_model)
                          for name, rows in (('greedy', setting.batch),
                                             ('beam4', 4 * setting.batch))}, setting.rounds),
  }

  # The ceiling GFLOP/s are read against, measured in this run when a group reports them.
  peak = (common.measure_peaks(['float32'], with_torch=bool(marian), size=2048)['float32']
          if {'headline', 'matmul_ceiling'} & set(args.groups) else None)
  timings = {}
  groups = {name: groups[name]() for name in GROUPS if name in args.groups}
  total = sum(len(contenders) * rounds for contenders, rounds in groups.values())
  with tqdm(total=total, desc='decode benchmark', unit='call', file=sys.stderr) as bar:
    for group, (contenders, rounds) in groups.items():
      bar.set_postfix_str(group)
      timings[group] = common.interleaved_medians(contenders, rounds=rounds,
                                                  progress=lambda: bar.update(1))
  report = summarize(timings, setting, config, peak and peak['gflops'])
  if peak:
    report['float32_matmul_peak'] = peak
  if 'naive' in groups:
    cached = np.asarray(greedy()())
    naive = np.asarray(groups['naive'][0]['naive_greedy']())
    report['naive_tokens_equal_cached'] = float((cached == naive).mean())
  print(format_report(report))

  # A partial run never overwrites the full one's file.
  partial = '' if set(args.groups) == set(GROUPS) else '_' + '+'.join(groups)
  output = args.output or common.RESULTS / f'decode{"_quick" if args.quick else ""}{partial}.json'
  path = common.write_json(output, {
      'benchmark': 'decode', 'machine': common.machine_info(len(cores)),
      'setting': dataclasses.asdict(setting), 'model': dataclasses.asdict(config),
      'flops_formula': '\n'.join(f.__doc__ for f in (decode_flops, prefix_flops, step_flops)),
      **report, 'timings': timings})
  print(f'wrote {path}')
  return 0


def prefix_flops(config, batch: int, src_len: int) -> int:
  """Matmul FLOPs before the first step (2 per multiply-add): the encoder, then K and V.

  With B sources of S tokens, D = d_model, F = d_ff, N_e / N_d layers:

    encoder layer   2BS(4D^2 + 2DF) + 4BS^2 D      Q, K, V, O, FFN; QK^T and AV
    decoder layer   2BS(2D^2)                      cross-attention K and V, once
  """
  D = config.d_model
  return (config.num_encoder_layers * common.encoder_layer_flops(config, batch, src_len)
          + config.num_decoder_layers * 2 * batch * src_len * 2 * D * D)


def step_flops(config, rows: int, src_len: int, attended: int) -> int:
  """Matmul FLOPs of one decode step of R rows attending to `attended` positions of their own.

    decoder layer   2R(4D^2 + 2DF)                 Q, K, V, O of one token, FFN
                    + 2R(2D^2) + 4RSD              cross-attention Q, O; QK^T and AV over S
                    + 4R A D                       self-attention QK^T and AV over A positions
    output          2RDV                           logits against the shared embedding

  The compiled step attends to all L cache slots (masked), so its dots count
  A = L; `decode_flops` counts the model's work, A = t + 1 at step t.
  """
  R, S, A = rows, src_len, attended
  D, F, V = config.d_model, config.d_ff, config.vocab_size
  layer = 2 * R * (4 * D * D + 2 * D * F) + 2 * R * 2 * D * D + 4 * R * S * D + 4 * R * A * D
  return config.num_decoder_layers * layer + 2 * R * D * V


def decode_flops(config, batch: int, src_len: int, new_tokens: int, beams: int = 1) -> int:
  """Model FLOPs of decoding `new_tokens` for B sources: the prefix plus every step on B * beams rows.

  The same count for every contender (ours, Marian), so GFLOP/s compare like
  tokens/s; not counted: softmax, LayerNorm, top-k and the cache reorder.
  """
  return prefix_flops(config, batch, src_len) + sum(
      step_flops(config, batch * beams, src_len, t + 1) for t in range(new_tokens))


def summarize(timings: dict, setting: Setting, config, peak_gflops: float | None) -> dict:
  """The report's sections, each from the groups it needs (all of them by default).

  `peak_gflops` is needed when 'headline' or 'matmul_ceiling' was timed.
  """
  seconds = lambda group, name: timings[group][name]['median_s']
  tokens = setting.batch * setting.new_tokens
  report = {}
  if 'headline' in timings:
    rates = {name: tokens / seconds('headline', name) for name in timings['headline']}
    gflops = {name: decode_flops(config, setting.batch, setting.source_len, setting.new_tokens,
                                 4 if name.endswith('beam4') else 1)
                    / seconds('headline', name) / 1e9 for name in timings['headline']}
    speedups = {}
    if 'marian_greedy' in rates:
      speedups['greedy_over_marian_greedy'] = rates['greedy'] / rates['marian_greedy']
      speedups['beam4_over_marian_beam4'] = rates['beam4'] / rates['marian_beam4']
    report.update(
        tokens_per_second=rates, speedups=speedups, gflops=gflops,
        fraction_of_peak={name: value / peak_gflops for name, value in gflops.items()},
        # What 2x Marian's tokens/s would take, as a fraction of the matmul peak.
        fraction_of_peak_for_2x_marian={
            name: 2 * gflops[f'marian_{name}'] / peak_gflops
            for name in ('greedy', 'beam4') if f'marian_{name}' in gflops})
  if 'naive' in timings:
    naive_rate = tokens / seconds('naive', 'naive_greedy')
    report.setdefault('tokens_per_second', {})['naive_greedy'] = naive_rate
    if 'headline' in timings:
      report['speedups']['greedy_over_naive'] = report['tokens_per_second']['greedy'] / naive_rate
  if 'per_step' in timings:
    report['greedy_ms_per_step'] = {length: 1e3 * seconds('per_step', f'greedy_{length}') / length
                                    for length in setting.per_step_lengths}
  designs = [group for group in ('ends_early', 'runs_to_end') if group in timings]
  if designs:
    report['loop_design_seconds'] = {
        group: {name: t['median_s'] for name, t in timings[group].items()} for group in designs}
  if 'matmul_ceiling' in timings:
    # The steps' weight matmuls alone (`step_matmuls`): as fast as XLA's dots go at these shapes.
    report['step_matmul_ceiling_fraction_of_peak'] = {
        name: setting.new_tokens * step_flops(config, rows, 0, 0)
        / seconds('matmul_ceiling', name) / 1e9 / peak_gflops
        for name, rows in (('greedy', setting.batch), ('beam4', 4 * setting.batch))}
  return report


def format_report(report: dict) -> str:
  lines = []
  if 'tokens_per_second' in report:
    lines.append('tokens/s: ' + ', '.join(f'{k} {v:.0f}'
                                          for k, v in report['tokens_per_second'].items()))
  if report.get('speedups'):
    lines.append('speedups: ' + ', '.join(f'{k} {v:.2f}x' for k, v in report['speedups'].items()))
  if 'gflops' in report:
    lines.append('GFLOP/s (share of the float32 matmul peak): ' + ', '.join(
        f'{k} {v:.0f} ({report["fraction_of_peak"][k]:.0%})' for k, v in report['gflops'].items()))
  if 'greedy_ms_per_step' in report:
    lines.append('greedy ms/step by output length: ' + ', '.join(
        f'{k}: {v:.1f}' for k, v in report['greedy_ms_per_step'].items()))
  for group, times in report.get('loop_design_seconds', {}).items():
    lines.append(f'loop design, {group} (s): ' + ', '.join(f'{k} {v:.2f}' for k, v in times.items()))
  if 'step_matmul_ceiling_fraction_of_peak' in report:
    lines.append("decode steps' matmuls alone: " + ', '.join(
        f'{k} rows {v:.0%} of peak'
        for k, v in report['step_matmul_ceiling_fraction_of_peak'].items()))
  if report.get('fraction_of_peak_for_2x_marian'):
    lines.append('2x Marian would need: ' + ', '.join(
        f'{k} {v:.0%} of peak' for k, v in report['fraction_of_peak_for_2x_marian'].items()))
  if 'naive_tokens_equal_cached' in report:
    lines.append(f"naive tokens equal to cached: {report['naive_tokens_equal_cached']:.1%}")
  return '\n'.join(lines)


# --- the contenders -------------------------------------------------------------


def naive_greedy(model, params, src, n):
  """Greedy with no cache: the whole decoder re-runs over the `[B, n]` output buffer each step.

  Returns a function giving the tokens `[B, n]`; the same rule as the engine
  (no PAD or BOS, no EOS before n tokens), so it must give the same tokens.
  """
  import jax
  import jax.numpy as jnp

  from flax_transformer.nn import masks
  from flax_transformer.nn.model import Transformer

  config = model.config
  variables = {'params': params}
  banned = jnp.array([config.pad_id, config.bos_id, config.eos_id])

  @jax.jit
  def run(src):
    memory = model.apply(variables, src, method=Transformer.encode)
    src_mask = masks.padding_mask(src, config.pad_id)
    tgt_in = jnp.full((src.shape[0], n), config.pad_id, jnp.int32).at[:, 0].set(config.bos_id)

    def step(position, buffers):
      tgt_in, out = buffers
      logits = model.apply(variables, tgt_in, memory, src_mask, method=Transformer.decode)
      logits = jax.lax.dynamic_index_in_dim(logits, position, axis=1, keepdims=False)
      token = jnp.argmax(logits.at[:, banned].set(-jnp.inf), axis=-1).astype(jnp.int32)
      # The last step's token is never an input; clamping keeps the write in the buffer.
      tgt_in = jax.lax.dynamic_update_index_in_dim(tgt_in, token, jnp.minimum(position + 1, n - 1),
                                                   axis=1)
      return tgt_in, out.at[:, position].set(token)

    return jax.lax.fori_loop(0, n, step, (tgt_in, jnp.zeros_like(tgt_in)))[1]

  return lambda: jax.block_until_ready(run(src))


def ending_at(model, params, src, n, budget, steps_per_check, beam_size=None):
  """Greedy (or beam search) over a `budget`-token buffer where every row ends with EOS as token n."""
  import jax
  import jax.numpy as jnp

  from flax_transformer.decode import autoregressive
  config = model.config
  loop = autoregressive.LoopConfig.for_model(config, budget, min_len=n - 1,
                                       steps_per_check=steps_per_check)
  limits = jnp.full((src.shape[0],), budget, jnp.int32)

  def force_eos(step_fn):
    def step(tokens, cache, position):
      logits, cache = step_fn(tokens, cache, position)
      at_n = (jnp.arange(logits.shape[-1]) == config.eos_id) & (position == n - 1)
      return logits + jnp.where(at_n, 1e4, 0.0), cache
    return step

  @jax.jit
  def run(params, src):
    step_fn, cache = autoregressive.model_step_fn(config, {'params': params}, src, budget,
                                            beam_size or 1)
    if beam_size is None:
      state = autoregressive.decode_loop(force_eos(step_fn), autoregressive.argmax_pick, cache, limits, loop)
      return state.tokens, state.position
    state = autoregressive.beam_loop(force_eos(step_fn), cache, limits, loop,
                               autoregressive.BeamConfig(beam_size=beam_size))
    return state.finished_tokens, state.position

  return lambda: jax.block_until_ready(run(params, src))


def step_matmuls(config, n: int):
  """n decode steps through the weight matmuls alone, random weights: a ceiling.

  Returns a jitted function of float32 rows `[R, D]`.

  Per step and layer the same dots as `Transformer.decode_step` (Q, K, V, O; the
  cross-attention's Q and O; the FFN), then the logits against a `[V, D]`
  table; no attention over the cache or the source, no softmax, LayerNorm,
  top-k or cache writes. Its FLOPs are `step_flops(config, rows, 0, 0)` per
  step. However a decoder is written, its steps cannot run faster than their
  matmuls do at these shapes on XLA's CPU dots.
  """
  import jax
  import jax.numpy as jnp

  D, F, V = config.d_model, config.d_ff, config.vocab_size
  shapes = {'q': (D, D), 'k': (D, D), 'v': (D, D), 'o': (D, D), 'cross_q': (D, D),
            'cross_o': (D, D), 'ffn_in': (D, F), 'ffn_out': (F, D)}
  keys = iter(jax.random.split(jax.random.key(0), len(shapes) * config.num_decoder_layers + 2))
  weight = lambda *shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)
  layers = [{name: weight(*shape) for name, shape in shapes.items()}
            for _ in range(config.num_decoder_layers)]
  embedding = weight(V, D)

  @jax.jit
  def run(x):                                                                   # [R, D]
    def step(_, x):
      h = x
      for w in layers:
        h = (h @ w['q'] + h @ w['k'] + h @ w['v']) @ w['o']
        h = (h @ w['cross_q']) @ w['cross_o']
        h = jax.nn.relu(h @ w['ffn_in']) @ w['ffn_out']
      logits = jnp.einsum('rd,vd->rv', h, embedding)                           # [R, V]
      return x + 1e-3 * logits[:, :D]  # the next step waits for this one's logits
    return jax.lax.fori_loop(0, n, step, x)

  return run


def on_rows(fn, rows: int, width: int):
  """A timed call of `fn` on fixed random float32 rows `[rows, width]`."""
  import jax
  import numpy as np
  x = np.random.default_rng(0).standard_normal((rows, width)).astype(np.float32)
  return lambda: jax.block_until_ready(fn(x))


def marian_generate(config, src, n, threads, skip):
  """`run(num_beams)`: `MarianMTModel.generate` of n forced tokens at our dimensions, or None."""
  from benchmarks import peers
  if skip:
    print('Marian skipped (--skip-marian)', file=sys.stderr)
    return None
  reason = peers.available('marian')
  if reason:
    print(reason, file=sys.stderr)
    return None
  # Waiting OpenMP threads sleep instead of spinning: with other processes on the cores,
  # spinning made Marian up to 20x slower here (17 vs 221 tokens/s, --quick). On an
  # idle machine the two policies time alike.
  os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')
  import torch
  common.torch_threads(threads)
  marian = peers.build_model('marian', config).eval()
  input_ids = torch.as_tensor(src, dtype=torch.long)

  def run(num_beams):
    with torch.inference_mode():
      out = marian.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                            num_beams=num_beams, do_sample=False, max_new_tokens=n,
                            min_new_tokens=n, forced_eos_token_id=None)
    if out.shape[1] != n + 1:  # the start token + n new ones
      raise RuntimeError(f'Marian generated {out.shape[1] - 1} tokens, expected {n}')
    return out

  return run


if __name__ == '__main__':
  sys.exit(main())
