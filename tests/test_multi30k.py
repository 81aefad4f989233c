"""The Multi30k recipe: the preset end to end on the real corpus, and its evaluation tools."""

import json
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest

from benchmarks import multi30k
from flax_transformer.config import run_preset
from flax_transformer.data import load_parallel
from flax_transformer.model import count_params
from flax_transformer.training import train

MULTI30K = Path(__file__).resolve().parents[2] / 'shared' / 'data' / 'multi30k'


@pytest.mark.skipif(not MULTI30K.is_dir(), reason=f'Multi30k not found at {MULTI30K}')
@pytest.mark.filterwarnings('ignore:source length .* output capped')
def test_preset_trains_on_multi30k(tmp_path):
  model_config, train_config, data_config = run_preset('multi30k')
  corpus = load_parallel(str(MULTI30K), data_config.src_lang, data_config.tgt_lang)
  # The preset's tokenizer, batches and model on the whole training split; 3 steps, and
  # 16 sentences each to validate on and decode (the full splits take minutes untrained).
  subset = datasets.DatasetDict({'train': corpus['train'],
                                 'validation': corpus['validation'].select(range(16)),
                                 'test': corpus['test'].select(range(16))})
  messages = []
  result = train(model_config, train_config.replace(steps=3, log_every=1, eval_every=3,
                                                    bleu_every=0, checkpoint_every=3),
                 data_config.replace(source=str(MULTI30K)), tmp_path, dataset=subset,
                 print_fn=messages.append)
  text = '\n'.join(messages)
  assert 'train: 29,000 pairs' in text
  assert result.tokenizer.vocab_size == data_config.vocab_size == 8000
  assert 7_000_000 < count_params(result.state.params) < 8_000_000
  assert int(result.state.step) == 3
  log = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  losses = [m['loss'] for m in log if 'loss' in m]
  # Untrained: about log(8000) = 9.0 nats per token, label smoothing included.
  assert len(losses) == 3 and all(7.0 < loss < 11.0 for loss in losses)
  assert any('val_loss' in m for m in log)
  assert 'test, greedy decoding of 16 sentences' in text


def test_score_lowercases_only_the_lowercased_variant():
  hypotheses = ['Ein Mann fährt mit dem Fahrrad eine Straße entlang .']
  references = ['ein mann fährt mit dem fahrrad eine straße entlang .']
  result = multi30k.score(hypotheses, references)
  assert result['bleu_lc'] == pytest.approx(100.0)
  # Cased, only 'fährt mit dem' + 'eine' + '.' match: far below.
  assert result['bleu'] < 50.0
  assert 'lc' in result['signatures']['bleu_lc'] and 'mixed' in result['signatures']['bleu']


def test_plot_writes_a_small_png(tmp_path):
  lines = []
  for step in range(50, 1001, 50):
    lines.append({'step': step, 'loss': 8.0 / np.log(step), 'elapsed_s': 1.4 * step})
    if step % 500 == 0:
      lines.append({'step': step, 'val_loss': 7.0 / np.log(step)})
    if step % 1000 == 0:
      lines.append({'step': step, 'val_bleu': 30.0})
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(m) + '\n' for m in lines))
  output = tmp_path / 'curves.png'
  multi30k.plot(SimpleNamespace(workdir=str(tmp_path), output=str(output), title=None))
  assert output.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert output.stat().st_size < 200 * 1024
