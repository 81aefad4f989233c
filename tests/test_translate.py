"""Text-level decoding: Translator (batching, order, truncation, alignment) and decode.py."""

import importlib.util
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from flax_transformer import ConfigError, ModelConfig, Transformer, decoding
from flax_transformer.checkpoint import Checkpoints, write_config
from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.translate import Search, Translator

CORPUS = ['Ein Mann fährt Fahrrad.', 'Zwei Hunde spielen im Schnee.', 'Eine Frau liest ein Buch.',
          'Kinder spielen am Strand.', 'Ein Hund läuft über die Wiese.',
          'A man rides a bike.', 'Two dogs play in the snow.', 'A woman reads a book.']
# Lengths that need several source widths, and an empty line.
SENTENCES = ['Ein Hund spielt.', 'Zwei Männer fahren Fahrrad im Schnee am Strand und die Frau '
             'liest.', '', 'Kinder.', 'Eine Frau läuft über die Wiese im Schnee.']
MAX_LEN = 64

# The tiny model's max_len caps the source + 50 budget of the longest sentences;
# test_decoding.py checks that warning.
pytestmark = pytest.mark.filterwarnings('ignore:source length .* exceeds model.max_len')


def load_decode_script():
  path = Path(__file__).resolve().parents[1] / 'decode.py'
  spec = importlib.util.spec_from_file_location('decode_script', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope='module')
def tokenizer():
  return Tokenizer.train(CORPUS, vocab_size=120)


@pytest.fixture(scope='module')
def config(tokenizer):
  return ModelConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=MAX_LEN, dropout_rate=0.0)


@pytest.fixture(scope='module')
def params(config):
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  # A longer EOS embedding so that random-weight translations end at different lengths.
  params['embedding']['embedding'] = params['embedding']['embedding'].at[config.eos_id].multiply(10)
  return params


@pytest.fixture(scope='module')
def translator(config, params, tokenizer):
  return Translator(config, params, tokenizer)


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory, config, params, tokenizer):
  workdir = tmp_path_factory.mktemp('run')
  write_config(workdir, config, TrainConfig(), DataConfig())
  tokenizer.save(workdir)
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(7, jax.device_get(params))
  checkpoints.close()
  return workdir


@pytest.fixture(scope='module')
def greedy_translations(translator):
  return translator.translate(SENTENCES, method='greedy', batch_size=2)


@pytest.fixture(scope='module')
def decode_script():
  return load_decode_script()


def test_batches_come_back_in_input_order(translator, config, params, tokenizer,
                                          greedy_translations):
  # Reference: all non-empty sentences in one batch, in input order.
  present = [s for s in SENTENCES if s]
  rows = [ids + [config.eos_id] for ids in tokenizer.encode(present)]
  src = np.array([row + [config.pad_id] * (MAX_LEN - len(row)) for row in rows], np.int32)
  expected = tokenizer.decode(np.asarray(decoding.greedy(Transformer(config), params, src)))
  assert [t for s, t in zip(SENTENCES, greedy_translations) if s] == expected
  assert len(set(expected)) > 1, 'the fixture should give different translations'


def test_empty_sentences_translate_to_empty_lines(greedy_translations):
  assert len(greedy_translations) == len(SENTENCES)
  assert greedy_translations[SENTENCES.index('')] == ''
  assert all(t for s, t in zip(SENTENCES, greedy_translations) if s)


def test_sources_are_encoded_like_training_and_truncated(translator, tokenizer):
  long = ' '.join(['Hund'] * 80)
  sources = translator.encode(['Ein Hund.', long, ' '])
  np.testing.assert_array_equal(sources.ids[0], tokenizer.encode(['Ein Hund.'])[0] + [2])
  assert len(sources.ids[1]) == MAX_LEN and sources.ids[1][-1] == 2
  assert sources.ids[2] is None
  assert sources.truncated == [(1, len(tokenizer.encode([long])[0]))]
  with pytest.warns(UserWarning, match=f'sentence 0: .* exceed model.max_len={MAX_LEN}; truncated'):
    translator.translate([long], method='greedy')


def test_from_checkpoint_translates_like_the_saved_model(run_dir, greedy_translations):
  loaded = Translator.from_checkpoint(run_dir)
  assert loaded.translate(SENTENCES, method='greedy', batch_size=2) == greedy_translations


@pytest.mark.parametrize('settings, message', [
    (dict(method='nucleus'), 'method must be one of beam, greedy, sample'),
    (dict(method='greedy', beam_size=8), "beam_size only apply to method 'beam'"),
    (dict(method='beam', temperature=0.7, top_p=0.9),
     "temperature, top_p only apply to method 'sample'"),
    (dict(method='sample', top_p=1.5), r'top_p must be in \(0, 1\]'),
])
def test_search_settings_are_checked(settings, message):
  with pytest.raises(ConfigError, match=message):
    Search(**settings)


def test_alignment_is_the_cross_attention_of_the_output(translator, config, tokenizer):
  alignment = translator.alignment('Ein Hund spielt.', 'A dog plays.')
  source = tokenizer.encode(['Ein Hund spielt.'])[0] + [config.eos_id]
  target = tokenizer.encode(['A dog plays.'])[0] + [config.eos_id]
  assert alignment.source_tokens == [tokenizer.id_to_token(i) for i in source]
  assert alignment.target_tokens == [tokenizer.id_to_token(i) for i in target]
  assert alignment.weights.shape == (config.num_decoder_layers, config.num_heads, len(target),
                                     len(source))
  np.testing.assert_allclose(alignment.weights.sum(axis=-1), 1.0, rtol=1e-5)

  # Without a translation, the one decoded from the same source ids.
  decoded = translator.alignment('Ein Hund spielt.', search=Search(method='greedy'))
  output = np.asarray(decoding.greedy(translator.model, translator.variables,
                                      np.array([source])))[0]
  assert decoded.target_tokens == [tokenizer.id_to_token(i) for i in output if i != 0]
  assert decoded.weights.shape[2] == len(decoded.target_tokens)


# --- decode.py ------------------------------------------------------------------


def test_cli_translates_arguments_to_stdout(decode_script, run_dir, greedy_translations, capsys):
  status = decode_script.main(['--checkpoint', str(run_dir), '--method', 'greedy',
                               '--batch-size', '2', *SENTENCES])
  captured = capsys.readouterr()
  assert status == 0, captured.err
  assert captured.out.split('\n')[:-1] == greedy_translations


def test_cli_file_to_file_with_reference_scores(decode_script, run_dir, greedy_translations,
                                                tmp_path, capsys):
  source, output, reference = tmp_path / 'in.de', tmp_path / 'out.en', tmp_path / 'ref.en'
  source.write_text('\n'.join(SENTENCES) + '\n')
  reference.write_text('\n'.join(greedy_translations[:-1] + ['something else']) + '\n')
  status = decode_script.main(['--checkpoint', str(run_dir), '--method', 'greedy',
                               '--batch-size', '2', '--input', str(source), '--output', str(output),
                               '--reference', str(reference)])
  captured = capsys.readouterr()
  assert status == 0, captured.err
  assert output.read_text().split('\n')[:-1] == greedy_translations
  bleu, chrf = captured.out.strip().split('\n')
  assert bleu.startswith('BLEU = ') and 'signature: nrefs:1|case:mixed|eff:no|tok:13a' in bleu
  assert chrf.startswith('chrF2 = ') and 'signature: nrefs:1|case:mixed|eff:yes|nc:6' in chrf
  assert 0.0 < float(bleu.split()[2]) < 100.0


def test_cli_warns_about_overlong_lines(decode_script, run_dir, tokenizer, tmp_path, capsys):
  source, long = tmp_path / 'long.de', ' '.join(['Hund'] * 80)
  source.write_text('Ein Hund.\n' + long + '\n')
  status = decode_script.main(['--checkpoint', str(run_dir), '--method', 'greedy',
                               '--input', str(source)])
  captured = capsys.readouterr()
  assert status == 0
  count = len(tokenizer.encode([long])[0])
  assert f'warning: line 2 has {count} subword tokens; the model reads at most {MAX_LEN - 1}' \
      in captured.err
  assert len(captured.out.split('\n')) == 3


@pytest.mark.parametrize('arguments, message', [
    (['--checkpoint', '{tmp}/missing', 'Hallo'], 'missing: no such directory'),
    (['--checkpoint', '{tmp}', 'Hallo'], 'config.json: no such file'),
    (['--checkpoint', '{run}', '--input', '{tmp}/empty.txt'], 'empty.txt is empty'),
    (['--checkpoint', '{run}', '--input', '{tmp}/nothing.txt'], 'nothing.txt: no such file'),
    (['--checkpoint', '{run}', '--max-len', '100', 'Hallo'], r'--max-len must be in \[1, 64\]'),
    (['--checkpoint', '{run}', '--step', '3', 'Hallo'], r'no checkpoint at step 3 \(have: 7\)'),
    (['--checkpoint', '{run}', '--temperature', '0.5', 'Hallo'],
     "temperature only apply to method 'sample'"),
    (['--checkpoint', '{run}', '--reference', '{tmp}/empty.txt', 'Hallo', 'Welt'],
     'has 0 lines, the input has 2'),
])
def test_cli_errors_are_one_line_messages(decode_script, run_dir, tmp_path, capsys, arguments,
                                          message):
  (tmp_path / 'empty.txt').write_text('')
  arguments = [a.format(tmp=tmp_path, run=run_dir) for a in arguments]
  assert decode_script.main(arguments) == 2
  err = capsys.readouterr().err
  assert err.startswith('decode.py: error: ') and err.count('\n') == 1
  assert re.search(message, err), err
