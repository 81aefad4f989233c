"""The training loop and train.py: exact resume, the run directory it writes, Multi30k, CLI errors."""

import dataclasses
import json

import datasets
import jax
import numpy as np
import pytest

from flax_transformer.checkpoint import CheckpointError, load_for_inference
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.data import load_parallel
from flax_transformer.toy_task import number_translation
from flax_transformer.training import train
import train as train_cli  # the script at the repository root

# Dropout stays on: exact resume must reproduce the step-folded dropout keys too. One layer
# each side and a vocabulary that puts every pair in the 8-token bucket keep compiles short.
MODEL = ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=64, dropout_rate=0.1)
TRAIN = TrainConfig(steps=8, max_tokens=256, warmup_steps=4, lr_scale=0.5, log_every=2,
                    eval_every=4, checkpoint_every=4)
DATA = DataConfig(source='toy', vocab_size=256)
TRAIN_KEYS = {'step', 'loss', 'ppl', 'accuracy', 'learning_rate', 'grad_norm', 'tokens_per_s',
              'elapsed_s'}


@pytest.fixture(scope='module')
def numbers():
  return number_translation(num_train=400, num_validation=24, num_test=24)


def metrics_lines(workdir):
  return [json.loads(line) for line in (workdir / 'metrics.jsonl').read_text().splitlines()]


@pytest.fixture(scope='module')
def resumed_and_uninterrupted(tmp_path_factory, numbers):
  """Train 8 steps at once, and 4 steps then resumed to 8, on the train split only."""
  only_train = datasets.DatasetDict({'train': numbers['train']})
  quiet = lambda message: None
  straight = tmp_path_factory.mktemp('straight')
  full = train(MODEL, TRAIN, DATA, straight, dataset=only_train, print_fn=quiet)
  stopped = tmp_path_factory.mktemp('stopped')
  half = train(MODEL, TRAIN.replace(steps=4), DATA, stopped, dataset=only_train, print_fn=quiet)
  messages = []
  resumed = train(MODEL, TRAIN, DATA, stopped, dataset=only_train, print_fn=messages.append)
  return {'full': full, 'half': half, 'resumed': resumed, 'messages': messages,
          'straight': straight, 'stopped': stopped, 'dataset': only_train}


def test_resumed_run_equals_uninterrupted_run_bit_for_bit(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  assert int(runs['half'].state.step) == 4
  assert int(runs['full'].state.step) == int(runs['resumed'].state.step) == 8
  assert any('resumed from' in m and m.endswith('checkpoints/4') for m in runs['messages'])
  full, resumed = jax.tree.leaves(runs['full'].state), jax.tree.leaves(runs['resumed'].state)
  assert len(full) == len(resumed)
  for a, b in zip(full, resumed):
    np.testing.assert_array_equal(a, b)
  # Not trivially equal: training moved the parameters away from step 4's.
  moved = [not np.array_equal(a, b) for a, b in
           zip(jax.tree.leaves(runs['half'].state.params), jax.tree.leaves(runs['full'].state.params))]
  assert all(moved)


def test_resumed_metrics_log_reads_as_one_run(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  straight, stopped = metrics_lines(runs['straight']), metrics_lines(runs['stopped'])
  assert [line['step'] for line in stopped] == [2, 4, 6, 8]
  assert all(set(line) == TRAIN_KEYS for line in stopped)
  for a, b in zip(straight, stopped):
    assert a['loss'] == b['loss'] and a['grad_norm'] == b['grad_norm']


def test_resume_refuses_other_settings(resumed_and_uninterrupted):
  runs = resumed_and_uninterrupted
  with pytest.raises(CheckpointError, match='model.d_model: saved 32, requested 64'):
    train(MODEL.replace(d_model=64), TRAIN, DATA, runs['stopped'], dataset=runs['dataset'],
          print_fn=lambda message: None)


def test_full_run_writes_the_run_directory_and_reports(tmp_path, numbers):
  messages = []
  result = train(MODEL, TRAIN, DATA, tmp_path, dataset=numbers, average_last=2,
                 print_fn=messages.append)
  text = '\n'.join(messages)
  for name in ('config.json', 'tokenizer.json', 'metrics.jsonl', 'average-last2/checkpoints/8'):
    assert (tmp_path / name).exists(), name
  assert sorted(p.name for p in (tmp_path / 'checkpoints').iterdir()) == ['4', '8']
  lines = metrics_lines(tmp_path)
  assert [line['step'] for line in lines if 'loss' in line] == [2, 4, 6, 8]
  assert [line['step'] for line in lines if 'val_loss' in line] == [4, 8]
  final = [line for line in lines if 'bleu' in line]
  assert len(final) == 1 and final[0]['step'] == 8
  assert 0 <= final[0]['exact_match'] <= 1 and 0 <= final[0]['chrf'] <= 100
  assert any('avg_bleu' in line for line in lines)
  assert 'test, greedy decoding of 24 sentences: BLEU' in text
  assert 'nrefs:1|case:mixed|eff:no|tok:13a' in text  # the sacreBLEU signature
  assert text.count('reference: ') == 5
  assert result.scores['val_loss'] > 0 and result.model_config.vocab_size == result.tokenizer.vocab_size
  config, params, tokenizer = load_for_inference(tmp_path)
  assert config == result.model_config
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(result.state.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings('ignore:source length .* output capped')  # long test sentences
def test_short_train_on_multi30k(tmp_path, multi30k_dir):
  multi30k = load_parallel(str(multi30k_dir), 'en', 'de')
  # The whole training split (tokenizer and batches); 16 test sentences to decode.
  subset = datasets.DatasetDict({'train': multi30k['train'],
                                 'test': multi30k['test'].select(range(16))})
  messages = []
  # Two steps: each batch shape compiles once, and Multi30k's buckets give several shapes.
  result = train(MODEL, TRAIN.replace(steps=2, max_tokens=512),
                 DataConfig(source=str(multi30k_dir), vocab_size=1000), tmp_path, dataset=subset,
                 print_fn=messages.append)
  text = '\n'.join(messages)
  assert 'train: 29,000 pairs' in text
  assert result.tokenizer.vocab_size == 1000
  assert int(result.state.step) == 2 and np.isfinite(result.scores['loss'])
  assert 'test, greedy decoding of 16 sentences' in text


# --- train.py ------------------------------------------------------------------------

@pytest.mark.parametrize('argv,message', [
    (['--bogus'], 'unrecognized arguments: --bogus'),
    (['--model.d_model=abc'], "model.d_model must be an integer, got 'abc'"),
    (['--steps', '-1'], 'train.steps must be a positive integer, got -1'),
    (['--model.num_heads=3'], 'model.d_model=128 is not divisible by model.num_heads=3'),
    (['--model.activation=tanh'], "model.activation must be one of relu, gelu, got 'tanh'"),
    (['--train.label_smoothing=1.5'], r'train.label_smoothing must be in [0, 1), got 1.5'),
    (['--model.vocab_size=100'], 'unrecognized arguments: --model.vocab_size=100'),
    (['--devices', '0'], "argument --devices: expected a positive integer, got '0'"),
    (['--preset', 'huge'], "argument --preset: invalid choice: 'huge'"),
    (['--process-id', '1'], '--num-processes and --process-id need --coordinator'),
])
def test_cli_refuses_bad_options_up_front(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_cli.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize('argv,message', [
    (['--data', './nowhere'], 'nowhere: no such file or directory'),
    (['--devices', '64'], '--devices=64: this process has'),
])
def test_cli_reports_run_errors_without_a_traceback(argv, message, tmp_path, monkeypatch, capsys):
  monkeypatch.chdir(tmp_path)
  assert train_cli.main([*argv, '--workdir', str(tmp_path / 'run')]) == 1
  error = capsys.readouterr().err
  assert message in error and 'Traceback' not in error


def test_cli_help_documents_every_setting(capsys):
  with pytest.raises(SystemExit) as exit_info:
    train_cli.main(['--help'])
  assert exit_info.value.code == 0
  help_text = capsys.readouterr().out
  for option in ('--model.d_model', '--train.warmup_steps', '--train.grad_accum_steps',
                 '--data.vocab_size', '--bf16', '--average-last', '--parallel', '--no-resume',
                 '--coordinator'):
    assert option in help_text, option


def test_cli_describes_every_setting_and_nothing_else():
  settings = {f'{section}.{field.name}' for section, cls in train_cli.SECTIONS
              for field in dataclasses.fields(cls)
              if not (section == 'model' and field.name in train_cli.TOKENIZER_FIELDS)}
  assert set(train_cli.SETTING_HELP) == settings


def test_cli_presets_and_overrides():
  args = train_cli.build_parser().parse_args(
      ['--preset', 'multi30k', '--model.d_model=512', '--steps', '10', '--bf16', '--src', 'de',
       '--tgt', 'en'])
  model, training, data = train_cli.configs_from_args(args)
  assert (model.d_model, model.num_encoder_layers, model.dtype) == (512, 3, 'bfloat16')
  assert (training.steps, training.warmup_steps) == (10, TrainConfig.multi30k().warmup_steps)
  assert (data.source, data.src_lang, data.tgt_lang) == ('bentrevett/multi30k', 'de', 'en')
