"""The non-autoregressive (cmlm) model wired into training, decoding and distillation.

* The cmlm training step on 2 simulated devices equals 1 device (a subprocess,
  as tests/test_multidevice.py), and its loss falls on a tiny copy task.
* train.py --objective cmlm writes a run directory that decode.py --method nat
  reads; resume and checkpoint averaging work as for the autoregressive model.
* Methods and model kinds that do not belong together are refused by name.
* python -m flax_transformer.distill writes the teacher's beam translations as
  the training targets and copies the other splits byte for byte.
"""

import jax
import numpy as np
import pytest

from flax_transformer import distill
from flax_transformer.checkpoint import Checkpoints, write_config
from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.data import load_parallel
from flax_transformer.model import Transformer
from flax_transformer.nat import CMLMTransformer
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train_step import (DataParallel, create_train_state, length_metrics,
                                         make_optimizer, make_parallel_eval, make_parallel_step,
                                         token_metrics)
from flax_transformer.translate import Search, Translator
from support.copy_task import PAD, copy_batch
from support.device_workers import run_values, run_worker
from support.script_calls import call, error_line

# A random or barely trained model's translations run to the output budget, which max_len caps.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')


# --- the training step ------------------------------------------------------------------

WORKER = r'''
import sys
import jax
import numpy as np
from flax import traverse_util
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nat import CMLMTransformer
from flax_transformer.train_step import (DataParallel, create_train_state, make_optimizer,
                                         make_parallel_eval, make_parallel_step)
from support.copy_task import copy_batch

out, steps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
assert jax.device_count() == 2, jax.devices()
config = ModelConfig.tiny(kind='cmlm', num_encoder_layers=1, num_decoder_layers=1,
                          dropout_rate=0.0, max_length_offset=4)
# adam_eps=1: see tests/test_multidevice.py. EOS fill at 0.5 so that some rows are filled.
train_config = TrainConfig(steps=steps, warmup_steps=4, lr_scale=4.0, adam_eps=1.0,
                           eos_fill_rate=0.5)
model = CMLMTransformer(config)
optimizer = make_optimizer(train_config, config)
initial = jax.device_get(create_train_state(model, optimizer, seed=0))
results = {}
for run in runs:
  mode, count = run.split('-')
  parallel = DataParallel(jax.devices()[:int(count)], mode=mode)
  step = make_parallel_step(model, optimizer, train_config, parallel)
  evaluate = make_parallel_eval(model, train_config, parallel)
  state = parallel.replicate(initial)
  for index in range(steps):
    batch = copy_batch(np.random.default_rng(index), 8, 12, config.vocab_size)
    state, metrics = step(state, parallel.shard_batch(batch))
    for name, value in parallel.unreplicate(metrics).items():
      results[f'{run}/{name}/{index}'] = value
  sums = parallel.unreplicate(evaluate(state.params, parallel.shard_batch(batch)))
  results.update({f'{run}/eval_{name}/0': value for name, value in sums.items()})
  params = traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/')
  results.update({f'{run}/params/{name}': value for name, value in params.items()})
np.savez(out, **results)
'''
STEPS = 3
# pmap's equality with shard_map is tests/test_multidevice.py's; the cmlm step adds no mode logic.
RUNS = ('shard_map-1', 'shard_map-2')


@pytest.fixture(scope='module')
def device_runs(tmp_path_factory):
  out = tmp_path_factory.mktemp('nat_devices') / 'runs.npz'
  return run_worker(WORKER, out, [STEPS, *RUNS], device_count=2, backend_optimization=False)


@pytest.mark.parametrize('run', RUNS[1:])
def test_cmlm_step_on_two_devices_equals_one_device(device_runs, run):
  """Same masks (keyed by the row's place in the global batch), same global normalisation:
  the metrics to 1e-6 and the parameters to 1e-5 relative, as tests/test_multidevice.py."""
  one = 'shard_map-1'
  for kind in ('tokens', 'sentences', 'target_tokens', 'length_correct', 'correct'):
    assert run_values(device_runs, run, kind) == run_values(device_runs, one, kind), kind
  for kind in ('loss_sum', 'length_loss_sum', 'grad_norm', 'eval_loss_sum',
               'eval_length_loss_sum'):
    reference = run_values(device_runs, one, kind)
    for index, value in run_values(device_runs, run, kind).items():
      np.testing.assert_allclose(value, reference[index], rtol=1e-5, err_msg=f'{kind} {index}')
  reference = run_values(device_runs, one, 'params')
  for name, value in run_values(device_runs, run, 'params').items():
    np.testing.assert_allclose(value, reference[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_cmlm_step_metrics_count_masked_tokens_and_real_sentences(device_runs):
  one = 'shard_map-1'
  for index in map(str, range(STEPS)):
    batch = copy_batch(np.random.default_rng(int(index)), 8, 12, 64)
    real_rows = int((batch.tgt_out != PAD).any(axis=1).sum())
    assert run_values(device_runs, one, 'sentences')[index] == real_rows == 7
    assert run_values(device_runs, one, 'target_tokens')[index] == (batch.tgt_out != PAD).sum()
    # At least one masked token per real row; EOS-filled rows may add up to the batch width.
    masked = run_values(device_runs, one, 'tokens')[index]
    assert real_rows <= masked <= real_rows * batch.tgt_out.shape[1]
  # Different steps draw different masks.
  assert len({float(v) for v in run_values(device_runs, one, 'tokens').values()}) > 1


@pytest.fixture(scope='module')
def copy_task_training():
  """60 steps of the tiny cmlm model on 4 fixed copy batches, on one device."""
  config = ModelConfig.tiny(kind='cmlm', num_encoder_layers=1, num_decoder_layers=1,
                            dropout_rate=0.0, max_length_offset=4, vocab_size=16)
  train_config = TrainConfig(warmup_steps=20)
  model = CMLMTransformer(config)
  optimizer = make_optimizer(train_config, config)
  parallel = DataParallel(jax.devices()[:1])
  step = make_parallel_step(model, optimizer, train_config, parallel)
  state = parallel.replicate(create_train_state(model, optimizer, seed=0))
  batches = [copy_batch(np.random.default_rng(i), 8, 10, config.vocab_size) for i in range(4)]
  history = []
  for index in range(60):
    state, metrics = step(state, parallel.shard_batch(batches[index % 4]))
    history.append(parallel.unreplicate(metrics))
  evaluate = make_parallel_eval(model, train_config, parallel)
  evaluations = [parallel.unreplicate(evaluate(state.params, parallel.shard_batch(batches[0])))
                 for _ in range(2)]
  return history, evaluations, batches


def test_cmlm_loss_falls_on_a_copy_task(copy_task_training):
  history, _, _ = copy_task_training

  def window(steps):
    sums = {name: sum(m[name] for m in steps) for name in steps[0]}
    return {**token_metrics(sums), **length_metrics(sums)}

  # Measured: loss 2.69 -> 2.1 (smoothed; ln 16 = 2.77 is a uniform guess), masked-token
  # accuracy 0.18 -> 0.3, and the length (= the source's) learnt exactly.
  first, last = window(history[:10]), window(history[-10:])
  assert not any(m['nonfinite'] for m in history)
  assert last['loss'] < first['loss'] - 0.3, (first, last)
  assert last['accuracy'] > first['accuracy'] + 0.08, (first, last)
  assert last['length_loss'] < 0.5 * first['length_loss'], (first, last)


def test_cmlm_validation_sums_are_deterministic(copy_task_training):
  _, (a, b), batches = copy_task_training
  assert a == b
  assert a['sentences'] == 7
  # No EOS fill in validation: at most every real target token is masked.
  assert 7 <= a['tokens'] <= (batches[0].tgt_out != PAD).sum()


# --- the corpus of number words (conftest.py's numbers_corpus) ---------------------------

@pytest.fixture(scope='module')
def corpus(numbers_corpus):
  return numbers_corpus


# --- model kinds and methods -----------------------------------------------------------------

@pytest.fixture(scope='module')
def teacher(tmp_path_factory, corpus):
  """An autoregressive run directory with random parameters (no training needed)."""
  workdir = tmp_path_factory.mktemp('teacher') / 'run'
  dataset = load_parallel(str(corpus), 'en', 'de')
  tokenizer = Tokenizer.train(list(dataset['train']['source']) + list(dataset['train']['target']),
                              vocab_size=256)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, num_encoder_layers=1,
                            num_decoder_layers=1, max_len=16, dropout_rate=0.0)
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  # A longer EOS embedding, so that random-weight translations end at different lengths.
  params['embedding']['embedding'] = params['embedding']['embedding'].at[config.eos_id].multiply(8)
  workdir.mkdir()
  tokenizer.save(workdir)
  write_config(workdir, config, TrainConfig.toy(), DataConfig(source=str(corpus), vocab_size=256))
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(3, jax.device_get(params))
  checkpoints.close()
  return workdir


def test_translator_refuses_methods_of_the_other_kind(teacher, cmlm_run):
  autoregressive = Translator.from_checkpoint(teacher)
  with pytest.raises(ConfigError, match="method 'nat' decodes cmlm models, but this model is "
                                        "model.kind='autoregressive'; use method 'beam', "
                                        "'greedy' or 'sample'"):
    autoregressive.translate(['one'], method='nat')
  cmlm = Translator.from_checkpoint(cmlm_run['workdir'])
  assert isinstance(cmlm.model, CMLMTransformer)
  for method in ('greedy', 'beam', 'sample'):
    with pytest.raises(ConfigError, match=f"method '{method}' decodes autoregressive models"):
      cmlm.translate(['one'], method=method)
  with pytest.raises(ConfigError, match="alignment needs an autoregressive model; this one is "
                                        "model.kind='cmlm'"):
    cmlm.alignment('one')


@pytest.mark.parametrize('settings, message', [
    (dict(method='nat', max_len=5), 'max_len only applies to the autoregressive methods'),
    (dict(method='greedy', length_beam=1), "length_beam only apply to method 'nat'"),
    (dict(method='nat', beam_size=2), "beam_size only apply to method 'beam', not 'nat'"),
    (dict(method='nat', iterations=0), 'iterations must be a positive integer, got 0'),
])
def test_search_checks_nat_settings(settings, message):
  with pytest.raises(ConfigError, match=message):
    Search(**settings)


def test_search_describes_its_decoding():
  assert Search(method='nat').describe() == ('mask-predict decoding (10 iterations, length '
                                              'beam 3)')
  assert Search(method='nat', iterations=4, length_beam=1, nat_length='fixed').describe() == (
      'mask-predict decoding (4 iterations, fixed length)')
  assert Search(method='greedy').describe() == 'greedy decoding'


def test_search_refuses_a_length_beam_beyond_the_length_classes():
  config = ModelConfig.tiny(kind='cmlm', max_length_offset=1)
  Search(method='nat', length_beam=3).check_model(config)
  with pytest.raises(ConfigError, match=r"length_beam=4 exceeds the model's 3 length classes"):
    Search(method='nat', length_beam=4).check_model(config)


# --- distillation ------------------------------------------------------------------------

@pytest.fixture(scope='module')
def distilled(tmp_path_factory, teacher, corpus):
  output = tmp_path_factory.mktemp('distilled') / 'numbers-distilled'
  result = call(distill.main, ['--checkpoint', teacher, '--data', corpus, '--output', output,
                               '--beam-size', '2', '--batch-size', '16'])
  return {'output': output, 'result': result}


def test_distill_writes_the_teachers_beam_outputs(distilled, teacher, corpus):
  status, out, err = distilled['result']
  assert status == 0, err
  output = distilled['output']
  assert sorted(p.name for p in output.iterdir()) == ['test.de', 'test.en', 'train.de',
                                                      'train.en', 'val.de', 'val.en']
  for name in ('val.en', 'val.de', 'test.en', 'test.de'):
    assert (output / name).read_bytes() == (corpus / name).read_bytes(), name
  assert (output / 'train.en').read_bytes() == (corpus / 'train.en').read_bytes()
  sources = (corpus / 'train.en').read_text().splitlines()
  expected = Translator.from_checkpoint(teacher).translate(sources, method='beam', beam_size=2,
                                                           batch_size=16)
  assert (output / 'train.de').read_text().split('\n')[:-1] == expected
  assert len(set(expected)) > 1, 'the fixture should give different translations'
  # What training will read: the pairs whose translation is not empty.
  loaded = load_parallel(str(output), 'en', 'de')
  assert list(loaded['train']['target']) == [t for t in expected if t]
  assert f'wrote {output}: 64 training sources' in out
  command = out.strip().split('\n')[-1].strip()
  assert command.startswith(f'python train.py --preset toy --objective cmlm --data {output} '
                            '--src en --tgt de --model.d_model=32')


def test_distill_refuses_a_cmlm_teacher_and_a_used_output(distilled, cmlm_run, teacher, corpus,
                                                          tmp_path):
  output = distilled['output']
  status, _, err = call(distill.main, ['--checkpoint', cmlm_run['workdir'], '--data', corpus,
                                       '--output', tmp_path / 'out'])
  assert status == 2
  assert "holds a cmlm model (model.kind='cmlm'); the teacher must be autoregressive" in \
      error_line(err, 'distill')
  assert not (tmp_path / 'out').exists()
  before = {p.name: p.read_bytes() for p in output.iterdir()}
  status, _, err = call(distill.main, ['--checkpoint', teacher, '--data', corpus,
                                       '--output', output])
  assert status == 2
  assert f'--output {output} exists and is not empty' in error_line(err, 'distill')
  status, _, err = call(distill.main, ['--checkpoint', teacher, '--data', corpus,
                                       '--output', corpus, '--overwrite'])
  assert status == 2 and 'an input of the distillation' in error_line(err, 'distill')
  # --overwrite replaces it (with the same translations: the same teacher and beam).
  status, _, err = call(distill.main, ['--checkpoint', teacher, '--data', corpus, '--output',
                                       output, '--beam-size', '2', '--batch-size', '16',
                                       '--overwrite'])
  assert status == 0, err
  assert {p.name: p.read_bytes() for p in output.iterdir()} == before


def test_distill_refuses_a_teacher_that_only_emits_empty_translations(teacher, corpus, tmp_path,
                                                                    monkeypatch):
  monkeypatch.setattr(Translator, 'translate_sources',
                      lambda self, sources, *args, **kwargs: [''] * len(sources.ids))
  status, _, err = call(distill.main, ['--checkpoint', teacher, '--data', corpus,
                                       '--output', tmp_path / 'out'])
  assert status == 2
  assert 'is empty (it ends each sentence at once), which would leave no training pairs' in \
      error_line(err, 'distill')
  assert not (tmp_path / 'out').exists()
