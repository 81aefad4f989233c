"""The encoder against a reference checkout: the same encoded arrays (SHA-256), and its rate.

    git clone -q . /tmp/reference && git -C /tmp/reference checkout 0d48e0c   # the encoder before
    python -m benchmarks.make_standin --pairs 450000 --output /tmp/standin450k
    python -m benchmarks.encoding_gate --data /tmp/standin450k --reference /tmp/reference
    python -m benchmarks.encoding_gate --data ../shared/data/multi30k --reference /tmp/reference \
        --output benchmarks/results/encoding_gate_multi30k.json

A tokenizer is trained once on the training pairs (BPE, --vocab-size) and saved; then each
contender encodes train.en/train.de into a fresh corpus cache (`data.cache.load_or_encode`,
the path train.py takes), each in a process of its own, in interleaved rounds:

  reference  the checkout given by --reference (its `flax_transformer`, same command)
  plain      this checkout, every line through `tokenizers` (`Tokenizer(memo_words=0)`)
  memo       this checkout as train.py runs it: by words (`data.word_memo`)

Each reports the SHA-256 of every array it wrote (from the cache's manifest) and pairs/s
(encoding only, from the first block read to the manifest written). The gate holds when
every contender's digests equal the reference's: the same ids, lengths and kept rows. Exit
status 1 when it does not. Medians of --rounds rounds; writes benchmarks/results/
encoding_gate.json (or --output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, ROOT, machine_info, python_worker, write_json

CONTENDERS = ('reference', 'plain', 'memo')

# Run in each contender's process, with its checkout first on sys.path.
WORKER = """
import json, sys, time
from pathlib import Path
from flax_transformer.data import cache
from flax_transformer.tokenizer import Tokenizer
data, tokenizer_dir, cache_dir, memo = sys.argv[1:5]
backend = Tokenizer.load(tokenizer_dir)._backend
tokenizer = Tokenizer(backend) if memo == 'default' else Tokenizer(backend, memo_words=0)
source = cache.TextPairFiles(Path(data) / 'train.en', Path(data) / 'train.de')
source.fingerprint()  # hashing the text is not encoding
begin = time.perf_counter()
corpus = cache.load_or_encode(source, tokenizer, 'gate', 256, cache_dir, progress=False)
seconds = time.perf_counter() - begin
[directory] = [path for path in Path(cache_dir).iterdir() if not path.name.startswith('.')]
manifest = json.loads((directory / 'manifest.json').read_text())
print(json.dumps({'seconds': seconds, 'lines': source.num_lines, 'pairs': len(corpus),
                  'sha256': {name: array['sha256'] for name, array in manifest['arrays'].items()}}))
"""


def encode_in_process(checkout: Path, data: Path, tokenizer_dir: Path, memo: str) -> dict:
  with tempfile.TemporaryDirectory(prefix='encoding-gate-') as cache_dir:
    return python_worker(
      WORKER,
      [data, tokenizer_dir, cache_dir, memo],
      checkout,
      failed=f'encoding in {checkout} failed',
    )


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--data', type=Path, required=True, help='a directory with train.en/.de')
  parser.add_argument(
    '--reference', type=Path, required=True, help='a checkout of the encoder to compare with'
  )
  parser.add_argument('--vocab-size', type=int, default=37_000)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--output', type=Path, default=RESULTS / 'encoding_gate.json')
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  from flax_transformer.data.cache import TextPairFiles

  source = TextPairFiles(args.data / 'train.en', args.data / 'train.de')
  with tempfile.TemporaryDirectory(prefix='encoding-gate-tokenizer-') as tokenizer_dir:
    from flax_transformer.tokenizer import Tokenizer

    begin = time.perf_counter()
    sources, targets = source.sample_pairs(0)
    Tokenizer.train(sources + targets, args.vocab_size).save(tokenizer_dir)
    print(
      f'tokenizer: {args.vocab_size:,} pieces from {len(sources):,} pairs in '
      f'{time.perf_counter() - begin:.0f}s',
      flush=True,
    )
    del sources, targets
    runs = {name: [] for name in CONTENDERS}
    for round_index in range(args.rounds):
      order = CONTENDERS if round_index % 2 == 0 else CONTENDERS[::-1]
      for name in order:
        checkout = args.reference if name == 'reference' else ROOT
        runs[name].append(
          encode_in_process(
            checkout, args.data, Path(tokenizer_dir), 'none' if name == 'plain' else 'default'
          )
        )
        print(f'round {round_index + 1} {name}: {runs[name][-1]["seconds"]:.1f}s', flush=True)
  reference = runs['reference'][0]['sha256']
  results = {}
  for name, rounds in runs.items():
    seconds = statistics.median(run['seconds'] for run in rounds)
    results[name] = {
      'pairs_per_s': round(rounds[0]['lines'] / seconds),
      'seconds_median': round(seconds, 2),
      'seconds': [round(run['seconds'], 2) for run in rounds],
      'pairs_kept': rounds[0]['pairs'],
      'sha256': rounds[0]['sha256'],
      'same_arrays_as_reference': all(run['sha256'] == reference for run in rounds),
    }
  payload = {
    'benchmark': 'encoding_gate',
    'machine': machine_info(os.cpu_count()),
    'data': str(args.data),
    'lines': runs['memo'][0]['lines'],
    'vocab_size': args.vocab_size,
    'reference': str(args.reference),
    'reference_commit': subprocess.run(
      ['git', '-C', str(args.reference), 'rev-parse', 'HEAD'],
      capture_output=True,
      text=True,
      check=False,
    ).stdout.strip(),
    'rounds': args.rounds,
    'contenders': results,
    'memo_over_reference': round(
      results['reference']['seconds_median'] / results['memo']['seconds_median'], 2
    ),
    'memo_over_plain': round(
      results['plain']['seconds_median'] / results['memo']['seconds_median'], 2
    ),
    'load_average_at_end': list(os.getloadavg()),
  }
  print(
    json.dumps(
      {
        name: {k: v for k, v in result.items() if k != 'sha256'} for name, result in results.items()
      },
      indent=1,
    )
  )
  print(f'wrote {write_json(args.output, payload)}')
  if not all(result['same_arrays_as_reference'] for result in results.values()):
    raise SystemExit('the encoded arrays differ from the reference encoder')


if __name__ == '__main__':
  main()
