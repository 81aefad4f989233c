"""The benchmarks' arithmetic and plumbing: the analytic FLOP counts, the peers' sizes, the workers.

`bench.flops.train_flops` must equal the matmul FLOPs of the step XLA is given
(counted from its HLO, operand shapes and all), and stay within the elementwise
margin of XLA's own cost analysis of the compiled step; `prefix_flops` and
`step_flops` must equal the dots of the encoder pass and of one cached decode
step. The PyTorch peers must train as many parameters as our model, or the
side-by-side ratios compare different work.

The FlaxMarian test runs only where FLAXMARIAN_PYTHON names the python of its
environment (`bash benchmarks/make_peer_env.sh VENV`, then
FLAXMARIAN_PYTHON=VENV/bin/python).
"""

import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks import workloads
from benchmarks.workloads import Shape, synthetic_batch
from flax_transformer import train
from flax_transformer.bench.flops import decode_flops, prefix_flops, step_flops, train_flops
from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.nn.model import DecodeCache, Transformer, count_params

# Different source and target lengths, so S and T cannot be swapped unnoticed.
TINY_SHAPE = Shape(batch=4, src_len=8, tgt_len=6)
# Large enough for matmuls to dominate: softmax, LayerNorm and Adam add ~5%.
MID_CONFIG = ModelConfig.tiny(d_model=128, d_ff=512, vocab_size=512, num_heads=4)
MID_SHAPE = Shape(batch=8, src_len=16, tgt_len=12)


def _lowered_step(config: ModelConfig, shape: Shape):
  model = Transformer(config)
  train_config = TrainConfig()
  optimizer = train.make_optimizer(train_config, config)
  parallel = train.DataParallel(devices=jax.devices()[:1])
  state = parallel.replicate(train.create_train_state(model, optimizer, seed=0))
  batch = parallel.shard_batch(synthetic_batch(config, shape))
  return train.make_parallel_step(model, optimizer, train_config, parallel).lower(state, batch)


def hlo_dot_flops(hlo_text: str) -> int:
  """2 * (output elements) * (contracted size), summed over every `dot` in an HLO module."""
  shapes = {}
  for name, dims in re.findall(r'^\s*(?:ROOT )?([\w.\-]+) = \w+\[([\d,]*)\]', hlo_text, re.M):
    shapes[name] = [int(d) for d in dims.split(',') if d]
  total = 0
  for out, lhs, contracting in re.findall(
    r'^\s*(?:ROOT )?[\w.\-]+ = \w+\[([\d,]*)\]\S* dot\(([\w.\-]+), [\w.\-]+\).*?'
    r'lhs_contracting_dims=\{([\d,]*)\}',
    hlo_text,
    re.M,
  ):
    out_elements = math.prod(int(d) for d in out.split(',') if d)
    contracted = math.prod(shapes[lhs][int(i)] for i in contracting.split(','))
    total += 2 * out_elements * contracted
  return total


@pytest.fixture(scope='module')
def tiny_lowered():
  return _lowered_step(ModelConfig.tiny(), TINY_SHAPE)


def test_flop_formula_equals_the_matmuls_in_the_step(tiny_lowered):
  hlo = tiny_lowered.as_text(dialect='hlo')
  assert hlo.count(' dot(') > 50  # every projection, attention product and gradient
  assert train_flops(ModelConfig.tiny(), TINY_SHAPE) == hlo_dot_flops(hlo)


def test_flop_formula_by_hand_for_one_layer():
  # B=1, S=T=1, D=2, F=3, V=5: enc 2(16+12)+8 = 64, dec 64 + 16 + 16 + 8 = 104, out 20.
  config = ModelConfig(
    vocab_size=5,
    d_model=2,
    num_heads=1,
    num_encoder_layers=1,
    num_decoder_layers=1,
    d_ff=3,
    pad_id=0,
    bos_id=1,
    eos_id=2,
    unk_id=3,
  )
  assert train_flops(config, Shape(1, 1, 1)) == 3 * (64 + 104 + 20)


def test_flop_formula_within_xla_cost_analysis():
  """XLA counts every FLOP of the compiled step; the formula counts matmuls only."""
  formula = train_flops(MID_CONFIG, MID_SHAPE)
  xla = _lowered_step(MID_CONFIG, MID_SHAPE).compile().cost_analysis()['flops']
  assert formula <= xla <= 1.08 * formula, (formula, xla)


def test_decode_flop_formulas_equal_the_dots_of_the_encoder_pass_and_one_step():
  # D, F and V all different, so no two terms can be swapped unnoticed.
  config, rows, src_len, cache_len = ModelConfig.tiny(d_ff=96, vocab_size=80), 6, 7, 5
  model = Transformer(config)
  src = np.full((rows, src_len), config.unk_id + 1, np.int32)
  variables = model.init(jax.random.key(0), src[:, :1], src[:, :1])
  start = jax.jit(
    lambda v, src: model.apply(v, src, cache_len, method=Transformer.start_decoding)
  ).lower(variables, src)
  assert prefix_flops(config, rows, src_len) == hlo_dot_flops(start.as_text(dialect='hlo'))

  cache = jax.eval_shape(
    lambda v, src: model.apply(v, src, cache_len, method=Transformer.start_decoding), variables, src
  )
  step = jax.jit(
    lambda v, tokens, cache: model.apply(v, tokens, cache, 2, method=Transformer.decode_step)
  )
  tokens = jax.ShapeDtypeStruct((rows, 1), np.int32)
  step_hlo = step.lower(variables, tokens, cache).as_text(dialect='hlo')
  assert isinstance(cache, DecodeCache) and cache.max_len == cache_len
  # The compiled step attends to every cache slot (masked): A = L.
  assert step_flops(config, rows, src_len, cache_len) == hlo_dot_flops(step_hlo)


def test_decoding_one_token_costs_the_teacher_forced_forward_pass_with_one_target():
  """Prefix + first step (A = 1) is exactly the forward pass at T = 1: the two formulas agree."""
  for config in (ModelConfig.tiny(), MID_CONFIG, ModelConfig.base()):
    for batch, src_len in ((1, 1), (3, 11)):
      forward = train_flops(config, Shape(batch, src_len, 1)) // 3
      assert prefix_flops(config, batch, src_len) + step_flops(config, batch, src_len, 1) == forward
      assert decode_flops(config, batch, src_len, 1) == forward


def test_beams_share_the_encoder_pass_and_multiply_every_step():
  config, batch, src_len = ModelConfig.tiny(d_ff=96, vocab_size=80), 2, 9
  prefix = prefix_flops(config, batch, src_len)
  greedy = decode_flops(config, batch, src_len, 4)
  beam = decode_flops(config, batch, src_len, 4, beam_size=3)
  assert beam - prefix == 3 * (greedy - prefix)
  # One more attended position: QK^T and AV each grow by one D-vector product per row and layer.
  assert step_flops(config, batch, src_len, 2) - step_flops(config, batch, src_len, 1) == (
    config.num_decoder_layers * 4 * batch * config.d_model
  )


def test_every_multi30k_variant_decodes_the_model_kind_it_is_for():
  from benchmarks.multi30k import mask_predict_searches, searches
  from flax_transformer.decode.methods import BeamSearch, MaskPredict

  cmlm_variants, variants = mask_predict_searches(), searches([0.6, 1.5])
  assert {'mask-predict-T10-l3', 'mask-predict-T1-fixed', 'mask-predict-T10-fixed'} <= set(
    cmlm_variants
  )
  assert cmlm_variants['mask-predict-T10-fixed'] == MaskPredict(
    iterations=10, length_beam=1, length='fixed'
  )
  assert variants['beam4-a1.5'] == BeamSearch(beam_size=4, alpha=1.5)
  both = searches([1.0], [5], ['gnmt', 'fairseq'])
  assert set(both) == {'greedy', 'beam5-a1', 'beam5-a1-fairseq'}
  assert both['beam5-a1-fairseq'] == BeamSearch(beam_size=5, alpha=1.0, penalty_form='fairseq')
  for method in cmlm_variants.values():
    method.check_model(ModelConfig.tiny(kind='cmlm'))
  for method in variants.values():
    method.check_model(ModelConfig.tiny())


@pytest.mark.skipif(
  importlib.util.find_spec('torch') is None,
  reason="torch is not installed: pip install -e '.[bench]'",
)
@pytest.mark.parametrize('peer', ['torch', 'marian'])
def test_peer_has_our_parameter_count(peer):
  from benchmarks import peers

  if peers.available(peer):
    pytest.skip(peers.available(peer))
  config = ModelConfig.tiny()
  tokens = np.ones((1, 1), np.int32)
  ours = count_params(
    jax.eval_shape(Transformer(config).init, jax.random.key(0), tokens, tokens)['params']
  )
  # The peers keep a key-projection bias (torch's in_proj_bias covers q, k and v together);
  # ours has none (the softmax cancels it): one d_model vector per attention layer.
  num_attentions = config.num_encoder_layers + 2 * config.num_decoder_layers
  key_biases = num_attentions * config.d_model
  assert ours == 44_608
  assert peers.trainable_params(peers.build_model(peer, config)) == ours + key_biases


@pytest.mark.skipif(
  importlib.util.find_spec('torch') is None,
  reason="torch is not installed: pip install -e '.[bench]'",
)
def test_peer_step_starts_at_the_uniform_loss_and_learns():
  """Label-smoothed loss of a fresh model is near log V; a few steps on one batch lower it."""
  from benchmarks import peers

  config = ModelConfig.tiny(dropout_rate=0.0)
  batch = synthetic_batch(config, TINY_SHAPE)
  step = peers.PeerStep(
    'torch',
    config,
    TrainConfig(warmup_steps=10, lr_scale=5.0),
    batch.src,
    batch.tgt_in,
    batch.tgt_out,
  )
  losses = [step.step() for _ in range(20)]
  assert abs(losses[0] - math.log(config.vocab_size)) < 1.0
  assert losses[-1] < losses[0] - 0.5


def test_complexity_exponents_recover_the_growth_of_synthetic_rows():
  """benchmarks/complexity.py's fit: times ~ n^2 and bytes ~ n give slopes 2 and 1; small n left out."""
  from benchmarks.complexity import exponents

  rows = [
    {
      'length': n,
      **{
        name: {
          'median_s': 3e-9 * n**2,
          'min_s': 2e-9 * n**2,
          'cpu_median_s': 5e-9 * n**2,
          'bytes': 40 * n,
        }
        for name in ('full', 'full_masked', 'banded')
      },
    }
    for n in (128, 1024, 2048, 4096)
  ]
  rows[0]['banded']['median_s'] = 1.0  # below fit_from: must not count
  fitted = exponents(rows, fit_from=1024)
  assert fitted['banded']['time'] == pytest.approx(2.0, abs=1e-9)
  # Least-squares slopes of exact powers: 2 up to rounding (2.0000000000000044 on one CPU, ...27
  # on another), so each is compared with a tolerance far below any real change of exponent.
  assert fitted['full']['time_of_min'] == pytest.approx(2.0, abs=1e-9)
  assert fitted['full']['cpu_time'] == pytest.approx(2.0, abs=1e-9)
  assert fitted['full']['memory'] == pytest.approx(1.0, abs=1e-9)
  assert (fitted['full']['paper'], fitted['banded']['paper']) == (2.0, 1.0)


def test_ab_patches_the_before_variant_only_while_it_is_built():
  from benchmarks import ab
  from flax_transformer.decode import autoregressive

  original = autoregressive.cast_matrices
  with pytest.raises(RuntimeError):
    with ab.patched((autoregressive, 'cast_matrices', None)):
      assert autoregressive.cast_matrices is None
      raise RuntimeError('a build that fails still restores the library')
  assert autoregressive.cast_matrices is original
  with pytest.raises(SystemExit):
    ab.parse_args(['--lever', 'fused_qkv', '--parts', 'greedy,beam9'])


def test_ab_before_variant_of_fused_qkv_has_no_wide_product():
  """The fused_qkv lever's "before": a decode step's self-attention takes three [D, D] products
  where the library's step takes one [D, 3D] (here [B, 1, 3 * 32] outputs, one per layer)."""
  from benchmarks import ab
  from flax_transformer.decode import autoregressive

  config = ModelConfig.tiny(dropout_rate=0.0)
  src = np.full((2, 5), config.unk_id + 1, np.int32)
  variables = Transformer(config).init(jax.random.key(0), src[:, :1], src[:, :1])

  def step_hlo():
    def first_step(variables, src):
      step_fn, cache = autoregressive.model_step_fn(config, variables, src, 4)
      return step_fn(np.ones(2, np.int32), cache, 0)[0]

    return jax.jit(first_step).lower(variables, src).as_text(dialect='hlo')

  wide = lambda hlo: len(re.findall(r'f32\[2,1,96\]\S* dot\(', hlo))
  fused = step_hlo()
  with ab.patched(ab.unfused_qkv()):
    unfused = step_hlo()
  assert (wide(fused), wide(unfused)) == (config.num_decoder_layers, 0)
  assert unfused.count(' dot(') == fused.count(' dot(') + 2 * config.num_decoder_layers
  assert wide(step_hlo()) == config.num_decoder_layers  # restored


def test_the_first_preset_is_the_size_its_multi30k_run_recorded():
  """results/first_preset.json, which cmlm, packing --first-preset and solo --model small build
  from, holds the model and vocabulary the first preset's own run recorded (multi30k_ende.json)."""
  preset = workloads.first_preset()
  run = json.loads((workloads.RESULTS / 'multi30k_ende.json').read_text())['config']
  assert preset['model'] == {name: run['model'][name] for name in preset['model']}
  assert preset['vocab_size'] == run['data']['vocab_size'] == run['model']['vocab_size'] == 8000
  small = workloads.model_config('small')
  assert (
    small.d_model,
    small.num_heads,
    small.num_encoder_layers,
    small.num_decoder_layers,
    small.d_ff,
    small.vocab_size,
  ) == (256, 4, 3, 3, 1024, 8000)


def test_the_benchmark_commands_name_existing_modules():
  """gpu.sh's, docs/results.md's and benchmarks/README.md's commands (its first block, and its index's
  commands) run modules that exist; gpu.sh passes its options to the GPU check, whose parts are
  what its usage names."""
  from benchmarks import gpu_check

  repo = Path(__file__).resolve().parent.parent
  gpu = (repo / 'benchmarks' / 'gpu.sh').read_text()
  readme = (repo / 'benchmarks' / 'README.md').read_text()
  texts = {
    'gpu.sh': gpu,
    'docs/results.md': (repo / 'docs' / 'results.md').read_text(),
    'benchmarks/README.md': readme.split('```')[1],
    # Its rows but those marked † (made by train_step.py or decode.py, removed since).
    'the index': '\n'.join(
      row for row in readme.split('\n## Index\n')[1].splitlines() if '†' not in row
    ),
  }
  for where, text in texts.items():
    names = set(re.findall(r'-m benchmarks\.(\w+)', text))
    assert names, where
    for name in names:
      assert (repo / 'benchmarks' / f'{name}.py').is_file(), f'{where} runs benchmarks.{name}'
  assert 'python3 -m benchmarks.gpu_check "$@"' in gpu
  usage = re.search(r'gpu\.sh (--parts \S+)', gpu).group(1).split()
  assert gpu_check.parse_args(usage).parts == ['mfu', 'decode']
  assert set(re.search(r'gpu_check_\{(.*?)\}', gpu).group(1).split(',')) == set(gpu_check.PARTS)


def bench_commands(text: str) -> list[str]:
  """The `flax-transformer-bench` (or `python -m flax_transformer.bench`) command lines of a
  document's ``` blocks, and of the command column of its "## Index" tables, comments cut."""
  prefixes = ('flax-transformer-bench ', 'python -m flax_transformer.bench ')
  commands = []
  for block in text.split('```')[1::2]:
    commands += [line.split('  #')[0].strip() for line in block.splitlines()]
  if '\n## Index\n' in text:
    for row in text.split('\n## Index\n', 1)[1].splitlines():
      cells = row.split(' | ')
      if row.startswith('| ') and len(cells) > 2:
        commands += re.findall(r'`([^`]+)`', cells[1])
  return [c for c in commands if c.startswith(prefixes)]


def test_the_bench_commands_of_the_index_and_the_write_ups_parse():
  """The studies whose scripts `flax-transformer-bench` replaced are command lines now (benchmarks/
  README.md's index, the write-ups' blocks): each parses and its settings resolve as the bench
  reads them, so a renamed option or setting fails here rather than in a reader's hands."""
  import shlex

  from flax_transformer.bench import command

  repo = Path(__file__).resolve().parent.parent
  documents = [repo / 'benchmarks' / 'README.md', *sorted((repo / 'docs').glob('*.md'))]
  found = {path.name: bench_commands(path.read_text()) for path in documents}
  assert len(found['README.md']) >= 10, found['README.md']
  for name in ('training_step.md', 'input_pipeline.md'):
    assert found[name], name
  for name, lines in found.items():
    for line in lines:
      words = shlex.split(line)
      argv = words[3:] if words[0] == 'python' else words[1:]
      parser = command.build_parser()
      try:
        args = parser.parse_args(argv)
        if args.command != 'peak' and args.workdir is None:
          args.preset = args.preset or 'base'
          command.settings(parser, args)
      except SystemExit:
        pytest.fail(f'{name}: {line!r} does not parse')


# --- benchmarks.solo: each contender in its own process -------------------------------------

# The python of a FlaxMarian environment (transformers < 5), where one was made; no default.
FLAXMARIAN_PYTHON = os.environ.get('FLAXMARIAN_PYTHON', '')


def flaxmarian_skip_reason() -> str | None:
  if not FLAXMARIAN_PYTHON:
    return (
      'FLAXMARIAN_PYTHON is not set: make the env with bash benchmarks/make_peer_env.sh VENV, '
      'then set FLAXMARIAN_PYTHON=VENV/bin/python'
    )
  if not Path(FLAXMARIAN_PYTHON).is_file():
    return (
      f'FLAXMARIAN_PYTHON={FLAXMARIAN_PYTHON} is not a file (bash benchmarks/make_peer_env.sh VENV)'
    )
  return None


def test_solo_flop_classes_sum_to_the_analytic_counts():
  """Split by matmul shape, the step's and the decoders' FLOPs add up to the formulas above."""
  for config in (ModelConfig.tiny(d_ff=96, vocab_size=80), ModelConfig.base(vocab_size=8000)):
    assert sum(workloads.train_flop_classes(config, TINY_SHAPE).values()) == train_flops(
      config, TINY_SHAPE
    )
    for beam_size in (1, 4):
      classes = workloads.decode_flop_classes(config, 3, 7, 5, beam_size)
      assert sum(classes.values()) == decode_flops(config, 3, 7, 5, beam_size)
      assert {rows for rows, _, _ in classes} == {3 * 7, 3 * beam_size}  # prefix rows, step rows


def test_solo_weighted_peak_by_hand():
  """3 GFLOP at 300 GFLOP/s and 1 GFLOP at 100 take 0.01 + 0.01 s: 4 GFLOP / 0.02 s = 200."""
  from benchmarks import solo

  classes = {(8, 4, 4): 3e9, (2, 4, 4): 1e9}
  assert solo.weighted_peak(classes, {(8, 4, 4): 300.0, (2, 4, 4): 100.0}) == pytest.approx(200.0)
  assert solo.weighted_peak(classes, {(8, 4, 4): 50.0, (2, 4, 4): 50.0}) == pytest.approx(50.0)


def test_solo_worker_answers_the_protocol(tmp_path):
  """ours' worker process: hello, a matmul peak, each task built, timed and dropped, quit.

  What a timed call computed is what the library computes on the same setting,
  outside the worker: greedy's tokens for the benchmark's sources and weights,
  and the step's loss, the fresh model's label-smoothed loss on the benchmark's
  batch (a vanishing learning rate keeps the warm-up steps from moving it).
  The orchestrator's report counts the setting's tokens and FLOPs.
  """
  from benchmarks import solo
  from flax_transformer.decode import autoregressive

  with open(tmp_path / 'worker.log', 'w+') as log:
    worker = solo.Worker('ours', sys.executable, None, log)
    assert worker.skip_reason is None and worker.hello['framework'] == 'jax'
    assert worker.hello['versions']['jax'] == jax.__version__
    peaks = worker.ask(op='peaks', shapes=[[8, 16, 32]], dtypes=['float32'], repeats=2)['peaks']
    assert [(p['m'], p['k'], p['n']) for p in peaks] == [(8, 16, 32)]
    assert peaks[0]['flops'] % (2 * 8 * 16 * 32) == 0 and len(peaks[0]['times_s']) == 2
    config = ModelConfig.tiny(dropout_rate=0.0)
    setting = dataclasses.replace(
      solo.QUICK, shape=Shape(2, 5, 4), batch=2, source_len=4, new_tokens=3
    )
    model = Transformer(config)

    assert worker.ask(
      **solo.build_request('greedy', 'float32', dataclasses.asdict(config), setting)
    )['built']
    answers = [worker.ask(op='time', result=True) for _ in range(2)]
    src = workloads.decode_sources(config, setting.batch, setting.source_len)
    params = jax.jit(model.init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
    tokens = np.asarray(autoregressive.greedy(model, params, src, max_len=3, min_len=3))
    assert tokens.shape == (setting.batch, setting.new_tokens)
    assert [answer['result'] for answer in answers] == [{'tokens': tokens.tolist()}] * 2
    times = [answer['seconds'] for answer in answers]
    cell = solo.summarize_cell({'times_s': times}, 'greedy', 'float32', config, setting, None)
    assert cell['tokens_per_s'] == pytest.approx(2 * 3 / cell['median_s'])
    assert cell['gflops'] == pytest.approx(decode_flops(config, 2, 4, 3) / cell['median_s'] / 1e9)
    assert worker.ask(op='drop') == {'dropped': True}
    assert 'error' in worker.ask(op='time')  # nothing built any more

    request = solo.build_request('train', 'float32', dataclasses.asdict(config), setting)
    request['train']['lr_scale'] = 1e-12
    assert worker.ask(**request)['built']
    answer = worker.ask(op='time', result=True)
    train_config = TrainConfig(**request['train'])
    state = train.create_train_state(model, train.make_optimizer(train_config, config), seed=0)
    batch = synthetic_batch(config, setting.shape)
    logits = model.apply({'params': state.params}, batch.src, batch.tgt_in)
    loss_sum, count = train.label_smoothed_cross_entropy(
      logits, batch.tgt_out, train_config.label_smoothing, config.pad_id
    )
    assert int(count) == setting.shape.target_tokens == 8  # full rows, no PAD
    assert answer['result']['loss'] == pytest.approx(float(loss_sum) / 8, rel=1e-5)
    cell = solo.summarize_cell(
      {'times_s': [answer['seconds']]}, 'train', 'float32', config, setting, None
    )
    assert cell['tokens_per_s'] == pytest.approx(8 / answer['seconds'])
    assert cell['gflops'] == pytest.approx(
      train_flops(config, setting.shape) / answer['seconds'] / 1e9
    )
    worker.close()
    assert worker.process.returncode == 0


def test_solo_skips_a_peer_whose_python_lacks_its_packages(tmp_path):
  from benchmarks import solo

  with open(tmp_path / 'worker.log', 'w+') as log:
    missing = solo.Worker('flaxmarian', str(tmp_path / 'no-python'), None, log)
    assert missing.skip_reason.startswith('flaxmarian skipped: cannot run')
    if importlib.util.find_spec('transformers') and not hasattr(
      importlib.import_module('transformers'), 'FlaxMarianMTModel'
    ):
      lacking = solo.Worker('flaxmarian', sys.executable, None, log)  # transformers 5 here
      assert 'lacks transformers<5' in lacking.skip_reason
      assert 'benchmarks/make_peer_env.sh' in lacking.skip_reason
  with pytest.raises(Exception, match='NAME=PYTHON'):
    solo.parse_peer_python('flaxmarian')


@pytest.mark.skipif(flaxmarian_skip_reason() is not None, reason=str(flaxmarian_skip_reason()))
def test_flaxmarian_trains_our_parameter_count():
  """FlaxMarian, in its own env, updates as many parameters as torch Marian: ours + key biases."""
  config = ModelConfig.tiny()
  script = (
    'import json, sys, types, jax; from benchmarks import solo_worker as w; '
    'c = types.SimpleNamespace(**json.loads(sys.argv[1])); '
    'print(sum(x.size for x in jax.tree.leaves(w.flaxmarian_trainable('
    'w.flaxmarian_model(c, "float32").params))))'
  )
  done = subprocess.run(
    [FLAXMARIAN_PYTHON, '-c', script, json.dumps(dataclasses.asdict(config))],
    capture_output=True,
    text=True,
    env={**os.environ, 'PYTHONPATH': str(Path(__file__).parent.parent)},
  )
  assert done.returncode == 0, done.stderr[-2000:]
  num_attentions = config.num_encoder_layers + 2 * config.num_decoder_layers
  assert int(done.stdout.split()[-1]) == 44_608 + num_attentions * config.d_model


def test_solo_ctranslate2_worker_decodes_our_models_greedy_tokens(tmp_path):
  """The ctranslate2 contender exports the benchmark's model, converts it and decodes: its
  greedy tokens of the forced setting are ours; it trains nothing and has no bfloat16."""
  for package in ('ctranslate2', 'torch', 'transformers', 'safetensors'):
    pytest.importorskip(package, reason=f"needs {package}: pip install -e '.[pretrained-test]'")
  from benchmarks import solo
  from flax_transformer.decode import autoregressive

  config = ModelConfig.tiny(dropout_rate=0.0, layer_norm_epsilon=1e-5)
  setting = dataclasses.replace(solo.QUICK, batch=3, source_len=5, new_tokens=4)
  with open(tmp_path / 'worker.log', 'w+') as log:
    worker = solo.Worker('ctranslate2', sys.executable, None, log)
    assert worker.skip_reason is None and worker.hello['framework'] == 'ctranslate2'
    assert worker.ask(op='peaks', shapes=[[8, 16, 32]], dtypes=['float32'], repeats=1) == {
      'peaks': []
    }
    request = lambda task, dtype: solo.build_request(
      task, dtype, dataclasses.asdict(config), setting
    )
    assert 'decoding only' in worker.ask(**request('train', 'float32'))['unsupported']
    assert 'no bfloat16' in worker.ask(**request('greedy', 'bfloat16'))['unsupported']
    assert worker.ask(**request('greedy', 'float32'))['built']
    answer = worker.ask(op='time', result=True)
    model = Transformer(config)
    src = workloads.decode_sources(config, setting.batch, setting.source_len)
    params = jax.jit(model.init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
    tokens = np.asarray(autoregressive.greedy(model, params, src, max_len=4, min_len=4))
    assert answer['result'] == {'tokens': tokens.tolist()}
    for dtype in ('float32', 'int8'):
      assert worker.ask(**request('beam4', dtype))['built']
      assert np.asarray(worker.ask(op='time', result=True)['result']['tokens']).shape == (3, 4)
    worker.close()
    assert worker.process.returncode == 0


def test_synthetic_arrays_draw_the_ids_of_the_librarys_synthetic_batch():
  """The peers' numpy-only batches (`workloads.synthetic_arrays`) are the batches our step is
  timed on (`flax_transformer.bench.synthetic_batch`): the same ids from the same seed."""
  from flax_transformer.bench import synthetic_batch as library_batch

  config, shape = ModelConfig.tiny(), Shape(batch=3, src_len=5, tgt_len=4)
  batch = library_batch(config, shape, seed=7)
  for ours, theirs in zip(
    workloads.synthetic_arrays(config, shape, seed=7), (batch.src, batch.tgt_in, batch.tgt_out)
  ):
    np.testing.assert_array_equal(ours, theirs)
