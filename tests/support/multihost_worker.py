"""One process of a 2-process JAX job in tests/test_multihost.py: what a train.py run cannot show.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \\
        python tests/support/multihost_worker.py 127.0.0.1:PORT PROCESS_ID OUT_DIR

The test's train.py runs cover the default path (shard_map). This worker checks,
on the number-words task, the multi-process pieces they leave out:

  * `DataParallel` in 'pmap' and in 'shard_map' mode, STEPS steps each over the
    4 devices of both processes, from the same state on the same batches;
  * `translate_across_processes`: each process decodes every other sentence and
    gets all translations back, in order; beside it, this process's own
    single-process decode of all sentences, the reference.

It writes OUT_DIR/process_<PROCESS_ID>.npz: `{mode}/loss` `[STEPS]`,
`{mode}/params/<path>` after the last step, `translations` and `reference`.
"""

import sys

import jax
import numpy as np
from flax import traverse_util

from flax_transformer.config import ModelConfig, TrainConfig
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import encode_corpus
from flax_transformer.data.toy_task import number_translation
from flax_transformer.decode.methods import Greedy
from flax_transformer.decode.translator import Translator
from flax_transformer.nn.model import Transformer
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train import (
  DataParallel,
  create_train_state,
  make_optimizer,
  make_parallel_step,
)
from flax_transformer.train.evaluation import translate_across_processes

STEPS = 2
# Eight sentences and an empty one last, which translates to '' without decoding:
# process 0 gets 5 (4 to decode), process 1 gets 4.
NUM_SENTENCES = 9
# Rows per decoding batch: the shares and the reference all decode [4, 8] batches
# (toy sources are at most 8 tokens), so greedy decoding compiles once.
DECODE_BATCH = 4
# A random model decodes every sentence to the same tokens at Flax's initial scale;
# with its parameters scaled up, what it outputs depends on the input, so a sentence
# returned to the wrong place would show.
PARAMS_SCALE = 6.0


def main(coordinator: str, process_id: int, out_dir: str) -> None:
  # Nothing above has touched a JAX backend: initialize must come first.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  # Bound to the loopback address itself: JAX's coordinator would listen on every interface.
  jax.distributed.initialize(
    coordinator, num_processes=2, process_id=process_id, coordinator_bind_address=coordinator
  )
  assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
  numbers = number_translation(num_train=256, num_validation=NUM_SENTENCES - 1, num_test=1)
  tokenizer = Tokenizer.train(
    list(numbers['train']['source']) + list(numbers['train']['target']), vocab_size=256
  )
  # Dropout stays on: both modes give row block i to device i, so their masks agree.
  # adam_eps=1: see tests/test_multihost.py's docstring.
  config = ModelConfig.tiny(
    vocab_size=tokenizer.vocab_size, num_encoder_layers=1, num_decoder_layers=1, max_len=16
  )
  train_config = TrainConfig(warmup_steps=4, lr_scale=4.0, adam_eps=1.0)
  model = Transformer(config)
  optimizer = make_optimizer(train_config, config)
  initial = jax.device_get(create_train_state(model, optimizer, seed=0))
  batcher = Batcher(
    encode_corpus(numbers['train'], tokenizer, config.max_len),
    max_tokens=128,
    seed=0,
    row_multiple=jax.device_count(),
  )

  results = {}
  for mode in ('pmap', 'shard_map'):
    parallel = DataParallel(mode=mode)
    step = make_parallel_step(model, optimizer, train_config, parallel)
    state, losses = parallel.replicate(initial), []
    for index in range(STEPS):
      state, metrics = step(state, parallel.shard_batch(batcher.batch_at(index)))
      metrics = parallel.unreplicate(metrics)
      losses.append(metrics['loss_sum'] / metrics['tokens'])
    results[f'{mode}/loss'] = np.array(losses)
    params = traverse_util.flatten_dict(parallel.unreplicate(state).params, sep='/')
    results.update({f'{mode}/params/{name}': value for name, value in params.items()})

  scaled = jax.tree.map(lambda p: p * PARAMS_SCALE, initial.params)
  translator = Translator(config, scaled, tokenizer)
  sentences = list(numbers['validation']['source']) + ['']
  results['translations'] = np.array(
    translate_across_processes(translator, sentences, batch_size=DECODE_BATCH)
  )
  results['reference'] = np.array(
    translator.translate(sentences, Greedy(), batch_size=DECODE_BATCH)
  )
  np.savez(f'{out_dir}/process_{process_id}.npz', **results)


if __name__ == '__main__':
  main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
