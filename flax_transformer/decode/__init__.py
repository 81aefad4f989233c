"""Decoding: the functional API on the explicit KV cache, methods as values, text in and out.

Layer 6 (above `run`, whose checkpoints `Translator` loads). Modules:
`autoregressive` (greedy, sampling and beam search on a model's KV cache), `search`
(the loops they run: a `lax.scan`-style loop over steps on any step function),
`non_autoregressive` (mask-predict, a cmlm model's iterative refinement),
each with its methods' classes (one frozen class per method: its settings, checked, and
how it runs), `methods` (what a method is, the methods by decode.py's names, the default),
`translator` (`Translator`: text in, text out, for either model kind).

    tokens = decode.greedy(model, variables, src)                           # [B, L]
    tokens, scores = decode.beam_search(model, variables, src, beam_size=4, alpha=0.6)
"""

from flax_transformer.decode.autoregressive import (
  BeamSearch,
  Greedy,
  Sampling,
  beam_search,
  greedy,
  sample,
)
from flax_transformer.decode.methods import METHODS, DecodingMethod, default_method
from flax_transformer.decode.non_autoregressive import MaskPredict, mask_predict
from flax_transformer.decode.search import length_penalty
from flax_transformer.decode.translator import Translator

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
