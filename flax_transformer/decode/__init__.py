"""Decoding: the functional API on the explicit KV cache, methods as values, text in and out.

Layer 6 (above `run`, whose checkpoints `Translator` loads). Modules:
`autoregressive` (greedy, sampling and beam search on a model's KV cache), `search`
(the loops they run: a `lax.scan`-style loop over steps on any step function),
`non_autoregressive` (mask-predict, a cmlm model's iterative refinement), `methods`
(one frozen class per method: its settings, checked, and how it runs; the methods by
decode.py's names, the default; no JAX until a method runs), `translator` (`Translator`:
text in, text out, for either model kind). The functional API and `Translator` are
imported when first used.

    tokens = decode.greedy(model, variables, src)                           # [B, L]
    tokens, scores = decode.beam_search(model, variables, src, beam_size=4, alpha=0.6)
"""

import importlib

from flax_transformer.decode.methods import (
  METHODS,
  BeamSearch,
  DecodingMethod,
  Greedy,
  MaskPredict,
  Sampling,
  default_method,
)

# The functional API and Translator -> the module that defines each, imported when first
# asked for: the methods (above) load without JAX, so decode.py --help and settings do too.
_ON_A_MODEL = {
  'Translator': 'translator',
  'beam_search': 'autoregressive',
  'greedy': 'autoregressive',
  'sample': 'autoregressive',
  'mask_predict': 'non_autoregressive',
  'length_penalty': 'search',
}

__all__ = [
  'METHODS',
  'BeamSearch',
  'DecodingMethod',
  'Greedy',
  'MaskPredict',
  'Sampling',
  'Translator',
  'beam_search',
  'default_method',
  'greedy',
  'length_penalty',
  'mask_predict',
  'sample',
]


def __getattr__(name: str):
  if name in _ON_A_MODEL:
    return getattr(importlib.import_module(f'{__name__}.{_ON_A_MODEL[name]}'), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__() -> list[str]:
  return sorted({*globals(), *__all__})
