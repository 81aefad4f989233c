"""The post-LN encoder-decoder written out in NumPy float64: an independent reference for logits.

Covers what ModelConfig.tiny() uses: post-LN, ReLU, shared embeddings (the
output projection is the embedding table), interleaved sinusoidal positions,
no restricted attention. Source PAD keys are hidden from both attentions; the
decoder is causal (its inputs hold no PAD).
"""

import numpy as np


def _layer_norm(x, p, eps):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + eps) * p['scale'] + p['bias']


def _attention(p, x, memory, mask, heads):
  """x `[B, T, D]` over memory `[B, S, D]`, mask bool `[B, 1, T, S]`."""
  project = lambda name, y: y @ p[name]['kernel'] + p[name].get('bias', 0.0)
  split = lambda y: y.reshape(*y.shape[:2], heads, -1)                        # [B, L, N, H]
  q, k, v = split(project('query', x)), split(project('key', memory)), split(project('value', memory))
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(q.shape[-1])
  logits = np.where(mask, logits, -np.inf)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  return project('out', np.einsum('bnts,bsnh->btnh', weights, v).reshape(x.shape))


def _embed(table, tokens, d_model):
  position = np.arange(tokens.shape[1])[:, None]
  angle = position / np.power(10000.0, np.arange(0, d_model, 2)[None, :] / d_model)
  positions = np.zeros((tokens.shape[1], d_model))
  positions[:, 0::2], positions[:, 1::2] = np.sin(angle), np.cos(angle)[:, :d_model // 2]
  return table[tokens] * np.sqrt(d_model) + positions


def logits(config, params, src, tgt_in):
  """float64 logits `[B, T, V]` of ids src `[B, S]` and tgt_in `[B, T]` (no PAD in tgt_in)."""
  p = {k: v for k, v in _as_float64(params).items()}
  heads, eps = config.num_heads, config.layer_norm_epsilon
  ffn = lambda f, x: np.maximum(x @ f['wi']['kernel'] + f['wi']['bias'], 0) @ f['wo']['kernel'] + f['wo']['bias']
  src_keys = (src != config.pad_id)[:, None, None, :]                          # [B, 1, 1, S]
  x = _embed(p['embedding']['embedding'], src, config.d_model)
  for i in range(config.num_encoder_layers):
    e = p['encoder'][f'layer_{i}']
    x = _layer_norm(x + _attention(e['self_attention'], x, x, src_keys, heads),
                    e['self_attention_sublayer']['norm'], eps)
    x = _layer_norm(x + ffn(e['ffn'], x), e['ffn_sublayer']['norm'], eps)
  causal = np.tril(np.ones((tgt_in.shape[1],) * 2, bool))[None, None]         # [1, 1, T, T]
  y = _embed(p['embedding']['embedding'], tgt_in, config.d_model)
  for i in range(config.num_decoder_layers):
    d = p['decoder'][f'layer_{i}']
    y = _layer_norm(y + _attention(d['self_attention'], y, y, causal, heads),
                    d['self_attention_sublayer']['norm'], eps)
    y = _layer_norm(y + _attention(d['cross_attention'], y, x, src_keys, heads),
                    d['cross_attention_sublayer']['norm'], eps)
    y = _layer_norm(y + ffn(d['ffn'], y), d['ffn_sublayer']['norm'], eps)
  return y @ p['embedding']['embedding'].T


def _as_float64(tree):
  if isinstance(tree, dict) or hasattr(tree, 'items'):
    return {k: _as_float64(v) for k, v in tree.items()}
  return np.asarray(tree, np.float64)
