"""decode.py, the command line: translations in input order, files, scores, one-line errors.

Called through its `main` (exit status and standard error as a user sees them), on
three run directories: conftest.py's random_run (a random tiny model), this file's
decode_run (for messy input and failures part way), and conftest.py's cmlm_run (a
cmlm model, decoded by mask-predict).
"""

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from flax_transformer.cli import decode as decode_cli  # decode.py's program
from flax_transformer.cli import text_io
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.decode import non_autoregressive
from flax_transformer.decode.methods import Greedy, MaskPredict
from flax_transformer.decode.translator import Translator
from flax_transformer.nn.backend import compute_dtype
from flax_transformer.nn.model import Transformer
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import write_config
from flax_transformer.tokenizer import Tokenizer
from support.random_run import MAX_LEN, SENTENCES
from support.script_calls import call, error_line

# A random model's translations run to the output budget, which max_len caps.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* output capped')


# --- options refused before anything loads ----------------------------------------------


@pytest.mark.parametrize(
  'argv, expected',
  [
    (['--beam-size', '0'], 'decode.py: error: argument --beam-size: must be >= 1, got 0'),
    (['--batch-size', '0'], 'decode.py: error: argument --batch-size: must be >= 1, got 0'),
    (['--step', '-3'], 'decode.py: error: argument --step: must be >= 0, got -3'),
    (['--beams', '4'], 'decode.py: error: unrecognized arguments: --beams'),
    (['--dtype', 'float16'], "decode.py: error: argument --dtype: invalid choice: 'float16'"),
    # Every method setting's range, from its field's Bounds, and the old names of config.RENAMED.
    (['--top-p', '1.5'], 'decode.py: error: argument --top-p: must be in (0, 1], got 1.5'),
    (['--temperature', 'nan'], 'decode.py: error: argument --temperature: must be > 0, got nan'),
    (['--top-k', 'x'], "decode.py: error: argument --top-k: invalid int value: 'x'"),
    (['--nat-length', 'fixed'], 'decode.py: error: --nat-length is now called --length'),
  ],
)
def test_decode_refuses_bad_options_naming_them(argv, expected, tmp_path):
  status, _, err = call(decode_cli.main, ['--checkpoint', tmp_path, *argv, 'Hallo'])
  assert status == 2 and expected in err


# --- the random tiny model of conftest.py's random_run -----------------------------------


@pytest.fixture(scope='module')
def tokenizer(random_run):
  return random_run.tokenizer


@pytest.fixture(scope='module')
def run_dir(random_run):
  return random_run.run_dir


@pytest.fixture(scope='module')
def greedy_translations(random_run):
  return random_run.greedy_translations


def test_cli_translates_arguments_to_stdout(run_dir, greedy_translations, capsys):
  status = decode_cli.main(
    ['--checkpoint', str(run_dir), '--method', 'greedy', '--batch-size', '2', *SENTENCES]
  )
  captured = capsys.readouterr()
  assert status == 0, captured.err
  assert captured.out.split('\n')[:-1] == greedy_translations


def test_cli_input_with_special_strings_reaches_the_model_as_text(
  run_dir, tokenizer, monkeypatch, capsys
):
  lines = ['</s> ein Hund', 'ein <pad> Hund', 'ein Hund <s>', '<unk>', 'x</s>y']
  seen = []
  translate_sources = Translator.translate_sources

  def spy(self, sources, *args, **kwargs):
    seen.extend(sources.ids)
    return translate_sources(self, sources, *args, **kwargs)

  monkeypatch.setattr(Translator, 'translate_sources', spy)
  assert decode_cli.main(['--checkpoint', str(run_dir), '--method', 'greedy', *lines]) == 0
  assert len(capsys.readouterr().out.split('\n')[:-1]) == len(lines)
  assert len(seen) == len(lines)
  for line, ids in zip(lines, seen):
    # One EOS, the last; no PAD or BOS that would end the sentence or hide it from the masks.
    assert ids[-1] == tokenizer.eos_id
    assert not {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id} & set(ids[:-1].tolist())
    assert ids[:-1].tolist() == tokenizer.encode([line])[0]


def test_cli_decodes_in_bfloat16_as_the_translator_does(run_dir, random_run, capsys):
  status = decode_cli.main(
    [
      '--checkpoint',
      str(run_dir),
      '--method',
      'greedy',
      '--dtype',
      'bfloat16',
      '--batch-size',
      '2',
      *SENTENCES,
    ]
  )
  captured = capsys.readouterr()
  assert status == 0, captured.err
  translator = Translator(
    random_run.config, random_run.params, tokenizer=random_run.tokenizer, dtype='bfloat16'
  )
  assert translator.config.dtype == 'bfloat16' and compute_dtype(random_run.config) == 'float32'
  assert captured.out.split('\n')[:-1] == translator.translate(SENTENCES, Greedy(), batch_size=2)


def test_target_lang_is_checked_and_said_unused_without_a_reference(run_dir, capsys):
  argv = ['--checkpoint', str(run_dir), '--method', 'greedy', *SENTENCES[:1]]
  status = decode_cli.main([*argv, '--target-lang', 'klingon'])
  err = capsys.readouterr().err
  assert status == 2
  assert "--target-lang 'klingon' is not a language code sacremoses knows" in err
  assert 'known: ' in err and ' de, ' in err and err.count('\n') == 1
  assert decode_cli.main([*argv, '--target-lang', 'de']) == 0
  assert 'decode.py: --target-lang de is unused: it tokenizes the BLEU of --reference' in (
    capsys.readouterr().err
  )


def test_cli_file_to_file_with_reference_scores(run_dir, greedy_translations, tmp_path, capsys):
  source, output, reference = tmp_path / 'in.de', tmp_path / 'out.en', tmp_path / 'ref.en'
  source.write_text('\n'.join(SENTENCES) + '\n')
  reference.write_text('\n'.join(greedy_translations[:-1] + ['something else']) + '\n')
  status = decode_cli.main(
    [
      '--checkpoint',
      str(run_dir),
      '--method',
      'greedy',
      '--batch-size',
      '2',
      '--input',
      str(source),
      '--output',
      str(output),
      '--reference',
      str(reference),
    ]
  )
  captured = capsys.readouterr()
  assert status == 0, captured.err
  assert output.read_text().split('\n')[:-1] == greedy_translations
  bleu, lowercased, chrf, tokenized = captured.out.strip().split('\n')
  assert bleu.startswith('BLEU = ') and 'signature: nrefs:1|case:mixed|eff:no|tok:13a' in bleu
  assert (
    lowercased.startswith('BLEU = ') and 'signature: nrefs:1|case:lc|eff:no|tok:13a' in lowercased
  )
  assert chrf.startswith('chrF2 = ') and 'signature: nrefs:1|case:mixed|eff:yes|nc:6' in chrf
  assert 0.0 < float(bleu.split()[2]) < 100.0
  # The literature's tokenized BLEU, in the run's target language, as the library scores it.
  from flax_transformer.run.directory import read_config
  from flax_transformer.train.evaluation import tokenized_bleu

  lang = read_config(run_dir)[2].tgt_lang
  expected, signature = tokenized_bleu(
    greedy_translations, greedy_translations[:-1] + ['something else'], lang
  )
  assert tokenized.startswith('tokenized BLEU = ') and f'signature: {signature}' in tokenized
  assert float(tokenized.split()[3]) == pytest.approx(expected.score, abs=0.01)


def test_cli_warns_about_overlong_lines(run_dir, tokenizer, tmp_path, capsys):
  source, long = tmp_path / 'long.de', ' '.join(['Hund'] * 80)
  source.write_text('Ein Hund.\n' + long + '\n')
  status = decode_cli.main(
    ['--checkpoint', str(run_dir), '--method', 'greedy', '--input', str(source)]
  )
  captured = capsys.readouterr()
  assert status == 0
  count = len(tokenizer.encode([long])[0])
  assert (
    f'warning: line 2 has {count} subword tokens; the model reads at most {MAX_LEN - 1}'
    in captured.err
  )
  assert len(captured.out.split('\n')) == 3


@pytest.mark.parametrize(
  'arguments, message',
  [
    (['--checkpoint', '{tmp}/missing', 'Hallo'], 'missing: no such directory'),
    (['--checkpoint', '{tmp}', 'Hallo'], 'config.json: no such file'),
    (['--checkpoint', '{run}', '--input', '{tmp}/empty.txt'], 'empty.txt is empty'),
    (['--checkpoint', '{run}', '--input', '{tmp}/nothing.txt'], 'nothing.txt: no such file'),
    (['--checkpoint', '{run}', '--max-len', '100', 'Hallo'], r'max_len must be in \[1, 64\]'),
    (['--checkpoint', '{run}', '--step', '3', 'Hallo'], r'no checkpoint at step 3 \(have: 7\)'),
    (
      ['--checkpoint', '{run}', '--temperature', '0.5', 'Hallo'],
      "temperature only applies to method 'sample'",
    ),
    (
      ['--checkpoint', '{run}', '--reference', '{tmp}/empty.txt', 'Hallo', 'Welt'],
      'has 0 lines, the input has 2',
    ),
  ],
)
def test_cli_errors_are_one_line_messages(run_dir, tmp_path, capsys, arguments, message):
  (tmp_path / 'empty.txt').write_text('')
  arguments = [a.format(tmp=tmp_path, run=run_dir) for a in arguments]
  assert decode_cli.main(arguments) == 2
  err = capsys.readouterr().err
  assert err.startswith('decode.py: error: ') and err.count('\n') == 1
  assert re.search(message, err), err


# --- decoding messy input ------------------------------------------------------------

CORPUS = [
  'Ein Mann fährt Fahrrad.',
  'Zwei Hunde spielen im Schnee.',
  'Eine Frau liest ein Buch.',
  'A man rides a bike.',
  'Two dogs play in the snow.',
  'A woman reads a book.',
]
DECODE_MAX_LEN = 32


@pytest.fixture(scope='module')
def decode_run(tmp_path_factory):
  """A run directory with a random tiny model, and its Translator."""
  workdir = tmp_path_factory.mktemp('decode')
  tokenizer = Tokenizer.train(CORPUS, vocab_size=100)
  config = ModelConfig.tiny(
    vocab_size=tokenizer.vocab_size,
    max_len=DECODE_MAX_LEN,
    num_encoder_layers=1,
    num_decoder_layers=1,
    dropout_rate=0.0,
  )
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  tokenizer.save(workdir)
  write_config(workdir, config, TrainConfig(), DataConfig())
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(1, jax.device_get(params))
  checkpoints.close()
  return workdir, Translator(config, params, tokenizer)


def test_decode_handles_empty_long_and_unknown_input_line_by_line(decode_run, tmp_path):
  workdir, translator = decode_run
  long = ' '.join(['Hund'] * 2000)  # 9,999 characters
  lines = ['Ein Hund läuft.', '', long + 'e', '☃ 日本語 🙂 Ωμέγα', 'Zwei Männer.', '  ']
  source, output = tmp_path / 'in.de', tmp_path / 'out.en'
  # CRLF line ends, as from a Windows editor.
  source.write_bytes(''.join(f'{line}\r\n' for line in lines).encode())
  status, _, err = call(
    decode_cli.main,
    ['--checkpoint', workdir, '--method', 'greedy', '--input', source, '--output', output],
  )
  assert status == 0, err
  assert len(long + 'e') == 10_000
  count = len(translator.tokenizer.encode([long + 'e'])[0])
  assert (
    f'decode.py: warning: line 3 has {count} subword tokens; the model reads at most '
    f'{DECODE_MAX_LEN - 1} + EOS: truncated'
  ) in err
  written = output.read_text().split('\n')
  assert written[-1] == '' and len(written) - 1 == len(lines)  # one line out per line in
  with pytest.warns(UserWarning, match='sentence 2: .* truncated'):
    expected = translator.translate(lines, Greedy())
  assert written[:-1] == expected
  assert written[1] == written[5] == '' and all(written[i] for i in (0, 2, 3, 4))
  assert '<unk>' in translator.tokenizer.decode([translator.tokenizer.encode([lines[3]])[0]])[0]


def test_decode_refuses_invalid_utf8_naming_the_line(decode_run, tmp_path):
  workdir, _ = decode_run
  source, output = tmp_path / 'in.de', tmp_path / 'out.en'
  source.write_bytes(b'Ein Hund.\nZwei M\xe4nner.\n')
  status, _, err = call(
    decode_cli.main, ['--checkpoint', workdir, '--input', source, '--output', output]
  )
  assert status == 2 and not output.exists()
  assert error_line(err, 'decode.py') == (
    f'decode.py: error: {source}, line 2: invalid UTF-8 (invalid continuation byte at byte '
    '6 of the line); re-encode the file as UTF-8'
  )


def test_decode_failure_part_way_keeps_the_lines_already_written(decode_run, tmp_path, monkeypatch):
  workdir, translator = decode_run
  lines = [CORPUS[i % 3] for i in range(10)]
  calls = []
  original = Translator.translate_sources

  def fail_second_block(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 2:
      raise RuntimeError('device lost')
    return original(self, *args, **kwargs)

  monkeypatch.setattr(Translator, 'translate_sources', fail_second_block)
  source, output = tmp_path / 'in.de', tmp_path / 'out.en'
  source.write_text('\n'.join(lines) + '\n')
  # --batch-size 1: blocks of text_io.BATCHES_PER_BLOCK = 8 lines.
  status, _, err = call(
    decode_cli.main,
    [
      '--checkpoint',
      workdir,
      '--method',
      'greedy',
      '--batch-size',
      '1',
      '--input',
      source,
      '--output',
      output,
    ],
  )
  monkeypatch.undo()
  block = text_io.BATCHES_PER_BLOCK
  # One line, no traceback (unless --debug), naming what is in the output.
  assert status == 1 and 'Traceback' not in err
  assert error_line(err, 'decode.py') == (
    f'decode.py: error: failed after {block} lines, whose translations are in {output}: '
    'RuntimeError: device lost (unexpected; --debug or FLAX_TRANSFORMER_DEBUG=1 shows the '
    'traceback)'
  )
  assert output.read_text().split('\n')[:-1] == translator.translate(lines[:block], Greedy())


def test_decode_reports_a_full_disk_with_the_lines_written(decode_run):
  if not Path('/dev/full').exists():
    pytest.skip('/dev/full (writes fail with ENOSPC) is Linux only')
  workdir, _ = decode_run
  status, _, err = call(
    decode_cli.main,
    ['--checkpoint', workdir, '--method', 'greedy', '--output', '/dev/full', 'Ein Hund.'],
  )
  assert status == 1
  assert error_line(err, 'decode.py') == (
    'decode.py: error: writing /dev/full failed (No space left on device); it holds the '
    'translations of the first 0 lines at most'
  )


def test_decode_refuses_another_model_or_a_missing_tokenizer(decode_run, tmp_path):
  workdir, _ = decode_run
  other = tmp_path / 'other'
  shutil.copytree(workdir, other)
  config = json.loads((other / 'config.json').read_text())
  config['model']['d_model'] = 64
  (other / 'config.json').write_text(json.dumps(config))
  status, _, err = call(decode_cli.main, ['--checkpoint', other, 'Ein Hund.'])
  assert status == 2
  assert re.fullmatch(
    r'decode.py: error: .*/checkpoints/1 does not hold parameters of the model '
    r'in config.json: \d+ arrays differ, .* is saved as \(32, 32\), the model '
    r'needs \(64, 64\); .* The checkpoint belongs to another model: use the '
    r'config.json it was written with',
    error_line(err, 'decode.py'),
  )
  (other / 'tokenizer.json').unlink()
  status, _, err = call(decode_cli.main, ['--checkpoint', other, 'Ein Hund.'])
  assert status == 2 and error_line(err, 'decode.py').startswith(
    f'decode.py: error: {other}/tokenizer.json: no such file'
  )
  status, _, err = call(
    decode_cli.main,
    ['--checkpoint', workdir, '--output', tmp_path / 'missing' / 'out.txt', 'Ein Hund.'],
  )
  assert status == 2 and error_line(err, 'decode.py') == (
    f'decode.py: error: --output {tmp_path}/missing/out.txt: cannot write it (No such file or '
    'directory)'
  )


# --- a cmlm run: mask-predict (conftest.py's cmlm_run) ------------------------------------


def test_decode_cli_method_mask_predict_translates_a_cmlm_run(cmlm_run, tmp_path):
  workdir = cmlm_run['workdir']
  source = tmp_path / 'in.en'
  source.write_text('one hundred\n\ntwenty-two\n')
  status, out, err = call(
    decode_cli.main,
    [
      '--checkpoint',
      workdir,
      '--method',
      'mask_predict',
      '--iterations',
      '4',
      '--length-beam',
      '2',
      '--input',
      source,
    ],
  )
  assert status == 0, err
  lines = out.split('\n')[:-1]
  assert len(lines) == 3 and lines[1] == ''
  translator = Translator.from_checkpoint(workdir)
  assert lines[::2] == translator.translate(
    ['one hundred', 'twenty-two'], MaskPredict(iterations=4, length_beam=2)
  )
  # The averaged checkpoints' directory and a fixed length decode too.
  status, out, err = call(
    decode_cli.main,
    [
      '--checkpoint',
      workdir / 'average-last2',
      '--method',
      'mask_predict',
      '--length',
      'fixed',
      'one hundred',
    ],
  )
  assert status == 0 and len(out.split('\n')) == 2, err
  # Without --method a cmlm checkpoint decodes with mask-predict, the default of its kind,
  # as Translator.translate does without a method.
  status, default_out, err = call(decode_cli.main, ['--checkpoint', workdir, 'twenty-two'])
  assert status == 0, err
  assert default_out == translator.translate(['twenty-two'])[0] + '\n'
  assert default_out == translator.translate(['twenty-two'], MaskPredict())[0] + '\n'


def test_decode_cli_length_options_reach_mask_predict(cmlm_run, monkeypatch):
  workdir = cmlm_run['workdir']
  sentences = ['one hundred', 'twenty-two', 'three thousand four hundred']
  translator = Translator.from_checkpoint(workdir)
  calls, mask_predict = [], non_autoregressive.mask_predict

  def recorded(*args, **settings):
    calls.append((settings['length_ratio'], settings['length_offset']))
    return mask_predict(*args, **settings)

  monkeypatch.setattr(non_autoregressive, 'mask_predict', recorded)
  status, out, err = call(
    decode_cli.main,
    [
      '--checkpoint',
      workdir,
      '--method',
      'mask_predict',
      '--iterations',
      '2',
      '--length-ratio',
      '1.5',
      '--length-offset=-1',
      *sentences,
    ],
  )
  assert status == 0, err
  assert calls == [(1.5, -1)]
  assert out.split('\n')[:-1] == translator.translate(
    sentences, MaskPredict(iterations=2, length_ratio=1.5, length_offset=-1)
  )


@pytest.mark.parametrize(
  'argv, message',
  [
    (
      ['--method', 'beam'],
      "method 'beam' decodes autoregressive models, but this model is "
      "model.kind='cmlm'; use method 'mask_predict'",
    ),
    (['--method', 'greedy'], "method 'greedy' decodes autoregressive models"),
    (
      ['--method', 'mask_predict', '--max-len', '5'],
      "max_len only applies to method 'beam' or 'greedy' or 'sample', not 'mask_predict'",
    ),
    (
      ['--method', 'beam', '--iterations', '4'],
      "iterations only applies to method 'mask_predict', not 'beam'",
    ),
    (
      ['--method', 'mask_predict', '--length', 'fixed', '--length-beam', '3'],
      "length='fixed' decodes one length per sentence: length_beam must be 1",
    ),
    (
      ['--method', 'mask_predict', '--iterations', '0'],
      'argument --iterations: must be >= 1, got 0',
    ),
    (['--method', 'nat'], "method 'nat' is now called 'mask_predict'"),
    (
      ['--method', 'beam', '--length-offset', '2'],
      "length_offset only applies to method 'mask_predict', not 'beam'",
    ),
    (['--length-ratio', '0'], 'argument --length-ratio: must be in (0, 65536], got 0.0'),
    (
      ['--seed', str(2**63)],  # integer limits in full, not 9.22337e+18
      f'argument --seed: must be in [-{2**63}, {2**63 - 1}], got {2**63}',
    ),
  ],
)
def test_decode_cli_refuses_methods_of_the_other_kind(cmlm_run, argv, message):
  status, _, err = call(decode_cli.main, ['--checkpoint', cmlm_run['workdir'], *argv, 'one'])
  assert status == 2
  assert message in error_line(err, 'decode.py')


def tree_bytes(directory: Path) -> dict[str, bytes]:
  """Every file under `directory` and its bytes."""
  return {
    str(path.relative_to(directory)): path.read_bytes()
    for path in sorted(directory.rglob('*'))
    if path.is_file()
  }


def test_decode_refuses_an_output_over_its_inputs_and_writes_nothing(decode_run, tmp_path):
  """--output that is the input, the references, or anything inside the checkpoint directory
  (its config.json, a symlink into it) is refused in one line, status 2, before any work; the
  files are byte for byte what they were."""
  workdir, _ = decode_run
  sources = tmp_path / 'sources.txt'
  sources.write_text('ein hund\n', encoding='utf-8')
  references = tmp_path / 'refs.txt'
  references.write_text('a dog\n', encoding='utf-8')
  (tmp_path / 'link').symlink_to(workdir)
  before = {**tree_bytes(workdir), 'sources': sources.read_bytes(), 'refs': references.read_bytes()}
  cases = [
    (sources, 'would replace the input'),
    (references, 'would replace the references'),
    (workdir / 'config.json', 'would write inside the checkpoint directory'),
    (tmp_path / 'link' / 'out.txt', 'would write inside the checkpoint directory'),
    (workdir, 'would replace the checkpoint directory'),
  ]
  for output, message in cases:
    status, out, err = call(
      decode_cli.main,
      [
        '--checkpoint',
        str(workdir),
        '--input',
        str(sources),
        '--reference',
        str(references),
        '--output',
        str(output),
      ],
    )
    assert status == 2 and out == '', (output, status, err)
    lines = err.strip().splitlines()
    assert (
      len(lines) == 1 and lines[0].startswith('decode.py: error: --output') and message in lines[0]
    ), err
  after = {**tree_bytes(workdir), 'sources': sources.read_bytes(), 'refs': references.read_bytes()}
  assert after == before
