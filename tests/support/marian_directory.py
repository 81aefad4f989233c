"""A random Marian (OPUS-MT layout) directory, built on the spot: the fixture of the Marian tests.

`make_marian_directory(directory, ...)` writes what `huggingface-cli download
Helsinki-NLP/opus-mt-...` gives (config.json, model.safetensors, source.spm,
target.spm, vocab.json, tokenizer_config.json), from a `MarianMTModel` with
random weights (and a random final_logits_bias: the real models' are not zero
either) saved by transformers' `save_pretrained`, and sentencepiece models
trained on SAMPLE_TEXT; nothing is downloaded. Needs torch, transformers and
sentencepiece (`pip install -e .[pretrained-test]`). benchmarks/marian.py and
notebook 04 build their random models with it too (from the repository root).
"""

import dataclasses
import io
import json
from pathlib import Path

# Text for the sentencepiece models: enough for a few hundred pieces.
SAMPLE_TEXT = (
  'The animal did not cross the street because it was too tired.',
  'A man rides a bicycle down the hill while two children watch.',
  'Das Tier überquerte die Straße nicht, weil es zu müde war.',
  'Ein Mann fährt mit dem Fahrrad den Hügel hinunter, zwei Kinder schauen zu.',
  'The quick brown fox jumps over the lazy dog near the river bank.',
  'Der schnelle braune Fuchs springt über den faulen Hund am Flussufer.',
  'Several people are sitting on a bench in the park, reading newspapers.',
  'Mehrere Leute sitzen auf einer Bank im Park und lesen Zeitungen.',
  'She sings a song about the sea, the wind and the stars at night.',
  'Sie singt ein Lied über das Meer, den Wind und die Sterne in der Nacht.',
)


@dataclasses.dataclass(frozen=True)
class MarianShape:
  """The dimensions of a random Marian model (MarianConfig's names)."""

  d_model: int = 32
  layers: int = 2
  heads: int = 4
  ffn_dim: int = 64
  vocab_size: int = 300  # filler pieces pad the sentencepiece ones up to this
  max_position_embeddings: int = 64
  share_encoder_decoder_embeddings: bool = True
  activation_function: str = 'swish'
  init_std: float = 0.3  # transformers' 0.02 leaves a tiny model's logits to the bias


def _train_spm(texts, vocab_size: int):
  """A sentencepiece unigram model trained on `texts` in memory; returns its serialized bytes."""
  import sentencepiece as spm

  model = io.BytesIO()
  spm.SentencePieceTrainer.train(
    sentence_iterator=iter(texts),
    model_writer=model,
    vocab_size=vocab_size,
    hard_vocab_limit=False,
    character_coverage=1.0,
    num_threads=1,
    minloglevel=2,
  )
  return model.getvalue()


def _vocab(spm_models: list[bytes], size: int) -> dict[str, int]:
  """Marian's vocab.json: '</s>' 0, '<unk>' 1, the pieces of the spm models, fillers, '<pad>' last."""
  import sentencepiece as spm

  vocab = {'</s>': 0, '<unk>': 1}
  for serialized in spm_models:
    processor = spm.SentencePieceProcessor(model_proto=serialized)
    for piece_id in range(processor.get_piece_size()):
      if not (processor.is_control(piece_id) or processor.is_unknown(piece_id)):
        vocab.setdefault(processor.id_to_piece(piece_id), len(vocab))
  while len(vocab) < size - 1:
    vocab[f'▁filler{len(vocab)}'] = len(vocab)
  vocab['<pad>'] = len(vocab)
  return vocab


def make_marian_directory(
  directory: str | Path, shape: MarianShape = MarianShape(), seed: int = 0
) -> Path:
  """Writes a random Marian model and its tokenizer files into `directory`; returns it."""
  import torch
  from transformers import MarianConfig, MarianMTModel
  from transformers.utils import logging

  logging.disable_progress_bar()  # save_pretrained's bar: noise in tests and notebook outputs
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  source, target = _train_spm(SAMPLE_TEXT[0::2], 200), _train_spm(SAMPLE_TEXT[1::2], 200)
  (directory / 'source.spm').write_bytes(source)
  (directory / 'target.spm').write_bytes(target)
  vocab = _vocab([source, target], shape.vocab_size)
  (directory / 'vocab.json').write_text(json.dumps(vocab, ensure_ascii=False, indent=1))
  pad = vocab['<pad>']
  config = MarianConfig(
    vocab_size=len(vocab),
    decoder_vocab_size=len(vocab),
    d_model=shape.d_model,
    encoder_layers=shape.layers,
    decoder_layers=shape.layers,
    encoder_attention_heads=shape.heads,
    decoder_attention_heads=shape.heads,
    encoder_ffn_dim=shape.ffn_dim,
    decoder_ffn_dim=shape.ffn_dim,
    activation_function=shape.activation_function,
    max_position_embeddings=shape.max_position_embeddings,
    scale_embedding=True,
    share_encoder_decoder_embeddings=shape.share_encoder_decoder_embeddings,
    tie_word_embeddings=True,
    pad_token_id=pad,
    decoder_start_token_id=pad,
    eos_token_id=0,
    forced_eos_token_id=0,
    bos_token_id=0,
    dropout=0.1,
    attention_dropout=0.0,
    activation_dropout=0.0,
    init_std=shape.init_std,
  )
  torch.manual_seed(seed)
  model = MarianMTModel(config)
  with torch.no_grad():
    model.final_logits_bias.normal_(0.0, 0.3)
    model.final_logits_bias[0, 0] += 2.0  # EOS: a random model then ends its sentences
    # Random LayerNorm gains and biases, so that a mix-up of them shows in the logits.
    for name, parameter in model.named_parameters():
      if 'layer_norm' in name or name.endswith('.bias'):
        parameter.normal_(1.0 if name.endswith('weight') else 0.0, 0.2)
  model.save_pretrained(directory, safe_serialization=True)
  (directory / 'tokenizer_config.json').write_text(
    json.dumps(
      {'tokenizer_class': 'MarianTokenizer', 'separate_vocabs': False, 'model_max_length': 512}
    )
  )
  return directory
