"""The training loop: exact resume, the run directory it writes, skipping non-finite steps,
Multi30k. train.py, its command line, is tests/test_train_cli.py's."""

import json
import re

import datasets
import jax
import numpy as np
import pytest
import sacrebleu

from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.corpus import load_parallel
from flax_transformer.data.toy_task import number_translation
from flax_transformer.decode.methods import Greedy
from flax_transformer.decode.translator import Translator
from flax_transformer.run.directory import CheckpointError
from flax_transformer.run.loading import load_for_inference
from flax_transformer.train import transformer_schedule
from flax_transformer.train.evaluation import (
  bleu_left_out,
  describe_scores,
  tokenized_bleu,
  translation_scores,
)
from flax_transformer.train.loop import NonFiniteError, train
from flax_transformer.train.optimizer import ema_params
from support.runs import assert_trees_equal, finite, read_metrics, saved_steps, train_state

# Dropout stays on: exact resume must reproduce the step-folded dropout keys too. One layer
# each side and a vocabulary that puts every pair in the 8-token bucket keep compiles short.
MODEL = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=64, dropout_rate=0.1)
TRAIN = TrainConfig(
  steps=8,
  max_tokens=256,
  warmup_steps=4,
  lr_scale=0.5,
  log_every=2,
  eval_every=4,
  checkpoint_every=4,
)
DATA = DataConfig(source='toy', vocab_size=256)
TRAIN_KEYS = {
  'step',
  'loss',
  'ppl',
  'accuracy',
  'learning_rate',
  'grad_norm',
  'tokens_per_s',
  'elapsed_s',
}


@pytest.fixture(scope='module')
def numbers():
  return number_translation(num_train=400, num_validation=24, num_test=24)


def metrics_lines(workdir):
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def resumed_and_uninterrupted(tmp_path_factory, numbers):
  """Train 8 steps at once, and 4 steps then resumed to 8, on a train split of text files
  (so through the encoded-corpus cache and the batch prefetching of a real run)."""
  text = tmp_path_factory.mktemp('text')
  for column, lang in (('source', 'en'), ('target', 'de')):
    (text / f'train.{lang}').write_text('\n'.join(numbers['train'][column]) + '\n')
  data = DATA.replace(source=str(text))
  quiet = lambda message: None
  straight = tmp_path_factory.mktemp('straight')
  full = train(MODEL, TRAIN, data, straight, print_fn=quiet)
  stopped = tmp_path_factory.mktemp('stopped')
  first = []
  half = train(MODEL, TRAIN.replace(steps=4), data, stopped, print_fn=first.append)
  messages = []
  resumed = train(MODEL, TRAIN, data, stopped, print_fn=messages.append)
  return {
    'full': full,
    'half': half,
    'resumed': resumed,
    'messages': messages,
    'first': first,
    'straight': straight,
    'stopped': stopped,
    'data': data,
  }


def test_resumed_run_equals_uninterrupted_run_bit_for_bit(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  assert int(runs['half'].state.step) == 4
  assert int(runs['full'].state.step) == int(runs['resumed'].state.step) == 8
  assert any('resumed from' in m and m.endswith('checkpoints/4') for m in runs['messages'])
  # Encoded once, read back on resuming.
  assert sum(m.startswith('cache: encoded') for m in runs['first']) == 1
  assert sum(m.startswith('cache: hit') for m in runs['messages']) == 1
  full, resumed = jax.tree.leaves(runs['full'].state), jax.tree.leaves(runs['resumed'].state)
  assert len(full) == len(resumed)
  for a, b in zip(full, resumed):
    np.testing.assert_array_equal(a, b)
  # Not trivially equal: training moved the parameters away from step 4's.
  moved = [
    not np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(runs['half'].state.params), jax.tree.leaves(runs['full'].state.params)
    )
  ]
  assert all(moved)


def test_a_resume_inside_the_wsd_cooldown_equals_the_uninterrupted_run(
  resumed_and_uninterrupted, tmp_path
):
  """A schedule that ends is a function of train.steps: resumed from step 4, where its
  cooldown began, the run follows the same rates to the same state as the run that was never
  stopped; a resume that asks for another train.steps is refused."""
  import shutil

  data = resumed_and_uninterrupted['data']
  wsd = TRAIN.replace(
    schedule='wsd', cooldown_fraction=0.5, lr_scale=1.0, peak_lr=0.01, ema_decay=0.5
  )
  quiet = lambda message: None
  full = train(MODEL, wsd, data, tmp_path / 'straight', print_fn=quiet)
  shutil.copytree(tmp_path / 'straight', tmp_path / 'resumed')
  shutil.rmtree(tmp_path / 'resumed' / 'checkpoints' / '8')
  assert saved_steps(tmp_path / 'resumed') == [4]
  resumed = train(MODEL, wsd, data, tmp_path / 'resumed', print_fn=quiet)
  assert int(resumed.state.step) == 8
  assert_trees_equal(resumed.state, full.state)
  # The parameters' moving average is in the state, so it resumed exactly too; the run wrote it
  # out as WORKDIR/ema, decodable like an average, and scored it.
  average = ema_params(resumed.state.opt_state)
  assert_trees_equal(average, ema_params(full.state.opt_state))
  _, ema_loaded, _ = load_for_inference(tmp_path / 'resumed' / 'ema')
  assert_trees_equal(ema_loaded, average)
  assert json.loads((tmp_path / 'resumed' / 'ema' / 'config.json').read_text())['ema'] == {
    'decay': 0.5,
    'step': 8,
  }
  assert not all(
    np.allclose(a, b) for a, b in zip(jax.tree.leaves(average), jax.tree.leaves(full.state.params))
  )
  rates = [line['learning_rate'] for line in read_metrics(tmp_path / 'resumed') if 'loss' in line]
  # Logged every 2 steps: the rate of updates 2, 4, 6 and 8 (counts 1, 3, 5, 7) on wsd's curve.
  np.testing.assert_allclose(rates, [0.005, 0.01, 0.01 * (1 - 0.5**0.5), 0.0], rtol=1e-5, atol=1e-9)
  with pytest.raises(
    CheckpointError, match=r'train.steps: saved 8, requested 12 \(train.schedule=wsd'
  ):
    train(MODEL, wsd.replace(steps=12), data, tmp_path / 'resumed', print_fn=quiet)


def test_a_resume_with_bpe_dropout_equals_the_uninterrupted_run(
  resumed_and_uninterrupted, tmp_path
):
  """BPE-dropout's pieces are a function of (seed, epoch, pair): resumed from step 4 the run
  draws the same ones and ends in the same state; and they are not the plain pieces."""
  import shutil

  data = resumed_and_uninterrupted['data'].replace(bpe_dropout=0.2)
  messages = []
  full = train(MODEL, TRAIN, data, tmp_path / 'straight', print_fn=messages.append)
  assert any('BPE-dropout 0.2 (data.bpe_dropout)' in message for message in messages)
  shutil.copytree(tmp_path / 'straight', tmp_path / 'resumed')
  shutil.rmtree(tmp_path / 'resumed' / 'checkpoints' / '8')
  resumed = train(MODEL, TRAIN, data, tmp_path / 'resumed', print_fn=lambda message: None)
  assert int(resumed.state.step) == 8
  assert_trees_equal(resumed.state, full.state)
  plain = metrics_lines(resumed_and_uninterrupted['straight'])
  dropped = metrics_lines(tmp_path / 'straight')
  assert [line['loss'] for line in plain if 'loss' in line] != [
    line['loss'] for line in dropped if 'loss' in line
  ]


def test_resumed_metrics_log_reads_as_one_run(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  straight, stopped = metrics_lines(runs['straight']), metrics_lines(runs['stopped'])
  assert [line['step'] for line in stopped] == [2, 4, 6, 8]
  assert all(set(line) == TRAIN_KEYS for line in stopped)
  for a, b in zip(straight, stopped):
    assert a['loss'] == b['loss'] and a['grad_norm'] == b['grad_norm']
  # The resumed process's clock carries on from step 4's: training time of the whole run.
  clock = [line['elapsed_s'] for line in stopped]
  assert clock[0] > 0 and all(later > earlier for earlier, later in zip(clock, clock[1:]))


def test_resume_refuses_other_settings(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  with pytest.raises(CheckpointError, match='model.d_model: saved 32, requested 64'):
    train(
      MODEL.replace(d_model=64), TRAIN, runs['data'], runs['stopped'], print_fn=lambda message: None
    )


def test_full_run_writes_the_run_directory_and_reports(tmp_path, numbers):
  messages = []
  # With the parameters' moving average too: WORKDIR/ema is scored beside the average.
  result = train(
    MODEL,
    TRAIN.replace(ema_decay=0.9),
    DATA,
    tmp_path,
    dataset=numbers,
    average_last=2,
    print_fn=messages.append,
  )
  text = '\n'.join(messages)
  for name in (
    'config.json',
    'tokenizer.json',
    'metrics.jsonl',
    'average-last2/checkpoints/8',
    'ema/checkpoints/8',
  ):
    assert (tmp_path / name).exists(), name
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['4', '8']
  lines = metrics_lines(tmp_path)
  assert [line['step'] for line in lines if 'loss' in line] == [2, 4, 6, 8]
  assert [line['step'] for line in lines if 'val_loss' in line] == [4, 8]
  (final,) = [line for line in lines if 'bleu' in line]
  (averaged,) = [line for line in lines if 'avg_bleu' in line]
  (moving,) = [line for line in lines if 'ema_bleu' in line]
  assert final['step'] == averaged['step'] == moving['step'] == 8
  final.update(averaged)
  final.update(moving)
  # The scores are those of the test split decoded again, greedily, from the saved run and
  # from its average, and scored here.
  sources, references = list(numbers['test']['source']), list(numbers['test']['target'])
  for prefix, workdir in (
    ('', tmp_path),
    ('avg_', tmp_path / 'average-last2'),
    ('ema_', tmp_path / 'ema'),
  ):
    hypotheses = Translator.from_checkpoint(workdir).translate(sources, Greedy())
    assert final[f'{prefix}exact_match'] == np.mean(
      [h == r for h, r in zip(hypotheses, references)]
    )
    assert final[f'{prefix}chrf'] == pytest.approx(
      sacrebleu.corpus_chrf(hypotheses, [references]).score, abs=1e-9
    )
    assert final[f'{prefix}bleu'] == pytest.approx(
      sacrebleu.corpus_bleu(hypotheses, [references]).score, abs=1e-9
    )
  # Single-word references: BLEU is left out, saying why; chrF and exact match report.
  assert (
    'test, greedy decoding of 24 sentences: chrF' in text
    and '(BLEU left out: the references are single words' in text
  )
  assert 'nrefs:1|case:mixed|eff:no|tok:13a' in text  # the sacreBLEU signature
  assert text.count('reference: ') == 5
  assert (
    result.scores['val_loss'] > 0 and result.model_config.vocab_size == result.tokenizer.vocab_size
  )
  config, params, tokenizer = load_for_inference(tmp_path)
  assert config == result.model_config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.state.params)):
    np.testing.assert_array_equal(a, b)


def test_translation_scores_are_sacrebleus_and_the_share_of_exact_matches():
  # The full run above decodes only empty strings after 8 steps; here the outputs are known.
  references = [
    'ein Hund läuft über die Wiese',
    'zwei Katzen schlafen auf dem Sofa',
    'der alte Mann liest eine Zeitung',
    'ein Kind spielt im Garten',
  ]
  hypotheses = [
    'ein Hund läuft über die Wiese',
    'zwei Hunde schlafen auf dem Sofa',
    'der alte Mann liest eine Zeitung',
    'ein Kind spielt',
  ]

  class KnownOutputs:
    def translate(self, sentences, method, batch_size, on_batch=None):
      return [hypotheses[int(sentence)] for sentence in sentences]

  split = datasets.Dataset.from_dict({'source': ['0', '1', '2', '3'], 'target': references})
  values, report = translation_scores(KnownOutputs(), split, Greedy())
  assert values['exact_match'] == 0.5
  assert values['bleu'] == pytest.approx(sacrebleu.corpus_bleu(hypotheses, [references]).score)
  assert values['chrf'] == pytest.approx(sacrebleu.corpus_chrf(hypotheses, [references]).score)
  assert 0 < values['bleu'] < 100 and 0 < values['chrf'] < 100
  assert (
    'reference: zwei Katzen schlafen auf dem Sofa\n  output:    zwei Hunde schlafen auf dem Sofa'
  ) in report['samples']
  assert report['bleu_left_out'] == ''
  assert values['bleu_lc'] == pytest.approx(
    sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True).score
  )
  assert describe_scores(values, report) == (
    f'BLEU {values["bleu"]:.2f}, lowercased {values["bleu_lc"]:.2f}, chrF {values["chrf"]:.2f}, '
    'exact match 50.0%'
  )
  # With the target language, tokenized BLEU too (no lang given here: none).
  assert 'bleu_tok' not in values
  tokenized, _ = translation_scores(KnownOutputs(), split, Greedy(), lang='de')
  assert tokenized['bleu_tok'] == pytest.approx(
    tokenized_bleu(hypotheses, references, 'de')[0].score
  )
  assert 'tokenized BLEU' in describe_scores(tokenized, report)


@pytest.mark.parametrize(
  'references, left_out',
  [
    (['einhunderteins', 'zweiundvierzig'], 'the references are single words'),
    (['ein Hund', 'zwei kleine Katzen'], 'the references are at most 3 words'),
    (['ein Hund.', 'zwei Katzen'], 'the references are at most 3 words'),  # '.' is a token
    (['ein Hund läuft schnell', 'zwei'], ''),  # one 4-gram is enough
    (['ein Hund läuft.', 'zwei'], ''),
  ],
)
def test_bleu_is_left_out_where_no_reference_has_a_4_gram(references, left_out):
  values = {
    'bleu': sacrebleu.corpus_bleu(references, [references]).score,
    'chrf': 100.0,
    'exact_match': 1.0,
  }
  report = {'bleu_left_out': bleu_left_out(references, sacrebleu.metrics.BLEU().tokenizer)}
  line = describe_scores(values, report)
  if left_out:
    # Even a perfect output scores BLEU 0 here: that is what the line must not show.
    assert values['bleu'] == 0 and left_out in report['bleu_left_out']
    assert (
      line.startswith('chrF 100.00, exact match 100.0% (BLEU left out: ') and 'BLEU 0' not in line
    )
  else:
    assert values['bleu'] == pytest.approx(100) and line.startswith('BLEU 100.00, chrF 100.00')


# Batches holding a token id outside the vocabulary, whose embedding lookup (`jnp.take`
# fills out-of-range rows with NaN) make that one step's loss NaN, as a corrupt batch would.
def test_skip_nonfinite_goes_on_after_a_bad_batch_and_stops_past_its_bound(tmp_path, monkeypatch):
  corrupt = {2, 4}  # batch indices: steps 3 and 5
  original = Batcher.local_batch_at

  def local_batch_at(self, step, index, count):
    batch = original(self, step, index, count)
    if step in corrupt:
      src = batch.src.copy()
      src[0, 0] = 10**6  # outside any vocabulary
      batch = batch.replace(src=src)
    return batch

  monkeypatch.setattr(Batcher, 'local_batch_at', local_batch_at)
  dataset = datasets.DatasetDict(
    {'train': number_translation(num_train=200, num_validation=1, num_test=1)['train']}
  )
  model = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=16)
  config = TrainConfig(steps=6, max_tokens=256, warmup_steps=4, log_every=1, checkpoint_every=1)
  messages = []
  with pytest.raises(NonFiniteError) as error:
    train(
      model,
      config,
      DataConfig(vocab_size=256),
      tmp_path,
      dataset=dataset,
      skip_nonfinite=1,
      print_fn=messages.append,
    )
  assert error.value.step == 5
  assert re.fullmatch(
    r'step 5: the loss or the gradient is not finite \(loss sum nan, gradient norm nan\); its '
    r'update was not applied; 2 such steps \(3, 5\), more than --skip-nonfinite=1 allows\. '
    + re.escape(
      f'Training stopped; the last checkpoint, {tmp_path}/checkpoints/4, holds the '
      'last good parameters.'
    )
    + ' .*',
    str(error.value),
  )
  assert any(
    m.startswith('step 3: the loss or the gradient is not finite')
    and m.endswith('skipped (1 of at most 1, --skip-nonfinite)')
    for m in messages
  )
  # Step 3 applied no update: its checkpoint holds step 2's parameters and Adam moments.
  assert saved_steps(tmp_path) == [1, 2, 3, 4]
  two, three, four = (train_state(tmp_path, step) for step in (2, 3, 4))
  assert int(three.step) == 3
  assert_trees_equal((three.params, three.opt_state), (two.params, two.opt_state))
  # ... and step 4 trained on from there.
  assert finite(four) and not np.array_equal(
    jax.tree.leaves(four.params)[0], jax.tree.leaves(three.params)[0]
  )
  lines = {line['step']: line for line in read_metrics(tmp_path)}
  assert lines[3]['nonfinite_steps'] == 1 and 'loss' not in lines[3]
  assert np.isfinite(lines[4]['loss']) and 'nonfinite_steps' not in lines[4]
  # The logged rate is the one the update used: the schedule at the optimizer's count of
  # applied updates (step 4 is the third), not at the step.
  schedule = transformer_schedule(model.d_model, config.warmup_steps, config.lr_scale)
  for step, updates_before in ((2, 1), (4, 2)):
    np.testing.assert_allclose(
      lines[step]['learning_rate'], float(schedule(updates_before)), rtol=1e-6
    )
  assert not np.isclose(lines[4]['learning_rate'], float(schedule(3)), rtol=1e-3)


@pytest.mark.filterwarnings('ignore:source length .* output capped')  # long test sentences
def test_short_train_on_multi30k(tmp_path, multi30k_dir):
  multi30k = load_parallel(str(multi30k_dir), 'en', 'de')
  # The whole training split (tokenizer and batches); 16 validation and 16 test sentences.
  subset = datasets.DatasetDict(
    {
      'train': multi30k['train'],
      'validation': multi30k['validation'].select(range(16)),
      'test': multi30k['test'].select(range(16)),
    }
  )
  messages = []
  # Four steps: enough to learn the frequent words; each batch shape compiles once, and
  # Multi30k's buckets give several shapes.
  steps = 4
  result = train(
    MODEL,
    TRAIN.replace(steps=steps, max_tokens=512, log_every=1, eval_every=steps),
    DataConfig(source=str(multi30k_dir), vocab_size=1000),
    tmp_path,
    dataset=subset,
    print_fn=messages.append,
  )
  text = '\n'.join(messages)
  assert 'train: 29,000 pairs' in text
  vocab = result.tokenizer.vocab_size
  assert vocab == 1000 and int(result.state.step) == steps
  lines = metrics_lines(tmp_path)
  losses = [line['loss'] for line in lines if 'loss' in line]
  # From a random start (about uniform, or worse) to clearly below uniform prediction: after 4
  # steps the training loss had dropped by 0.9 nats, validation perplexity was 448 of 1000.
  assert len(losses) == steps and losses[-1] < losses[0] - 0.5, losses
  (validation,) = [line for line in lines if 'val_ppl' in line]
  assert validation['val_ppl'] < 0.6 * vocab, validation
  assert 'test, greedy decoding of 16 sentences' in text
