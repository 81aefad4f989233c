"""The whole float32 Flax models against tests/support/numpy_transformer.py, their NumPy float64
reference written from the paper: encoder, decoder, cross-attention, residuals, both LayerNorm
placements, the sqrt(d_model) embedding scale and the shared output projection; the cmlm's
non-causal decoder with its MASK row, and its length head.

The parameters are the initial ones with every bias, LayerNorm scale and LayerNorm bias drawn
at random (at initialisation they are 0, 1 and 0, which would hide a dropped bias or a
LayerNorm in the wrong place). The logits are O(1) (about 3 at most); float32 through two
encoder and two decoder layers stays within ~1e-6 of float64, so the tolerance is 1e-5 of the
largest logit: dropping a residual or the embedding scale moves the logits by O(1).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer import ModelConfig, Transformer
from flax_transformer.nn.cmlm import CMLMTransformer, num_length_classes
from support import numpy_transformer

PAD, EOS, BOS = 0, 2, 1
# Two sentences, the first padded on both sides: PAD keys must be hidden everywhere.
SRC = np.array([[5, 9, 12, 7, 2, 0, 0], [3, 4, 5, 6, 7, 8, 2]], np.int32)
TGT_IN = np.array([[1, 8, 13, 6, 0, 0], [1, 4, 4, 30, 31, 32]], np.int32)
VARIANTS = {
  'post': dict(),
  'pre': dict(norm_placement='pre'),
  # Untied embeddings, another activation and the logits bias: the other output projection.
  'pre_untied_gelu_bias': dict(
    norm_placement='pre', share_embeddings=False, activation='gelu', logits_bias=True
  ),
}


def randomized(params, seed):
  """`params` with every bias, LayerNorm scale and mask row drawn at random, kernels kept."""
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    name = jax.tree_util.keystr(path)
    shape = np.shape(leaf)
    if name.endswith("['scale']"):
      return jnp.asarray(1.0 + 0.3 * rng.standard_normal(shape), jnp.float32)
    if name.endswith("['bias']") or name.endswith("['logits_bias']"):
      return jnp.asarray(0.2 * rng.standard_normal(shape), jnp.float32)
    return leaf

  return jax.tree_util.tree_map_with_path(draw, params)


def assert_close_to_reference(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape
  scale = np.abs(want).max()
  assert 0.3 < scale < 30, f'logits of unexpected size {scale}: the tolerance assumes O(1)'
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize('variant', VARIANTS)
def test_transformer_matches_the_float64_reference(variant):
  config = ModelConfig.tiny(dropout_rate=0.0, **VARIANTS[variant])
  model = Transformer(config)
  params = randomized(model.init(jax.random.key(0), SRC, TGT_IN)['params'], seed=1)
  logits = jax.jit(lambda p, s, t: model.apply({'params': p}, s, t))(params, SRC, TGT_IN)
  assert logits.dtype == jnp.float32
  assert_close_to_reference(logits, numpy_transformer.logits(config, params, SRC, TGT_IN))


def test_a_decoder_starting_from_pad_matches_the_reference():
  # Marian's convention: the start token is PAD, yet position 0 is visible to the decoder.
  config = ModelConfig.tiny(dropout_rate=0.0, bos_id=0, positions='concatenated', activation='silu')
  model = Transformer(config)
  tgt_in = np.where(np.arange(TGT_IN.shape[1]) == 0, PAD, TGT_IN).astype(np.int32)
  params = randomized(model.init(jax.random.key(2), SRC, tgt_in)['params'], seed=3)
  logits = model.apply({'params': params}, SRC, tgt_in)
  assert_close_to_reference(logits, numpy_transformer.logits(config, params, SRC, tgt_in))


@pytest.mark.parametrize('norm_placement', ['post', 'pre'])
def test_cmlm_matches_the_float64_reference(norm_placement):
  config = ModelConfig.tiny(
    kind='cmlm', dropout_rate=0.0, max_length_offset=4, norm_placement=norm_placement
  )
  mask = config.vocab_size
  # Partly MASKed rows of different lengths; PAD beyond each row.
  tokens = np.array([[mask, 8, mask, 6, 2, 0], [4, mask, mask, mask, 31, 2]], np.int32)
  model = CMLMTransformer(config)
  params = randomized(model.init(jax.random.key(0), SRC, tokens)['params'], seed=4)
  token_logits, length_logits = jax.jit(lambda p, s, t: model.apply({'params': p}, s, t))(
    params, SRC, tokens
  )
  want_tokens, want_lengths = numpy_transformer.cmlm_outputs(config, params, SRC, tokens)
  assert length_logits.shape == (2, num_length_classes(config))
  assert_close_to_reference(token_logits, want_tokens)
  assert_close_to_reference(length_logits, want_lengths)
  # The MASK row matters: with a different one the MASKed positions move well beyond tolerance.
  # (Not a constant shift: every LayerNorm of a pre-LN stack would remove it.)
  shift = np.random.default_rng(5).standard_normal(config.d_model) * 0.5
  moved = {**params, 'mask_embedding': np.asarray(params['mask_embedding']) + shift}
  moved_logits, _ = numpy_transformer.cmlm_outputs(config, moved, SRC, tokens)
  assert np.abs(moved_logits - want_tokens).max() > 1e-2
