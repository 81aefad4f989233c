"""How far transformers and CTranslate2 are from the run an export came from.

    python -m benchmarks.export_check                       # the toy run and a short Multi30k run
    python -m benchmarks.export_check --run runs/m30k --sentences 200

For each run: export it (`pretrained.export`), then on the first N validation
sources (the toy task's own, or Multi30k's val.en) teacher-force our greedy output
through our model and through transformers' MarianMTModel and report the largest
logit difference over the tokens a search may output, beside the largest logit;
then the same with our model's LayerNorm epsilon set to transformers' 1e-5 (what
is left is float32 arithmetic). Greedy strings: transformers' `generate` and
CTranslate2's `translate_batch(beam_size=1)`, each sentence with decode.py's cap,
against decode.py's. transformers 5 removed `pipeline('translation')`; with
`--pipeline-python PY`, a python with transformers < 5 and torch (`python -m venv V
&& V/bin/pip install torch==2.13.0 'transformers==4.57.*' sentencepiece safetensors`)
runs it too, greedy (`num_beams=1`: that pipeline's default is beam 4).
Results: benchmarks/results/export.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
MULTI30K = REPO.parent / 'shared' / 'data' / 'multi30k'


PIPELINE = """
import json, sys
from transformers import pipeline
data = json.load(open(sys.argv[2]))
translate = pipeline('translation', model=sys.argv[1], device='cpu')
out = [translate(sentence, num_beams=1, max_new_tokens=budget)[0]['translation_text']
       for sentence, budget in zip(data['sentences'], data['budgets'])]
print(json.dumps({'equal': sum(a == b for a, b in zip(out, data['greedy'])),
                  'transformers': __import__('transformers').__version__}))
"""


def pipeline_check(
  python: str, directory: Path, sentences, greedy, budgets: list[int], scratch: Path
) -> dict:
  """pipeline('translation', num_beams=1) under `python` (transformers < 5), each sentence
  with decode.py's cap: how many strings equal ours."""
  import subprocess

  data = scratch / 'greedy.json'
  data.write_text(json.dumps({'sentences': sentences, 'greedy': greedy, 'budgets': budgets}))
  result = subprocess.run(
    [python, '-c', PIPELINE, str(directory), str(data)], capture_output=True, text=True, check=True
  )
  return json.loads(result.stdout.strip().splitlines()[-1])


def compare(
  workdir: Path, sentences: list[str], scratch: Path, pipeline_python: str | None = None
) -> dict:
  import ctranslate2
  import torch
  import transformers

  from flax_transformer.decode.methods import EXTRA_OUTPUT_TOKENS, Greedy
  from flax_transformer.decode.translator import Translator
  from flax_transformer.nn.model import Transformer
  from flax_transformer.pretrained import export
  from flax_transformer.run.export import export_run
  from flax_transformer.run.loading import load_for_inference

  config, params, tokenizer = load_for_inference(workdir)
  greedy = Translator(config, params, tokenizer).translate(sentences, Greedy())
  directory = export_run(workdir, scratch / 'marian')
  order = export.vocabulary_order(config.vocab_size, config.pad_id)
  pad = lambda rows, v: np.array([r + [v] * (max(map(len, rows)) - len(r)) for r in rows], np.int32)
  sources = [row[: config.max_len - 1] + [config.eos_id] for row in tokenizer.encode(sentences)]
  targets = [(row + [config.eos_id])[: config.max_len] for row in tokenizer.encode(greedy)]
  tgt_in = pad([[config.bos_id] + row[:-1] for row in targets], config.pad_id)
  model = transformers.MarianMTModel.from_pretrained(directory).eval()
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
  start = model.config.decoder_start_token_id
  with torch.no_grad():
    theirs = model(
      **hf_tokenizer(sentences, return_tensors='pt', padding=True),
      decoder_input_ids=torch.tensor(
        pad([[start] + [int(order[i]) for i in r[:-1]] for r in targets], start)
      ),
    ).logits.numpy()[..., order]
  allowed = np.ones(config.vocab_size, bool)
  allowed[[config.pad_id, config.bos_id]] = False
  report = {
    'run': str(workdir),
    'sentences': len(sentences),
    'layer_norm_epsilon': config.layer_norm_epsilon,
  }
  for label, epsilon in (('logits', config.layer_norm_epsilon), ('logits_at_epsilon_1e-5', 1e-5)):
    ours = np.asarray(
      Transformer(config.replace(layer_norm_epsilon=epsilon)).apply(
        {'params': params}, pad(sources, config.pad_id), tgt_in
      )
    )
    rows = [
      (ours[b, : len(t)][:, allowed], theirs[b, : len(t)][:, allowed])
      for b, t in enumerate(targets)
    ]
    report[label] = {
      'max_abs_difference': float(max(np.abs(a - b).max() for a, b in rows)),
      'max_abs_logit': float(max(np.abs(a).max() for a, _ in rows)),
    }
  budget = lambda n: min(n + EXTRA_OUTPUT_TOKENS, config.max_len)
  with torch.no_grad():
    generated = [
      hf_tokenizer.decode(
        model.generate(**hf_tokenizer([s], return_tensors='pt'), max_new_tokens=budget(len(src)))[
          0
        ],
        skip_special_tokens=True,
      )
      for s, src in zip(sentences, sources)
    ]
  converted = ctranslate2.converters.TransformersConverter(str(directory)).convert(
    str(scratch / 'ct2')
  )
  translator = ctranslate2.Translator(converted, device='cpu')
  ct2 = []
  for sentence in sentences:
    tokens = hf_tokenizer.convert_ids_to_tokens(hf_tokenizer.encode(sentence))
    (result,) = translator.translate_batch(
      [tokens], beam_size=1, max_decoding_length=budget(len(tokens))
    )
    ct2.append(
      hf_tokenizer.decode(
        hf_tokenizer.convert_tokens_to_ids(result.hypotheses[0]), skip_special_tokens=True
      )
    )
  report['greedy_equal'] = {
    'transformers': sum(a == b for a, b in zip(generated, greedy)),
    'ctranslate2': sum(a == b for a, b in zip(ct2, greedy)),
  }
  if pipeline_python:
    report['pipeline_translation'] = pipeline_check(
      pipeline_python, directory, sentences, greedy, [budget(len(s)) for s in sources], scratch
    )
  return report


def default_runs(scratch: Path) -> list[tuple[Path, list[str]]]:
  """The toy run (`python train.py`) and a short Multi30k run, as tests/test_export.py makes them."""
  from flax_transformer.cli import train as train_cli
  from flax_transformer.data.toy_task import number_translation

  toy = scratch / 'toy'
  if train_cli.main(['--workdir', str(toy)]) != 0:
    raise SystemExit('the toy run failed')
  runs = [(toy, number_translation()['validation']['source'][:20])]
  if MULTI30K.is_dir():
    data = scratch / 'm30k-data'
    data.mkdir()
    for stem, lines in {'train': 3000, 'val': 20, 'test_2016_flickr': 20}.items():
      for lang in ('en', 'de'):
        text = (MULTI30K / f'{stem}.{lang}').read_text(encoding='utf-8').splitlines()[:lines]
        (data / f'{stem}.{lang}').write_text('\n'.join(text) + '\n', encoding='utf-8')
    m30k = scratch / 'm30k'
    options = [
      '--data',
      str(data),
      '--data.test_split=test_2016_flickr',
      '--data.vocab_size=2000',
      '--model.d_model=64',
      '--model.num_heads=4',
      '--model.num_encoder_layers=2',
      '--model.num_decoder_layers=2',
      '--model.d_ff=128',
      '--model.max_len=64',
      '--train.warmup_steps=40',
      '--train.max_tokens=1024',
      '--steps=150',
      '--workdir',
      str(m30k),
    ]
    if train_cli.main(options) != 0:
      raise SystemExit('the Multi30k run failed')
    runs.append((m30k, (data / 'val.en').read_text(encoding='utf-8').splitlines()[:20]))
  return runs


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.export_check', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('--run', action='append', type=Path, help='a run directory (repeatable)')
  parser.add_argument('--sentences', type=int, default=20, help='validation sources per run')
  parser.add_argument(
    '--pipeline-python',
    help="a python with transformers < 5 and torch, to run pipeline('translation') too",
  )
  parser.add_argument(
    '--source',
    type=Path,
    help="sources, one per line (default: the run's validation split, or Multi30k val.en)",
  )
  args = parser.parse_args(argv)
  with tempfile.TemporaryDirectory() as scratch:
    scratch = Path(scratch)
    if args.run:
      text = (args.source or MULTI30K / 'val.en').read_text(encoding='utf-8').splitlines()
      runs = [(run, text[: args.sentences]) for run in args.run]
    else:
      runs = default_runs(scratch)
    reports = []
    for index, (run, sentences) in enumerate(runs):
      (scratch / f'out{index}').mkdir()
      reports.append(compare(run, sentences, scratch / f'out{index}', args.pipeline_python))
      print(json.dumps(reports[-1]), file=sys.stderr)
  path = common.write_json(
    REPO / 'benchmarks' / 'results' / 'export.json',
    {'machine': common.machine_info(os.cpu_count()), 'runs': reports},
  )
  print(f'wrote {path}')
  return 0


if __name__ == '__main__':
  sys.exit(main())
