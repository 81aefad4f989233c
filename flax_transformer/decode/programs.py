"""The compiled programs a decoding method runs, lowered for inspection and timing.

    programs = decoding_programs(Greedy(max_len=32), model, variables, src, min_len=32)
    compiled = [lowered.compile() for lowered in programs.lowered]   # memory_analysis(), ...
    tokens = programs.run(compiled)                                  # [B, L], as method.run's

Greedy, sampling and beam search are one program each (the whole `lax.scan`-style loop);
mask-predict is two (the encoder with the length classifier, then the refinement passes at
the canvas width the predicted lengths need, which is why it encodes once here to find it).
`run` calls exactly those programs, so a benchmark times what decode.py runs, compiled once.
`min_len` forbids EOS before that many tokens (autoregressive methods): with min_len ==
max_len every row generates the same number of tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from flax_transformer.decode import autoregressive as ar
from flax_transformer.decode import non_autoregressive as nar
from flax_transformer.decode.methods import (
  BeamSearch,
  DecodingMethod,
  Greedy,
  MaskPredict,
  Sampling,
)


@dataclasses.dataclass(frozen=True)
class DecodingPrograms:
  """`lowered`: the programs, in the order `run(compiled)` calls them; `run` returns the
  output ids `[B, L]` (beam search: the best hypothesis)."""

  lowered: tuple[jax.stages.Lowered, ...]
  run: Callable[[Sequence[jax.stages.Compiled]], jax.Array]


def decoding_programs(
  method: DecodingMethod, model, params, src, *, min_len: int = 0, batch_index: int = 0
) -> DecodingPrograms:
  """The programs `method.run(model, params, src, batch_index)` compiles and runs (with
  `min_len`, which decode.py leaves at 0). Raises what `method.run` raises for bad input."""
  config = model.config
  if isinstance(method, MaskPredict):
    return _mask_predict_programs(method, model, params, src)
  if not isinstance(method, (Greedy, Sampling, BeamSearch)):
    raise TypeError(f'no programs known for decoding method {type(method).__name__}')
  variables, src, limits, loop = ar._prepare(
    model, params, src, method.max_len, min_len, ar.DEFAULT_STEPS_PER_CHECK
  )
  if isinstance(method, Greedy):
    lowered = ar._greedy.lower(config, variables, src, limits, loop)
    return DecodingPrograms((lowered,), lambda compiled: compiled[0](variables, src, limits))
  if isinstance(method, Sampling):
    rng = jax.random.fold_in(jax.random.key(method.seed), batch_index)
    static = dataclasses.replace(method, seed=0, max_len=None)
    lowered = ar._sample.lower(config, variables, src, limits, rng, loop, static)
    return DecodingPrograms((lowered,), lambda compiled: compiled[0](variables, src, limits, rng))
  static = dataclasses.replace(method, max_len=None)
  lowered = ar._beam_search.lower(config, variables, src, limits, loop, static, 1)
  return DecodingPrograms((lowered,), lambda compiled: compiled[0](variables, src, limits)[0][:, 0])


def _mask_predict_programs(method: MaskPredict, model, params, src) -> DecodingPrograms:
  config = model.config
  method.check_model(config)
  src = ar.check_source(src, config)
  variables = ar.as_variables(params)
  # The canvas width is a static argument read from the predicted lengths, as mask_predict
  # reads it: the encoder runs once here.
  memory, lengths = nar._encode(config, variables, src, method)
  width = nar.canvas_width(int(jnp.max(lengths, initial=0)), config.max_len)
  plain = dataclasses.replace(method, length_ratio=1.0, length_offset=0)
  encode = nar._encode.lower(config, variables, src, method)
  refine = nar._refine.lower(config, variables, src, memory, lengths, plain, width)

  def run(compiled):
    memory, lengths = compiled[0](variables, src)
    return compiled[1](variables, src, memory, lengths)[0]

  return DecodingPrograms((encode, refine), run)
