"""The encoder-decoder written out in NumPy float64 from a params tree: an independent reference.

Written from the paper (and cmlm.py's docstring), not from the Flax modules:

  embed(tokens) = E[tokens] * sqrt(D) + PE (sinusoids, interleaved or concatenated)
  post-LN sub-layer:  x = LayerNorm(x + F(x))
  pre-LN sub-layer:   x = x + F(LayerNorm(x)), and a final LayerNorm after each stack
  encoder layer:      self-attention, FFN
  decoder layer:      self-attention (causal for the paper's model, not for the cmlm),
                      cross-attention over the memory, FFN
  logits = y E^T (shared embeddings) or y W_out, plus the logits bias when configured

Keys at PAD positions are hidden from every attention (source PAD from the encoder and
cross-attention, target PAD from the decoder's self-attention; a decoder starting from PAD,
bos_id == pad_id, still sees its position 0). The cmlm decoder embeds MASK (id V) as the
'mask_embedding' row, scaled like the others; its length head is a dense layer over the mean
of the memory at the real source positions. Inputs are numpy ids; every computation is float64.

  logits(config, params, src, tgt_in)          the paper's model, `[B, T, V]`
  cmlm_outputs(config, params, src, tokens)    the cmlm's token logits `[B, T, V]` and
                                               length logits `[B, C]`
"""

import math

import numpy as np


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def _attention(p, x, memory, mask, heads):
  """x `[B, T, D]` over memory `[B, S, D]`, mask bool broadcastable to `[B, 1, T, S]`."""
  project = lambda name, y: y @ p[name]['kernel'] + p[name].get('bias', 0.0)
  split = lambda y: y.reshape(*y.shape[:2], heads, -1)  # [B, L, N, H]
  q, k, v = (
    split(project('query', x)),
    split(project('key', memory)),
    split(project('value', memory)),
  )
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return project('out', np.einsum('bnts,bsnh->btnh', weights, v).reshape(x.shape))


def _activation(name, x):
  if name == 'relu':
    return np.maximum(x, 0.0)
  if name == 'silu':
    return x / (1.0 + np.exp(-x))
  # flax.linen.gelu's default: the tanh approximation.
  return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x**3)))


def _ffn(config, f, x):
  hidden = _activation(config.activation, x @ f['wi']['kernel'] + f['wi']['bias'])
  return hidden @ f['wo']['kernel'] + f['wo']['bias']


def positions(length, d_model, layout='interleaved'):
  """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i + 1) = cos(same), float64 `[L, D]`."""
  angle = np.arange(length)[:, None] / np.power(
    10000.0, np.arange(0, d_model, 2)[None, :] / d_model
  )
  sin, cos = np.sin(angle), np.cos(angle)[:, : d_model // 2]
  if layout == 'concatenated':
    return np.concatenate([sin, cos], axis=1)
  table = np.zeros((length, d_model))
  table[:, 0::2], table[:, 1::2] = sin, cos
  return table


def _embed(config, table, tokens, mask_row=None):
  rows = table[np.where(tokens < table.shape[0], tokens, 0)]
  if mask_row is not None:
    rows = np.where((tokens == config.vocab_size)[..., None], mask_row, rows)
  return rows * math.sqrt(config.d_model) + positions(
    tokens.shape[1], config.d_model, config.positions
  )


def _sublayer(config, x, norm, fn):
  """One residual sub-layer, post-LN or pre-LN."""
  if config.norm_placement == 'pre':
    return x + fn(_layer_norm(x, norm, config.layer_norm_epsilon))
  return _layer_norm(x + fn(x), norm, config.layer_norm_epsilon)


def _table(p, side):
  return p['embedding']['embedding'] if 'embedding' in p else p[f'{side}_embedding']['embedding']


def encode(config, params, src):
  """float64 memory `[B, S, D]` of source ids `[B, S]` (not all PAD)."""
  p = _as_float64(params)
  src = np.asarray(src)
  keys = (src != config.pad_id)[:, None, None, :]  # [B, 1, 1, S]
  x = _embed(config, _table(p, 'source'), src)
  for i in range(config.num_encoder_layers):
    e = p['encoder'][f'layer_{i}']
    x = _sublayer(
      config,
      x,
      e['self_attention_sublayer']['norm'],
      lambda h: _attention(e['self_attention'], h, h, keys, config.num_heads),
    )
    x = _sublayer(config, x, e['ffn_sublayer']['norm'], lambda h: _ffn(config, e['ffn'], h))
  if config.norm_placement == 'pre':
    x = _layer_norm(x, p['encoder']['final_norm'], config.layer_norm_epsilon)
  return x


def decode(config, params, tokens, memory, src, causal=True):
  """float64 logits `[B, T, V]` of decoder input ids `[B, T]` over the memory `[B, S, D]`.

  causal: the paper's look-ahead mask; False for the cmlm, whose MASK ids (V) get the
  'mask_embedding' row.
  """
  p = _as_float64(params)
  tokens, src = np.asarray(tokens), np.asarray(src)
  src_keys = (np.asarray(src) != config.pad_id)[:, None, None, :]  # [B, 1, 1, S]
  visible = tokens != config.pad_id
  if causal and config.bos_id == config.pad_id:
    visible = visible | (np.arange(tokens.shape[1]) == 0)
  self_keys = visible[:, None, None, :]  # [B, 1, 1, T]
  if causal:
    self_keys = self_keys & np.tril(np.ones((tokens.shape[1],) * 2, bool))[None, None]
  y = _embed(config, _table(p, 'target'), tokens, None if causal else p.get('mask_embedding'))
  for i in range(config.num_decoder_layers):
    d = p['decoder'][f'layer_{i}']
    y = _sublayer(
      config,
      y,
      d['self_attention_sublayer']['norm'],
      lambda h: _attention(d['self_attention'], h, h, self_keys, config.num_heads),
    )
    y = _sublayer(
      config,
      y,
      d['cross_attention_sublayer']['norm'],
      lambda h: _attention(d['cross_attention'], h, memory, src_keys, config.num_heads),
    )
    y = _sublayer(config, y, d['ffn_sublayer']['norm'], lambda h: _ffn(config, d['ffn'], h))
  if config.norm_placement == 'pre':
    y = _layer_norm(y, p['decoder']['final_norm'], config.layer_norm_epsilon)
  out = (
    y @ p['embedding']['embedding'].T if 'embedding' in p else y @ p['output_projection']['kernel']
  )
  return out + p['logits_bias'] if 'logits_bias' in p else out


def logits(config, params, src, tgt_in):
  """float64 logits `[B, T, V]` of ids src `[B, S]` and tgt_in `[B, T]` (the paper's model)."""
  return decode(config, params, tgt_in, encode(config, params, src), src, causal=True)


def length_logits(config, params, memory, src):
  """float64 `[B, C]`: the length head over the mean of the memory at the non-PAD source
  positions."""
  p = _as_float64(params)
  real = (np.asarray(src) != config.pad_id)[..., None]  # [B, S, 1]
  pooled = (memory * real).sum(1) / np.maximum(real.sum(1), 1)
  return pooled @ p['length_head']['kernel'] + p['length_head']['bias']


def cmlm_outputs(config, params, src, tokens):
  """The cmlm's float64 (token logits `[B, T, V]`, length logits `[B, C]`), decoder input
  `tokens` with MASK = V (config.cmlm_decoder_input == 'mask')."""
  memory = encode(config, params, src)
  return (
    decode(config, params, tokens, memory, src, causal=False),
    length_logits(config, params, memory, src),
  )


def _as_float64(tree):
  if isinstance(tree, dict) or hasattr(tree, 'items'):
    return {k: _as_float64(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)
