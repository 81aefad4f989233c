"""benchmarks/gpu_check.py --tiny: every part of the GPU check runs on this CPU, so the command
is ready (and has not rotted) the first time a GPU is at hand.

One run of the tiny check per module; its JSON files are read part by part. The parts that need
the Multi30k corpus (the stand-in is made from it) skip without it, saying so.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.workloads import Shape
from flax_transformer.bench.flops import train_flops

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def check(tmp_path_factory):
  """(exit status, stderr, {part: results}) of the tiny check run with every part."""
  output = tmp_path_factory.mktemp('gpu_check')
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'benchmarks.gpu_check',
      '--tiny',
      '--output-dir',
      str(output),
      '--budget-s',
      '600',
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=900,
    env={**os.environ, 'JAX_PLATFORMS': 'cpu'},
  )
  parts = {
    path.stem.removeprefix('gpu_check_'): json.loads(path.read_text())
    for path in output.glob('gpu_check_*.json')
  }
  return done.returncode, done.stderr, parts


def results_of(check, part: str) -> dict:
  status, stderr, parts = check
  assert status == 0, stderr[-3000:]
  assert set(parts) == set(gpu_check.PARTS)
  assert parts[part]['tiny'] and parts[part]['accelerator']['platform'] == 'cpu'
  results = parts[part]['results']
  if 'skipped' in results:
    pytest.skip(results['skipped'])
  return results


def test_numerics_compare_the_fused_kernel_with_einsum(check):
  results = results_of(check, 'numerics')
  assert results['fused'] == 'xla'  # cuDNN's place on a CPU
  assert results['float32']['kernel'] == results['bfloat16']['kernel'] == 'xla'
  for name in ('logits', 'gradients'):
    assert 0 <= results['float32'][f'{name}_max_difference_over_largest'] < 1e-5
    # bfloat16 keeps 8 bits: measured 0.6-0.8% (logits) and 3.4-4.0% (gradients) here
    assert 0 <= results['bfloat16'][f'{name}_max_difference_over_largest'] < 0.1


def test_mfu_times_each_kernel_and_remat_policy(check):
  results = results_of(check, 'mfu')
  cells = results['cells']
  assert {(c['kernel'], c['remat']) for c in cells} == {
    ('einsum', 'none'),
    ('xla', 'layer'),
    ('xla', 'dots'),
  }
  config = gpu_check.model_config('tiny')
  for cell in cells:
    assert cell['median_s'] > 0 and cell['temp_gib'] > 0 and cell['compile_s'] > 0
    flops = train_flops(config, Shape(*map(int, cell['shape'].replace('+', 'x').split('x'))))
    assert math.isclose(cell['tflops'], flops / cell['median_s'] / 1e12, rel_tol=1e-9)
    assert math.isclose(
      cell['mfu_of_measured_peak'], cell['tflops'] / results['matmul_peak_tflops'], rel_tol=1e-9
    )


def test_decode_reports_greedy_and_beam_tokens_per_second(check):
  results = results_of(check, 'decode')
  assert {c['search'] for c in results['cells']} == {'greedy', 'beam4'}
  for cell in results['cells']:
    assert math.isclose(
      cell['tokens_per_s'], cell['batch'] * results['new_tokens'] / cell['median_s'], rel_tol=1e-9
    )


def test_input_sets_host_seconds_per_batch_against_device_seconds_per_step(check):
  results = results_of(check, 'input')
  assert results['first_run']['first_step_s'] > results['first_run']['cache_written_s'] > 0
  assert 0 < results['bucketed_host_s_per_batch'] <= results['bucketed_host_s_per_batch_p90']
  rows, length = results['bucketed_most_frequent_shape']
  assert results['device_step_shape'] == f'{rows}x{length}+{length}'
  assert math.isclose(
    results['host_over_device'], results['bucketed_host_s_per_batch'] / results['device_s_per_step']
  )


def test_multi30k_trains_to_the_end_and_scores_the_test_set(check):
  results = results_of(check, 'multi30k')
  assert results['train_status'] == 0 and results['train_wall_s'] > 0
  assert any('BLEU' in line for line in results['score_lines']), results['score_lines']
  # lowercasing only adds n-gram matches, at the same lengths
  assert 0 <= results['test_2016_bleu'] <= results['test_2016_bleu_lowercased'] <= 100


def test_a_run_past_its_deadline_gets_sigterm():
  import signal
  import time

  started = time.monotonic()
  status, out, _ = gpu_check.run_until(
    [sys.executable, '-c', 'import time; print("started", flush=True); time.sleep(60)'],
    deadline=started + 1,
    least_s=0.5,
  )
  assert status == -signal.SIGTERM and out == 'started\n'
  assert time.monotonic() - started < 30


def test_a_failing_part_is_written_and_the_others_still_run(tmp_path, monkeypatch):
  def broken(setting, deadline):
    raise NotImplementedError('cuDNN: unsupported sequence length')

  monkeypatch.setattr(gpu_check, 'numerics', broken)
  monkeypatch.setattr(gpu_check, 'decode', lambda setting, deadline: {'cells': []})
  status = gpu_check.main(['--tiny', '--parts', 'numerics,decode', '--output-dir', str(tmp_path)])
  assert status == 1
  failed = json.loads((tmp_path / 'gpu_check_numerics.json').read_text())['results']
  assert failed['failed'] == 'NotImplementedError: cuDNN: unsupported sequence length'
  assert json.loads((tmp_path / 'gpu_check_decode.json').read_text())['results'] == {'cells': []}
