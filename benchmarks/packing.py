"""Sequence packing on the Multi30k preset: padding share, and real target tokens per second.

    python -m benchmarks.packing                                  # ~10 minutes on 2 CPU cores
    python -m benchmarks.packing --row-lengths 32,64,128 --steps 20 --rounds 3
    python -m benchmarks.packing --first-preset   # 3+3 layers, d=256, 8,000 pieces: packing.json

The preset's data (Multi30k train, `--data DIR`, skipped with a message when
absent), tokenizer (the preset's 16,000 BPE pieces trained on it, or
`--vocab-size`), model (4+4 layers, d=128,
bfloat16, dropout 0.3) and batching (4,096 tokens per side, the default length
buckets) as `train.py --preset multi30k` uses them; `--first-preset` takes the
first preset's model and vocabulary instead (benchmarks/results/first_preset.json),
which the recorded results measured.
Contenders: unpacked buckets ('unpacked', one pair per row, `--train.packing=0`)
and `Batcher` with a `FirstFit` packing plan at each row length of `--row-lengths` ('packed-L',
`--train.packing=L`).

Reported for each: the padding share of source and target positions over a
whole epoch, its batches per epoch, and the training step's real (non-PAD)
target tokens per second over `--steps` batches spread evenly over epoch 0:
their target tokens / the sum of each batch's median step time. Every step is
one call, timed in interleaved rounds (`common.interleaved_medians`: batch i of
each contender in turn, then batch i + 1) after one untimed pass that compiles
every shape. Results: benchmarks/results/packing.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common, workloads

DEFAULT_DATA = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'


class Contender:
  """One batcher's training step on the preset model, over a fixed list of batches."""

  def __init__(self, model_config, train_config, batcher, steps: int):
    import jax

    from flax_transformer.nn.build import build_model
    from flax_transformer.train import (
      DataParallel,
      create_train_state,
      make_optimizer,
      make_parallel_step,
    )

    epoch = batcher.epoch(0)
    picked = [epoch[i * len(epoch) // steps] for i in range(steps)]
    self.tokens = [int(batch.num_tokens) for batch in picked]
    self.shapes = sorted({batch.src.shape for batch in picked})
    parallel = DataParallel(jax.devices()[:1])
    model = build_model(model_config)
    optimizer = make_optimizer(train_config, model_config)
    self.step = make_parallel_step(model, optimizer, train_config, parallel)
    self.state = parallel.replicate(create_train_state(model, optimizer, train_config.seed))
    self.batches = [parallel.shard_batch(batch) for batch in picked]
    self._jax = jax

  def on(self, index: int):
    """A call that takes one training step on batch `index` and returns when it is done."""

    def call():
      self.state, _ = self.step(self.state, self.batches[index])
      self._jax.block_until_ready(self.state)

    return call


def measure(
  data: Path,
  row_lengths: list[int],
  steps: int,
  rounds: int,
  vocab_size: int | None = None,
  first: bool = False,
) -> dict:
  """Padding shares and interleaved step timings of 'unpacked' and each 'packed-L'."""
  from flax_transformer.config import run_preset
  from flax_transformer.data.batcher import Batcher
  from flax_transformer.data.batching import encode_corpus
  from flax_transformer.data.corpus import load_parallel
  from flax_transformer.data.packing import padding_share
  from flax_transformer.data.plans import FirstFit
  from flax_transformer.tokenizer import Tokenizer

  model_config, train_config, data_config = run_preset('multi30k')
  preset = workloads.first_preset()
  if first:
    model_config = model_config.replace(**preset['model'])
    data_config = data_config.replace(vocab_size=preset['vocab_size'])
  data_config = data_config.replace(vocab_size=vocab_size or data_config.vocab_size)
  dataset = load_parallel(str(data), data_config.src_lang, data_config.tgt_lang)
  texts = list(dataset['train']['source']) + list(dataset['train']['target'])
  tokenizer = Tokenizer.train(texts, data_config.vocab_size, data_config.tokenizer)
  corpus = encode_corpus(dataset['train'], tokenizer, model_config.max_len)
  model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
  batchers = {'unpacked': (0, Batcher(corpus, train_config.max_tokens, train_config.seed))}
  batchers.update(
    {
      f'packed-{length}': (
        length,
        Batcher(corpus, train_config.max_tokens, train_config.seed, FirstFit(length)),
      )
      for length in row_lengths
    }
  )
  results = {}
  for name, (length, batcher) in batchers.items():
    epoch = list(batcher.epoch(0))
    results[name] = {
      'row_length': length or None,
      'batches_per_epoch': len(epoch),
      'padding_share': padding_share(epoch, corpus.pad_id),
      'shapes': [list(shape) for shape in batcher.shapes],
    }
    print(f'{name}: {batcher.describe()}', flush=True)
  contenders = {
    name: Contender(model_config, train_config.replace(packing=length), batcher, steps)
    for name, (length, batcher) in batchers.items()
  }
  # One step per call, batch by batch, every contender in turn: a burst of load from
  # elsewhere hits a step of each alike, and each batch's median over rounds drops it.
  timings = common.interleaved_medians(
    {(name, i): c.on(i) for i in range(steps) for name, c in contenders.items()}, rounds
  )
  seconds = {
    name: {
      statistic: sum(timings[name, i][statistic] for i in range(steps))
      for statistic in ('median_s', 'min_s')
    }
    for name in contenders
  }
  rate = lambda name, statistic: sum(contenders[name].tokens) / seconds[name][statistic]
  for name, contender in contenders.items():
    # Also from each batch's fastest step: on a shared machine, the least disturbed.
    results[name].update(
      steps=steps,
      target_tokens=sum(contender.tokens),
      seconds_median_sum=seconds[name]['median_s'],
      seconds_min_sum=seconds[name]['min_s'],
      step_times_s=[timings[name, i]['times_s'] for i in range(steps)],
      target_tokens_per_s=rate(name, 'median_s'),
      speedup=rate(name, 'median_s') / rate('unpacked', 'median_s'),
      best_target_tokens_per_s=rate(name, 'min_s'),
      best_speedup=rate(name, 'min_s') / rate('unpacked', 'min_s'),
      timed_shapes=[list(shape) for shape in contender.shapes],
    )
  model = {name: getattr(model_config, name) for name in preset['model']}
  return {
    'pairs': len(corpus),
    'vocab_size': tokenizer.vocab_size,
    'model': model,
    'contenders': results,
  }


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument(
    '--data',
    type=Path,
    default=DEFAULT_DATA,
    help='Multi30k as <split>.<lang> files (default: %(default)s)',
  )
  parser.add_argument(
    '--row-lengths',
    default='32,64',
    help='packed row lengths to measure, comma-separated (default: %(default)s)',
  )
  parser.add_argument('--steps', type=int, default=12, help='batches per timed call')
  parser.add_argument('--rounds', type=int, default=5, help='interleaved timed rounds')
  parser.add_argument('--threads', type=int, default=None, help='cores to use (default: all)')
  parser.add_argument(
    '--vocab-size', type=int, default=None, help="BPE vocabulary (default: the multi30k preset's)"
  )
  parser.add_argument(
    '--first-preset',
    action='store_true',
    help='the first multi30k preset: 3+3 layers, d=256, 8,000 pieces '
    '(benchmarks/results/first_preset.json)',
  )
  parser.add_argument(
    '--out',
    type=Path,
    default=None,
    help='JSON file (default: results/packing.json with --first-preset, '
    'results/packing_preset.json without)',
  )
  args = parser.parse_args(argv)
  if not args.data.is_dir():
    print(f'benchmarks.packing: skipped, Multi30k not found at {args.data} (pass --data DIR)')
    return None
  args.out = args.out or common.RESULTS / (
    'packing.json' if args.first_preset else 'packing_preset.json'
  )
  row_lengths = [int(length) for length in args.row_lengths.split(',')]
  cores = common.pin_threads(args.threads)
  before = common.machine_info(len(cores))
  payload = {
    'machine': before,
    **measure(args.data, row_lengths, args.steps, args.rounds, args.vocab_size, args.first_preset),
  }
  payload['machine']['load_average_after'] = common.machine_info(len(cores))['load_average']
  for name, entry in payload['contenders'].items():
    print(
      f'{name:>10}: padding {entry["padding_share"]["target"]:.1%} target, '
      f'{entry["padding_share"]["source"]:.1%} source; {entry["batches_per_epoch"]} batches '
      f'per epoch; {entry["target_tokens_per_s"]:,.0f} real target tokens/s '
      f'({entry["speedup"]:.2f}x; fastest call {entry["best_speedup"]:.2f}x)'
    )
  path = common.write_json(args.out, payload)
  print(
    f'load average {before["load_average"]} before, '
    f'{payload["machine"]["load_average_after"]} after; wrote {path}'
  )
  return payload


if __name__ == '__main__':
  main()
