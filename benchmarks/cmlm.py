"""Decoding speed: mask-predict (non-autoregressive) against greedy and beam search.

  python -m benchmarks.cmlm [--quick]

The first Multi30k preset's size (benchmarks/results/first_preset.json: 3+3
layers, d=256, vocabulary 8,000; README's mask-predict rows were trained at it),
bfloat16 compute, random weights, sources of 16 tokens and outputs of exactly 16
tokens for every method: the autoregressive searches run with min_len = max_len
= 16, and the length classifier of the non-autoregressive model is set to
predict the source length, so every method produces the same number of tokens
(with a length beam of 3, the other two candidates are 15 and 17 tokens).
Sentences/s at batch 1 and batch 64, medians of interleaved rounds after
compilation. Quality is not measured here (random weights).
Results: benchmarks/results/cmlm_speed.json.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from benchmarks import common, workloads
from flax_transformer import ModelConfig
from flax_transformer.decode import autoregressive, non_autoregressive
from flax_transformer.nn.build import build_model

RESULTS = Path(__file__).resolve().parent / 'results'
LENGTH = 16


def models(vocab: int | None = None):
  """(autoregressive, cmlm) models and variables of the first Multi30k preset's size
  (`workloads.first_preset`; its vocabulary unless `vocab`)."""
  preset = workloads.first_preset()
  shape = dict(
    vocab_size=vocab or preset['vocab_size'],
    **preset['model'],
    max_len=128,
    dropout_rate=0.0,
    dtype='bfloat16',
  )
  built = []
  for kind in ('autoregressive', 'cmlm'):
    config = ModelConfig(kind=kind, **shape)
    model = build_model(config)
    tokens = np.ones((1, LENGTH), np.int32)
    params = jax.jit(model.init)(jax.random.key(0), tokens, tokens)['params']
    if kind == 'cmlm':
      # Length class R (target length = source length) far above the others, then its
      # neighbours R -+ 1: a length beam of 3 decodes 15, 16 and 17 tokens, as a trained
      # classifier's top lengths cluster. (Left random, the 2nd and 3rd candidates could be
      # up to R tokens longer, and the shared canvas twice as wide.)
      bias = np.zeros_like(params['length_head']['bias'])
      r = config.max_length_offset
      bias[r], bias[r - 1], bias[r + 1] = 1e4, 1e4 - 1, 1e4 - 2
      params = {**params, 'length_head': {**params['length_head'], 'bias': bias}}
    built.append((model, {'params': params}))
  return built


def sources(batch: int, vocab: int) -> np.ndarray:
  rng = np.random.default_rng(batch)
  src = rng.integers(4, vocab, (batch, LENGTH)).astype(np.int32)
  src[:, -1] = 2  # EOS
  return src


def main() -> None:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.cmlm',
    description=__doc__,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument('--quick', action='store_true', help='batch 1 only, 2 rounds')
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument(
    '--output', help='JSON file (default benchmarks/results/cmlm_speed[_quick].json)'
  )
  args = parser.parse_args()
  rounds = 2 if args.quick else args.rounds
  batches = (1,) if args.quick else (1, 64)
  (ar_model, ar_vars), (nat_model, nat_vars) = models()

  def block(x):
    return jax.block_until_ready(x)

  rows = []
  for batch in batches:
    src = sources(batch, ar_model.config.vocab_size)
    contenders = {
      'greedy': lambda: block(
        autoregressive.greedy(ar_model, ar_vars, src, max_len=LENGTH, min_len=LENGTH)
      ),
      'beam 4': lambda: block(
        autoregressive.beam_search(
          ar_model, ar_vars, src, beam_size=4, max_len=LENGTH, min_len=LENGTH
        )
      ),
    }
    for iterations in (1, 4, 10):
      for length_beam in (1, 3):
        contenders[f'mask-predict T={iterations} l={length_beam}'] = (
          lambda i=iterations, k=length_beam: block(
            non_autoregressive.mask_predict(nat_model, nat_vars, src, iterations=i, length_beam=k)
          )
        )
    # Every method decodes LENGTH positions: checked once, outside the timing.
    for name, fn in contenders.items():
      out = np.asarray(fn()[0] if name == 'beam 4' else fn())
      assert out.shape[1] >= LENGTH, (name, out.shape)
    with tqdm(total=rounds * len(contenders), desc=f'batch {batch}', unit='call') as bar:
      timings = common.interleaved_medians(contenders, rounds, progress=bar.update)
    greedy = timings['greedy']['median_s']
    for name, timing in timings.items():
      rows.append(
        {
          'batch': batch,
          'method': name,
          'median_s': timing['median_s'],
          'sentences_per_s': batch / timing['median_s'],
          'speedup_vs_greedy': greedy / timing['median_s'],
          'times_s': timing['times_s'],
        }
      )
  print(f'{"batch":>5s} {"method":<26s} {"ms":>8s} {"sent/s":>8s} {"vs greedy":>9s}')
  for r in rows:
    print(
      f'{r["batch"]:5d} {r["method"]:<26s} {r["median_s"] * 1e3:8.1f} '
      f'{r["sentences_per_s"]:8.1f} {r["speedup_vs_greedy"]:8.2f}x'
    )
  output = Path(args.output or RESULTS / f'cmlm_speed{"_quick" if args.quick else ""}.json')
  common.write_json(
    output,
    {
      'benchmark': 'cmlm_speed',
      'machine': common.machine_info(os.cpu_count()),
      'accelerator': common.accelerator_info(),
      'length': LENGTH,
      'rounds': rounds,
      'rows': rows,
    },
  )
  print(f'wrote {output}')


if __name__ == '__main__':
  main()
