"""Settings by lifetime: every rule about changing a run's settings (resume, fine-tuning, which
settings are options) is read from each field's `Lifetime`, and a run directory written before
the settings declared lifetimes (main at 0f9f246: config.json's fields in that order, dtype
compared on resume) resumes, decodes, distills and exports unchanged.
"""

import dataclasses
import json
import shutil

import datasets
import numpy as np
import pytest

from flax_transformer.cli import train as train_cli
from flax_transformer.config import (
  LIFETIMES,
  SECTIONS,
  DataConfig,
  ModelConfig,
  TrainConfig,
  fields_where,
  lifetime_of,
)
from flax_transformer.decode.methods import BeamSearch, Greedy
from flax_transformer.decode.translator import Translator
from flax_transformer.errors import CheckpointError
from flax_transformer.run.config_file import check_resumable, read_config, write_config
from flax_transformer.run.export import export_run
from flax_transformer.run.loading import load_for_inference
from flax_transformer.train.distill import distill
from flax_transformer.train.loop import train
from support.checkpointed_run import TEXTS, TRAIN_CONFIG

FIXTURE = 'run_config_0f9f246.json'  # config.json as main wrote it at 0f9f246


def test_every_setting_of_a_run_declares_a_lifetime_and_every_lifetime_is_used():
  used = set()
  for cls in SECTIONS.values():
    for field in dataclasses.fields(cls):
      used.add(lifetime_of(cls, field.name))  # raises for a field without one
  assert used == set(LIFETIMES)


# One setting of each lifetime, changed: a resumed run may change the computation, the
# initialisation, the cadence and the cache's place; everything else is its identity.
CHANGES = [
  ('model', 'remat', 'layer', True),
  ('model', 'dtype', 'bfloat16', True),
  ('model', 'attention_kernel', 'xla', True),
  ('model', 'qkv_init_gain', 0.5, True),
  ('train', 'steps', 99, True),
  ('train', 'patience', 3, True),
  ('data', 'cache_dir', 'elsewhere', True),
  ('model', 'd_ff', 128, False),
  ('model', 'dropout_rate', 0.2, False),
  ('train', 'adam_eps', 1e-8, False),
  ('train', 'label_smoothing', 0.2, False),
  ('train', 'best_metric', 'bleu', False),
  ('data', 'lowercase', True, False),
  ('data', 'bpe_dropout', 0.1, False),
]


@pytest.mark.parametrize('section, name, value, resumable', CHANGES)
def test_a_resumed_run_may_change_what_its_lifetime_allows(
  tmp_path, section, name, value, resumable
):
  saved = {'model': ModelConfig.tiny(), 'train': TrainConfig(bleu_every=5), 'data': DataConfig()}
  write_config(tmp_path, saved['model'], saved['train'], saved['data'])
  requested = dict(saved, **{section: saved[section].replace(**{name: value})})
  assert lifetime_of(SECTIONS[section], name).resumable is resumable
  if resumable:
    check_resumable(tmp_path, requested['model'], requested['train'], requested['data'])
    return
  with pytest.raises(CheckpointError, match=f'{section}.{name}: saved '):
    check_resumable(tmp_path, requested['model'], requested['train'], requested['data'])


def test_fine_tuning_may_change_the_computation_and_dropout_only():
  changeable = fields_where(ModelConfig, lambda lifetime: lifetime.fine_tunable)
  assert set(changeable) == {
    'dropout_rate',
    'activation_dropout_rate',
    'attention_dropout_rate',
    'dtype',
    'remat',
    'loss_chunk',
    'attention_kernel',
  }
  # train.py --help says so, from the same lifetimes (its refusal: test_pretrained.py)
  help_text = ' '.join(train_cli.build_parser().format_help().split())
  assert 'may only change ' + ', '.join(changeable) in help_text


def test_the_vocabulary_is_no_option_and_every_other_setting_is():
  options = {cls: fields_where(cls, lambda lifetime: lifetime.option) for cls in SECTIONS.values()}
  assert set(options[ModelConfig]) == {f.name for f in dataclasses.fields(ModelConfig)} - {
    'vocab_size',
    'pad_id',
    'bos_id',
    'eos_id',
    'unk_id',
  }
  assert len(options[TrainConfig]) == len(dataclasses.fields(TrainConfig))


# --- a run directory in 0f9f246's layout ----------------------------------------------------


@pytest.fixture(scope='module')
def former_run(tmp_path_factory, checkpointed_run, request):
  """checkpointed_run's directory with config.json replaced by the one main wrote at 0f9f246
  for the same run (fields in that order: the vocabulary first, dropout among the
  architecture), and a corpus of its six sentences."""
  workdir = tmp_path_factory.mktemp('former') / 'run'
  shutil.copytree(checkpointed_run.run_dir, workdir)
  fixture = request.path.parent / 'fixtures' / FIXTURE
  (workdir / 'config.json').write_text(fixture.read_text())
  corpus = workdir.parent / 'corpus'
  corpus.mkdir()
  english, german = TEXTS[1::2], TEXTS[0::2]
  for stem in ('train', 'val', 'test'):
    (corpus / f'{stem}.en').write_text(''.join(f'{line}\n' for line in english))
    (corpus / f'{stem}.de').write_text(''.join(f'{line}\n' for line in german))
  return {'workdir': workdir, 'corpus': corpus, 'config': checkpointed_run.setup[0]}


def test_the_former_config_json_reads_as_the_run_it_describes(former_run):
  written = json.loads((former_run['workdir'] / 'config.json').read_text())
  assert list(written['model'])[:2] == ['vocab_size', 'd_model']  # the former order
  assert read_config(former_run['workdir']) == (former_run['config'], TRAIN_CONFIG, DataConfig())


def test_a_former_run_decodes_and_distills(former_run, tmp_path):
  config, params, tokenizer = load_for_inference(former_run['workdir'])
  assert config == former_run['config']
  translator = Translator(config, params, tokenizer)
  (greedy,) = translator.translate(['a small dog runs'], Greedy())
  assert isinstance(greedy, str)
  result = distill(
    former_run['workdir'],
    tmp_path / 'distilled',
    data=str(former_run['corpus']),
    method=BeamSearch(beam_size=2),
    batch_size=4,
    progress=False,
  )
  assert result.sentences == 3
  assert (tmp_path / 'distilled' / 'train.de').read_text().count('\n') == 3


def test_a_former_run_exports(former_run, tmp_path):
  output = export_run(former_run['workdir'], tmp_path / 'export')
  exported = json.loads((output / 'config.json').read_text())
  assert exported['model_type'] == 'marian'
  assert exported['d_model'] == former_run['config'].d_model
  assert exported['vocab_size'] == former_run['config'].vocab_size


def test_a_former_run_resumes_from_its_last_checkpoint(former_run, tmp_path):
  workdir = tmp_path / 'run'
  shutil.copytree(former_run['workdir'], workdir)
  pairs = {'source': TEXTS[1::2], 'target': TEXTS[0::2]}
  dataset = datasets.DatasetDict(
    {split: datasets.Dataset.from_dict(pairs) for split in ('train', 'validation')}
  )
  lines = []
  result = train(
    former_run['config'],
    TRAIN_CONFIG.replace(steps=12, eval_every=100, bleu_every=0),
    DataConfig(),
    workdir,
    dataset=dataset,
    print_fn=lines.append,
  )
  assert int(result.state.step) == 12
  assert any('resum' in line and '10' in line for line in lines), lines
  rewritten = json.loads((workdir / 'config.json').read_text())
  assert rewritten['train']['steps'] == 12
  assert np.isfinite(result.scores['loss'])


def test_a_resume_reads_the_run_and_compares_only_what_is_given(former_run, tmp_path, capsys):
  """train.py --workdir RUN --steps N resumes a run written before layer_norm_epsilon was
  recorded (99dd910: 1e-6 then, the default is 1e-5 now) with its own settings: those not
  given come from config.json, so the preset's changed default cannot strand it; a setting
  given that differs from the run's is refused, naming both values."""
  workdir = tmp_path / 'run'
  shutil.copytree(former_run['workdir'], workdir)
  written = json.loads((workdir / 'config.json').read_text())
  del written['model']['layer_norm_epsilon']  # as 99dd910 wrote it
  written['data']['source'] = str(former_run['corpus'])
  (workdir / 'config.json').write_text(json.dumps(written))
  quick = ['--train.eval_every', '100', '--train.bleu_every', '0']
  status = train_cli.main(['--workdir', str(workdir), '--steps', '12', *quick])
  assert status == 0, capsys.readouterr().err
  rewritten = json.loads((workdir / 'config.json').read_text())
  assert rewritten['model']['layer_norm_epsilon'] == 1e-6
  assert rewritten['train']['steps'] == 12
  # Not the toy preset's settings: the run's (d_model 32, accumulation 2, its corpus).
  assert rewritten['model']['d_model'] == 32 and rewritten['train']['grad_accum_steps'] == 2
  assert rewritten['data']['source'] == str(former_run['corpus'])
  # --preset is said to be unused, and a setting given is compared with the run's.
  capsys.readouterr()
  status = train_cli.main(
    ['--workdir', str(workdir), '--preset', 'multi30k', '--model.layer_norm_epsilon', '1e-5']
  )
  captured = capsys.readouterr()
  assert status != 0
  assert (
    f'{workdir}: resuming with its config.json; --preset multi30k is not applied' in captured.out
  )
  assert 'model.layer_norm_epsilon: saved 1e-06, requested 1e-05' in captured.err
