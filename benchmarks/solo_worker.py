"""One contender of `benchmarks.solo` in a process of its own, answering JSON lines on stdin/stdout.

    python -m benchmarks.solo_worker CONTENDER [--threads N]     # run by benchmarks.solo

Contenders: `ours` (flax_transformer's jit step and decoders), `marian` (Hugging
Face `MarianMTModel`, PyTorch, eager), `flaxmarian` (Hugging Face
`FlaxMarianMTModel`, transformers < 5, JAX), `torch` (`nn.Transformer`,
training step only) and `ctranslate2` (our model exported by `pretrained.export`,
converted by CTranslate2's transformers converter: decoding only, float32 or int8). The worker pins itself to its cores, says hello (its
python, its package versions) or which packages it lacks, then blocks on stdin
and answers one request at a time, so that it computes only when asked:

  {"op": "peaks", "shapes": [[M, K, N], ...], "dtypes": [...], "repeats": R}
      -> {"peaks": [{"m", "k", "n", "dtype", "flops", "times_s"}, ...]}  (compiled and run
         once untimed the first time a shape is asked for; "flops" per timed call)
  {"op": "build", "task": "train"|"greedy"|"beam4", "dtype": ..., "model": {...}, ...}
      -> {"built": true, "setup_s", "first_call_s"} or {"unsupported": reason}
  {"op": "time"}  -> {"seconds": one call of the built task}
  {"op": "time", "result": true}  -> also {"result": {"loss": the step's loss} or
                                     {"tokens": the decoded tokens [B, n]}}
  {"op": "drop"}  -> {"dropped": true}
  {"op": "quit"}  -> exits

Only the standard library and NumPy are imported up front, and nothing from
flax_transformer except for `ours`: a peer's worker runs under a python of its
own (the FlaxMarian one has jax, flax, optax, transformers < 5 and numpy only)
with PYTHONPATH at the repository root.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import types
from pathlib import Path

from benchmarks import common, peers, workloads
from benchmarks.workloads import Shape, decode_sources, synthetic_arrays

CONTENDERS = ('ours', 'marian', 'flaxmarian', 'torch', 'ctranslate2')
FRAMEWORK = {
  'ours': 'jax',
  'flaxmarian': 'jax',
  'marian': 'torch',
  'torch': 'torch',
  'ctranslate2': 'ctranslate2',
}
PACKAGES = ('jax', 'jaxlib', 'flax', 'optax', 'numpy', 'torch', 'transformers', 'ctranslate2')
# CTranslate2's compute type for each dtype of the request (it has no bfloat16 on a CPU).
CT2_COMPUTE = {'float32': 'float32', 'int8': 'int8'}
# One timed call of a small matmul loop does about this much work (~50 ms at 200 GFLOP/s), in
# at most MAX_ITERATIONS products (PyTorch's are eager calls).
PEAK_CALL_FLOPS = 1e10
MAX_ITERATIONS = 2000


def missing_packages(contender: str) -> list[str]:
  """What `contender` lacks in this python (empty when it can run); imports nothing heavy."""
  needed = {
    'ours': ('jax', 'flax', 'optax', 'flax_transformer'),
    'torch': ('torch',),
    'marian': ('torch', 'transformers'),
    'flaxmarian': ('jax', 'flax', 'optax', 'transformers'),
    'ctranslate2': ('ctranslate2', 'torch', 'transformers', 'safetensors', 'flax_transformer'),
  }[contender]
  missing = [name for name in needed if importlib.util.find_spec(name) is None]
  if contender == 'flaxmarian' and 'transformers' not in missing:
    version = importlib.metadata.version('transformers')
    if int(version.split('.')[0]) >= 5:  # transformers 5 dropped the Flax classes
      missing.append(f'transformers<5 (found {version})')
  return missing


def hello(contender: str) -> dict:
  # The versions as `flax_transformer.bench.environment` reads them, which a peer's python
  # (module docstring) cannot import.
  versions = {}
  for package in PACKAGES:
    try:
      versions[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return {
    'contender': contender,
    'framework': FRAMEWORK[contender],
    'python': sys.executable,
    'python_version': platform.python_version(),
    'versions': versions,
    'cores': sorted(os.sched_getaffinity(0)),
  }


# --- matmul peaks ------------------------------------------------------------------------


def jax_matmul_loop(m: int, k: int, n: int, dtype: str, iterations: int):
  """`run()`: `iterations` products [m, k] @ [k, n] in one jitted loop (float32 accumulation).

  Each iteration's left operand is shifted by the loop index (an [m, k] add, a
  1/n share of the dot's work), so XLA can neither hoist the dot out of the
  loop nor share it; the products are summed so that none is dead.
  """
  import jax
  import jax.numpy as jnp

  x = jax.random.normal(jax.random.key(0), (m, k), jnp.float32).astype(dtype)  # [m, k]
  w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32).astype(dtype)  # [k, n]

  @jax.jit
  def loop(x, w):
    def body(i, total):
      shifted = x + (i * 1e-3).astype(x.dtype)
      return total + jnp.dot(shifted, w, preferred_element_type=jnp.float32)  # [m, n]

    return jax.lax.fori_loop(0, iterations, body, jnp.zeros((m, n), jnp.float32))

  return lambda: loop(x, w).block_until_ready()


def torch_matmul_loop(m: int, k: int, n: int, dtype: str, iterations: int):
  """`run()`: `iterations` eager `F.linear` calls: [m, k] times a [n, k] weight, as in `nn.Linear`.

  Eager, as the PyTorch peers run: the per-call dispatch is part of what their
  small decode-step matmuls cost. (`torch.matmul(..., out=buffer)` ran 1024 x 512
  x 2048 float32 at 48 GFLOP/s where `F.linear` and `@` ran at 80, informally.)
  """
  import torch
  import torch.nn.functional as F

  generator = torch.Generator().manual_seed(0)
  x = torch.randn(m, k, generator=generator).to(getattr(torch, dtype))  # [m, k]
  w = torch.randn(n, k, generator=generator).to(getattr(torch, dtype))  # [n, k]

  def run():
    for _ in range(iterations):
      F.linear(x, w)  # [m, n]

  return run


def time_matmuls(framework: str, shapes, dtypes, repeats: int, loops: dict) -> list[dict]:
  """`repeats` timed calls of each [m, k] @ [k, n] loop per dtype; FLOPs per call alongside.

  `loops` keeps the built loops between requests (the orchestrator asks once per
  round, so that the frameworks' peaks are timed in alternation too); a loop is
  compiled and run once untimed when first built.
  """
  if framework not in ('jax', 'torch'):
    return []  # CTranslate2 exposes no matmul of its own
  loop = jax_matmul_loop if framework == 'jax' else torch_matmul_loop
  results = []
  for dtype in dtypes:
    for m, k, n in shapes:
      iterations = max(1, min(MAX_ITERATIONS, round(PEAK_CALL_FLOPS / (2 * m * k * n))))
      if (m, k, n, dtype) not in loops:
        loops[m, k, n, dtype] = loop(m, k, n, dtype, iterations)
        loops[m, k, n, dtype]()
      times = common.time_calls(loops[m, k, n, dtype], repeats)
      results.append(
        {
          'm': m,
          'k': k,
          'n': n,
          'dtype': dtype,
          'flops': 2 * m * k * n * iterations,
          'times_s': [round(t, 6) for t in times],
        }
      )
  return results


# --- the tasks -----------------------------------------------------------------------------


def ours_task(request: dict, config):
  """Our jit-compiled training step, or greedy / beam 4 decoding, on the request's setting.

  Every task returns what it computed: the step its loss, a decoder its tokens `[B, n]`.
  """
  import jax

  from flax_transformer import Transformer
  from flax_transformer.config import ModelConfig, TrainConfig
  from flax_transformer.decode import autoregressive

  model_config = ModelConfig(**request['model']).replace(dtype=request['dtype'])
  if request['task'] == 'train':
    step = workloads.OurStep(
      model_config, TrainConfig(**request['train']), Shape(*request['shape']), jax.devices()[:1]
    )
    return step.step
  model_config = model_config.replace(dropout_rate=0.0)
  model = Transformer(model_config)
  src = decode_sources(config, request['batch'], request['source_len'])
  params = jax.jit(model.init)(jax.random.key(0), src[:, :1], src[:, :1])['params']
  n = request['new_tokens']
  if request['task'] == 'greedy':
    return lambda: jax.block_until_ready(
      autoregressive.greedy(model, params, src, max_len=n, min_len=n)
    )
  return lambda: jax.block_until_ready(
    autoregressive.beam_search(model, params, src, beam_size=4, max_len=n, min_len=n)
  )[0]


def torch_task(contender: str, request: dict, config, threads: int):
  """`peers.PeerStep`, or `MarianMTModel.generate` (float32 only)."""
  if request['task'] == 'train':
    src, tgt_in, tgt_out = synthetic_arrays(config, Shape(*request['shape']))
    step = peers.PeerStep(
      contender, config, types.SimpleNamespace(**request['train']), src, tgt_in, tgt_out
    )
    return step.step
  if contender == 'torch':
    return 'nn.Transformer has no decoder loop here; training step only'
  if request['dtype'] != 'float32':
    return 'Marian generate is timed in float32 only'
  return marian_generate(config, request)


def marian_generate(config, request: dict):
  """`MarianMTModel.generate` of n forced tokens (EOS banned until then); returns them `[B, n]`."""
  import torch

  model = peers.build_model('marian', config).eval()
  src = torch.as_tensor(
    decode_sources(config, request['batch'], request['source_len']), dtype=torch.long
  )
  n, beam_size = request['new_tokens'], 1 if request['task'] == 'greedy' else 4

  def run():
    with torch.inference_mode():
      out = model.generate(
        input_ids=src,
        attention_mask=torch.ones_like(src),
        num_beams=beam_size,
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        forced_eos_token_id=None,
      )  # [B, 1 + n]
    if out.shape[1] != n + 1:
      raise RuntimeError(f'Marian generated {out.shape[1] - 1} tokens, expected {n}')
    return out[:, 1:]

  return run


def ctranslate2_task(request: dict, config, threads: int):
  """CTranslate2's `translate_batch` of n forced tokens, on our model (ours_task's weights)
  exported and converted; returns the tokens `[B, n]` as ids."""
  if request['task'] == 'train':
    return 'CTranslate2 is an inference engine; decoding only'
  if request['dtype'] not in CT2_COMPUTE:
    return f'CTranslate2 has no {request["dtype"]} on a CPU ({", ".join(CT2_COMPUTE)})'
  import tempfile

  import ctranslate2
  import jax
  import numpy as np

  from flax_transformer import Transformer
  from flax_transformer.config import ModelConfig
  from flax_transformer.pretrained import export

  model_config = ModelConfig(**request['model']).replace(dropout_rate=0.0)
  src = decode_sources(config, request['batch'], request['source_len'])
  params = jax.jit(Transformer(model_config).init)(jax.random.key(0), src[:, :1], src[:, :1])[
    'params'
  ]
  directory = Path(tempfile.mkdtemp(prefix='ct2-'))
  export.export_marian(
    model_config, params, synthetic_tokenizer(model_config.vocab_size), directory / 'marian'
  )
  ctranslate2.converters.TransformersConverter(str(directory / 'marian')).convert(
    str(directory / 'ct2')
  )
  translator = ctranslate2.Translator(
    str(directory / 'ct2'),
    device='cpu',
    inter_threads=1,
    intra_threads=threads,
    compute_type=CT2_COMPUTE[request['dtype']],
  )
  order = export.vocabulary_order(model_config.vocab_size, model_config.pad_id)
  vocabulary = {index: f'w{index}' for index in range(model_config.vocab_size)}
  vocabulary.update({model_config.eos_id: '</s>'})
  sources = [[vocabulary[int(order[i])] for i in row] for row in src]
  n, beam_size = request['new_tokens'], 1 if request['task'] == 'greedy' else 4
  ids = {token: index for index, token in vocabulary.items()}

  def run():
    results = translator.translate_batch(
      sources, beam_size=beam_size, min_decoding_length=n, max_decoding_length=n
    )
    tokens = [result.hypotheses[0] for result in results]
    if any(len(row) != n for row in tokens):
      raise RuntimeError(
        f'CTranslate2 gave {sorted({len(r) for r in tokens})} tokens, expected {n}'
      )
    return np.array([[int(order[ids[t]]) for t in row] for row in tokens])

  return run


def synthetic_tokenizer(vocab_size: int):
  """Our `Tokenizer` over pieces 'w4', 'w5', ... (no merges): a vocabulary of `vocab_size` ids
  for the export, whose strings CTranslate2 reads."""
  import tokenizers
  from tokenizers import decoders, models, normalizers, pre_tokenizers

  from flax_transformer.tokenizer import SPECIAL_TOKENS, Tokenizer

  vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
  vocab.update({f'w{index}': index for index in range(len(SPECIAL_TOKENS), vocab_size)})
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token='<unk>'))
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  backend.normalizer = normalizers.NFKC()
  backend.pre_tokenizer = pre_tokenizers.Metaspace()
  backend.decoder = decoders.Metaspace()
  return Tokenizer(backend)


def flaxmarian_model(config, dtype: str):
  """`FlaxMarianMTModel` at our dimensions (peers.marian_config_kwargs), random, seed 0."""
  import jax.numpy as jnp
  from transformers import FlaxMarianMTModel, MarianConfig

  return FlaxMarianMTModel(
    MarianConfig(**peers.marian_config_kwargs(config)), seed=0, dtype=getattr(jnp, dtype)
  )


def flaxmarian_trainable(params) -> dict:
  """What the optimizer updates: everything but `final_logits_bias`, which PyTorch Marian keeps
  as a frozen buffer (zero at initialisation); its sinusoidal positions are constants in both."""
  return params['model']


def flaxmarian_train_step(model, config, train):
  """`(state, batch) -> (state, loss)`, jitted, state donated: the Flax twin of `peers.PeerStep`.

  Label-smoothed cross-entropy (optax.smooth_labels: (1 - eps) one-hot + eps / V,
  PyTorch's `label_smoothing`) summed over non-PAD targets over their count,
  Adam(b1, b2, eps) on the paper's schedule, dropout on.
  """
  import jax
  import jax.numpy as jnp
  import optax

  schedule = lambda count: (
    train.lr_scale
    * config.d_model**-0.5
    * jnp.minimum((count + 1) ** -0.5, (count + 1) * train.warmup_steps**-1.5)
  )
  optimizer = optax.adam(schedule, train.adam_b1, train.adam_b2, train.adam_eps)
  frozen_bias = model.params['final_logits_bias']  # [1, V]
  pad = config.pad_id

  def loss_fn(trainable, key, src, tgt_in, tgt_out):
    logits = model(
      input_ids=src,
      attention_mask=src != pad,
      decoder_input_ids=tgt_in,
      decoder_attention_mask=tgt_in != pad,
      dropout_rng=key,
      train=True,
      params={'model': trainable, 'final_logits_bias': frozen_bias},
    ).logits
    targets = optax.smooth_labels(jax.nn.one_hot(tgt_out, config.vocab_size), train.label_smoothing)
    losses = optax.softmax_cross_entropy(logits.astype(jnp.float32), targets)  # [B, T]
    mask = tgt_out != pad
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1)

  def step(state, batch):
    trainable, opt_state, key = state
    key, dropout_key = jax.random.split(key)
    loss, grads = jax.value_and_grad(loss_fn)(trainable, dropout_key, *batch)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    return (optax.apply_updates(trainable, updates), opt_state, key), loss

  def init_state():
    trainable = flaxmarian_trainable(model.params)
    return trainable, optimizer.init(trainable), jax.random.key(0)

  return jax.jit(step, donate_argnums=0), init_state


def flaxmarian_task(request: dict, config):
  """FlaxMarian's training step, or its jitted `generate` (greedy or beam 4) of n forced tokens."""
  import jax
  import jax.numpy as jnp

  model = flaxmarian_model(config, request['dtype'])
  if request['task'] == 'train':
    train = types.SimpleNamespace(**request['train'])
    step, init_state = flaxmarian_train_step(model, config, train)
    batch = tuple(jnp.asarray(a) for a in synthetic_arrays(config, Shape(*request['shape'])))
    holder = {'state': init_state()}

    def run():
      holder['state'], loss = step(holder['state'], batch)
      jax.block_until_ready((holder['state'], loss))
      return float(loss)

    return run
  n, beam_size = request['new_tokens'], 1 if request['task'] == 'greedy' else 4
  src = jnp.asarray(decode_sources(config, request['batch'], request['source_len']))
  # Lengths count the start token; EOS is banned until then (min_length), none forced at the end.
  generate = jax.jit(
    lambda params, src: (
      model.generate(
        src,
        attention_mask=jnp.ones_like(src),
        params=params,
        max_length=n + 1,
        min_length=n + 1,
        num_beams=beam_size,
        do_sample=False,
        forced_eos_token_id=None,
      ).sequences
    )
  )

  def run():
    out = jax.block_until_ready(generate(model.params, src))  # [B, 1 + n]
    if out.shape[1] != n + 1 or bool((out[:, 1:] == config.eos_id).any()):
      raise RuntimeError(f'FlaxMarian generate did not give {n} tokens without EOS')
    return out[:, 1:]

  return run


def build(contender: str, request: dict, threads: int):
  """A callable that runs the request's task once, or a string saying why it is not timed."""
  config = types.SimpleNamespace(**{**request['model'], 'dtype': request['dtype']})
  if request['dtype'] == 'int8' and contender != 'ctranslate2':
    return 'int8 is timed for CTranslate2 only'
  if contender == 'ours':
    return ours_task(request, config)
  if contender == 'flaxmarian':
    return flaxmarian_task(request, config)
  if contender == 'ctranslate2':
    return ctranslate2_task(request, config, threads)
  return torch_task(contender, request, config, threads)


def describe(output) -> dict:
  """What a task's call computed, as JSON: {'loss': float} or {'tokens': [[int, ...], ...]}."""
  if isinstance(output, float):
    return {'loss': output}
  import numpy as np

  return {'tokens': np.asarray(output).tolist()}


# --- the loop ------------------------------------------------------------------------------


def serve(contender: str, threads: int, reply, lines) -> None:
  """Answers requests from `lines` (JSON) through `reply(dict)` until 'quit' or end of input."""
  framework, task, loops = FRAMEWORK[contender], None, {}
  for line in lines:
    request = json.loads(line)
    op = request['op']
    try:
      if op == 'quit':
        return
      if op == 'peaks':
        reply(
          {
            'peaks': time_matmuls(
              framework, request['shapes'], request['dtypes'], request['repeats'], loops
            )
          }
        )
      elif op == 'build':
        task = None
        start = time.perf_counter()
        built = build(contender, request, threads)
        if isinstance(built, str):
          reply({'unsupported': built})
          continue
        setup_s = time.perf_counter() - start
        first_call_s = common.time_calls(built, 1)[0]  # compiles on the first call, where lazy
        common.time_calls(built, request.get('warmup', 1))
        task = built
        reply({'built': True, 'setup_s': setup_s, 'first_call_s': first_call_s})
      elif op == 'time' and task is None:
        reply({'error': 'no task built'})
      elif op == 'time':
        start = time.perf_counter()
        output = task()
        answer = {'seconds': time.perf_counter() - start}
        if request.get('result'):
          answer['result'] = describe(output)
        reply(answer)
      elif op == 'drop':
        task = None
        reply({'dropped': True})
      else:
        reply({'error': f'unknown op {op!r}'})
    except Exception as error:  # reported to the orchestrator, which goes on without this task
      traceback.print_exc(file=sys.stderr)
      task = None
      reply({'error': f'{type(error).__name__}: {error}'.splitlines()[0][:300]})


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
    prog='python -m benchmarks.solo_worker', description=__doc__.split('\n\n')[0]
  )
  parser.add_argument('contender', choices=CONTENDERS)
  parser.add_argument('--threads', type=int, help='cores to use (default: all)')
  args = parser.parse_args(argv)
  # The protocol owns the real stdout; anything a library prints goes to stderr.
  channel = os.fdopen(os.dup(sys.stdout.fileno()), 'w', buffering=1)
  os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

  def reply(message: dict):
    channel.write(json.dumps(message) + '\n')

  missing = missing_packages(args.contender)
  if missing:
    reply({'missing': missing})
    return 3
  cores = common.pin_threads(args.threads)  # before JAX or PyTorch starts
  if FRAMEWORK[args.contender] == 'torch':
    common.torch_threads(len(cores))
  reply({'hello': hello(args.contender)})
  serve(args.contender, len(cores), reply, sys.stdin)
  return 0


if __name__ == '__main__':
  sys.exit(main())
