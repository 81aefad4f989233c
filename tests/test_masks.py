"""The mask builders return exactly the small matrices of their docstrings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_transformer.nn import masks

A, B, C, PAD = 5, 6, 7, 0  # "a b c PAD"


def test_padding_mask_masks_the_pad_column_and_keeps_the_pad_row():
  mask = masks.padding_mask(jnp.array([[A, B, C, PAD]]))
  assert mask.shape == (1, 1, 1, 4) and mask.dtype == jnp.bool_
  per_query = np.broadcast_to(np.asarray(mask), (1, 1, 4, 4))[0, 0]
  np.testing.assert_array_equal(
    per_query, [[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
  )  # PAD query row (last) still sees a, b, c


def test_padding_mask_honours_pad_id():
  np.testing.assert_array_equal(
    masks.padding_mask(jnp.array([[7, 0, 7]]), pad_id=7)[0, 0, 0], [False, True, False]
  )


def test_causal_mask_is_the_lower_triangle():
  mask = masks.causal_mask(4)
  assert mask.shape == (1, 1, 4, 4)
  np.testing.assert_array_equal(
    mask[0, 0], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
  )


def test_causal_mask_with_offset_is_a_row_of_the_full_mask():
  full = masks.causal_mask(6)[0, 0]
  for position in range(6):
    row = masks.causal_mask(1, 6, offset=position)
    assert row.shape == (1, 1, 1, 6)
    np.testing.assert_array_equal(row[0, 0, 0], full[position])


def test_causal_mask_offset_may_be_traced():
  rows = jax.jit(lambda p: masks.causal_mask(1, 4, offset=p))(jnp.int32(2))
  np.testing.assert_array_equal(rows[0, 0, 0], [1, 1, 1, 0])


def test_local_mask_is_a_band():
  np.testing.assert_array_equal(
    masks.local_mask(4, radius=1)[0, 0], [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
  )


def test_local_mask_composes_with_causal():
  both = masks.combine(masks.causal_mask(5), masks.local_mask(5, radius=2))
  np.testing.assert_array_equal(
    both[0, 0],
    [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 1, 1, 1, 0], [0, 0, 1, 1, 1]],
  )


def test_combine_broadcasts_and_ignores_none():
  padding = masks.padding_mask(jnp.array([[A, B, PAD], [A, PAD, PAD]]))  # [2, 1, 1, 3]
  combined = masks.combine(padding, None, masks.causal_mask(3))
  assert combined.shape == (2, 1, 3, 3)
  np.testing.assert_array_equal(combined[1, 0], [[1, 0, 0], [1, 0, 0], [1, 0, 0]])
  assert masks.combine(None, None) is None


def test_beam_history_mask_selects_each_beam_s_own_slots():
  history = jnp.array([[[1, 0, 0], [1, 1, 0]]])  # K=2 beams, L=3: the docstring's example
  mask = jax.jit(masks.beam_history_mask)(history, 1)
  assert mask.shape == (1, 1, 2, 6) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(mask[0, 0], [[0, 1, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0]])
  # Each beam sees exactly one slot per written position, in the block its history names.
  full = masks.beam_history_mask(jnp.array([[[0, 1, 1], [1, 0, 1]]]), 2)[0, 0]
  assert (np.asarray(full).reshape(2, 2, 3).sum(axis=1) == 1).all()
  np.testing.assert_array_equal(full, [[1, 0, 0, 0, 1, 1], [0, 1, 0, 1, 0, 1]])


@pytest.mark.parametrize(
  'builder', [lambda n: masks.causal_mask(n), lambda n: masks.local_mask(n, 1)]
)
def test_builders_jit_and_vmap(builder):
  np.testing.assert_array_equal(jax.jit(builder, static_argnums=0)(5), builder(5))
  tokens = jnp.array([[1, 2, 0], [3, 0, 0]])
  np.testing.assert_array_equal(
    jax.vmap(lambda t: masks.padding_mask(t[None])[0])(tokens), masks.padding_mask(tokens)
  )


def test_segment_mask_hides_padding_keys_from_every_query_pad_included():
  """Segment 0 (PAD) matches nothing: a PAD query's row is all False too, so no query, real
  or padding, reads a PAD key (the docstring's 4 x 4 example)."""
  segments = jnp.array([[1, 1, 2, 0]])
  want = np.array([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 0]], bool)
  np.testing.assert_array_equal(np.asarray(masks.segment_mask(segments, segments))[0, 0], want)
