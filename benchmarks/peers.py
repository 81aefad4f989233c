"""PyTorch peers of our training step, for `benchmarks.solo`'s workers.

Two models with our architecture, loss and optimizer, so that a step does the
same arithmetic as ours:

  torch    `torch.nn.Transformer`: post-LN blocks without the final encoder and
           decoder LayerNorms (our post-LN stacks have none), one embedding
           matrix shared by source, target and the pre-softmax projection,
           scaled by sqrt(d_model), plus the paper's interleaved sinusoids.
  marian   Hugging Face `MarianMTModel`, randomly initialised with the same
           dimensions: post-LN, scaled shared embeddings tied to the output
           projection, ReLU, dropout on embeddings and sub-layer outputs only.

Both train with label-smoothed cross-entropy summed over non-PAD targets and
divided by their count (`F.cross_entropy(..., label_smoothing=eps)` is the
same smoothed target as `train.losses.token_losses`), and Adam(b1, b2, eps) on
the paper's schedule. Their trainable parameter counts equal ours
(`tests/test_benchmarks.py` checks it).

Optional: `pip install -e .[bench]` (torch==2.13.0 is a CPU build;
a plain `pip install torch` downloads several GB of CUDA libraries). The
library never imports this module; `available()` says whether it can run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only for annotations: benchmarks.solo_worker runs this module in peer envs
  from flax_transformer.config import ModelConfig, TrainConfig

PEERS = ('torch', 'marian')


def available(peer: str) -> str | None:
  """None when `peer` can run here, else the reason it cannot (a missing package)."""
  needed = {'torch': ('torch',), 'marian': ('torch', 'transformers')}[peer]
  missing = [name for name in needed if importlib.util.find_spec(name) is None]
  if missing:
    return f'{peer} peer skipped: {" and ".join(missing)} not installed (pip install -e .[bench])'
  return None


def _torch_transformer(config: ModelConfig):
  """`torch.nn.Transformer` with our embeddings and tied output projection."""
  import torch
  from torch import nn

  c = config

  class TorchTransformer(nn.Module):
    def __init__(self):
      super().__init__()
      self.embedding = nn.Embedding(c.vocab_size, c.d_model)
      nn.init.normal_(self.embedding.weight, std=c.d_model**-0.5)
      position = torch.arange(c.max_len, dtype=torch.float32)[:, None]
      angle = position / 10_000.0 ** (
        torch.arange(0, c.d_model, 2, dtype=torch.float32) / c.d_model
      )
      table = torch.stack([angle.sin(), angle.cos()], dim=-1).reshape(c.max_len, -1)
      self.register_buffer('positions', table[:, : c.d_model], persistent=False)
      self.dropout = nn.Dropout(c.dropout_rate)
      layer = dict(
        d_model=c.d_model,
        nhead=c.num_heads,
        dim_feedforward=c.d_ff,
        dropout=c.dropout_rate,
        activation=c.activation,
        batch_first=True,
        norm_first=c.norm_placement == 'pre',
        layer_norm_eps=c.layer_norm_epsilon,
      )
      encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(**layer),
        c.num_encoder_layers,
        norm=None,
        enable_nested_tensor=False,
      )
      decoder = nn.TransformerDecoder(
        nn.TransformerDecoderLayer(**layer), c.num_decoder_layers, norm=None
      )
      self.transformer = nn.Transformer(
        d_model=c.d_model,
        nhead=c.num_heads,
        batch_first=True,
        custom_encoder=encoder,
        custom_decoder=decoder,
      )

    def _embed(self, tokens):
      x = self.embedding(tokens) * math.sqrt(c.d_model) + self.positions[: tokens.shape[1]]
      return self.dropout(x)

    def forward(self, src, tgt_in):
      """src [B, S], tgt_in [B, T] -> logits [B, T, V]."""
      length = tgt_in.shape[1]
      # bool like the padding masks (True = may NOT attend), so torch takes one mask path
      causal = torch.ones(length, length, dtype=torch.bool).triu(1)
      src_pad, tgt_pad = src == c.pad_id, tgt_in == c.pad_id
      y = self.transformer(
        self._embed(src),
        self._embed(tgt_in),
        tgt_mask=causal,
        src_key_padding_mask=src_pad,
        tgt_key_padding_mask=tgt_pad,
        memory_key_padding_mask=src_pad,
        tgt_is_causal=True,
      )
      return y @ self.embedding.weight.T

  return TorchTransformer()


def marian_config_kwargs(config: ModelConfig) -> dict:
  """`MarianConfig` keywords for our dimensions (the PyTorch and the Flax Marian peers share them)."""
  c = config
  return dict(
    vocab_size=c.vocab_size,
    d_model=c.d_model,
    encoder_layers=c.num_encoder_layers,
    decoder_layers=c.num_decoder_layers,
    encoder_attention_heads=c.num_heads,
    decoder_attention_heads=c.num_heads,
    encoder_ffn_dim=c.d_ff,
    decoder_ffn_dim=c.d_ff,
    activation_function=c.activation,
    dropout=c.dropout_rate,
    attention_dropout=c.attention_dropout_rate,
    activation_dropout=c.activation_dropout_rate,
    max_position_embeddings=c.max_len,
    scale_embedding=True,
    share_encoder_decoder_embeddings=True,
    tie_word_embeddings=True,
    pad_token_id=c.pad_id,
    eos_token_id=c.eos_id,
    forced_eos_token_id=c.eos_id,
    decoder_start_token_id=c.bos_id,
  )


def _marian(config: ModelConfig):
  """`MarianMTModel` at our dimensions, randomly initialised (nothing is downloaded)."""
  from transformers import MarianConfig, MarianMTModel

  return MarianMTModel(MarianConfig(**marian_config_kwargs(config)))


def _logits_fn(peer: str, model, config: ModelConfig):
  """`(src [B, S], tgt_in [B, T]) -> logits [B, T, V]` for either peer."""
  if peer == 'torch':
    return model
  pad = config.pad_id
  return lambda src, tgt_in: (
    model(
      input_ids=src,
      attention_mask=src != pad,
      decoder_input_ids=tgt_in,
      decoder_attention_mask=tgt_in != pad,
      use_cache=False,
    ).logits
  )


def trainable_params(module) -> int:
  """Scalars the optimizer updates: tied matrices once, frozen tables (Marian's sinusoids) not at all."""
  return sum(p.numel() for p in module.parameters() if p.requires_grad)


def build_model(peer: str, config: ModelConfig):
  """The peer's `torch.nn.Module` for `config` (torch's default initialisation, seed 0)."""
  import torch

  torch.manual_seed(0)
  if peer == 'torch':
    return _torch_transformer(config)
  if peer == 'marian':
    return _marian(config)
  raise ValueError(f'unknown peer {peer!r}; choose one of {", ".join(PEERS)}')


class PeerStep:
  """One training step of a peer on a fixed batch: forward, loss, backward, Adam.

  `step()` runs it once and returns when PyTorch is done (CPU ops are
  synchronous). bfloat16 runs the forward under `torch.autocast` (bfloat16
  matmuls, float32 parameters and loss), as our `dtype='bfloat16'` does.
  """

  def __init__(
    self,
    peer: str,
    model_config: ModelConfig,
    train_config: TrainConfig,
    src: np.ndarray,
    tgt_in: np.ndarray,
    tgt_out: np.ndarray,
  ):
    import torch
    import torch.nn.functional as F

    self.model = build_model(peer, model_config)
    self.model.train()
    c, t = model_config, train_config
    self.optimizer = torch.optim.Adam(
      self.model.parameters(), lr=1.0, betas=(t.adam_b1, t.adam_b2), eps=t.adam_eps, fused=True
    )
    # The paper's schedule (train.optimizer.transformer_schedule) on top of lr=1.
    self.scheduler = torch.optim.lr_scheduler.LambdaLR(
      self.optimizer,
      lambda count: (
        t.lr_scale * c.d_model**-0.5 * min((count + 1) ** -0.5, (count + 1) * t.warmup_steps**-1.5)
      ),
    )
    self.src, self.tgt_in, self.tgt_out = (
      torch.from_numpy(np.asarray(a, np.int64)) for a in (src, tgt_in, tgt_out)
    )
    forward = _logits_fn(peer, self.model, c)
    autocast = (
      (lambda: torch.autocast('cpu', dtype=torch.bfloat16))
      if c.dtype == 'bfloat16'
      else contextlib.nullcontext
    )
    num_tokens = (self.tgt_out != c.pad_id).sum().clamp(min=1)

    def step() -> float:
      with autocast():
        logits = forward(self.src, self.tgt_in)  # [B, T, V]
      loss = (
        F.cross_entropy(
          logits.float().reshape(-1, c.vocab_size),
          self.tgt_out.reshape(-1),
          ignore_index=c.pad_id,
          label_smoothing=t.label_smoothing,
          reduction='sum',
        )
        / num_tokens
      )
      self.optimizer.zero_grad(set_to_none=True)
      loss.backward()
      self.optimizer.step()
      self.scheduler.step()
      return loss.item()

    self.step = step
