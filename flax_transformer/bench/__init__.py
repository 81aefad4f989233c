"""Benchmarking jit-compiled steps: the training step train.py compiles, decoding as decode.py
runs it, and the matmul peak they are measured against.

Layer 9 (the top: it times what `train` and `decode` build, and its command reads `cli`'s
settings). Modules: `timing` (medians and percentiles of blocking calls, alternating rounds),
`flops` (the hand counts and XLA's), `shape_mix` (an epoch's batch shapes, their step weighted
by batches), `peaks` (measured and datasheet matmul peaks),
`compiled` (compile seconds, the persistent cache, XLA's memory account), `step`
(`step_report`), `matmul_bound` (the step's products timed alone), `breakdown` (its
operations by time, profiled), `decoding` (`decode_report`), `comparison` (`compare`: several settings in alternating
rounds, each compiled once), `writers` (the command's JSON, CSV and plot), `command`
(`flax-transformer-bench`), `environment` (where a measurement was made: machine, load,
versions, device).

    from flax_transformer import bench
    from flax_transformer.config import ModelConfig, TrainConfig

    peak = bench.measure_peak('float32')
    report = bench.step_report(ModelConfig.base(), TrainConfig(), bench.BatchShape(64, 32, 32),
                               peak=peak)
    print(report.table())                       # compile, step ms, tokens/s, FLOPs, MFU, memory
    bench.decode_report(ModelConfig.base(), 'beam', batch=32, src_len=32, new_tokens=32)
    bench.compare({'none': (config, train, shape),
                   'layer': (config.replace(remat='layer'), train, shape)})

Every report is a frozen value with `to_dict()` (JSON-ready) and `table()` (one screen).
"""

import importlib

# Public name -> its module, loaded on first use: `bench.flops` alone (the hand counts) needs
# no more than the config, and benchmarks' peer workers import it under other environments.
_EXPORTS = {
  'Breakdown': 'breakdown',
  'breakdown': 'breakdown',
  'compare': 'comparison',
  'reports_table': 'comparison',
  'Compilation': 'compiled',
  'CompiledMemory': 'compiled',
  'DecodeReport': 'decoding',
  'Decoding': 'decoding',
  'decode_report': 'decoding',
  'environment': 'environment',
  'BatchShape': 'flops',
  'decode_flops': 'flops',
  'train_flops': 'flops',
  'xla_flops': 'flops',
  'PeakReport': 'peaks',
  'datasheet_peak': 'peaks',
  'measure_peak': 'peaks',
  'MatmulBound': 'matmul_bound',
  'matmul_bound': 'matmul_bound',
  'MixReport': 'shape_mix',
  'ShapeMix': 'shape_mix',
  'StepReport': 'step',
  'TrainingStep': 'step',
  'step_report': 'step',
  'synthetic_batch': 'step',
  'Timing': 'timing',
  'alternating_rounds': 'timing',
  'time_rounds': 'timing',
}


def __getattr__(name: str):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f'{__name__}.{_EXPORTS[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = sorted(_EXPORTS)
