"""A training run's setup: everything `loop.train` does before the first step, as stages
that each hand on a frozen value.

- `check_settings`: settings that are each valid but cannot make a run together,
  refused before any data is loaded (`checkpoints_kept`: how many checkpoints a run
  leaves, for --average-last);
- `local_devices`: the devices asked for (`DataParallel` over them);
- `load_run_data`: the parallel text (`data_config.source`, or the `dataset` given;
  `load_data` reads the former for other programs), before anything is written;
- `open_writers`: the run directory (writable, cleared unless resuming) and its
  checkpoints, with process 0's messages (`speaker`): the `Writers`, which know nothing
  of the model;
- `prepare_training_run`: the tokenizer (WORKDIR/tokenizer.json, or trained on a bounded
  sample of the training split and saved), the model settings with its vocabulary, checked
  against WORKDIR/config.json; it returns the `TrainingRun` the stages compute with;
- `encode_training_split` and `eval_batches`: the training split encoded through the cache,
  and the validation split's batches;
- `initial_state`: the latest intact checkpoint in WORKDIR/checkpoints (damaged ones
  set aside, `restore_latest_intact`), or fresh parameters (--init-from's when fine-tuning).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import optax
from jax.experimental import multihost_utils

from flax_transformer.config import (
  NONNEGATIVE_INT,
  ConfigError,
  DataConfig,
  ModelConfig,
  TrainConfig,
  check_bounds,
)
from flax_transformer.data import preprocessing
from flax_transformer.data.batcher import Batcher
from flax_transformer.data.batching import SEQUENCE_LENGTH, EncodedCorpus, encode_corpus
from flax_transformer.data.corpus import load_parallel
from flax_transformer.data.packing import check_settings as check_packing
from flax_transformer.data.pipeline import TrainingData, load_training_data
from flax_transformer.data.resegmenting import Resegmenting, resegmenting_of
from flax_transformer.data.toy_task import number_translation
from flax_transformer.errors import DamagedCheckpoint, TokenizerError
from flax_transformer.nn.backend import compute_dtype, resolve_attention_kernel, resolve_loss_chunk
from flax_transformer.nn.model import Transformer, count_params
from flax_transformer.pretrained.marian import load_marian
from flax_transformer.run.checkpoints import Checkpoints
from flax_transformer.run.directory import RunDirectory
from flax_transformer.run.sizes import check_fits
from flax_transformer.tokenizer import SPECIAL_TOKENS, Tokenizer
from flax_transformer.train import scheduled_sampling
from flax_transformer.train.parallel import DataParallel
from flax_transformer.train.run_tokenizer import run_tokenizer
from flax_transformer.train.step import TrainState, create_train_state


def load_data(data_config: DataConfig) -> datasets.DatasetDict:
  """The parallel text of `data_config`: the toy task, or `data.load_parallel`."""
  if data_config.source == 'toy':
    return number_translation()
  return load_parallel(
    data_config.source,
    data_config.src_lang,
    data_config.tgt_lang,
    valid_split=data_config.valid_split,
    test_split=data_config.test_split,
  )


def check_settings(
  model_config: ModelConfig,
  train_config: TrainConfig,
  data_config: DataConfig,
  average_last: int = 0,
  skip_nonfinite: int = 0,
  pretrained: bool = False,
  saved: Sequence[int] = (),
) -> None:
  """Raises ConfigError for settings that are each valid but cannot make a run together.

  pretrained: the model config comes from a pretrained model (`--init-from`), with
  its own vocabulary, rather than from a tokenizer trained on the data.
  saved: the steps of the checkpoints a resumed run starts with (`saved_steps`).

  Checked before any data is loaded, rather than found out later (the vocabulary
  when the tokenizer is trained, the averaging after the last step).
  """
  if data_config.vocab_size <= len(SPECIAL_TOKENS):
    raise ConfigError(
      f'data.vocab_size={data_config.vocab_size} leaves no room for text: the '
      f'{len(SPECIAL_TOKENS)} special tokens {", ".join(SPECIAL_TOKENS)} take '
      f'ids 0-{len(SPECIAL_TOKENS) - 1}; ask for more'
    )
  if not SEQUENCE_LENGTH.admits(model_config.max_len):
    raise ConfigError(
      f'model.max_len={model_config.max_len} cannot hold a token and EOS; '
      f'it must be at least {SEQUENCE_LENGTH.low}'
    )
  if average_last < 0 or average_last > train_config.keep_checkpoints:
    raise ConfigError(
      f'--average-last={average_last} needs that many checkpoints on disk, but '
      f'train.keep_checkpoints={train_config.keep_checkpoints} keeps fewer; raise '
      'it or average fewer'
    )
  # With a time budget the steps are fixed later (train.budget), and these checked then.
  if train_config.time_budget is None:
    check_average_last(train_config, average_last, saved)
    check_patience(train_config)
  check_bounds(skip_nonfinite, NONNEGATIVE_INT, '--skip-nonfinite')
  picked = [f'data.{name}' for name in ('valid_split', 'test_split') if getattr(data_config, name)]
  if data_config.source == 'toy' and picked:
    raise ConfigError(
      f'{picked[0]} picks a split of a data directory or Hub dataset; the toy '
      'task (data.source=toy) has its own'
    )
  # The tokenizer has at most data.vocab_size tokens.
  check_fits(
    model_config if pretrained else model_config.replace(vocab_size=data_config.vocab_size),
    train_config.max_tokens,
  )
  scheduled_sampling.check_model(model_config, train_config)
  check_packing(model_config, train_config)
  steps = preprocessing.TextPreprocessing.of(data_config)
  if pretrained and steps.active:
    raise ConfigError(
      f'--init-from brings a tokenizer trained on text as written; data '
      f'preprocessing ({steps.describe()}) would feed it text it never saw: '
      'leave data.normalize_punctuation, data.lowercase and data.pretokenize '
      'at their defaults when fine-tuning'
    )
  preprocessing.check_available(steps)
  if data_config.bpe_dropout and train_config.packing:
    raise ConfigError(
      f'data.bpe_dropout={data_config.bpe_dropout} resamples one pair a row; packed rows '
      f'(train.packing={train_config.packing}) are planned by the plain lengths: set one '
      'of them off'
    )


def check_patience(train_config: TrainConfig) -> None:
  """Raises ConfigError when train.patience counts validations that train.steps never reaches."""
  c = train_config
  cadence = c.eval_every if c.best_metric == 'loss' else c.bleu_every
  if c.patience and cadence > c.steps:
    interval = 'train.eval_every' if c.best_metric == 'loss' else 'train.bleu_every'
    raise ConfigError(
      f'train.patience={c.patience} counts validations of the {c.best_metric} every {cadence} '
      f'steps ({interval}), but train.steps={c.steps} reaches none: lower {interval}, or set '
      'train.patience 0'
    )


def check_average_last(train_config: TrainConfig, average_last: int, saved: Sequence[int] = ()):
  """Raises ConfigError when the run ends with fewer checkpoints than --average-last needs."""
  kept = checkpoints_kept(train_config, saved)
  if average_last > kept:
    raise ConfigError(
      f'--average-last={average_last} needs that many checkpoints, but this run '
      f'ends with {kept}: train.steps={train_config.steps} with '
      f'train.checkpoint_every={train_config.checkpoint_every} (and one at the '
      f'end){f", beside the {len(saved)} saved" if saved else ""}; average fewer, '
      'or lower train.checkpoint_every'
    )


def checkpoints_kept(train_config: TrainConfig, saved: Sequence[int] = ()) -> int:
  """How many checkpoints a run leaves on disk: one every checkpoint_every steps and one at the
  last step, after the `saved` ones it resumes from, the newest keep_checkpoints of them.

  For steps 5, checkpoint_every 2, keep_checkpoints 5: steps 2, 4 and 5, so 3.
  """
  every, last, start = train_config.checkpoint_every, train_config.steps, max(saved, default=0)
  written = {step for step in range(every, last + 1, every) if step > start}
  written |= {last} if last > start else set()
  return min(train_config.keep_checkpoints, len(written | set(saved)))


@dataclasses.dataclass(frozen=True)
class Writers:
  """Where a run writes and what it says: the run directory, its checkpoints, and process 0's
  messages (`say`; the other processes' go nowhere). Opened before the tokenizer and the
  model exist, and independent of them; what the run computes with is the `TrainingRun`."""

  directory: RunDirectory
  checkpoints: Checkpoints
  say: Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class TrainingRun:
  """What setup prepares for the stages to compute with: the settings, data, tokenizer and
  devices. A value: a time budget's steps make a new one (`dataclasses.replace`); where the
  run writes is `Writers`; what changes while training is the state, the scores
  (`metrics.ScoreRecord`) and the best checkpoint (`best.BestCheckpoint`)."""

  model_config: ModelConfig
  train_config: TrainConfig
  data_config: DataConfig
  train_data: TrainingData  # the training split (on disk or a table)
  dataset: datasets.DatasetDict  # the evaluation splits: 'validation', 'test' when present
  tokenizer: Tokenizer
  data_parallel: DataParallel
  pretrained_params: dict | None = None  # --init-from's, for a run without checkpoints
  resegmenting: Resegmenting | None = None  # data.bpe_dropout's, for the training batches


def speaker(directory: RunDirectory, print_fn: Callable[[str], None]) -> Callable[[str], None]:
  """`print_fn` on process 0; elsewhere nothing (one process speaks for the run)."""
  return print_fn if directory.is_main else (lambda message: None)


def load_run_data(
  train_config: TrainConfig,
  data_config: DataConfig,
  dataset: datasets.DatasetDict | None,
  say: Callable[[str], None],
) -> TrainingData:
  """The parallel text (`data_config.source`, or the `dataset` given), with its validation
  split checked against the settings that read it."""
  train_data = load_training_data(data_config, dataset)
  say(f'data: {train_data.describe()}')
  _check_validation(train_config, train_data.evaluation)
  steps = preprocessing.TextPreprocessing.of(data_config)
  if steps.active:
    say(f'text: {steps.describe()} (data.normalize_punctuation, data.lowercase, data.pretokenize)')
  return train_data


def open_writers(
  directory: RunDirectory,
  train_config: TrainConfig,
  resume: bool,
  say: Callable[[str], None],
  allow_unverified: bool = False,
) -> Writers:
  """WORKDIR prepared (writable, cleared unless resuming) and its checkpoints opened."""
  directory.prepare(resume)
  checkpoints = Checkpoints(
    directory.path,
    keep=train_config.keep_checkpoints,
    on_unverified=say if allow_unverified else None,
  )
  return Writers(directory=directory, checkpoints=checkpoints, say=say)


def prepare_training_run(
  model_config: ModelConfig,
  train_config: TrainConfig,
  data_config: DataConfig,
  train_data: TrainingData,
  data_parallel: DataParallel,
  writers: Writers,
  init_from: str | Path | None = None,
) -> TrainingRun:
  """The tokenizer (WORKDIR's, --init-from's, or trained and saved), the model settings with
  its vocabulary, checked against WORKDIR/config.json; the `TrainingRun` the stages share."""
  directory: RunDirectory = writers.directory
  say = writers.say
  has_checkpoints = writers.checkpoints.latest_step() is not None
  pretrained_params = None
  if init_from is not None and not has_checkpoints:
    _, pretrained_params, marian_tokenizer = load_marian(init_from)
    if directory.is_main:
      marian_tokenizer.save(directory.path)
    say(f'fine-tuning {init_from}')
  steps = preprocessing.TextPreprocessing.of(data_config)
  tokenizer = run_tokenizer(
    directory,
    lambda: _tokenizer_texts(train_data, data_config, steps),
    data_config,
    has_checkpoints=has_checkpoints,
    say=say,
  )
  # Everything the run encodes or decodes sees text through the data settings' preprocessing.
  tokenizer = preprocessing.wrap(tokenizer, data_config)
  model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
  tokenizer.check_compatible(model_config)
  try:
    resegmenting = resegmenting_of(tokenizer, data_config.bpe_dropout, train_config.seed)
  except TokenizerError as error:
    raise ConfigError(f'data.bpe_dropout={data_config.bpe_dropout}: {error}') from None
  directory.check_settings(model_config, train_config, data_config)
  return TrainingRun(
    model_config=model_config,
    train_config=train_config,
    data_config=data_config,
    train_data=train_data,
    dataset=train_data.evaluation,
    tokenizer=tokenizer,
    data_parallel=data_parallel,
    pretrained_params=pretrained_params,
    resegmenting=resegmenting,
  )


def _check_validation(train_config: TrainConfig, evaluation: datasets.DatasetDict) -> None:
  """Raises ConfigError for settings that read validation scores when there is no validation
  split (the best checkpoint, early stopping)."""
  if 'validation' in evaluation:
    return
  wanted = [
    name
    for name, on in (
      ('train.patience', train_config.patience),
      ('train.best_metric=bleu', train_config.best_metric == 'bleu'),
    )
    if on
  ]
  if wanted:
    raise ConfigError(
      f'{wanted[0]} reads validation scores, but the data has no validation '
      'split (data.valid_split names one)'
    )


def _tokenizer_texts(
  train_data: TrainingData, data_config: DataConfig, steps: preprocessing.TextPreprocessing
) -> list[str]:
  """The tokenizer's training sample, sources then targets, each preprocessed in its language."""
  sources, targets = train_data.tokenizer_pairs(data_config.tokenizer_sample)
  return steps.prepare(sources, data_config.src_lang) + steps.prepare(targets, data_config.tgt_lang)


def local_devices(count: int | None) -> list[jax.Device] | None:
  """The first `count` local devices; None: every device of every process."""
  if count is None:
    return None
  if jax.process_count() > 1:
    raise ConfigError(
      '--devices selects local devices of a single process; with several '
      'processes every device takes part'
    )
  available = jax.local_devices()
  if not 1 <= count <= len(available):
    raise ConfigError(
      f'--devices={count}: this process has {len(available)} device(s) '
      f'({available[0].platform}); on CPU, simulate more with '
      f'XLA_FLAGS=--xla_force_host_platform_device_count={count}'
    )
  return available[:count]


def encode_training_split(run: TrainingRun, writers: Writers) -> EncodedCorpus:
  """The training split encoded, through the cache (`data.cache_dir`, else WORKDIR/encoded):
  process 0 encodes it or finds it there; the others wait, then read it."""
  cache_dir = run.data_config.cache_dir or writers.directory.encoded_dir
  several = jax.process_count() > 1
  return run.train_data.encoded_train(
    run.tokenizer,
    run.tokenizer.digest(),
    run.model_config.max_len,
    cache_dir,
    is_writer=writers.directory.is_main,
    progress=writers.directory.is_main,
    say=writers.say,
    wait=(lambda: multihost_utils.sync_global_devices('encoded corpus ready')) if several else None,
  )


def eval_batches(run: TrainingRun, split: str, say: Callable[[str], None]) -> list:
  """The split's batches in a fixed order (no shuffling), or [] when it is absent."""
  if split not in run.dataset:
    say(f'no {split} split: validation loss is not computed')
    return []
  corpus = encode_corpus(run.dataset[split], run.tokenizer, run.model_config.max_len)
  if corpus.num_dropped:
    say(f'{split}: {corpus.num_dropped:,} pairs longer than model.max_len left out of the loss')
  batcher = Batcher(
    corpus,
    run.train_config.max_tokens,
    run.train_config.seed,
    row_multiple=run.data_parallel.num_devices,
    shuffle=False,
  )
  return list(batcher.epoch(0))


def initial_state(
  run: TrainingRun,
  writers: Writers,
  model: Transformer,
  optimizer: optax.GradientTransformation,
  parallel: str,
) -> tuple[TrainState, int]:
  """The replicated state to train from and its step: the latest checkpoint's, or fresh.

  model, optimizer: the `TrainingLoop`'s (`step.compiled_training`).
  """
  seed = run.train_config.seed
  abstract_state = jax.eval_shape(lambda: create_train_state(model, optimizer, seed))
  restored = restore_latest_intact(writers.checkpoints, abstract_state, writers.say)
  if restored is None:
    state, start = create_train_state(model, optimizer, seed), 0
    if run.pretrained_params is not None:  # Adam's moments start at zero either way
      state = state.replace(params=jax.tree.map(jnp.asarray, run.pretrained_params))
  else:
    state, start = restored
    writers.say(f'resumed from {writers.checkpoints.directory / str(start)}')
  processes = f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''
  kind = ' cmlm (non-autoregressive),' if run.model_config.kind == 'cmlm' else ''
  writers.say(
    f'model: {count_params(abstract_state.params):,} parameters,{kind} '
    f'{_how_it_computes(run)}; {run.data_parallel.num_devices} device(s)'
    f'{processes} via {parallel}; steps {start} -> {_last_step(run.train_config, start)}'
  )
  return run.data_parallel.replicate(state), start


def _last_step(config: TrainConfig, start: int) -> str:
  """The model line's last step: train.steps, or, for a new run with a time budget, what the
  budget will hold (fixed once measured, `budget.fit_steps`)."""
  if config.time_budget is not None and start == 0:
    return f'as many as the {config.time_budget} budget holds'
  return str(config.steps)


def _how_it_computes(run: TrainingRun) -> str:
  """The model line's compute dtype, attention kernel and fused loss, each saying where auto
  decided it, and which attention the kernel does not take."""
  config, backend = run.model_config, jax.default_backend()
  dtype = f'{compute_dtype(config).name} compute'
  if config.dtype == 'auto':
    dtype += f' (model.dtype auto on {backend})'
  kernel = resolve_attention_kernel(config)
  attention = f'{kernel} attention'
  if kernel != 'einsum' and run.train_config.packing:
    attention += ' (packed rows: einsum)'
  elif kernel != 'einsum' and config.attention_radius is not None:
    attention += ' (self-attention: banded)'
  elif config.attention_kernel == 'auto':
    attention += f' (model.attention_kernel auto on {backend})'
  # A full batch's target tokens on one device: what the step's loss is fused over, if anything.
  tokens = run.train_config.max_tokens // run.data_parallel.num_devices
  chunk = resolve_loss_chunk(config, tokens) if config.kind == 'autoregressive' else 0
  loss = f', the loss fused over {chunk:,}-token chunks' if chunk else ''
  if chunk and config.loss_chunk == 'auto':
    loss += f' (model.loss_chunk auto on {backend})'
  return f'{dtype}, {attention}{loss}'


def restore_latest_intact(
  checkpoints: Checkpoints, abstract_state, say: Callable[[str], None]
) -> tuple[TrainState, int] | None:
  """The newest checkpoint that can be read, and its step; None when there is none.

  Damaged ones (files changed, missing or unreadable) are moved aside, saying so;
  a checkpoint of another model (CheckpointError) stops the run.
  """
  skipped = []
  for step in reversed(checkpoints.steps()):
    try:
      return checkpoints.restore(step, abstract_state), step
    except DamagedCheckpoint as error:
      aside = checkpoints.set_aside(step)
      skipped.append(step)
      say(f'skipped checkpoint {step}: {error}; moved it to {aside}')
  if skipped:
    say(
      f'no intact checkpoint left (skipped {", ".join(map(str, skipped))}): training '
      'starts afresh from step 0'
    )
  return None
