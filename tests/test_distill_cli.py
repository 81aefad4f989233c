"""distill.py: the teacher's beam translations become the training
targets of a cmlm student, the other splits are copied byte for byte, and a teacher or an
output that cannot serve is refused by name.

The teacher is conftest.py's random autoregressive run directory on the number words of
numbers_corpus; a cmlm teacher is conftest.py's cmlm_run.
"""

import pytest

import distill as distill_cli  # the program at the repository root
from flax_transformer.data.corpus import load_parallel
from flax_transformer.decode.methods import BeamSearch
from flax_transformer.decode.translator import Translator
from support.script_calls import call, error_line

# A random model's translations run to the output budget, which max_len caps.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')


@pytest.fixture(scope='module')
def corpus(numbers_corpus):
  return numbers_corpus


@pytest.fixture(scope='module')
def distilled(tmp_path_factory, teacher, corpus):
  output = tmp_path_factory.mktemp('distilled') / 'numbers-distilled'
  result = call(
    distill_cli.main,
    [
      '--checkpoint',
      teacher,
      '--data',
      corpus,
      '--output',
      output,
      '--beam-size',
      '2',
      '--batch-size',
      '16',
    ],
  )
  return {'output': output, 'result': result}


def test_distill_writes_the_teachers_beam_outputs(distilled, teacher, corpus):
  status, out, err = distilled['result']
  assert status == 0, err
  output = distilled['output']
  # The splits, and the mark that lets a later --overwrite replace them.
  assert sorted(p.name for p in output.iterdir()) == [
    '.written-by-distill',
    'test.de',
    'test.en',
    'train.de',
    'train.en',
    'val.de',
    'val.en',
  ]
  for name in ('val.en', 'val.de', 'test.en', 'test.de'):
    assert (output / name).read_bytes() == (corpus / name).read_bytes(), name
  assert (output / 'train.en').read_bytes() == (corpus / 'train.en').read_bytes()
  sources = (corpus / 'train.en').read_text().splitlines()
  expected = Translator.from_checkpoint(teacher).translate(
    sources, BeamSearch(beam_size=2), batch_size=16
  )
  assert (output / 'train.de').read_text().split('\n')[:-1] == expected
  assert len(set(expected)) > 1, 'the fixture should give different translations'
  # What training will read: the pairs whose translation is not empty.
  loaded = load_parallel(str(output), 'en', 'de')
  assert list(loaded['train']['target']) == [t for t in expected if t]
  assert f'wrote {output}: 64 training sources' in out
  command = out.strip().split('\n')[-1].strip()
  assert command.startswith(
    f'python train.py --preset toy --objective cmlm --data {output} '
    '--src en --tgt de --model.d_model=32'
  )


def test_distill_refuses_a_cmlm_teacher_and_a_used_output(
  distilled, cmlm_run, teacher, corpus, tmp_path
):
  output = distilled['output']
  status, _, err = call(
    distill_cli.main,
    ['--checkpoint', cmlm_run['workdir'], '--data', corpus, '--output', tmp_path / 'out'],
  )
  assert status == 2
  assert "holds a cmlm model (model.kind='cmlm'); the teacher must be autoregressive" in error_line(
    err, 'distill.py'
  )
  assert not (tmp_path / 'out').exists()
  before = {p.name: p.read_bytes() for p in output.iterdir()}
  status, _, err = call(
    distill_cli.main, ['--checkpoint', teacher, '--data', corpus, '--output', output]
  )
  assert status == 2
  assert f'--output {output} exists and is not empty' in error_line(err, 'distill.py')
  status, _, err = call(
    distill_cli.main, ['--checkpoint', teacher, '--data', corpus, '--output', corpus, '--overwrite']
  )
  assert status == 2 and 'an input of the distillation' in error_line(err, 'distill.py')
  # --overwrite replaces it (with the same translations: the same teacher and beam).
  status, _, err = call(
    distill_cli.main,
    [
      '--checkpoint',
      teacher,
      '--data',
      corpus,
      '--output',
      output,
      '--beam-size',
      '2',
      '--batch-size',
      '16',
      '--overwrite',
    ],
  )
  assert status == 0, err
  assert {p.name: p.read_bytes() for p in output.iterdir()} == before


def test_distill_refuses_a_teacher_that_only_emits_empty_translations(
  teacher, corpus, tmp_path, monkeypatch
):
  monkeypatch.setattr(
    Translator, 'translate_sources', lambda self, sources, *args, **kwargs: [''] * len(sources.ids)
  )
  status, _, err = call(
    distill_cli.main, ['--checkpoint', teacher, '--data', corpus, '--output', tmp_path / 'out']
  )
  assert status == 2
  assert (
    'is empty (it ends each sentence at once), which would leave no training pairs'
    in error_line(err, 'distill.py')
  )
  assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize(
  'argv, expected',
  [
    (['--beam-size', '0'], 'distill.py: error: argument --beam-size: must be >= 1, got 0'),
    (['--alpha', '-1'], 'distill.py: error: argument --alpha: must be >= 0, got -1.0'),
    (['--temperature', '2'], 'distill.py: error: unrecognized arguments: --temperature 2'),
  ],
)
def test_distill_refuses_bad_options_naming_them(argv, expected, tmp_path):
  status, _, err = call(
    distill_cli.main, ['--checkpoint', tmp_path, '--output', tmp_path / 'out', *argv]
  )
  assert status == 2 and expected in err


def test_distill_fails_as_the_other_programs_do(tmp_path):
  # cli/failures.py: one line and status 2 for a missing teacher; --debug adds the traceback.
  argv = ['--checkpoint', tmp_path / 'missing', '--output', tmp_path / 'out']
  status, _, err = call(distill_cli.main, argv)
  assert status == 2 and 'Traceback' not in err
  assert error_line(err, 'distill.py').startswith(f'distill.py: error: {tmp_path}/missing')
  status, _, debug_err = call(distill_cli.main, [*argv, '--debug'])
  assert status == 2 and 'Traceback' in debug_err
  assert error_line(debug_err, 'distill.py') == error_line(err, 'distill.py')


def test_student_of_a_packed_teacher_trains_unpacked_and_is_accepted(tmp_path):
  # A teacher trained with --train.packing 64: the cmlm student's EOS fill cannot pack, so
  # its command says so and train.py accepts the settings it names.
  import shlex

  from flax_transformer.cli.options import configs_from_args
  from flax_transformer.cli.train import build_parser
  from flax_transformer.config import run_preset
  from flax_transformer.data import packing
  from flax_transformer.train.distill import student_command

  model_config, train_config, data_config = run_preset('multi30k')
  train_config = train_config.replace(packing=64)
  command = student_command(
    tmp_path / 'distilled',
    model_config.replace(vocab_size=16_000),
    train_config,
    data_config,
    tmp_path / 'runs' / 'm30k',
  )
  words = shlex.split(command)
  assert words[:4] == ['python', 'train.py', '--preset', 'multi30k']
  assert words.count('--train.packing=0') == 1 and not any(
    w.startswith('--train.packing=') and w != '--train.packing=0' for w in words
  )
  student_model, student_train, _ = configs_from_args(build_parser().parse_args(words[2:]))
  assert student_model.kind == 'cmlm' and student_train.eos_fill_rate > 0
  packing.check_settings(student_model, student_train)  # raises ConfigError if refused
  with pytest.raises(Exception, match='train.eos_fill_rate'):
    packing.check_settings(student_model, student_train.replace(packing=64))
