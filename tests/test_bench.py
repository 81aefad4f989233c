"""flax_transformer.bench: its reports' arithmetic, its FLOP counts against XLA's, the memory
of the remat policies through it, that the step it times is train.py's, and its command.

No test asserts a speed: timings are only checked to be what the reports compute from.
"""

import importlib.util
import json
import os
import time

import jax
import numpy as np
import pytest

from flax_transformer import bench
from flax_transformer.bench import command
from flax_transformer.bench.compiled import Compilation, CompiledMemory
from flax_transformer.bench.environment import cpu_description
from flax_transformer.bench.flops import BatchShape, train_flops
from flax_transformer.bench.peaks import PeakReport, datasheet_peak
from flax_transformer.bench.shape_mix import ShapeMix
from flax_transformer.bench.step import StepReport, TrainingStep, synthetic_batch
from flax_transformer.bench.timing import Timing, alternating_rounds, time_rounds
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.train import loop as train_loop

TINY = ModelConfig.tiny()
# Matmuls dominate: softmax, LayerNorm and Adam add a few percent (tests/test_benchmarks.py).
DENSE = ModelConfig.tiny(d_model=128, d_ff=512, vocab_size=512, num_heads=4)
DENSE_SHAPE = BatchShape(8, 16, 12)


def fake_timing(*seconds):
  return Timing(tuple(float(s) for s in seconds))


def test_timing_percentiles_by_hand():
  timing = fake_timing(0.5, 0.1, 0.4, 0.2, 0.3)  # sorted 0.1 .. 0.5
  assert timing.median_s == pytest.approx(0.3)
  # Linear interpolation between order statistics: rank 0.4 and 3.6 of 0..4.
  assert timing.p10_s == pytest.approx(0.1 + 0.4 * 0.1)
  assert timing.p90_s == pytest.approx(0.4 + 0.6 * 0.1)
  assert timing.to_dict()['times_s'] == [0.5, 0.1, 0.4, 0.2, 0.3]
  with pytest.raises(ValueError, match='at least one'):
    Timing(())


def test_alternating_rounds_interleave_the_contenders():
  calls = []
  timings = alternating_rounds(
    {'a': lambda: calls.append('a'), 'b': lambda: calls.append('b')}, rounds=3, warmup=1
  )
  assert calls == ['a', 'b'] + ['a', 'b'] * 3  # warm-up, then a b in every round
  assert {name: len(t.times_s) for name, t in timings.items()} == {'a': 3, 'b': 3}
  with pytest.raises(ValueError, match='rounds must be a positive integer'):
    alternating_rounds({'a': lambda: None}, rounds=0)


def step_report(**overrides):
  values = dict(
    model='m',
    parameters=10,
    shape=BatchShape(4, 8, 6),
    packing=0,
    dtype='float32',
    attention_kernel='einsum',
    remat='none',
    device='cpu',
    devices=2,
    parallel='shard_map',
    real_tokens=20,
    compilation=Compilation(1.5, 'off', 1),
    timing=fake_timing(0.2, 0.1, 0.4),
    analytic_flops=6_000,
    xla_flops=6_300.0,
    memory=CompiledMemory(temporaries=100, arguments=40, outputs=40, aliased=30),
    peak_flops_per_s=25_000.0,
    datasheet_flops_per_s=50_000.0,
  )
  return StepReport(**{**values, **overrides})


def test_step_report_arithmetic():
  report = step_report()
  assert report.tokens_per_s == pytest.approx(20 / 0.2)
  assert report.flops_per_s == pytest.approx(6_000 / 0.2)
  # MFU: model FLOP/s over the peak of both devices.
  assert report.mfu == pytest.approx(6_000 / 0.2 / (25_000 * 2))
  assert report.datasheet_mfu == pytest.approx(6_000 / 0.2 / (50_000 * 2))
  assert report.memory.total == 100 + 40 + 40 - 30
  assert step_report(peak_flops_per_s=None).mfu is None
  as_peak = PeakReport(
    device='cpu',
    dtype='float32',
    size=10,
    iterations=3,
    timing=fake_timing(0.001),
    datasheet_flops_per_s=None,
  )
  assert as_peak.flops == 2 * 10**3 * 3
  assert report.with_peak(as_peak).peak_flops_per_s == pytest.approx(6_000 / 0.001)
  row = report.to_dict()
  assert row['tokens_per_s'] == pytest.approx(100.0) and row['memory']['total'] == 150
  assert json.loads(json.dumps(row)) == row  # JSON-ready
  assert 'MFU' in report.table() and '60.0% of the measured peak' in report.table()
  # train.time_budget: (budget - compile) / median step; 1 min: (60 - 1.5) / 0.2 = 292 steps.
  assert report.budget_steps is None and 'budget' not in report.table()
  budgeted = step_report(time_budget='1m')
  assert budgeted.budget_steps == 292
  assert budgeted.to_dict()['budget_steps'] == 292
  assert '1m: at most 292 of these steps' in budgeted.table()


def test_datasheet_peaks_match_the_device_names_jax_reports():
  assert datasheet_peak('NVIDIA H100 80GB HBM3', 'bfloat16') == pytest.approx(989.4e12)
  assert datasheet_peak('NVIDIA H200', 'float32') == pytest.approx(494.7e12)
  assert datasheet_peak('TPU v5 lite', 'bfloat16') == pytest.approx(197e12)  # not v5p's
  assert datasheet_peak('TPU v5p', 'bfloat16') == pytest.approx(459e12)
  assert datasheet_peak('cpu', 'float32') is None
  assert datasheet_peak('Tesla V100-SXM2-16GB', 'bfloat16') is None  # no bfloat16 there


def test_batch_shape_parsing_and_token_budgets():
  assert BatchShape.parse('32x64+48') == BatchShape(32, 64, 48)
  assert BatchShape.parse('32x64') == BatchShape(32, 64, 64)
  for bad in ('32', '0x8', 'ax8', '4x8+'):
    if bad == '4x8+':
      assert BatchShape.parse(bad) == BatchShape(4, 8, 8)
      continue
    with pytest.raises(ValueError):
      BatchShape.parse(bad)
  # train.py's bucket rows: max_tokens // L rounded down to the devices, at least that.
  assert BatchShape.for_tokens(4096, 48, 4) == BatchShape(84, 48, 48)
  assert BatchShape.for_tokens(100, 64, 2) == BatchShape(2, 64, 64)
  # An epoch's shapes with their batches, as train.py's log names them.
  mix = ShapeMix.parse('1024x8:2, 128x64+64:6')
  assert mix.shapes == (BatchShape(1024, 8, 8), BatchShape(128, 64, 64)) and mix.batches == (2, 6)
  assert ShapeMix.parse(str(mix)) == mix and ShapeMix.parse('4x8').batches == (1,)
  assert mix.weighted([1.0, 3.0]) == pytest.approx((2 * 1.0 + 6 * 3.0) / 8)


def test_packed_synthetic_batch_holds_whole_pairs_with_their_segments():
  batch = synthetic_batch(TINY, BatchShape(3, 20, 20), packing=20, pair_len=6)
  # 3 pairs of 6 a row, then 2 PAD positions.
  np.testing.assert_array_equal(batch.src_segments[0], [1] * 6 + [2] * 6 + [3] * 6 + [0, 0])
  np.testing.assert_array_equal(batch.tgt_positions[1, :7], [0, 1, 2, 3, 4, 5, 0])
  assert (batch.tgt_out[:, 5::6][:, :3] == TINY.eos_id).all()
  assert (batch.tgt_in[:, [0, 6, 12]] == TINY.bos_id).all()
  np.testing.assert_array_equal(batch.tgt_in[:, 1:6], batch.tgt_out[:, 0:5])
  assert int(batch.num_tokens) == 3 * 3 * 6
  assert batch.example_ids.shape == (3, 20) and (batch.example_ids[:, 3:] == -1).all()


@pytest.fixture(scope='module')
def dense_steps():
  """The dense configuration's step at a batch and at twice its rows, compiled once."""
  return {
    rows: TrainingStep(DENSE, TrainConfig(), BatchShape(rows, 16, 12), devices=1)
    for rows in (8, 16)
  }


def test_xla_flops_within_ten_percent_of_the_hand_count(dense_steps):
  report = dense_steps[8].report(fake_timing(1.0))
  assert report.analytic_flops == train_flops(DENSE, DENSE_SHAPE)
  assert report.analytic_flops <= report.xla_flops <= 1.10 * report.analytic_flops


def test_doubling_the_batch_doubles_the_flops(dense_steps):
  small, large = (dense_steps[rows].report(fake_timing(1.0)) for rows in (8, 16))
  assert large.analytic_flops == 2 * small.analytic_flops
  # XLA's count doubles too, but for the optimizer's per-parameter work, which stays.
  assert 1.9 < large.xla_flops / small.xla_flops <= 2.0
  assert large.real_tokens == 2 * small.real_tokens == 2 * 8 * 12


def test_remat_policies_keep_less_memory_through_the_api():
  config = ModelConfig.tiny(d_model=64, d_ff=256, num_heads=4, max_len=64)
  shape = BatchShape(8, 48, 48)
  temporaries = {
    remat: TrainingStep(config.replace(remat=remat), TrainConfig(), shape, devices=1)
    .report(fake_timing(1.0))
    .memory.temporaries
    for remat in ('none', 'layer', 'dots')
  }
  assert temporaries['layer'] < temporaries['dots'] < temporaries['none'], temporaries


def test_the_step_benchmarked_is_the_step_train_py_runs(tmp_path, monkeypatch):
  """train.py's first step, lowered from the batch its batcher built, against the benchmark's
  step at that batch's shape: the same program text."""
  seen = {}
  build = train_loop.compiled_training

  def recording(model_config, train_config, parallel):
    model, optimizer, step = build(model_config, train_config, parallel)

    def step_and_record(state, batch):
      if 'text' not in seen:
        seen.update(
          text=step.lower(state, batch).as_text(),
          model=model_config,
          shape=BatchShape(*batch.src.shape, batch.tgt_in.shape[1]),
        )
      return step(state, batch)

    return model, optimizer, step_and_record

  monkeypatch.setattr(train_loop, 'compiled_training', recording)
  from flax_transformer.config import DataConfig

  train_config = TrainConfig(
    steps=1, max_tokens=256, warmup_steps=4, log_every=1, eval_every=1, checkpoint_every=1
  )
  train_loop.train(
    ModelConfig.tiny(num_encoder_layers=1, num_decoder_layers=1, max_len=64),
    train_config,
    DataConfig(source='toy', vocab_size=256),
    tmp_path,
    devices=1,
    print_fn=lambda message: None,
  )
  benchmarked = TrainingStep(seen['model'], train_config, seen['shape'], devices=1)
  assert benchmarked.lowered.as_text() == seen['text']
  # Another training setting is another program: the comparison can fail.
  other = TrainingStep(
    seen['model'], train_config.replace(label_smoothing=0.2), seen['shape'], devices=1
  )
  assert other.lowered.as_text() != seen['text']


def test_decode_reports_count_the_tokens_every_method_writes():
  for method in ('greedy', 'beam', 'sample'):
    report = bench.decode_report(TINY, method, batch=3, src_len=5, new_tokens=7, rounds=2)
    assert report.generated_tokens == 3 * 7  # held to exactly new_tokens each
    assert report.tokens_per_s == pytest.approx(21 / report.timing.median_s)
    assert report.ms_per_token == pytest.approx(1e3 * report.timing.median_s / 7)
    assert report.memory.temporaries > 0 and report.compilation.programs == 1
  cmlm = bench.decode_report(
    ModelConfig.tiny(kind='cmlm'), 'mask_predict', batch=2, src_len=5, rounds=1
  )
  assert cmlm.compilation.programs == 2 and cmlm.analytic_flops is None
  assert cmlm.generated_tokens >= 2  # at least an EOS each


def test_compare_times_every_contender_and_reports_each():
  shape = BatchShape(4, 8, 8)
  reports = bench.compare(
    {
      'none': (TINY, TrainConfig(), shape),
      'layer': (TINY.replace(remat='layer'), TrainConfig(), shape),
    },
    rounds=2,
    warmup=1,
  )
  assert [r.remat for r in reports.values()] == ['none', 'layer']
  assert all(len(r.timing.times_s) == 2 for r in reports.values())
  # The function stays the package's name once its module is loaded (a module of the same
  # name would shadow it).
  from flax_transformer.bench import comparison

  assert bench.compare is comparison.compare
  table = bench.reports_table(reports)
  assert table.splitlines()[1].startswith('none') and 'layer' in table


@pytest.mark.parametrize(
  'argv, message',
  [
    (['step', '--shape', '3x'], 'is not a batch shape'),
    (['step', '--shape', '8x8:2,16x8:0'], 'batch counts must be positive'),
    (['step', '--shape', '8x8:2,8x8+8:1'], 'a shape is named twice'),
    (['step', '--shape', '8x8:two'], 'must be an integer'),
    (['step', '--preset', 'toy', '--shape', '8x100+100'], 'longer than model.max_len=64'),
    (['step', '--preset', 'toy', '--shape', '3x8', '--devices', '2'], 'devices must be between'),
    (['step', '--model.remat', 'all'], 'model.remat must be one of'),
    (['decode', '--preset', 'toy', '--methods', 'mask_predict'], 'decodes cmlm models'),
    (['sweep', '--preset', 'toy', '--batches', '0'], 'every value must be a positive integer'),
    (['peak', '--dtype', 'int8'], 'choose float32, bfloat16 or float16'),
    (
      ['step', '--preset', 'toy', '--train.packing', '32', '--shape', '4x16'],
      'train.packing=32 packs rows of that length',
    ),
  ],
)
def test_command_refuses_bad_options_in_one_line_before_compiling(
  argv, message, capsys, monkeypatch
):
  compiled = []
  monkeypatch.setattr(
    bench.step.TrainingStep, '__init__', lambda *a, **k: compiled.append(1) or None
  )
  with pytest.raises(SystemExit) as exit_info:
    command.main(argv)
  assert exit_info.value.code == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert message in lines[-1] and not compiled


TOY_STEP = ['step', '--preset', 'toy', '--shape', '2x8', '--rounds', '1', '--warmup', '0']


def output_cases(tmp_path):
  (tmp_path / 'a-file').write_text('')
  (tmp_path / 'bad').mkdir()
  (tmp_path / 'bad' / 'config.json').write_text('{"model": ')
  (tmp_path / 'marian').mkdir()
  (tmp_path / 'marian' / 'config.json').write_text('{"model_type": "marian"}')
  step = ['step', '--shape', '2x8']
  return [
    ([*step, '--json', str(tmp_path)], 'is a directory; name a file'),
    ([*step, '--csv', str(tmp_path / 'a-file' / 'r.csv')], 'a-file is a file, not a directory'),
    ([*step, '--json', '/proc/r.json'], '/proc cannot be written'),
    ([*step, '--json', str(tmp_path / 'r'), '--csv', str(tmp_path / 'r')], 'name the same file'),
    (['sweep', '--batches', '2', '--plot', str(tmp_path / 'r.gif')], 'not .gif'),
    ([*step, '--workdir', str(tmp_path / 'bad'), '--preset', 'toy'], '--preset with --workdir'),
    ([*step, '--workdir', str(tmp_path / 'bad'), '--data', 'toy'], '--data with --workdir'),
    ([*step, '--workdir', str(tmp_path / 'bad')], 'bad/config.json: not a valid run config'),
    ([*step, '--workdir', str(tmp_path / 'marian')], "is a Hugging Face model's"),
  ]


def test_command_refuses_outputs_and_run_directories_before_any_work(tmp_path, capsys, monkeypatch):
  compiled = []
  monkeypatch.setattr(
    bench.step.TrainingStep, '__init__', lambda *a, **k: compiled.append(1) or None
  )
  for argv, message in output_cases(tmp_path):
    with pytest.raises(SystemExit) as exit_info:
      command.main(argv)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and message in lines[-1], (argv, lines)
  assert not compiled and not (tmp_path / 'r').exists()
  # Without matplotlib, --plot is refused with the pip command that brings it.
  real = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util, 'find_spec', lambda name, *a: None if name == 'matplotlib' else real(name, *a)
  )
  with pytest.raises(SystemExit):
    command.main(['sweep', '--batches', '2', '--plot', str(tmp_path / 'r.png')])
  assert 'pip install "flax_transformer[plot]"' in capsys.readouterr().err


def test_a_step_larger_than_the_machine_is_refused_and_a_sweep_keeps_its_finished_cells(
  tmp_path, capsys, monkeypatch
):
  # The estimate refuses before compiling, as train.py would.
  monkeypatch.setattr(bench.step, 'physical_memory', lambda: 10_000)
  with pytest.raises(SystemExit) as exit_info:
    command.main(TOY_STEP)
  assert exit_info.value.code == 2 and 'too large for this machine' in capsys.readouterr().err
  # The compiled program's own account refuses what the estimate let through: here the
  # second cell of a sweep (with a machine made small just for it), after the first was written.
  monkeypatch.undo()
  real_check, checked = bench.step.check_compiled_fits, []

  def second_cell_on_a_small_machine(compiled, device, shape):
    checked.append(shape)
    if len(checked) == 2:
      monkeypatch.setattr(bench.step, 'physical_memory', lambda: 10_000)
    real_check(compiled, device, shape)

  monkeypatch.setattr(bench.step, 'check_compiled_fits', second_cell_on_a_small_machine)
  output = tmp_path / 'sweep.json'
  argv = ['sweep', '--preset', 'toy', '--batches', '2,4', '--length', '8', '--rounds', '1']
  status = command.main([*argv, '--warmup', '0', '--json', str(output)])
  err = capsys.readouterr().err.strip().splitlines()[-1]
  assert status == 2
  assert 'needs' in err and 'of cpu memory here' in err and 'the 1 cells before are written' in err
  assert [row['rows'] for row in json.loads(output.read_text())['reports']] == [2]


def test_command_writes_the_reports_as_json_and_csv(tmp_path, capsys):
  status = command.main(
    [
      'step',
      '--preset',
      'toy',
      '--model.d_model',
      '32',
      '--model.d_ff',
      '64',
      '--shape',
      '4x8+6',
      '--rounds',
      '2',
      '--warmup',
      '1',
      '--peak',
      '0.5',
      '--json',
      str(tmp_path / 'r.json'),
      '--csv',
      str(tmp_path / 'r.csv'),
      '--compilation-cache',
      'off',
    ]
  )
  assert status == 0
  written = json.loads((tmp_path / 'r.json').read_text())
  assert written['command'] == 'step' and len(written['reports']) == 1
  # Where it was measured: this process's versions and device, not made-up values.
  assert written['environment']['versions']['jax'] == jax.__version__
  assert written['environment']['accelerator']['platform'] == jax.devices()[0].platform
  assert written['environment']['cores_available'] == len(os.sched_getaffinity(0))
  row = written['reports'][0]
  assert {
    'timing',
    'tokens_per_s',
    'analytic_flops',
    'xla_flops',
    'mfu',
    'memory',
    'compilation',
  } <= set(row)
  assert row['shape'] == '4x8+6' and row['real_tokens'] == 24
  assert row['compilation']['cache'] == 'off'
  assert row['mfu'] == pytest.approx(row['flops_per_s'] / 0.5e12)
  assert row['tokens_per_s'] == pytest.approx(24 / row['timing']['median_s'])
  header, values = (tmp_path / 'r.csv').read_text().splitlines()
  assert 'timing.median_s' in header.split(',') and 'memory.total' in header.split(',')
  assert 'real target tokens' in capsys.readouterr().out


def test_command_times_a_run_directorys_own_settings(random_run, tmp_path):
  model_config = random_run.config
  assert (
    command.main(
      [
        'step',
        '--workdir',
        str(random_run.run_dir),
        '--shape',
        '2x8:3,4x16:1',
        '--rounds',
        '2',
        '--warmup',
        '0',
        '--json',
        str(tmp_path / 'r.json'),
      ]
    )
    == 0
  )
  first, second, mix = json.loads((tmp_path / 'r.json').read_text())['reports']
  assert first['model'].startswith(f'd{model_config.d_model} ')
  assert f'vocab {model_config.vocab_size}' in first['model']
  # Each shape of the mix timed, and their mean weighted by the batches of each.
  assert (first['shape'], second['shape'], mix['kind']) == ('2x8+8', '4x16+16', 'shape_mix')
  medians = [first['timing']['median_s'], second['timing']['median_s']]
  assert mix['step_s'] == pytest.approx((3 * medians[0] + medians[1]) / 4)
  assert mix['target_positions_per_s'] == pytest.approx((3 * 16 + 64) / 4 / mix['step_s'])
  assert (mix['shapes'], mix['batches']) == ('2x8+8:3,4x16+16:1', 4)


def test_python_dash_m_runs_the_command():
  import subprocess
  import sys

  done = subprocess.run(
    [sys.executable, '-m', 'flax_transformer.bench', 'peak', '--help'],
    capture_output=True,
    text=True,
    check=False,
  )
  assert done.returncode == 0 and '--iterations' in done.stdout


def test_peak_measures_the_flops_it_ran():
  report = bench.measure_peak('float32', size=64, iterations=2, rounds=2)
  assert report.flops == 2 * 64**3 * 2
  assert report.flops_per_s == pytest.approx(report.flops / report.timing.median_s)
  assert report.device == jax.devices()[0].device_kind


def test_cpu_description_reads_the_first_processor_and_its_matmul_flags():
  cpuinfo = (
    'processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n'
    'model name\t: AMD EPYC 9R14\nflags\t\t: fpu sse2 avx2 fma avx512f avx512_bf16 sha_ni\n'
    '\nprocessor\t: 1\nmodel name\t: Other CPU\nflags\t\t: fpu amx_bf16\n'
  )
  assert cpu_description(cpuinfo) == {
    'name': 'AMD EPYC 9R14',
    'family': '25',
    'model': '17',
    'matmul_flags': ['avx2', 'fma', 'avx512f', 'avx512_bf16'],
  }
  # An ARM cpuinfo has none of these fields: nothing is made up.
  assert cpu_description('processor\t: 0\nFeatures\t: fp asimd bf16\n') == {'matmul_flags': []}


def test_the_matmul_bound_holds_the_models_products_and_their_flops(capsys):
  shape = BatchShape(4, 8, 8)
  step = TrainingStep(TINY, TrainConfig(), shape)
  bound = step.matmul_bound(rounds=1)
  products = {product: count for product, count, _ in bound.products}
  d, f, v = TINY.d_model, TINY.d_ff, TINY.vocab_size
  # The feed-forward's first product, forward: [B, T, D] . [D, F] contracting D, once per layer
  # (not its weight gradient [N, D]^T . [N, F], whose shapes match when N == D, as here).
  layers = TINY.num_encoder_layers + TINY.num_decoder_layers
  forward_ff = [
    p
    for p in products
    if p.lhs[-1] == d and p.rhs == (d, f) and p.dimension_numbers[0] == ((len(p.lhs) - 1,), (0,))
  ]
  assert forward_ff and sum(products[p] for p in forward_ff) == layers
  # The output projection against the shared embedding [V, D], forward and backward.
  assert any(v in p.lhs + p.rhs for p in products)
  # Every product of the step, forward and backward: the hand count of its FLOPs.
  assert bound.flops == pytest.approx(train_flops(TINY, shape), rel=0.02)
  assert bound.seconds > 0 and all(seconds >= 0 for _, _, seconds in bound.products)
  report = step.report(time_rounds(step.run, 2, 1), bound=bound)
  assert report.bound_ratio == pytest.approx(report.timing.median_s / bound.seconds)
  assert report.to_dict()['matmul_bound']['flops'] == bound.flops
  assert 'its matmul bound' in report.table()


HLO = """HloModule jit_step, is_scheduled=true

%fused_computation.1 (param_0: f32[8,16], param_1: f32[16,32]) -> f32[8,32] {
  %param_0 = f32[8,16]{1,0} parameter(0)
  %param_1 = f32[16,32]{1,0} parameter(1)
  %dot.0 = f32[8,32]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %tanh.0 = f32[8,32]{1,0} tanh(%dot.0), metadata={op_name="jit(step)/ffn/tanh"}
}

%fused_computation.2 (param_0.1: f32[8,32]) -> f32[8,32] {
  %param_0.1 = f32[8,32]{1,0} parameter(0)
  ROOT %exp.0 = f32[8,32]{1,0} exponential(%param_0.1)
}

ENTRY %main.3 (a.1: f32[8,16], b.1: f32[16,32]) -> (f32[8,32], s32[]) {
  %a.1 = f32[8,16]{1,0} parameter(0), metadata={op_name="a"}
  %b.1 = f32[16,32]{1,0} parameter(1), metadata={op_name="b"}
  %ynn_fusion.1 = f32[8,32]{1,0} fusion(%a.1, %b.1), kind=kCustom, calls=%fused_computation.1, metadata={op_name="jit(step)/ffn/dot_general"}
  %loop_exp_fusion = f32[8,32]{1,0} fusion(%ynn_fusion.1), kind=kLoop, calls=%fused_computation.2
  %constant.3 = s32[] constant(0)
  ROOT %tuple.4 = (f32[8,32]{1,0}, s32[]) tuple(%loop_exp_fusion, %constant.3)
}
"""


def test_hlo_instructions_name_each_fusions_kind_its_products_and_its_source():
  from flax_transformer.bench.breakdown import hlo_instructions

  found = hlo_instructions(HLO)
  assert found['ynn_fusion.1'].opcode == 'fusion:kCustom+dot'
  assert found['ynn_fusion.1'].shape == 'f32[8,32]'
  assert found['ynn_fusion.1'].source == 'jit(step)/ffn/dot_general'
  assert found['loop_exp_fusion'].opcode == 'fusion:kLoop'  # no product inside
  assert found['tuple.4'].opcode == 'tuple'
  assert found['tuple.4'].shape == '(f32[8,32], s32[])'
  assert found['dot.0'].opcode == 'dot' and found['param_0'].opcode == 'parameter'
  assert 'fused_computation.1' not in found  # computations are not instructions


def test_the_breakdown_times_the_steps_own_operations():
  from flax_transformer.bench.breakdown import breakdown, hlo_instructions

  step = TrainingStep(TINY, TrainConfig(), BatchShape(4, 8, 8))
  step.run()
  walls = []

  def timed_run():
    start = time.perf_counter()
    step.run()
    walls.append(time.perf_counter() - start)

  profile = breakdown(step.compiled, timed_run, steps=2)
  instructions = hlo_instructions(step.compiled.as_text())
  assert len(walls) == 2 and profile.steps == 2 and profile.ops
  assert all(op.instruction == instructions[op.instruction.name] for op in profile.ops)
  # Per step, every operation took time, and none outlasts the call that ran it.
  assert all(0 < op.seconds <= max(walls) for op in profile.ops)
  times = [op.seconds for op in profile.ops]
  assert times == sorted(times, reverse=True)
  # The model's products are among them: the feed-forward's [tokens, d_ff] output.
  products = [
    op
    for op in profile.ops
    if op.instruction.opcode.endswith('+dot') or op.instruction.opcode == 'dot'
  ]
  assert any(f',{TINY.d_ff}]' in op.instruction.shape for op in products)
  assert 0 < profile.matmul_share() <= 1
  report = step.report(time_rounds(step.run, 2, 1), profile=step.breakdown(steps=1))
  top = report.to_dict()['breakdown']['ops'][0]
  assert top['name'] in instructions and top['seconds'] > 0
  assert 'in matrix products' in report.breakdown.table(3)
  assert len(report.breakdown.table(3).splitlines()) == 4
