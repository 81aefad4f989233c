"""The best validation checkpoint and early stopping (issue #50, item 4), and a run trained on
preprocessed text end to end: tokenizer, cache, validation, decoding (item 2)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.data.preprocessing import PreprocessingTokenizer
from flax_transformer.data.toy_task import number_translation
from flax_transformer.decode.methods import Greedy
from flax_transformer.decode.translator import Translator
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.loading import load_for_inference
from flax_transformer.train.best import BestCheckpoint, read_best
from flax_transformer.train.loop import train
from flax_transformer.train.setup import check_settings

MODEL = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=64, dropout_rate=0.1)
# A learning rate so small that Adam moves each parameter by at most ~1e-30, which no
# activation of this model notices in float32: the validation loss repeats exactly, so the
# first validation stays the best and patience 2 stops at the third.
# Checkpoints every 5 steps: the stop at step 6 is saved because it stops, not on the cadence.
FROZEN = TrainConfig(
  steps=20,
  max_tokens=256,
  warmup_steps=2,
  peak_lr=1e-30,
  log_every=2,
  eval_every=2,
  checkpoint_every=5,
  keep_checkpoints=3,
  patience=2,
)
# Lowercased, Moses-tokenized text; outputs detokenized.
DATA = DataConfig(
  source='toy', vocab_size=256, lowercase=True, pretokenize='moses', normalize_punctuation=True
)


@pytest.fixture(scope='module')
def numbers():
  return number_translation(num_train=200, num_validation=12, num_test=12)


@pytest.fixture(scope='module')
def stopped_run(tmp_path_factory, numbers):
  workdir = tmp_path_factory.mktemp('stopped')
  messages = []
  result = train(MODEL, FROZEN, DATA, workdir, dataset=numbers, print_fn=messages.append)
  return workdir, result, messages


def test_patience_stops_after_that_many_validations_without_improvement(stopped_run):
  workdir, result, messages = stopped_run
  # Validations at 2 (the best), 4 and 6 (no better): stopped at 6, saved there.
  assert int(result.state.step) == 6
  assert Checkpoints(workdir, read_only=True).steps() == [5, 6]
  assert any('step 6: stopping early, 2 validations without a better loss' in m for m in messages)
  lines = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  assert max(line['step'] for line in lines) == 6
  assert [line['step'] for line in lines if 'best_val_loss' in line] == [2]


def test_the_best_checkpoint_is_kept_decodable_with_its_score(stopped_run):
  workdir, _, _ = stopped_run
  best = read_best(workdir)
  assert (best.metric, best.step) == ('loss', 2)
  lines = [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]
  (validated,) = [line['val_loss'] for line in lines if line['step'] == 2 and 'val_loss' in line]
  assert best.value == pytest.approx(validated, rel=1e-12)
  config, params, tokenizer = load_for_inference(workdir / 'best')
  # Step 2's parameters; the learning rate moved none by more than ~1e-30 since.
  for kept, final in zip(
    jax.tree.leaves(jax.device_get(params)),
    jax.tree.leaves(jax.device_get(stopped_run[1].state.params)),
  ):
    np.testing.assert_allclose(kept, final, rtol=0, atol=1e-25)
  # The run's preprocessing comes with it.
  assert isinstance(tokenizer, PreprocessingTokenizer)


def test_a_resumed_run_that_stopped_early_trains_no_further(stopped_run, numbers):
  workdir, _, _ = stopped_run
  messages = []
  result = train(MODEL, FROZEN, DATA, workdir, dataset=numbers, print_fn=messages.append)
  assert int(result.state.step) == 6
  assert any('stopped early at step 6' in m for m in messages)
  # With more patience it goes on from the saved step, comparing with the recorded best.
  more = train(
    MODEL, FROZEN.replace(patience=3), DATA, workdir, dataset=numbers, print_fn=lambda m: None
  )
  # Validations at 4, 6 and 8 without a better loss: stopped at 8.
  assert int(more.state.step) == 8 and read_best(workdir).step == 2


def test_a_best_moved_away_half_way_is_recovered(stopped_run):
  workdir, _, _ = stopped_run
  os.replace(workdir / 'best', workdir / '.best.tmp')  # a crash after the old one was removed
  assert read_best(workdir).step == 2
  assert (workdir / 'best').is_dir() and not (workdir / '.best.tmp').exists()


def test_better_scores_replace_the_best_and_bleu_counts_upward(tmp_path, stopped_run):
  workdir, result, _ = stopped_run
  keeper = BestCheckpoint(workdir, FROZEN.replace(best_metric='bleu', bleu_every=4))
  assert keeper.best is None  # the recorded best is a loss: BLEU starts afresh
  params = jax.device_get(result.state.params)
  assert keeper.consider(4, 10.0, params) and not keeper.consider(8, 9.5, params)
  assert keeper.consider(12, 12.5, params)
  assert (read_best(workdir).step, read_best(workdir).value) == (12, 12.5)
  # Validations at 16 and 20 since the best at 12 (BLEU every 4): patience 2 is spent.
  assert keeper.validations_since_best(19) == 1 and keeper.exhausted(20)


def test_preprocessed_run_decodes_text_as_it_was_trained(stopped_run, numbers):
  workdir, result, _ = stopped_run
  translator = Translator.from_checkpoint(workdir)
  sources = list(numbers['test']['source'][:4])
  # What the model saw: the sources prepared, the outputs detokenized and lowercase.
  outputs = translator.translate(sources, Greedy())
  wrapped = translator.tokenizer
  assert wrapped.encode(sources) == wrapped.inner.encode(
    wrapped.preprocessing.prepare(sources, 'en')
  )
  assert all(text == text.lower() for text in outputs)
  assert json.loads((workdir / 'config.json').read_text())['data']['pretokenize'] == 'moses'
  assert np.isfinite(result.scores['val_loss'])


def test_patience_without_a_validation_split_is_refused(tmp_path, numbers):
  no_validation = numbers.copy()
  no_validation.pop('validation')
  with pytest.raises(ConfigError, match='train.patience reads validation scores') as error:
    train(MODEL, FROZEN, DATA, tmp_path / 'run', dataset=no_validation, print_fn=lambda m: None)
  assert '\n' not in str(error.value)


@pytest.mark.parametrize(
  'overrides,interval',
  [({'steps': 3, 'eval_every': 4}, 'train.eval_every'), ({'steps': 3}, 'train.bleu_every')],
)
def test_patience_that_no_validation_inside_the_steps_can_spend_is_refused(overrides, interval):
  config = FROZEN.replace(**overrides)
  if interval == 'train.bleu_every':
    config = config.replace(best_metric='bleu', bleu_every=4)
  with pytest.raises(
    ConfigError, match=rf'reaches none: lower {interval}, or set train.patience 0'
  ):
    check_settings(MODEL, config, DATA)
  check_settings(MODEL, config.replace(steps=4), DATA)  # one validation: it may count


def test_export_refuses_a_preprocessed_run(stopped_run, tmp_path):
  """A Marian export cannot lowercase or Moses-tokenize its input: refused in one line, writing
  nothing."""
  from flax_transformer.pretrained.export import ExportError
  from flax_transformer.run.export import export_run

  workdir, _, _ = stopped_run
  with pytest.raises(ExportError, match='trained on preprocessed text') as error:
    export_run(workdir / 'best', tmp_path / 'export')
  assert '\n' not in str(error.value) and 'lowercased' in str(error.value)
  assert not (tmp_path / 'export').exists()


def test_a_run_trained_lowercased_is_not_resumed_cased(stopped_run, numbers):
  """Its tokenizer and checkpoints were made from lowercased text: resuming with other
  preprocessing is refused in one line naming the setting, before any work."""
  from flax_transformer.run.directory import CheckpointError

  workdir, _, _ = stopped_run
  before = sorted(p.name for p in (workdir / 'checkpoints').iterdir())
  with pytest.raises(CheckpointError, match='data.lowercase') as error:
    train(
      MODEL,
      FROZEN,
      DATA.replace(lowercase=False),
      workdir,
      dataset=numbers,
      print_fn=lambda m: None,
    )
  assert '\n' not in str(error.value)
  assert sorted(p.name for p in (workdir / 'checkpoints').iterdir()) == before


def test_best_by_bleu_follows_the_validation_tokenized_bleu(tmp_path, numbers):
  """best_metric=bleu keeps the parameters of the highest validation tokenized BLEU, scored
  every bleu_every steps; its recorded value is the logged val_bleu_tok of that step."""
  config = FROZEN.replace(steps=4, patience=0, best_metric='bleu', bleu_every=2, eval_every=4)
  train(MODEL, config, DATA, tmp_path / 'run', dataset=numbers, print_fn=lambda m: None)
  best = read_best(tmp_path / 'run')
  lines = [
    json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()
  ]
  scored = {line['step']: line['val_bleu_tok'] for line in lines if 'val_bleu_tok' in line}
  assert sorted(scored) == [2, 4] and best.metric == 'bleu'
  # Equal scores do not replace the best: the first of the highest is kept.
  first_highest = min(step for step, value in scored.items() if value == max(scored.values()))
  assert best.step == first_highest and best.value == pytest.approx(scored[best.step], abs=1e-9)


def test_a_copied_best_trained_into_is_called_a_best_checkpoint_naming_the_copy(
  stopped_run, tmp_path
):
  import shutil

  from flax_transformer.run.directory import NotARun, check_workdir

  workdir, _, _ = stopped_run
  copy = tmp_path / 'my-best'
  shutil.copytree(workdir / 'best', copy)
  with pytest.raises(NotARun) as refused:
    check_workdir(copy)
  message = str(refused.value)
  step = json.loads((copy / 'config.json').read_text())['best']['step']  # earlier tests move it
  assert message.startswith(f'--workdir {copy} is a best checkpoint (step {step}) (its checkpoint')
  assert str(workdir) not in message and message.endswith('train in a new --workdir')
  # In its own run, the run it belongs to is named for resuming.
  with pytest.raises(NotARun, match=f'resume {workdir}'):
    check_workdir(workdir / 'best')
