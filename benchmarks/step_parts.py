"""Where our float32 training step's time goes, against the time its matmuls alone would take.

    python -m benchmarks.step_parts [--rounds 5] [--dtype float32]

The issue-21 setting (base model, vocabulary 8,000, batch 32 x (32 + 32)),
timed in one process in interleaved rounds, each variant compiled ahead of time:

  mapped step    the library's step (`train.make_parallel_step`, shard_map on
                 one device, with its metrics: what train.py and benchmarks.solo run)
  jit step       the plain `jax.jit` step (`PlainStep`: loss, gradient, Adam)
  no dropout     the same with dropout_rate = attention_dropout_rate = 0
  gradients      loss and gradient only, no optimizer update (dropout on)
  forward        the loss only (dropout on)
  matmul floor   the step's matmul FLOPs split by shape (`workloads.train_flop_classes`),
                 each class at the speed of a lone jitted [rows, K] @ [K, N] timed in
                 the same rounds: what the step would take if it did nothing but its
                 matmuls, each as fast as XLA runs that shape alone

Differences of adjacent rows price Adam, dropout, the backward pass and the
mapping; `jit step - matmul floor` is everything that is not a matmul.
Writes benchmarks/results/step_parts[_<dtype>].json.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

from benchmarks import common, workloads


class PlainStep:
  """The reference single-device step a user would write: `jax.jit`, no mapping, no metrics.

  Loss, gradient and Adam update from the library's public pieces
  (`label_smoothed_cross_entropy`, `make_optimizer`), the same model and batch,
  state donated. The gap to `workloads.OurStep` on one device is the cost of the
  mapped step's psums and its metrics (NLL, accuracy, gradient norm).
  """

  def __init__(self, model_config, train_config, shape: workloads.Shape):
    import jax
    import jax.numpy as jnp

    from flax_transformer import train
    from flax_transformer.nn.model import Transformer

    model = Transformer(model_config)
    optimizer = train.make_optimizer(train_config, model_config)
    state = train.create_train_state(model, optimizer, seed=0)
    batch = jax.device_put(workloads.synthetic_batch(model_config, shape))
    base_key = jax.random.key(train_config.seed)

    @functools.partial(jax.jit, donate_argnums=0)
    def plain_step(state, batch):
      def loss_fn(params):
        logits = model.apply(
          {'params': params},
          batch.src,
          batch.tgt_in,
          train=True,
          rngs={'dropout': jax.random.fold_in(base_key, state.step)},
        )
        loss_sum, tokens = train.label_smoothed_cross_entropy(
          logits, batch.tgt_out, train_config.label_smoothing, model_config.pad_id
        )
        return loss_sum / jnp.maximum(tokens, 1.0)

      loss, grads = jax.value_and_grad(loss_fn)(state.params)
      updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
      return state.replace(
        step=state.step + 1,
        opt_state=opt_state,
        params=jax.tree.map(jnp.add, state.params, updates),
      ), loss

    start = time.perf_counter()
    compiled = plain_step.lower(state, batch).compile()
    self.compile_s = time.perf_counter() - start
    self._state = state

    def step():
      self._state, loss = compiled(self._state, batch)
      jax.block_until_ready((self._state, loss))

    self.step = step


def variants(dtype: str) -> dict:
  """{name: run()} for the step variants; each run() does one call and waits for it."""
  import jax
  import jax.numpy as jnp

  from flax_transformer import train
  from flax_transformer.config import TrainConfig
  from flax_transformer.nn.model import Transformer

  config = workloads.model_config('base', dtype=dtype)
  train_config, shape = TrainConfig(), workloads.SHAPE
  batch = jax.device_put(workloads.synthetic_batch(config, shape))
  runs = {
    'mapped step': workloads.OurStep(config, train_config, shape, jax.devices()[:1]).step,
    'jit step': PlainStep(config, train_config, shape).step,
    'no dropout': PlainStep(
      config.replace(dropout_rate=0.0, attention_dropout_rate=0.0), train_config, shape
    ).step,
  }
  model = Transformer(config)
  params = train.create_train_state(
    model, train.make_optimizer(train_config, config), seed=0
  ).params
  key = jax.random.key(0)

  def loss(params):
    logits = model.apply(
      {'params': params}, batch.src, batch.tgt_in, train=True, rngs={'dropout': key}
    )
    total, tokens = train.label_smoothed_cross_entropy(
      logits, batch.tgt_out, train_config.label_smoothing, config.pad_id
    )
    return total / jnp.maximum(tokens, 1.0)

  gradients = jax.jit(jax.value_and_grad(loss)).lower(params).compile()
  forward = jax.jit(loss).lower(params).compile()
  runs['gradients'] = lambda: jax.block_until_ready(gradients(params))
  runs['forward'] = lambda: jax.block_until_ready(forward(params))
  return runs, config, shape


def matmul_runs(classes: dict, dtype: str) -> dict:
  """{(rows, K, N): (run(), FLOPs per call)}: one jitted loop of products per FLOP class."""
  from benchmarks.solo_worker import MAX_ITERATIONS, PEAK_CALL_FLOPS, jax_matmul_loop

  runs = {}
  for m, k, n in classes:
    iterations = max(1, min(MAX_ITERATIONS, round(PEAK_CALL_FLOPS / (2 * m * k * n))))
    run = jax_matmul_loop(m, k, n, dtype, iterations)
    run()
    runs[m, k, n] = (run, 2 * m * k * n * iterations)
  return runs


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--rounds', type=int, default=5)
  parser.add_argument('--dtype', default='float32', choices=('float32', 'bfloat16'))
  parser.add_argument(
    '--output', help='JSON file (default benchmarks/results/step_parts[_DTYPE].json)'
  )
  args = parser.parse_args(argv)
  cores = common.pin_threads(None)
  load_at_start = os.getloadavg()
  runs, config, shape = variants(args.dtype)
  classes = workloads.train_flop_classes(config, shape)
  matmuls = matmul_runs(classes, args.dtype)
  contenders = {**runs, **{f'matmul {m}x{k}x{n}': run for (m, k, n), (run, _) in matmuls.items()}}
  timings = common.interleaved_medians(contenders, args.rounds)
  seconds = {name: timing['median_s'] for name, timing in timings.items()}
  speed = {
    key: flops / seconds[f'matmul {key[0]}x{key[1]}x{key[2]}'] / 1e9
    for key, (_, flops) in matmuls.items()
  }  # GFLOP/s
  floor = sum(flops / (speed[key] * 1e9) for key, flops in classes.items())
  seconds['matmul floor'] = floor
  report(seconds, floor)
  record = {
    'benchmark': 'step_parts',
    'machine': common.machine_info(len(cores)),
    'load_average_at_start': load_at_start,
    'load_average_at_end': os.getloadavg(),
    'dtype': args.dtype,
    'rounds': args.rounds,
    'timings': timings,
    'matmul_gflops': {f'{m}x{k}x{n}': value for (m, k, n), value in speed.items()},
    'flop_classes': {f'{m}x{k}x{n}': value for (m, k, n), value in classes.items()},
    'matmul_floor_s': floor,
  }
  suffix = '' if args.dtype == 'float32' else f'_{args.dtype}'
  path = args.output or common.RESULTS / f'step_parts{suffix}.json'
  print(f'wrote {common.write_json(path, record)}')
  return 0


def report(seconds: dict, floor: float) -> None:
  """Prints each variant's median and what adjacent differences price."""
  for name in ('mapped step', 'jit step', 'no dropout', 'gradients', 'forward', 'matmul floor'):
    print(f'{name:>14s} {seconds[name]:7.3f} s')
  jit = seconds['jit step']
  parts = {
    'the mapping and its metrics': seconds['mapped step'] - jit,
    'Adam (jit step - gradients)': jit - seconds['gradients'],
    'dropout (jit step - no dropout)': jit - seconds['no dropout'],
    'backward (gradients - forward)': seconds['gradients'] - seconds['forward'],
    'not matmuls (jit step - matmul floor)': jit - floor,
  }
  for name, value in parts.items():
    print(f'{name:>40s} {value:+7.3f} s ({value / jit:+.0%} of the jit step)')


if __name__ == '__main__':
  raise SystemExit(main())
