"""A run directory of a random tiny model, whose greedy translations of SENTENCES differ.

tests/test_translate.py tests Translator with it, tests/test_decode_cli.py decode.py;
conftest.py builds it once per session (the fixture `random_run`).
"""

import dataclasses
from pathlib import Path

import jax
import numpy as np

from flax_transformer import ModelConfig, Transformer
from flax_transformer.config import DataConfig, TrainConfig
from flax_transformer.decode.methods import Greedy
from flax_transformer.decode.translator import Translator
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import write_config
from flax_transformer.tokenizer import Tokenizer

CORPUS = [
  'Ein Mann fährt Fahrrad.',
  'Zwei Hunde spielen im Schnee.',
  'Eine Frau liest ein Buch.',
  'Kinder spielen am Strand.',
  'Ein Hund läuft über die Wiese.',
  'A man rides a bike.',
  'Two dogs play in the snow.',
  'A woman reads a book.',
]
# Lengths that need several source widths, and an empty line.
SENTENCES = [
  'Ein Hund spielt.',
  'Zwei Männer fahren Fahrrad im Schnee am Strand und die Frau liest.',
  '',
  'Kinder.',
  'Eine Frau läuft über die Wiese im Schnee.',
]
MAX_LEN = 64


@dataclasses.dataclass(frozen=True)
class RandomRun:
  tokenizer: Tokenizer
  config: ModelConfig
  params: dict
  translator: Translator
  run_dir: Path  # config.json, tokenizer.json and the parameters as checkpoint 7
  greedy_translations: list[str]  # of SENTENCES, batch_size=2


def build(workdir: Path) -> RandomRun:
  tokenizer = Tokenizer.train(CORPUS, vocab_size=120)
  config = ModelConfig.tiny(vocab_size=tokenizer.vocab_size, max_len=MAX_LEN, dropout_rate=0.0)
  tokens = np.ones((1, 4), np.int32)
  params = Transformer(config).init(jax.random.key(0), tokens, tokens)['params']
  # A longer EOS embedding so that random-weight translations end at different lengths.
  params['embedding']['embedding'] = params['embedding']['embedding'].at[config.eos_id].multiply(10)
  translator = Translator(config, params, tokenizer)
  write_config(workdir, config, TrainConfig(), DataConfig())
  tokenizer.save(workdir)
  checkpoints = Checkpoints(workdir)
  checkpoints.save_params(7, jax.device_get(params))
  checkpoints.close()
  return RandomRun(
    tokenizer=tokenizer,
    config=config,
    params=params,
    translator=translator,
    run_dir=workdir,
    greedy_translations=translator.translate(SENTENCES, Greedy(), batch_size=2),
  )
