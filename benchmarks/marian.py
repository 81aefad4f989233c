"""Random Marian (OPUS-MT layout) directories, and decoding speed of one imported here vs transformers.

    python -m benchmarks.marian            # d=512, 6+6 layers, 58k vocabulary; a few minutes
    python -m benchmarks.marian --quick    # 2+2 layers, 8k vocabulary

`make_marian_directory(directory, ...)` writes what `huggingface-cli download
Helsinki-NLP/opus-mt-...` gives (config.json, model.safetensors, source.spm,
target.spm, vocab.json), from a `MarianMTModel` with random weights (and a random
final_logits_bias: the real models' are not zero either) saved by transformers'
`save_pretrained`, and sentencepiece models trained on a few sentences.
Notebook 04 and this benchmark build theirs with it (the tests with their own
copy, tests/support/marian_directory.py); nothing is downloaded. It needs torch, transformers and sentencepiece
(`pip install -e .[pretrained-test]`).

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
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks import common

# Text for the sentencepiece models: enough for a few hundred pieces.
SAMPLE_TEXT = (
    'The animal did not cross the street because it was too tired.',
    'A man rides a bicycle down the hill while two children watch.',
    'Das Tier überquerte die Straße nicht, weil es zu müde war.',
    'Ein Mann fährt mit dem Fahrrad den Hügel hinunter, zwei Kinder schauen zu.',
    'The quick brown fox jumps over the lazy dog near the river bank.',
    'Der schnelle braune Fuchs springt über den faulen Hund am Flussufer.',
    'Several people are sitting on a bench in the park, reading newspapers.',
    'Mehrere Leute sitzen auf einer Bank im Park und lesen Zeitungen.',
    'She sings a song about the sea, the wind and the stars at night.',
    'Sie singt ein Lied über das Meer, den Wind und die Sterne in der Nacht.',
)


@dataclasses.dataclass(frozen=True)
class MarianShape:
  """The dimensions of a random Marian model (MarianConfig's names)."""
  d_model: int = 32
  layers: int = 2
  heads: int = 4
  ffn_dim: int = 64
  vocab_size: int = 300        # filler pieces pad the sentencepiece ones up to this
  max_position_embeddings: int = 64
  share_encoder_decoder_embeddings: bool = True
  activation_function: str = 'swish'
  init_std: float = 0.3        # transformers' 0.02 leaves a tiny model's logits to the bias


BASE = MarianShape(d_model=512, layers=6, heads=8, ffn_dim=2048, vocab_size=58_101,
                   max_position_embeddings=512, init_std=0.02)


def _train_spm(texts, vocab_size: int):
  """A sentencepiece unigram model trained on `texts` in memory; returns its serialized bytes."""
  import sentencepiece as spm

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model,
                                 vocab_size=vocab_size, hard_vocab_limit=False,
                                 character_coverage=1.0, num_threads=1, minloglevel=2)
  return model.getvalue()


def _vocab(spm_models: list[bytes], size: int) -> dict[str, int]:
  """Marian's vocab.json: '</s>' 0, '<unk>' 1, the pieces of the spm models, fillers, '<pad>' last."""
  import sentencepiece as spm

  vocab = {'</s>': 0, '<unk>': 1}
  for serialized in spm_models:
    processor = spm.SentencePieceProcessor(model_proto=serialized)
    for piece_id in range(processor.get_piece_size()):
      if not (processor.is_control(piece_id) or processor.is_unknown(piece_id)):
        vocab.setdefault(processor.id_to_piece(piece_id), len(vocab))
  while len(vocab) < size - 1:
    vocab[f'▁filler{len(vocab)}'] = len(vocab)
  vocab['<pad>'] = len(vocab)
  return vocab


def make_marian_directory(directory: str | Path, shape: MarianShape = MarianShape(),
                          seed: int = 0) -> Path:
  """Writes a random Marian model and its tokenizer files into `directory`; returns it."""
  import torch
  from transformers import MarianConfig, MarianMTModel
  from transformers.utils import logging

  logging.disable_progress_bar()  # save_pretrained's bar: noise in tests and notebook outputs
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  source, target = _train_spm(SAMPLE_TEXT[0::2], 200), _train_spm(SAMPLE_TEXT[1::2], 200)
  (directory / 'source.spm').write_bytes(source)
  (directory / 'target.spm').write_bytes(target)
  vocab = _vocab([source, target], shape.vocab_size)
  (directory / 'vocab.json').write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
  pad = vocab['<pad>']
  config = MarianConfig(
      vocab_size=len(vocab), decoder_vocab_size=len(vocab), d_model=shape.d_model,
      encoder_layers=shape.layers, decoder_layers=shape.layers,
      encoder_attention_heads=shape.heads, decoder_attention_heads=shape.heads,
      encoder_ffn_dim=shape.ffn_dim, decoder_ffn_dim=shape.ffn_dim,
      activation_function=shape.activation_function,
      max_position_embeddings=shape.max_position_embeddings, scale_embedding=True,
      share_encoder_decoder_embeddings=shape.share_encoder_decoder_embeddings,
      tie_word_embeddings=True, pad_token_id=pad, decoder_start_token_id=pad, eos_token_id=0,
      forced_eos_token_id=0, bos_token_id=0, dropout=0.1, attention_dropout=0.0,
      activation_dropout=0.0, init_std=shape.init_std)
  torch.manual_seed(seed)
  model = MarianMTModel(config)
  with torch.no_grad():
    model.final_logits_bias.normal_(0.0, 0.3)
    model.final_logits_bias[0, 0] += 2.0  # EOS: a random model then ends its sentences
    # Random LayerNorm gains and biases, so that a mix-up of them shows in the logits.
    for name, parameter in model.named_parameters():
      if 'layer_norm' in name or name.endswith('.bias'):
        parameter.normal_(1.0 if name.endswith('weight') else 0.0, 0.2)
  model.save_pretrained(directory, safe_serialization=True)
  (directory / 'tokenizer_config.json').write_text(json.dumps(
      {'tokenizer_class': 'MarianTokenizer', 'separate_vocabs': False, 'model_max_length': 512}))
  return directory


# --- the benchmark ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setting:
  batch: int
  source_len: int
  new_tokens: int
  rounds: int
  shape: MarianShape


FULL = Setting(batch=8, source_len=16, new_tokens=32, rounds=5, shape=BASE)
QUICK = Setting(batch=4, source_len=16, new_tokens=16, rounds=3,
                shape=dataclasses.replace(BASE, layers=2, vocab_size=8000))
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
      'beam4': lambda: np.asarray(autoregressive.beam_search(model, params, src, beam_size=4,
                                                       max_len=n, min_len=n)[0])}
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
      out = model.generate(input_ids=src, attention_mask=torch.ones_like(src), num_beams=num_beams,
                           do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           forced_eos_token_id=None)
    if out.shape[1] != n + 1:  # the start token + n new ones
      raise RuntimeError(f'generate gave {out.shape[1] - 1} tokens, expected {n}')

  return common.interleaved_medians(
      {name: lambda beam_size=beam_size: run(beam_size) for name, beam_size in METHODS.items()},
      setting.rounds)


def _worker(args) -> int:
  common.pin_threads(args.threads)
  setting = QUICK if args.quick else FULL
  threads = len(os.sched_getaffinity(0))
  timings = (ours if args.worker == 'ours' else theirs)(args.directory, setting, threads)
  Path(args.out).write_text(json.dumps(timings))
  return 0


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog='python -m benchmarks.marian',
                                   description=__doc__.split('\n\n')[0])
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
    report = {'setting': dataclasses.asdict(setting), 'machine': common.machine_info(threads),
              'results': {}}
    for worker in ('ours', 'transformers'):
      out = Path(scratch) / f'{worker}.json'
      # Each framework in its own process: two in one process slow each other.
      subprocess.run([sys.executable, '-m', 'benchmarks.marian', '--worker', worker,
                      '--directory', str(directory), '--out', str(out),
                      '--threads', str(threads)] + ['--quick'] * args.quick, check=True)
      for method, timing in json.loads(out.read_text()).items():
        tokens = setting.batch * setting.new_tokens
        report['results'][f'{worker}/{method}'] = {**timing,
                                                   'tokens_per_s': tokens / timing['median_s']}
  for method in METHODS:
    report['results'][f'speedup/{method}'] = (report['results'][f'ours/{method}']['tokens_per_s']
                                              / report['results'][f'transformers/{method}']['tokens_per_s'])
  path = common.write_json(common.RESULTS / f'marian{"_quick" * args.quick}.json', report)
  print(format_report(report))
  print(f'written to {path}')
  return 0


def format_report(report: dict) -> str:
  setting, results = report['setting'], report['results']
  lines = [f"batch {setting['batch']}, {setting['source_len']} source tokens, "
           f"{setting['new_tokens']} new tokens, d={setting['shape']['d_model']}, "
           f"{setting['shape']['layers']}+{setting['shape']['layers']} layers, "
           f"vocabulary {setting['shape']['vocab_size']:,}",
           f"{'method':<8} {'ours tok/s':>11} {'transformers tok/s':>19} {'ratio':>6}"]
  for method in METHODS:
    lines.append(f"{method:<8} {results[f'ours/{method}']['tokens_per_s']:>11.1f} "
                 f"{results[f'transformers/{method}']['tokens_per_s']:>19.1f} "
                 f"{results[f'speedup/{method}']:>5.2f}x")
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
