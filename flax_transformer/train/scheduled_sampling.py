"""Scheduled sampling for the Transformer (Mihaylova & Martins 2019), off by default.

Axis legend: B batch rows (per device inside a mapped step), S source length,
T target length, V vocabulary.

Teacher forcing feeds the decoder the reference prefix; at test time it reads
its own, possibly wrong, outputs. Scheduled sampling narrows that gap. A first
decoder pass, teacher-forced and without gradient, predicts every position;
the second pass, the one trained, reads at each position t > 0 either the gold
token or the first pass's prediction made at t - 1 (which is what it would
have read when decoding), the latter with probability 1 - eps_i, where eps_i
decays with the training step i (Bengio et al. 2015):

    tgt_in     <s>  a    b    c    PAD      predictions  a'  x'  c'  </s>'  .
    mixed      <s>  a    x'   c    PAD      (position 2 drew the prediction)

The loss is on the second pass's logits against the gold `tgt_out`. BOS and
PAD positions are never replaced: BOS is what decoding starts from, and a PAD
input would change the decoder's padding mask.

The coin flips and samples of a row come from the run's seed, the step and the
row's index in the global batch, so a row is mixed alike on any number of
devices and a resumed run mixes exactly as the uninterrupted one did.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from flax_transformer.config import ConfigError, ModelConfig, TrainConfig
from flax_transformer.nn import masks
from flax_transformer.nn.model import Transformer

_COIN, _SAMPLE = 0, 1  # the two streams of a row's key


def gold_probability(step: jax.Array | int, train_config: TrainConfig) -> jax.Array:
  """eps_i, the probability of feeding the gold token at step i: float32 [] in [0, 1].

  linear: min(1, max(eps, k - c * i)); exponential: k^i; inverse_sigmoid:
  k / (k + exp(i / k)); off: 1. (k^i as exp(i log k) and k / (k + e^(i/k)) as
  sigmoid(log k - i / k), with the logarithm in float64: float32 k^i would be
  off by ~1e-4 at i = 2000, and e^(i/k) overflows.)
  """
  c = train_config
  i = jnp.asarray(step, jnp.float32)
  k = c.scheduled_sampling_k
  if c.scheduled_sampling == 'linear':
    return jnp.clip(k - c.scheduled_sampling_c * i, c.scheduled_sampling_eps, 1.0)
  if c.scheduled_sampling == 'exponential':
    return jnp.exp(i * math.log(k))
  if c.scheduled_sampling == 'inverse_sigmoid':
    return jax.nn.sigmoid(math.log(k) - i / k)
  return jnp.ones((), jnp.float32)


def row_keys(key: jax.Array, first_row: jax.Array | int, rows: int) -> jax.Array:
  """[B] keys: `key` folded with each row's index in the global batch (first_row + r)."""
  return jax.vmap(lambda row: jax.random.fold_in(key, row))(first_row + jnp.arange(rows))


def predict(logits: jax.Array, keys: jax.Array, choice: str) -> jax.Array:
  """The first pass's token at every position: int32 [B, T] from logits [B, T, V].

  choice 'argmax' takes the most likely token; 'sample' draws one from the
  softmax, row b from keys[b].
  """
  if choice == 'argmax':
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample(key, row_logits):  # [T, V] -> [T]
    return jax.random.categorical(jax.random.fold_in(key, _SAMPLE), row_logits)

  return jax.vmap(sample)(keys, logits.astype(jnp.float32)).astype(jnp.int32)


def mix_decoder_inputs(
  gold_in: jax.Array,
  predictions: jax.Array,
  use_prediction_prob: jax.Array | float,
  keys: jax.Array,
  pad_id: int,
  positions: jax.Array | None = None,
) -> jax.Array:
  """The second pass's decoder input, int32 [B, T].

  gold_in: [B, T] `<s> y1 .. yn PAD..`; predictions: [B, T], predictions[:, t]
  the first pass's guess of y_{t+1}, which is input position t + 1's token.
  Each position t > 0 of a non-PAD input takes predictions[:, t - 1] with
  probability `use_prediction_prob` (row b's coins from keys[b]), else stays gold.
  In packed rows, `positions` int [B, T] (`masks.Packing.tgt_positions`): every
  sentence's position 0 (its BOS) stays gold, as position 0 of a row does.
  """
  shifted = jnp.concatenate([gold_in[:, :1], predictions[:, :-1]], axis=1)  # [B, T]

  def coins(key):  # -> bool [T]
    return jax.random.bernoulli(
      jax.random.fold_in(key, _COIN), use_prediction_prob, gold_in.shape[1:]
    )

  use = jax.vmap(coins)(keys)  # [B, T]
  position = jnp.arange(gold_in.shape[1]) if positions is None else positions  # [T] or [B, T]
  use = use & (gold_in != pad_id) & (position > 0)
  return jnp.where(use, shifted, gold_in)


def scheduled_inputs(
  model: Transformer,
  params,
  src: jax.Array,
  gold_in: jax.Array,
  step: jax.Array,
  key: jax.Array,
  first_row: jax.Array | int,
  train_config: TrainConfig,
  packing: masks.Packing | None = None,
) -> jax.Array:
  """The mixed decoder input [B, T] of one step's rows (src [B, S], gold_in [B, T]).

  packing: the rows' segment ids and positions when they are packed (both passes read them).

  The first pass runs without dropout: its predictions are those of the model
  as it decodes at test time, the mistakes the second pass should learn to
  recover from. No gradient flows through it (the tokens are integers, and
  stop_gradient says so for the parameters).
  """
  logits = model.apply(
    {'params': jax.lax.stop_gradient(params)}, src, gold_in, packing=packing
  )  # [B, T, V]
  keys = row_keys(key, first_row, gold_in.shape[0])
  predictions = predict(logits, keys, train_config.scheduled_sampling_choice)
  use_prediction_prob = 1.0 - gold_probability(step, train_config)
  return mix_decoder_inputs(
    gold_in,
    predictions,
    use_prediction_prob,
    keys,
    model.config.pad_id,
    None if packing is None else packing.tgt_positions,
  )


def check_model(model_config: ModelConfig, train_config: TrainConfig) -> None:
  """Raises ConfigError when scheduled sampling is asked of a model that has no first pass."""
  if train_config.scheduled_sampling != 'off' and model_config.kind != 'autoregressive':
    raise ConfigError(
      f'train.scheduled_sampling={train_config.scheduled_sampling!r} needs '
      f"model.kind='autoregressive'; a {model_config.kind} decoder does not read "
      'its own previous outputs'
    )
