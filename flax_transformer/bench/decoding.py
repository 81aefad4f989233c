"""Decoding as decode.py runs it, timed: greedy, sampling, beam search and mask-predict.

    report = decode_report(ModelConfig.base(), 'beam', batch=32, src_len=32, new_tokens=32)
    report.tokens_per_s, report.ms_per_token, report.memory

The programs are the method's own (`decode.programs`: the whole `lax.scan`-style loop with
its KV cache, or mask-predict's encoder and refinement passes), compiled once and timed
after warm-up. Autoregressive methods are held to exactly `new_tokens` tokens per sentence
(EOS is forbidden before, `min_len`), so every method and batch size does the same work;
mask-predict writes the lengths its classifier predicts. Parameters are random unless
given: the speed of a trained model is the same.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from flax_transformer.bench.compiled import (
  Compilation,
  CompiledMemory,
  compile_programs,
  format_bytes,
  memory_of,
)
from flax_transformer.bench.flops import decode_flops
from flax_transformer.bench.step import describe_model
from flax_transformer.bench.timing import Timing, time_rounds
from flax_transformer.config import ModelConfig
from flax_transformer.decode.methods import (
  BeamSearch,
  DecodingMethod,
  MaskPredict,
  method_from_name,
)
from flax_transformer.decode.programs import decoding_programs
from flax_transformer.nn.backend import compute_dtype
from flax_transformer.nn.build import build_model
from flax_transformer.nn.model import count_params


@dataclasses.dataclass(frozen=True)
class DecodeReport:
  """One decoding call's cost for `batch` sources of `src_len` tokens.

  generated_tokens: output tokens of the whole batch (EOS included, PAD not);
  tokens_per_s: those over the median call; ms_per_token: the median call over the tokens
  per sentence (the latency of one output position); analytic_flops: the model's matmuls
  (`flops.decode_flops`; None for mask-predict).
  """

  model: str
  parameters: int
  method: str
  batch: int
  src_len: int
  new_tokens: int
  generated_tokens: int
  dtype: str
  device: str
  compilation: Compilation
  timing: Timing
  memory: CompiledMemory | None
  analytic_flops: int | None

  @property
  def tokens_per_s(self) -> float:
    return self.generated_tokens / self.timing.median_s

  @property
  def ms_per_token(self) -> float:
    return 1e3 * self.timing.median_s / (self.generated_tokens / self.batch)

  def to_dict(self) -> dict:
    return {
      'kind': 'decode',
      'model': self.model,
      'parameters': self.parameters,
      'method': self.method,
      'batch': self.batch,
      'src_len': self.src_len,
      'new_tokens': self.new_tokens,
      'generated_tokens': self.generated_tokens,
      'dtype': self.dtype,
      'device': self.device,
      'compilation': self.compilation.to_dict(),
      'timing': self.timing.to_dict(),
      'tokens_per_s': self.tokens_per_s,
      'ms_per_token': self.ms_per_token,
      'analytic_flops': self.analytic_flops,
      'memory': self.memory and self.memory.to_dict(),
    }

  def table(self) -> str:
    t, m = self.timing, self.memory
    rows = [
      ('model', f'{self.model} ({self.parameters:,} parameters), {self.dtype} on {self.device}'),
      ('method', self.method),
      (
        'batch',
        f'{self.batch} sources of {self.src_len} tokens, {self.generated_tokens:,} tokens out',
      ),
      (
        'compile',
        f'{self.compilation.seconds:.2f} s for {self.compilation.programs} '
        f'program(s) (cache: {self.compilation.cache})',
      ),
      (
        'call',
        f'{t.median_s * 1e3:.2f} ms median, p10 {t.p10_s * 1e3:.2f}, p90 '
        f'{t.p90_s * 1e3:.2f} ({len(t.times_s)} rounds)',
      ),
      ('tokens/s', f'{self.tokens_per_s:,.0f} ({self.ms_per_token:.3f} ms per token)'),
      (
        'memory',
        'n/a'
        if m is None
        else f'{format_bytes(m.total)}: temporaries {format_bytes(m.temporaries)}, arguments '
        f'{format_bytes(m.arguments)}, outputs {format_bytes(m.outputs)}',
      ),
    ]
    return '\n'.join(f'{name:>9s}  {value}' for name, value in rows)


def random_sources(config: ModelConfig, batch: int, src_len: int, seed: int = 0) -> np.ndarray:
  """`[batch, src_len]` random ordinary ids, EOS last (NumPy int32): what every decoder gets."""
  rng = np.random.default_rng(seed)
  src = rng.integers(config.unk_id + 1, config.vocab_size, (batch, src_len)).astype(np.int32)
  src[:, -1] = config.eos_id
  return src


class Decoding:
  """A decoding method's programs for one batch, compiled at creation; `run()` blocks.

  method: a DecodingMethod, or decode.py's name ('greedy', 'beam', 'sample',
  'mask_predict') with its defaults. Autoregressive methods get max_len = min_len =
  new_tokens. params None: random parameters (seeded).
  """

  def __init__(
    self,
    config: ModelConfig,
    method: DecodingMethod | str = 'greedy',
    *,
    batch: int = 32,
    src_len: int = 32,
    new_tokens: int = 32,
    params=None,
    seed: int = 0,
  ):
    for name, value in (('batch', batch), ('src_len', src_len), ('new_tokens', new_tokens)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be a positive integer, got {value!r}')
    if max(src_len, new_tokens) > config.max_len:
      raise ValueError(
        f'src_len {src_len} and new_tokens {new_tokens} must be at most '
        f'model.max_len={config.max_len}'
      )
    if isinstance(method, str):
      method = method_from_name(method)
    autoregressive = not isinstance(method, MaskPredict)
    if autoregressive:
      method = dataclasses.replace(method, max_len=new_tokens)
    method.check_model(config)
    model = build_model(config)
    src = random_sources(config, batch, src_len, seed)
    if params is None:
      params = jax.jit(model.init)(jax.random.key(seed), src[:, :1], src[:, :1])['params']
    programs = decoding_programs(
      method, model, params, src, min_len=new_tokens if autoregressive else 0
    )
    compiled, self.compilation = compile_programs(lambda: programs.lowered)
    self.run_programs = lambda: programs.run(compiled)
    self.compiled = compiled
    self.config, self.method, self.params = config, method, params
    self.batch, self.src_len, self.new_tokens = batch, src_len, new_tokens
    tokens = np.asarray(self.run_programs())
    self.generated_tokens = int((tokens != config.pad_id).sum())

  def run(self) -> None:
    jax.block_until_ready(self.run_programs())

  def report(self, timing: Timing) -> DecodeReport:
    config, device = self.config, jax.devices()[0]
    beams = self.method.beam_size if isinstance(self.method, BeamSearch) else 1
    flops = (
      None
      if isinstance(self.method, MaskPredict)
      else decode_flops(config, self.batch, self.src_len, self.new_tokens, beams)
    )
    return DecodeReport(
      model=describe_model(config),
      parameters=count_params(self.params),
      method=self.method.describe(),
      batch=self.batch,
      src_len=self.src_len,
      new_tokens=self.new_tokens,
      generated_tokens=self.generated_tokens,
      dtype=compute_dtype(config).name,
      device=getattr(device, 'device_kind', device.platform),
      compilation=self.compilation,
      timing=timing,
      memory=memory_of(self.compiled),
      analytic_flops=flops,
    )


def decode_report(
  config: ModelConfig,
  method: DecodingMethod | str = 'greedy',
  *,
  batch: int = 32,
  src_len: int = 32,
  new_tokens: int = 32,
  rounds: int = 5,
  warmup: int = 1,
  params=None,
  seed: int = 0,
) -> DecodeReport:
  """Compiles `method`'s programs for `batch` random sources and times `rounds` calls."""
  decoding = Decoding(
    config, method, batch=batch, src_len=src_len, new_tokens=new_tokens, params=params, seed=seed
  )
  return decoding.report(time_rounds(decoding.run, rounds, warmup))
