"""Decoding speed of a Marian model imported here vs transformers, on a random Marian directory.

    python -m benchmarks.marian            # d=512, 6+6 layers, 58k vocabulary; a few minutes
    python -m benchmarks.marian --quick    # 2+2 layers, 8k vocabulary

The directory comes from `make_marian_directory` (tests/support/marian_directory.py, the
Marian tests' fixture, which notebook 04 uses too): what `huggingface-cli download
Helsinki-NLP/opus-mt-...` gives, with random weights; nothing is downloaded. It needs
torch, transformers and sentencepiece (`pip install -e .[pretrained-test]`); run it from
the repository root.

The benchmark decodes one batch of random sources with the same weights in two
processes (two frameworks in one process slow each other): ours through
`flax_transformer.pretrained.marian.load_marian` and `autoregressive.greedy`/`beam_search`,
and transformers' `MarianMTModel.generate(num_beams=1 or 4)`, both forced to the
same number of new tokens (EOS banned until then, then the length limit).
Tokens/s count batch x new tokens; numbers are medians of timed calls after a
warm-up call. Results: benchmarks/results/marian[_quick].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common

# The random Marian directory is the Marian tests' fixture: one builder for tests, this
# benchmark and notebook 04 (run from the repository root, `tests.support` imports).
from tests.support.marian_directory import MarianShape, make_marian_directory

BASE = MarianShape(
  d_model=512,
  layers=6,
  heads=8,
  ffn_dim=2048,
  vocab_size=58_101,
  max_position_embeddings=512,
  init_std=0.02,
)


# --- the benchmark ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
  batch: int
  source_len: int
  new_tokens: int
  rounds: int
  shape: MarianShape


FULL = Setting(batch=8, source_len=16, new_tokens=32, rounds=5, shape=BASE)
QUICK = Setting(
  batch=4,
  source_len=16,
  new_tokens=16,
  rounds=3,
  shape=dataclasses.replace(BASE, layers=2, vocab_size=8000),
)
METHODS = {'greedy': 1, 'beam4': 4}


def _sources(setting: Setting, vocab_size: int, eos_id: int):
  """Random source ids `[B, S]`, EOS last, no PAD (ids 2 .. V-2: neither EOS, UNK nor PAD)."""
  import numpy as np

  rng = np.random.default_rng(0)
  src = rng.integers(2, vocab_size - 1, (setting.batch, setting.source_len))
  src[:, -1] = eos_id
  return src


def ours(directory: Path, setting: Setting, threads: int) -> dict:
  """Our decoders on the imported model: {method: timings}, in this process."""
  import numpy as np

  from flax_transformer.decode import autoregressive
  from flax_transformer.nn.build import build_model
  from flax_transformer.pretrained.marian import load_marian

  config, params, tokenizer = load_marian(directory)
  model, src = build_model(config), _sources(setting, config.vocab_size, tokenizer.eos_id)
  n = setting.new_tokens
  calls = {
    'greedy': lambda: np.asarray(autoregressive.greedy(model, params, src, max_len=n, min_len=n)),
    'beam4': lambda: np.asarray(
      autoregressive.beam_search(model, params, src, beam_size=4, max_len=n, min_len=n)[0]
    ),
  }
  return common.interleaved_medians(calls, setting.rounds)


def theirs(directory: Path, setting: Setting, threads: int) -> dict:
  """transformers' `generate` on the same weights: {method: timings}, in this process."""
  common.torch_threads(threads)
  import torch
  from transformers import MarianMTModel

  model = MarianMTModel.from_pretrained(directory).eval()
  src = torch.as_tensor(_sources(setting, model.config.vocab_size, model.config.eos_token_id))
  n = setting.new_tokens

  def run(num_beams):
    with torch.inference_mode():
      out = model.generate(
        input_ids=src,
        attention_mask=torch.ones_like(src),
        num_beams=num_beams,
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        forced_eos_token_id=None,
      )
    if out.shape[1] != n + 1:  # the start token + n new ones
      raise RuntimeError(f'generate gave {out.shape[1] - 1} tokens, expected {n}')

  return common.interleaved_medians(
    {name: lambda beam_size=beam_size: run(beam_size) for name, beam_size in METHODS.items()},
    setting.rounds,
  )


def _worker(args) -> int:
  common.pin_threads(args.threads)
  setting = QUICK if args.quick else FULL
  threads = len(os.sched_getaffinity(0))
  timings = (ours if args.worker == 'ours' else theirs)(args.directory, setting, threads)
  Path(args.out).write_text(json.dumps(timings))
  return 0


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.marian', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('--quick', action='store_true', help='2+2 layers, 8k vocabulary')
  parser.add_argument('--threads', type=int, help='cores to use (default: all)')
  parser.add_argument('--worker', choices=('ours', 'transformers'), help=argparse.SUPPRESS)
  parser.add_argument('--directory', type=Path, help=argparse.SUPPRESS)
  parser.add_argument('--out', help=argparse.SUPPRESS)
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if args.worker:
    return _worker(args)
  setting = QUICK if args.quick else FULL
  threads = len(common.pin_threads(args.threads))
  with tempfile.TemporaryDirectory() as scratch:
    directory = make_marian_directory(Path(scratch) / 'marian', setting.shape)
    report = {
      'setting': dataclasses.asdict(setting),
      'machine': common.machine_info(threads),
      'results': {},
    }
    for worker in ('ours', 'transformers'):
      out = Path(scratch) / f'{worker}.json'
      # Each framework in its own process: two in one process slow each other.
      subprocess.run(
        [
          sys.executable,
          '-m',
          'benchmarks.marian',
          '--worker',
          worker,
          '--directory',
          str(directory),
          '--out',
          str(out),
          '--threads',
          str(threads),
        ]
        + ['--quick'] * args.quick,
        check=True,
      )
      for method, timing in json.loads(out.read_text()).items():
        tokens = setting.batch * setting.new_tokens
        report['results'][f'{worker}/{method}'] = {
          **timing,
          'tokens_per_s': tokens / timing['median_s'],
        }
  for method in METHODS:
    report['results'][f'speedup/{method}'] = (
      report['results'][f'ours/{method}']['tokens_per_s']
      / report['results'][f'transformers/{method}']['tokens_per_s']
    )
  path = common.write_json(common.RESULTS / f'marian{"_quick" * args.quick}.json', report)
  print(format_report(report))
  print(f'written to {path}')
  return 0


def format_report(report: dict) -> str:
  setting, results = report['setting'], report['results']
  lines = [
    f'batch {setting["batch"]}, {setting["source_len"]} source tokens, '
    f'{setting["new_tokens"]} new tokens, d={setting["shape"]["d_model"]}, '
    f'{setting["shape"]["layers"]}+{setting["shape"]["layers"]} layers, '
    f'vocabulary {setting["shape"]["vocab_size"]:,}',
    f'{"method":<8} {"ours tok/s":>11} {"transformers tok/s":>19} {"ratio":>6}',
  ]
  for method in METHODS:
    lines.append(
      f'{method:<8} {results[f"ours/{method}"]["tokens_per_s"]:>11.1f} '
      f'{results[f"transformers/{method}"]["tokens_per_s"]:>19.1f} '
      f'{results[f"speedup/{method}"]:>5.2f}x'
    )
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
