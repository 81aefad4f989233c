"""The Multi30k recipe: the preset end to end on the real corpus, and its evaluation tools."""

import json
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import tokenizers

from benchmarks import multi30k
from flax_transformer.config import run_preset
from flax_transformer.data.corpus import load_parallel
from flax_transformer.nn.model import count_params
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train.loop import train


def whole_train_split(multi30k_dir, data_config, evaluated: int) -> datasets.DatasetDict:
  """Multi30k's whole training split, and the first `evaluated` pairs of validation and test."""
  corpus = load_parallel(str(multi30k_dir), data_config.src_lang, data_config.tgt_lang)
  return datasets.DatasetDict(
    {
      'train': corpus['train'],
      'validation': corpus['validation'].select(range(evaluated)),
      'test': corpus['test'].select(range(evaluated)),
    }
  )


@pytest.mark.filterwarnings('ignore:source length .* output capped')
def test_preset_trains_on_multi30k(tmp_path, multi30k_dir):
  model_config, train_config, data_config = run_preset('multi30k')
  # The preset's tokenizer, batches and model on the whole training split; 3 steps, and
  # 16 sentences each to validate on and decode (the full splits take minutes untrained).
  subset = whole_train_split(multi30k_dir, data_config, 16)
  messages = []
  result = train(
    model_config,
    train_config.replace(steps=3, log_every=1, eval_every=3, bleu_every=0, checkpoint_every=3),
    data_config.replace(source=str(multi30k_dir)),
    tmp_path,
    dataset=subset,
    print_fn=messages.append,
  )
  text = '\n'.join(messages)
  assert train_config.packing == 64 and 'train: 29,000 pairs packed' in text
  assert result.tokenizer.vocab_size == data_config.vocab_size == 16_000
  assert 3_500_000 < count_params(result.state.params) < 4_500_000
  assert int(result.state.step) == 3
  log = [json.loads(line) for line in (tmp_path / 'metrics.jsonl').read_text().splitlines()]
  losses = [m['loss'] for m in log if 'loss' in m]
  # Untrained: about log(16000) = 9.7 nats per token, label smoothing included.
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
  assert 'case:lc' in result['signatures'] and 'case:mixed' in result['signatures']


def test_tokenized_line_scores_moses_tokens_lowercased():
  # Moses keeps "z.B." whole where 13a splits it into "z . B ."; both sides match either way,
  # but a hypothesis that splits it itself only matches the reference under 13a.
  references = ['Ein Hund, z.B. ein Pudel, springt.']
  hypotheses = ['ein hund, z. b. ein pudel, springt.']
  result = multi30k.score(hypotheses, references, 'de')
  assert result['bleu_lc'] == pytest.approx(100.0)
  assert result['bleu_tok'] < 60.0
  assert multi30k.score(references, references, 'de')['bleu_tok'] == pytest.approx(100.0)
  signature = result['signatures']
  assert 'moses-norm+lc+tok-de' in signature and 'tok:none' in signature
  assert 'bleu_tok' not in multi30k.score(hypotheses, references)


def test_step_clock_carries_over_resumes_of_older_logs():
  # A log written before the clock carried on: the process resumed at step 20 (its line the
  # last before the reset) restarted at 0 s, and one more at step 40.
  lines = [
    {'step': 10, 'elapsed_s': 12.0},
    {'step': 20, 'elapsed_s': 22.0},
    {'step': 20, 'val_loss': 3.0},
    {'step': 30, 'elapsed_s': 15.0},
    {'step': 40, 'elapsed_s': 25.0},
    {'step': 50, 'elapsed_s': 16.0},
  ]
  assert multi30k.step_clock(lines) == {10: 12.0, 20: 22.0, 30: 37.0, 40: 47.0, 50: 63.0}
  # A log whose clock carries on is read as written.
  carried = [
    {'step': 10, 'elapsed_s': 12.0},
    {'step': 20, 'elapsed_s': 22.0},
    {'step': 30, 'elapsed_s': 37.0},
  ]
  assert multi30k.step_clock(carried) == {10: 12.0, 20: 22.0, 30: 37.0}


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
  multi30k.plot(SimpleNamespace(workdir=str(tmp_path), output=str(output), title=None, target=None))
  assert output.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert output.stat().st_size < 200 * 1024


def test_plot_draws_a_compare_files_runs_beside_a_run_directory(tmp_path, capsys):
  """A run whose directory is gone is drawn from its `compare` JSON: its validations, on a
  clock of the seconds per step it measured; a file that is not one is named."""
  compare = {
    'runs': [
      {
        'workdir': '/gone/anchor',
        'steps': 720,
        'seconds_per_step': 1.5,
        'evaluations': {
          '360': {'val_loss_per_token': 4.0, 'val_bleu_tok': 20.0},
          '720': {'val_loss_per_token': 3.0, 'val_bleu_tok': 30.0},
        },
      }
    ]
  }
  (tmp_path / 'curve.json').write_text(json.dumps(compare))
  ((label, lines),) = multi30k.curve_sources(tmp_path / 'curve.json')
  assert label == 'anchor (curve.json)'
  assert multi30k.time_to_bleu(lines, 25.0) == {
    'step': 720,
    'minutes': 18.0,
    'metric': 'val_bleu_tok',
    'value': 30.0,
  }
  run = tmp_path / 'new'
  run.mkdir()
  (run / 'metrics.jsonl').write_text(
    json.dumps({'step': 100, 'loss': 3.0, 'elapsed_s': 60.0})
    + '\n'
    + json.dumps({'step': 100, 'val_loss': 2.5, 'val_bleu_tok': 26.0})
    + '\n'
  )
  output = tmp_path / 'both.png'
  multi30k.plot(
    SimpleNamespace(
      workdir=f'{tmp_path / "curve.json"},{run}', output=str(output), title=None, target=25.0
    )
  )
  printed = capsys.readouterr().out
  assert 'anchor (curve.json): validation val_bleu_tok >= 25 at step 720, 18 min' in printed
  assert 'new: validation val_bleu_tok >= 25 at step 100, 1 min' in printed
  assert output.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  (tmp_path / 'other.json').write_text('{"benchmark": "step"}')
  with pytest.raises(SystemExit, match='other.json: not a `compare` JSON file'):
    multi30k.curve_sources(tmp_path / 'other.json')


def test_time_to_bleu_reads_the_first_validation_at_the_target(tmp_path, capsys):
  lines = [{'step': step, 'loss': 3.0, 'elapsed_s': 1.5 * step} for step in range(50, 401, 50)]
  lines += [
    {'step': 100, 'val_bleu': 45.0, 'val_bleu_tok': 30.0},
    {'step': 200, 'val_bleu': 46.0, 'val_bleu_tok': 40.5},
    {'step': 300, 'val_bleu': 47.0, 'val_bleu_tok': 39.0},
    {'step': 400, 'val_bleu': 48.0, 'val_bleu_tok': 41.0},
  ]
  # Tokenized BLEU, when logged, is the curve's: step 200 (300 s of training), not 100.
  assert multi30k.time_to_bleu(lines, 40.0) == {
    'step': 200,
    'minutes': 5.0,
    'metric': 'val_bleu_tok',
    'value': 40.5,
  }
  assert multi30k.time_to_bleu(lines, 42.0) is None
  # A validation between two logged steps (every 72 against every 50) reads the clock
  # interpolated between them; outside the logged steps there is none.
  clock = multi30k.step_clock(lines)
  assert multi30k.seconds_at(clock, 175) == pytest.approx(262.5)
  assert multi30k.seconds_at(clock, 401) is None
  between = lines + [{'step': 390, 'val_bleu_tok': 41.5}]
  assert multi30k.time_to_bleu(between, 41.2) == {
    'step': 390,
    'minutes': pytest.approx(9.75),
    'metric': 'val_bleu_tok',
    'value': 41.5,
  }
  older = [{k: v for k, v in m.items() if k != 'val_bleu_tok'} for m in lines]
  assert multi30k.time_to_bleu(older, 46.0)['step'] == 200
  # Two runs on one figure, the time to the target printed for each.
  for name in ('a', 'b'):
    (tmp_path / name).mkdir()
    (tmp_path / name / 'metrics.jsonl').write_text(
      ''.join(json.dumps({**m, 'val_loss': 2.0} if 'val_bleu' in m else m) + '\n' for m in lines)
    )
  output = tmp_path / 'both.png'
  multi30k.plot(
    SimpleNamespace(
      workdir=f'{tmp_path / "a"},{tmp_path / "b"}', output=str(output), title=None, target=40.0
    )
  )
  printed = capsys.readouterr().out
  assert printed.count('validation val_bleu_tok >= 40 at step 200, 5 min of training') == 2
  assert output.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def test_compare_measures_loss_per_sentence_with_each_runs_tokenizer(tmp_path):
  english = [
    'a man rides a red bike',
    'two dogs play in the snow',
    'a woman reads a book',
    'children run home from school',
  ]
  german = [
    'ein mann fährt ein rotes rad',
    'zwei hunde spielen im schnee',
    'eine frau liest ein buch',
    'kinder rennen von der schule heim',
  ]
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  for stem in ('train', 'val'):
    (corpus / f'{stem}.en').write_text('\n'.join(english) + '\n')
    (corpus / f'{stem}.de').write_text('\n'.join(german) + '\n')
  val_ppl = 20.0
  workdirs = []
  for size in (40, 120):
    workdir = tmp_path / f'vocab{size}'
    Tokenizer.train(english + german, size).save(workdir)
    (workdir / 'config.json').write_text(
      json.dumps({'data': {'src_lang': 'en', 'tgt_lang': 'de', 'vocab_size': size}})
    )
    # Steps 10-40 at 1 s per step, except 40-50 (which held a validation pass); step 60 is
    # past the compared range.
    clock = {10: 10, 20: 20, 30: 30, 40: 40, 50: 90, 60: 100}
    lines = [{'step': step, 'loss': 3.0, 'elapsed_s': seconds} for step, seconds in clock.items()]
    lines += [
      {'step': 50, 'val_ppl': val_ppl, 'val_accuracy': 0.25},
      {'step': 50, 'val_bleu': 12.5, 'val_chrf': 30.0, 'val_bleu_tok': 14.0},
      {'step': 60, 'val_ppl': 2.0},
    ]
    (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(m) + '\n' for m in lines))
    workdirs.append(workdir)

  result = multi30k.compare(
    SimpleNamespace(workdirs=[str(w) for w in workdirs], steps=50, data=str(corpus), output=None)
  )

  sentence_losses = []
  for workdir, run in zip(workdirs, result['runs']):
    backend = tokenizers.Tokenizer.from_file(str(workdir / 'tokenizer.json'))
    targets = [len(backend.encode(text, add_special_tokens=False).ids) + 1 for text in german]
    assert run['target_tokens_per_sentence'] == pytest.approx(np.mean(targets))
    assert run['seconds_per_step'] == pytest.approx(1.0)
    assert run['steps'] == 50 and list(run['evaluations']) == [50]
    evaluation = run['evaluations'][50]
    assert evaluation['val_bleu'] == 12.5 and evaluation['val_chrf'] == 30.0
    assert evaluation['elapsed_s'] == 90
    assert evaluation['val_loss_per_sentence'] == pytest.approx(np.log(val_ppl) * np.mean(targets))
    # The per-token loss, accuracy and tokenized BLEU are carried over as logged.
    assert evaluation['val_loss_per_token'] == pytest.approx(np.log(val_ppl))
    assert evaluation['val_token_accuracy'] == pytest.approx(0.25)
    assert evaluation['val_bleu_tok'] == pytest.approx(14.0)
    sentence_losses.append(evaluation['val_loss_per_sentence'])
  # The smaller vocabulary cuts the same sentences into more pieces: at an equal loss per
  # token, its loss per sentence is the larger.
  assert result['runs'][0]['vocab_size'] < result['runs'][1]['vocab_size']
  assert sentence_losses[0] > sentence_losses[1]


@pytest.mark.filterwarnings('ignore:source length .* output capped')
def test_the_fairseq_preset_validates_and_saves_once_an_epoch(tmp_path, multi30k_dir):
  """multi30k_fairseq validates and checkpoints every MULTI30K_FAIRSEQ_EPOCH steps, as fairseq
  does at each epoch's end: that is its batches per epoch on the real corpus, preprocessed,
  and a run of it sees lowercased Moses tokens and writes detokenized lowercase text."""
  from flax_transformer.config import MULTI30K_FAIRSEQ_EPOCH

  model_config, train_config, data_config = run_preset('multi30k_fairseq')
  subset = whole_train_split(multi30k_dir, data_config, 8)
  messages = []
  result = train(
    model_config,
    train_config.replace(steps=1, log_every=1, bleu_every=0, patience=0),
    data_config.replace(source=str(multi30k_dir)),
    tmp_path,
    dataset=subset,
    print_fn=messages.append,
  )
  text = '\n'.join(messages)
  assert f'29,000 pairs in {MULTI30K_FAIRSEQ_EPOCH} batches per epoch of <= 8,192 tokens' in text
  assert 'punctuation normalised, lowercased, Moses-tokenized (outputs detokenized)' in text
  assert result.tokenizer.vocab_size == 10_000
  assert result.tokenizer.encode(['A man, in blue.']) == result.tokenizer.inner.encode(
    ['a man , in blue .']
  )
  assert 'tokenized BLEU' in text and 'pre:moses-norm+lc+tok-de' in text


def test_the_grid_stops_a_stage_at_its_budget_and_refuses_unknown_recipes(tmp_path, capsys):
  import sys
  import time

  from benchmarks import multi30k_grid

  log = tmp_path / 'stage.log'
  start = time.monotonic()
  stage = multi30k_grid.run_stage(
    [sys.executable, '-c', 'import time; time.sleep(60)'], log, deadline=time.monotonic() + 1.0
  )
  assert stage['ended'] == 'stopped at the budget' and stage['exit_code'] != 0
  assert time.monotonic() - start < 30 and log.read_text().startswith('$ ')
  finished = multi30k_grid.run_stage(
    [sys.executable, '-c', 'print("done")'], log, deadline=time.monotonic() + 60
  )
  assert finished['ended'] == 'finished' and 'done' in log.read_text()
  # Every recipe is train.py's options on a preset train.py knows.
  from flax_transformer.cli.options import configs_from_args
  from flax_transformer.cli.train import build_parser
  from flax_transformer.config import RUN_PRESETS

  for options in multi30k_grid.RECIPES.values():
    assert options[0] == '--preset' and options[1] in RUN_PRESETS
    # ... and each parses into valid settings, as train.py reads them.
    configs_from_args(build_parser().parse_args(options))
  # The stall's recipe undoes the preset's initialisation gain, and only that.
  gain1 = configs_from_args(build_parser().parse_args(multi30k_grid.RECIPES['gain1-ende-s1']))
  anchor = configs_from_args(build_parser().parse_args(multi30k_grid.RECIPES['fairseq-ende-s1']))
  assert gain1[0].qkv_init_gain == pytest.approx(1.0)
  assert anchor[0].qkv_init_gain == pytest.approx(2**-0.5)
  assert gain1[0].replace(qkv_init_gain=anchor[0].qkv_init_gain) == anchor[0]
  # The headline's seeds are one recipe: the same settings but the seed, on a schedule that ends.
  seed1, seed2 = (
    configs_from_args(build_parser().parse_args(multi30k_grid.RECIPES[f'wsd4k-ende-s{seed}']))
    for seed in (1, 2)
  )
  assert (seed1[1].schedule, seed1[1].steps, seed1[1].seed, seed2[1].seed) == ('wsd', 4000, 1, 2)
  assert seed2[1].replace(seed=1) == seed1[1] and seed2[0] == seed1[0]
  # The linear recipe is the headline's but for the schedule.
  linear = configs_from_args(build_parser().parse_args(multi30k_grid.RECIPES['linear4k-ende-s1']))
  assert linear[1].schedule == 'linear' and linear[1].replace(schedule='wsd') == seed1[1]
  assert linear[0] == seed1[0] and linear[2] == seed1[2]
  cased = configs_from_args(build_parser().parse_args(multi30k_grid.RECIPES['wsd4k-cased-ende-s1']))
  assert cased[:2] == seed1[:2] and not (cased[2].lowercase or seed1[2].pretokenize == 'none')
  assert (
    cased[2].replace(normalize_punctuation=True, lowercase=True, pretokenize='moses') == seed1[2]
  )
  sys_argv = sys.argv
  try:
    sys.argv = ['multi30k_grid', '--runs', 'fairseq-ende-s1,no-such-recipe']
    with pytest.raises(SystemExit) as exit_status:
      multi30k_grid.main()
  finally:
    sys.argv = sys_argv
  assert exit_status.value.code == 2
  assert "unknown recipe 'no-such-recipe'" in capsys.readouterr().err


def _evaluation(test_bleu: float, val_bleu: float, steps: int) -> dict:
  """A `benchmarks.multi30k evaluate` result: the chosen variant, and a better-scoring one on
  test that validation did not choose (a summary must not pick by test)."""
  rows = []
  for search, shift in (('beam5-a1', 0.0), ('greedy', 5.0)):
    for split, bleu in (('validation', val_bleu - shift), ('test', test_bleu + shift)):
      scores = {'bleu_tok': bleu, 'bleu_lc': bleu + 0.1, 'bleu': bleu - 1.0, 'chrf': 2 * bleu}
      rows.append({'weights': 'average-last10', 'search': search, 'split': split, **scores})
  selected = {'weights': 'average-last10', 'search': 'beam5-a1', 'by': 'bleu_tok'}
  return {'steps': steps, 'rows': rows, 'selected': selected}


def test_the_grid_summarises_each_recipe_over_its_seeds(tmp_path, capsys):
  from benchmarks import multi30k_grid

  tests = {'dff512-ende-s1': 39.92, 'dff512-ende-s2': 40.40, 'dff512-ende-s3': 41.13}
  for index, (name, bleu) in enumerate(tests.items()):
    (tmp_path / f'{name}.json').write_text(json.dumps(_evaluation(bleu, bleu + 0.3, 5000 + index)))
  (tmp_path / 'fairseq-deen-s1.json').write_text(json.dumps(_evaluation(39.0, 39.8, 5213)))
  (tmp_path / 'grid.json').write_text(json.dumps({'runs': {}}))  # what ran: not an evaluation
  recipes = multi30k_grid.summarize(tmp_path)
  assert json.loads((tmp_path / 'seeds.json').read_text()) == recipes
  assert set(recipes) == {'dff512-ende', 'fairseq-deen'}
  dff512 = recipes['dff512-ende']
  assert dff512['runs'] == list(tests) and dff512['steps'] == [5000, 5001, 5002]
  values = np.array(list(tests.values()), np.float64)
  test = dff512['test']['bleu_tok']
  assert test['values'] == pytest.approx(values.tolist())  # the chosen search, not greedy's
  assert test['mean'] == pytest.approx(values.mean(), abs=1e-12)
  assert test['std'] == pytest.approx(values.std(ddof=1), abs=1e-12)
  assert (test['min'], test['max']) == (pytest.approx(39.92), pytest.approx(41.13))
  assert dff512['validation']['chrf']['mean'] == pytest.approx(2 * (values + 0.3).mean())
  one_seed = recipes['fairseq-deen']['test']['bleu_tok']
  assert one_seed['mean'] == pytest.approx(39.0) and one_seed['std'] is None
  table = capsys.readouterr().out
  assert f'{values.mean():.2f} ± {values.std(ddof=1):.2f}' in table and '39.00' in table


def test_the_multi30k_tools_answer_a_missing_or_half_written_run_in_one_line(tmp_path, random_run):
  from benchmarks import multi30k_grid

  def refusal(call) -> str:
    with pytest.raises(SystemExit) as stopped:
      call()
    message = str(stopped.value.code)
    assert '\n' not in message and 'Traceback' not in message
    return message

  evaluate = lambda workdir, **more: multi30k.evaluate(
    SimpleNamespace(
      **{'workdir': str(workdir), 'data': str(tmp_path), 'average_last': [], 'weights': [], **more}
    )
  )
  assert refusal(lambda: evaluate(tmp_path / 'gone')).endswith('gone: no such run directory')
  assert 'not a run of train.py (no config.json there)' in refusal(lambda: evaluate(tmp_path))
  half = tmp_path / 'half'
  half.mkdir()
  (half / 'config.json').write_text('{"model": {"d_model": 3')
  assert refusal(lambda: evaluate(half)).startswith(f'{half / "config.json"}: not complete JSON')
  compare = SimpleNamespace(workdirs=[str(half)], data=str(tmp_path), steps=10)
  assert 'not complete JSON' in refusal(lambda: multi30k.compare(compare))
  # An unknown --weights names the known ones.
  message = refusal(
    lambda: evaluate(random_run.run_dir, average_last=[2], weights=['average-last3'])
  )
  assert message.startswith('--weights average-last3: not one of average-last2, best, ema, last')
  # The grid's summary: an empty directory, a half-written evaluation.
  results = tmp_path / 'results'
  results.mkdir()
  assert 'no evaluations there' in refusal(lambda: multi30k_grid.summarize(results))
  (results / 'run.json').write_text('{"selected": ')
  assert refusal(lambda: multi30k_grid.summarize(results)).startswith(f'{results / "run.json"}')
  assert 'no such results directory' in refusal(lambda: multi30k_grid.summarize(tmp_path / 'x'))
