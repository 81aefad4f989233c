"""The training loop as a library function; train.py is a command line over it.

    model_config, train_config, data_config = run_preset('toy')
    result = train(model_config, train_config, data_config, 'runs/toy')
    result.scores          # {'bleu': ..., 'exact_match': ..., 'val_loss': ...}

A run goes through four stages, each a function or a small object below:

  1. `_prepare_training_run`: the run directory (writable, cleared unless resuming), the
     parallel text (`data_config.source`, or the `dataset` given), the
     tokenizer (WORKDIR/tokenizer.json, or trained on a bounded sample of the
     training split, `data.tokenizer_sample`, and saved), the settings checked against WORKDIR/config.json and written;
  2. `_initial_state`: the latest checkpoint in WORKDIR/checkpoints, or fresh
     parameters;
  3. `TrainingLoop.train_from`: trains to `train_config.steps` with the batch of each step
     (`data.pipeline.make_batcher`: each process builds its own rows, a background thread
     `train.prefetch` steps ahead), so the batches and dropout keys depend on the step
     alone and a resumed run continues exactly where an uninterrupted one would; the
     training split is encoded once into a cache on disk (`data.cache`) that a resumed
     run reads; logs to a progress bar
     and WORKDIR/metrics.jsonl, evaluates the validation loss and saves
     checkpoints at their cadence;
  4. `_final_scores`: decodes the test split (else validation) with
     `default_method(config, Greedy())`: greedy for the paper's model,
     mask-predict for a cmlm one; BLEU and chrF (sacreBLEU, signatures printed),
     exact match and sample translations; the same for the averaged checkpoints
     when asked.

A cmlm model (`ModelConfig.kind`) trains on the conditional masked LM
objective (`cmlm_objective`); its loss, ppl and accuracy are over the masked
target positions, beside the length classifier's length_loss and length_accuracy.

Failures leave valid state on disk: a signal saves the step reached and raises
`interruption.Interrupted`; a non-finite step applies no update and raises
`NonFiniteError` (or is skipped, up to `skip_nonfinite`); a checkpoint that
cannot be written raises `WriteError`; a damaged checkpoint is set aside and
the run resumes from the newest intact one. README's failure table lists each
case and what the programs answer.

Multi-host: every process builds only its own rows of each step's batch;
process 0 alone prints, writes config.json and metrics.jsonl, trains the
tokenizer and encodes the training split into the cache (the others wait, then
read them); every process takes part in the checkpoint saves. docs/scaling_out.md has the details.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from flax_transformer import signals
from flax_transformer.config import (
  NONNEGATIVE_INT,
  ConfigError,
  DataConfig,
  ModelConfig,
  TrainConfig,
  check_bounds,
  resolve_attention_kernel,
)
from flax_transformer.data import preprocessing
from flax_transformer.data.assembly import ArrayBatcher
from flax_transformer.data.batching import SEQUENCE_LENGTH, Batch, EncodedCorpus, encode_corpus
from flax_transformer.data.corpus import load_parallel
from flax_transformer.data.packing import check_settings as check_packing
from flax_transformer.data.pipeline import (
  Prefetcher,
  TrainingData,
  load_training_data,
  make_batcher,
)
from flax_transformer.data.toy_task import number_translation
from flax_transformer.decode.autoregressive import Greedy
from flax_transformer.decode.methods import default_method
from flax_transformer.decode.translator import Translator
from flax_transformer.errors import NonFiniteError
from flax_transformer.nn.model import count_params
from flax_transformer.pretrained.marian import load_marian
from flax_transformer.run.checkpoints import Checkpoints, DamagedCheckpoint, WriteError
from flax_transformer.run.directory import RunDirectory, saved_steps
from flax_transformer.run.loading import average_checkpoints, load_for_inference
from flax_transformer.run.metrics_log import MetricsLog
from flax_transformer.run.sizes import check_fits
from flax_transformer.tokenizer import SPECIAL_TOKENS, Tokenizer
from flax_transformer.train import scheduled_sampling
from flax_transformer.train.best import BestCheckpoint
from flax_transformer.train.evaluation import describe_scores, translation_scores
from flax_transformer.train.interruption import Interrupted, StopSignals
from flax_transformer.train.metrics import length_metrics, token_metrics
from flax_transformer.train.parallel import DataParallel
from flax_transformer.train.profiling import StepTrace
from flax_transformer.train.run_tokenizer import run_tokenizer
from flax_transformer.train.step import (
  TrainState,
  compiled_training,
  create_train_state,
  make_parallel_eval,
)


def evaluation_method(model_config: ModelConfig):
  """How BLEU is decoded during and after training: greedy for an autoregressive model (the
  usual, cheap model-selection signal), the model's default (mask-predict) for a cmlm one."""
  return default_method(model_config, autoregressive=Greedy())


@dataclasses.dataclass
class TrainResult:
  """What `train` leaves behind besides the files in `workdir`.

  state: the final TrainState on the host (numpy).
  scores: the last training metrics, val_* metrics, and bleu / exact_match
    (with avg_* for averaged checkpoints when requested).
  """

  workdir: Path
  model_config: ModelConfig
  tokenizer: Tokenizer
  state: TrainState
  scores: dict[str, float]


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
  kept = checkpoints_kept(train_config, saved)
  if average_last > kept:
    raise ConfigError(
      f'--average-last={average_last} needs that many checkpoints, but this run '
      f'ends with {kept}: train.steps={train_config.steps} with '
      f'train.checkpoint_every={train_config.checkpoint_every} (and one at the '
      f'end){f", beside the {len(saved)} saved" if saved else ""}; average fewer, '
      'or lower train.checkpoint_every'
    )
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


def checkpoints_kept(train_config: TrainConfig, saved: Sequence[int] = ()) -> int:
  """How many checkpoints a run leaves on disk: one every checkpoint_every steps and one at the
  last step, after the `saved` ones it resumes from, the newest keep_checkpoints of them.

  For steps 5, checkpoint_every 2, keep_checkpoints 5: steps 2, 4 and 5, so 3.
  """
  every, last, start = train_config.checkpoint_every, train_config.steps, max(saved, default=0)
  written = {step for step in range(every, last + 1, every) if step > start}
  written |= {last} if last > start else set()
  return min(train_config.keep_checkpoints, len(written | set(saved)))


def train(
  model_config: ModelConfig,
  train_config: TrainConfig,
  data_config: DataConfig,
  workdir: str | Path,
  *,
  dataset: datasets.DatasetDict | None = None,
  devices: int | None = None,
  parallel: str = 'shard_map',
  resume: bool = True,
  average_last: int = 0,
  skip_nonfinite: int = 0,
  init_from: str | Path | None = None,
  allow_unverified: bool = False,
  print_fn: Callable[[str], None] = print,
) -> TrainResult:
  """Trains (or resumes) a run in `workdir`; see the module docstring.

  Args:
    model_config: the architecture; its vocab_size is replaced by the tokenizer's.
    train_config, data_config: the run's settings, saved in WORKDIR/config.json.
    workdir: the run directory (created if needed).
    dataset: splits 'train' (required), 'validation' and 'test' (optional) with
      'source'/'target' columns; None loads `data_config.source`.
    devices: use the first this many local devices; None: all devices of all
      processes.
    parallel: 'shard_map' or 'pmap' (identical results).
    resume: continue from WORKDIR's latest checkpoint if there is one; False
      deletes WORKDIR's config, tokenizer, checkpoints and metrics first.
    average_last: if > 0, also write WORKDIR/average-last{K} (the mean of the
      last K checkpoints) at the end and report its scores as avg_*.
    skip_nonfinite: how many steps with a non-finite loss or gradient to skip
      (their updates are not applied) before stopping; 0 stops at the first.
      Counted afresh by each call, so a resumed run may skip as many again.
    init_from: a Hugging Face Marian directory to fine-tune: a fresh run starts
      from its parameters and copies its tokenizer into WORKDIR; model_config must
      be its config (`pretrained.fine_tuning_config`).
    allow_unverified: resume from a checkpoint without recorded SHA-256s (an older
      version's), saying it was not verified; by default such a checkpoint is damaged
      (set aside, and the newest verified one resumed).
    print_fn: where process 0's messages go.

  Raises:
    Interrupted: SIGTERM or SIGINT arrived during training; the step reached
      is saved.
    NonFiniteError: more than `skip_nonfinite` steps had a non-finite loss or
      gradient; the checkpoints on disk are those saved before.
    WriteError: WORKDIR or a checkpoint could not be written.
    ConfigError, DataError, TokenizerError, CheckpointError: bad settings,
      data, or run directory, before training starts.
  """
  check_settings(
    model_config,
    train_config,
    data_config,
    average_last,
    skip_nonfinite,
    pretrained=init_from is not None,
    saved=saved_steps(workdir) if resume else (),
  )
  directory = RunDirectory(workdir, init_from=init_from, data=data_config.source)
  with directory.locked():
    run = _prepare_training_run(
      model_config,
      train_config,
      data_config,
      directory,
      dataset,
      devices,
      parallel,
      resume,
      print_fn,
      init_from,
      allow_unverified,
    )
    loop = TrainingLoop(run, skip_nonfinite)
    state, start = _initial_state(run, loop, parallel)
    signals.check()  # a signal while loading stops before anything of the run is written
    # Only now, with the checkpoint restored, is anything of the run directory rewritten.
    directory.write_settings(run.model_config, train_config, data_config, loop.packing_plan)
    run.log = (
      MetricsLog(
        directory.metrics_file, resume_step=start, tensorboard_dir=directory.tensorboard_dir
      )
      if directory.is_main
      else None
    )
    try:
      state = loop.train_from(state, start)
      final_state = run.data_parallel.unreplicate(state)
      _final_evaluation(run, loop, final_state, start, average_last)
    finally:
      if run.log is not None:
        run.log.close()
  return TrainResult(
    workdir=directory.path,
    model_config=run.model_config,
    tokenizer=run.tokenizer,
    state=final_state,
    scores=run.scores,
  )


# --- stage 1: the run directory, the data and the settings ----------------------------------


@dataclasses.dataclass
class _TrainingRun:
  """What the stages share: the settings, data, devices and the run directory's writers."""

  directory: RunDirectory
  model_config: ModelConfig
  train_config: TrainConfig
  data_config: DataConfig
  train_data: TrainingData  # the training split (on disk or a table)
  dataset: datasets.DatasetDict  # the evaluation splits: 'validation', 'test' when present
  tokenizer: Tokenizer
  data_parallel: DataParallel
  checkpoints: Checkpoints
  say: Callable[[str], None]
  log: MetricsLog | None = None
  scores: dict[str, float] = dataclasses.field(default_factory=dict)
  pretrained_params: dict | None = None  # --init-from's, for a run without checkpoints

  def record(self, step: int, values: dict[str, float]) -> None:
    """Keeps `values` as the latest scores and logs them at `step` (process 0)."""
    self.scores.update(values)
    if self.log is not None:
      self.log.write(step, values)


def _prepare_training_run(
  model_config: ModelConfig,
  train_config: TrainConfig,
  data_config: DataConfig,
  directory: RunDirectory,
  dataset: datasets.DatasetDict | None,
  devices: int | None,
  parallel: str,
  resume: bool,
  print_fn: Callable[[str], None],
  init_from: str | Path | None = None,
  allow_unverified: bool = False,
) -> _TrainingRun:
  """Checks and prepares WORKDIR, loads the data and the tokenizer, records the settings."""
  say = print_fn if directory.is_main else (lambda message: None)
  data_parallel = DataParallel(_local_devices(devices), mode=parallel)
  train_data = load_training_data(data_config, dataset)
  say(f'data: {train_data.describe()}')
  _check_validation(train_config, train_data.evaluation)
  steps = preprocessing.TextPreprocessing.of(data_config)
  if steps.active:
    say(f'text: {steps.describe()} (data.normalize_punctuation, data.lowercase, data.pretokenize)')
  directory.prepare(resume)
  checkpoints = Checkpoints(
    directory.path,
    keep=train_config.keep_checkpoints,
    on_unverified=say if allow_unverified else None,
  )
  pretrained_params = None
  if init_from is not None and checkpoints.latest_step() is None:
    _, pretrained_params, marian_tokenizer = load_marian(init_from)
    if directory.is_main:
      marian_tokenizer.save(directory.path)
    say(f'fine-tuning {init_from}')
  tokenizer = run_tokenizer(
    directory,
    lambda: _tokenizer_texts(train_data, data_config, steps),
    data_config,
    has_checkpoints=checkpoints.latest_step() is not None,
    say=say,
  )
  # Everything the run encodes or decodes sees text through the data settings' preprocessing.
  tokenizer = preprocessing.wrap(tokenizer, data_config)
  model_config = directory.kept_dtype(model_config.replace(vocab_size=tokenizer.vocab_size))
  tokenizer.check_compatible(model_config)
  directory.check_settings(model_config, train_config, data_config)
  return _TrainingRun(
    directory=directory,
    model_config=model_config,
    train_config=train_config,
    data_config=data_config,
    train_data=train_data,
    dataset=train_data.evaluation,
    tokenizer=tokenizer,
    data_parallel=data_parallel,
    checkpoints=checkpoints,
    say=say,
    pretrained_params=pretrained_params,
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


def _local_devices(count: int | None) -> list[jax.Device] | None:
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


# --- stage 2: the initial state ---------------------------------------------------------------


def _initial_state(run: _TrainingRun, loop: TrainingLoop, parallel: str) -> tuple[TrainState, int]:
  """The replicated state to train from and its step: the latest checkpoint's, or fresh."""
  model, optimizer, seed = loop.model, loop.optimizer, run.train_config.seed
  abstract_state = jax.eval_shape(lambda: create_train_state(model, optimizer, seed))
  restored = _restore_latest_intact(run, abstract_state)
  if restored is None:
    state, start = create_train_state(model, optimizer, seed), 0
    if run.pretrained_params is not None:  # Adam's moments start at zero either way
      state = state.replace(params=jax.tree.map(jnp.asarray, run.pretrained_params))
  else:
    state, start = restored
    run.say(f'resumed from {run.checkpoints.directory / str(start)}')
  processes = f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''
  kind = ' cmlm (non-autoregressive),' if run.model_config.kind == 'cmlm' else ''
  run.say(
    f'model: {count_params(abstract_state.params):,} parameters,{kind} '
    f'{_how_it_computes(run)}; {run.data_parallel.num_devices} device(s)'
    f'{processes} via {parallel}; steps {start} -> {run.train_config.steps}'
  )
  return run.data_parallel.replicate(state), start


def _how_it_computes(run: _TrainingRun) -> str:
  """The model line's compute dtype and attention kernel, each saying where auto decided it,
  and which attention the kernel does not take."""
  config, backend = run.model_config, jax.default_backend()
  dtype = f'{config.compute_dtype.name} compute'
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
  return f'{dtype}, {attention}'


def _restore_latest_intact(run: _TrainingRun, abstract_state) -> tuple[TrainState, int] | None:
  """The newest checkpoint that can be read, and its step; None when there is none.

  Damaged ones (files changed, missing or unreadable) are moved aside, saying so;
  a checkpoint of another model (CheckpointError) stops the run.
  """
  skipped = []
  for step in reversed(run.checkpoints.steps()):
    try:
      return run.checkpoints.restore(step, abstract_state), step
    except DamagedCheckpoint as error:
      aside = run.checkpoints.set_aside(step)
      skipped.append(step)
      run.say(f'skipped checkpoint {step}: {error}; moved it to {aside}')
  if skipped:
    run.say(
      f'no intact checkpoint left (skipped {", ".join(map(str, skipped))}): training '
      'starts afresh from step 0'
    )
  return None


# --- stage 3: the loop ------------------------------------------------------------------------


class MetricBuffer:
  """The training steps' metrics between two log lines.

  They stay on the device (`pending`) until a log line or a save needs them,
  then wait on the host (`fetched`) for the interval's log line. Steps whose
  loss or gradient was not finite are noted in `skipped`.
  """

  def __init__(self, data_parallel: DataParallel):
    self.data_parallel = data_parallel
    self.pending: list = []
    self.fetched: list[dict] = []
    self.skipped: list[int] = []
    self.interval_start = time.perf_counter()

  def add(self, metrics) -> None:
    self.pending.append(metrics)

  def fetch(self) -> list[dict]:
    """Brings the pending metrics to the host; returns them (they also join the interval)."""
    new, self.pending = self.data_parallel.unreplicate(self.pending), []
    self.fetched += new
    return new

  def summary(self) -> dict[str, float]:
    """The interval's log line (see `summarize`), after which a new interval starts."""
    values = summarize(self.fetched, time.perf_counter() - self.interval_start)
    self.fetched, self.interval_start = [], time.perf_counter()
    return values


class TrainingLoop:
  """Steps from the start to train.steps, with their logging, validation and checkpoints."""

  def __init__(self, run: _TrainingRun, skip_nonfinite: int):
    self.run = run
    self.skip_nonfinite = skip_nonfinite
    config = run.train_config
    self.model, self.optimizer, self.step_fn = compiled_training(
      run.model_config, config, run.data_parallel
    )
    self.eval_fn = make_parallel_eval(self.model, config, run.data_parallel)
    corpus = _encoded_train(run)
    self.packing_plan = run.directory.packing_plan(run.checkpoints.latest_step() is not None)
    self.batcher = make_batcher(corpus, config, run.data_parallel.num_devices, self.packing_plan)
    run.say(
      f'train: {self.batcher.describe()}; {corpus.num_dropped:,} pairs dropped (a side '
      f'longer than model.max_len={run.model_config.max_len} tokens with EOS)'
    )
    self.val_batches = _eval_batches(run, 'validation')
    self.best = BestCheckpoint(run.directory.path, config) if 'validation' in run.dataset else None

  def local_batch(self, step: int) -> Batch:
    """This process's rows of step `step`'s batch, split over the devices."""
    index, count = jax.process_index(), jax.process_count()
    local = self.batcher.local_batch_at(step, index, count)
    return self.run.data_parallel.shard_local_batch(local, local.src.shape[0] * count)

  def train_from(self, state: TrainState, start: int) -> TrainState:
    """Trains from `start`; raises Interrupted after saving when a signal asked to stop."""
    run, config = self.run, self.run.train_config
    # The clock carries on from the log's last line, so a resumed run's elapsed_s is the
    # whole run's training time (the time stopped in between not counted).
    logged_s = run.log.elapsed_s if run.log is not None else 0.0
    buffer, run_start, done = MetricBuffer(run.data_parallel), time.perf_counter() - logged_s, start
    bar = tqdm(
      initial=start,
      total=config.steps,
      desc='train',
      unit='step',
      disable=not run.directory.is_main,
      dynamic_ncols=True,
    )
    if self.best is not None and self.best.exhausted(start):
      run.say(
        f'stopped early at step {start}: {config.patience} validations without a better '
        f'{config.best_metric} (train.patience); {self.best.describe()}'
      )
      return state
    batches = Prefetcher(self.local_batch, start, config.steps, config.prefetch)
    trace = StepTrace(config.profile_steps, run.directory.profile_dir, run.say)
    try:
      with StopSignals() as stop, batches, contextlib.closing(trace):
        for step, batch in batches:
          trace.before_step(step, state)
          state, metrics = self.step_fn(state, batch)
          bar.update()
          buffer.add(metrics)
          done, stopping = step + 1, stop.requested(step + 1)
          trace.after_step(done, state)
          run.checkpoints.check_saved()
          if self._after_step(state, done, stopping, buffer, bar, run_start):
            break
        bar.close()
        # Still under StopSignals: a signal now waits for the last save to be committed.
        run.checkpoints.close()
    except Exception:
      bar.close()
      # Let the saves already under way finish: the error raised is the one to report.
      with contextlib.suppress(WriteError):
        run.checkpoints.close()
      raise
    if stop.received() is not None:
      # Stopped at a step, saved. A signal after the last step, while its checkpoint was
      # written, also ends here: the evaluation is left to the next run ("already trained").
      raise Interrupted(stop.signal_number, done, run.checkpoints.directory / str(done))
    return state

  def _after_step(
    self, state: TrainState, done: int, stopping: bool, buffer: MetricBuffer, bar, run_start: float
  ) -> bool:
    """The log line, finiteness check, validation, save and BLEU due after step `done`.

    Returns whether to stop: asked before (`stopping`), or a signal during an evaluation,
    which is then abandoned; either way step `done` is saved.
    """
    run, config = self.run, self.run.train_config
    final = done == config.steps
    validate = not stopping and (done % config.eval_every == 0 or final)
    bleu = (
      not stopping
      and bool(config.bleu_every)
      and done % config.bleu_every == 0
      and 'validation' in run.dataset
    )
    save_due = final or done % config.checkpoint_every == 0
    log_now = stopping or final or done % config.log_every == 0
    # Checked before a save (which an evaluation's signal may bring): a state after too many
    # non-finite steps is not saved.
    new = buffer.fetch() if stopping or save_due or log_now or validate or bleu else []
    if log_now:
      values = {**buffer.summary(), 'elapsed_s': time.perf_counter() - run_start}
      run.record(done, values)
      if 'loss' in values:
        bar.set_postfix(loss=f'{values["loss"]:.3f}', tok_s=f'{values["tokens_per_s"]:,.0f}')
    check_finite(
      new, done - len(new) + 1, buffer.skipped, self.skip_nonfinite, run.checkpoints, run.say
    )
    if validate:
      stopping = _abandoned_on_signal(lambda: self.validate(done, state.params))
    early = not stopping and self.best is not None and self.best.exhausted(done)
    if stopping or save_due or early:
      run.checkpoints.save(run.data_parallel.unreplicate(state))
    if bleu and not stopping and not early:
      stopping = _abandoned_on_signal(lambda: self._validation_bleu(done, state.params))
      early = not stopping and self.best.exhausted(done)
      if (stopping or early) and not save_due:
        run.checkpoints.save(run.data_parallel.unreplicate(state))
    if early:
      run.say(
        f'step {done}: stopping early, {config.patience} validations without a better '
        f'{config.best_metric} (train.patience); {self.best.describe()}'
      )
    return stopping or early

  def _validation_bleu(self, step: int, params) -> None:
    run = self.run
    params = run.data_parallel.unreplicate(params)
    values, report = _split_scores(run, params, 'validation')
    run.record(step, {f'val_{name}': value for name, value in values.items()})
    run.say(f'step {step}: validation {describe_scores(values, report)}')
    if run.train_config.best_metric == 'bleu':
      # Tokenized BLEU: the literature's, and blind to case, which a lowercased run lacks.
      self._consider_best(step, values.get('bleu_tok', values['bleu']), params)

  def _consider_best(self, step: int, value: float, params) -> None:
    """WORKDIR/best follows a better validation score (`best.BestCheckpoint`)."""
    if self.best.consider(step, value, params):
      self.run.record(step, {f'best_val_{self.best.best.metric}': value})

  def validate(self, step: int, params, keep_best: bool = True) -> None:
    """Logs the validation loss, ppl and accuracy (and a cmlm model's length accuracy); with
    `keep_best`, `params` are the devices' (replicated) and WORKDIR/best follows the loss."""
    if not self.val_batches:
      return
    run = self.run
    outputs = []
    for batch in tqdm(
      self.val_batches,
      desc='validation',
      unit='batch',
      leave=False,
      disable=not run.directory.is_main,
      dynamic_ncols=True,
    ):
      signals.check()
      outputs.append(self.eval_fn(params, run.data_parallel.shard_batch(batch)))
    sums = jax.tree.map(lambda *xs: float(np.sum(xs)), *run.data_parallel.unreplicate(outputs))
    values = _metrics(sums)
    run.record(step, {f'val_{name}': value for name, value in values.items()})
    length = (
      f', length accuracy {values["length_accuracy"]:.1%}' if 'length_accuracy' in values else ''
    )
    run.say(
      f'step {step}: validation loss {values["loss"]:.3f}, ppl {values["ppl"]:.2f}, '
      f'token accuracy {values["accuracy"]:.1%}{length}'
    )
    if keep_best and run.train_config.best_metric == 'loss' and self.best is not None:
      self._consider_best(step, values['loss'], run.data_parallel.unreplicate(params))


def _abandoned_on_signal(evaluate: Callable[[], None]) -> bool:
  """Runs an evaluation; True if a signal stopped it (the signal stays recorded), else False."""
  try:
    evaluate()
  except signals.Stopped:
    return True
  return False


def _encoded_train(run: _TrainingRun) -> EncodedCorpus:
  """The training split encoded, through the cache (`data.cache_dir`, else WORKDIR/encoded):
  process 0 encodes it or finds it there; the others wait, then read it."""
  cache_dir = run.data_config.cache_dir or run.directory.encoded_dir
  several = jax.process_count() > 1
  return run.train_data.encoded_train(
    run.tokenizer,
    run.tokenizer.digest(),
    run.model_config.max_len,
    cache_dir,
    is_writer=run.directory.is_main,
    progress=run.directory.is_main,
    say=run.say,
    wait=(lambda: multihost_utils.sync_global_devices('encoded corpus ready')) if several else None,
  )


def _eval_batches(run: _TrainingRun, split: str) -> list:
  """The split's batches in a fixed order (no shuffling), or [] when it is absent."""
  if split not in run.dataset:
    run.say(f'no {split} split: validation loss is not computed')
    return []
  corpus = encode_corpus(run.dataset[split], run.tokenizer, run.model_config.max_len)
  if corpus.num_dropped:
    run.say(f'{split}: {corpus.num_dropped:,} pairs longer than model.max_len left out of the loss')
  batcher = ArrayBatcher(
    corpus,
    run.train_config.max_tokens,
    run.train_config.seed,
    row_multiple=run.data_parallel.num_devices,
    shuffle=False,
  )
  return list(batcher.epoch(0))


def _metrics(sums: dict[str, float]) -> dict[str, float]:
  """Loss, ppl, accuracy per token (masked token for cmlm), plus a cmlm model's length metrics."""
  return {**token_metrics(sums), **(length_metrics(sums) if 'sentences' in sums else {})}


def summarize(metrics: list[dict], seconds: float) -> dict[str, float]:
  """Per-step metrics of one logging interval -> per-token loss, ppl, accuracy, rates.

  Skipped steps (non-finite loss or gradient) are left out of the averages and
  counted as nonfinite_steps, a key present only when there were some.
  tokens_per_s counts every target token (a cmlm step's target_tokens, not
  only its masked ones).
  """
  good = [m for m in metrics if not m['nonfinite']]
  values = {}
  if good:
    sums = {name: float(np.sum([m[name] for m in good])) for name in good[0]}
    values = {
      **_metrics(sums),
      'learning_rate': float(good[-1]['learning_rate']),
      'grad_norm': float(np.mean([m['grad_norm'] for m in good])),
    }
  tokens = 'target_tokens' if 'target_tokens' in metrics[0] else 'tokens'
  values['tokens_per_s'] = float(np.sum([m[tokens] for m in metrics])) / seconds
  if len(good) < len(metrics):
    values['nonfinite_steps'] = len(metrics) - len(good)
  return values


def check_finite(
  metrics: list[dict],
  first_step: int,
  skipped: list[int],
  limit: int,
  checkpoints: Checkpoints,
  say: Callable[[str], None],
) -> None:
  """Notes the steps among `metrics` (steps first_step, first_step + 1, ...) that were skipped.

  Raises NonFiniteError once `skipped` holds more than `limit` steps, after the
  saves under way have finished, naming the last checkpoint.
  """
  for step, values in enumerate(metrics, start=first_step):
    if not values['nonfinite']:
      continue
    skipped.append(step)
    what = (
      f'step {step}: the loss or the gradient is not finite (loss sum '
      f'{float(values["loss_sum"])}, gradient norm {float(values["grad_norm"])}); its '
      'update was not applied'
    )
    if len(skipped) <= limit:
      say(f'{what}, skipped ({len(skipped)} of at most {limit}, --skip-nonfinite)')
      continue
    checkpoints.close()
    latest = checkpoints.latest_step()
    kept = (
      f'the last checkpoint, {checkpoints.directory / str(latest)}, holds the last good parameters'
      if latest is not None
      else 'no checkpoint was saved before it'
    )
    count = (
      f'; {len(skipped)} such steps ({", ".join(map(str, skipped))}), more than '
      f'--skip-nonfinite={limit} allows'
      if limit
      else ''
    )
    raise NonFiniteError(
      f'{what}{count}. Training stopped; {kept}. Usual causes: a learning rate too high for '
      'the model (--train.lr_scale, --train.warmup_steps), bfloat16 overflow, corrupt data. '
      'To skip such steps and go on, pass --skip-nonfinite N.',
      step,
    )


# --- stage 4: the final scores ----------------------------------------------------------------


def _final_evaluation(
  run: _TrainingRun, loop: TrainingLoop, state: TrainState, start: int, average_last: int
) -> None:
  """The final scores (after the validation loss, for a run that was trained already); a
  signal abandons them, and the next run evaluates the saved final step again."""
  steps = run.train_config.steps
  try:
    if start >= steps:
      run.say(
        f'{run.directory.path} is already trained to step {start} '
        f'(train.steps={steps}); evaluating it'
      )
      loop.validate(start, state.params, keep_best=False)  # validated when it was trained
    _final_scores(run, state, average_last)
  except signals.Stopped as stop:
    step = max(start, steps)
    raise Interrupted(
      stop.signal_number, step, run.checkpoints.directory / str(step), evaluating=True
    ) from None


def _final_scores(run: _TrainingRun, state: TrainState, average_last: int) -> None:
  """Test (else validation) scores of the final parameters, and of the averaged checkpoints."""
  split = next((name for name in ('test', 'validation') if name in run.dataset), None)
  if split is None:
    if average_last:
      run.say(f'wrote {average_checkpoints(run.directory.path, average_last)}')
    return
  step = int(state.step)
  values, report = _split_scores(run, state.params, split)
  run.record(step, values)
  run.say(
    f'{split}, {evaluation_method(run.model_config).describe()} of '
    f'{len(run.dataset[split]):,} sentences: {describe_scores(values, report)}\n'
    f'  ({report["signature"]})'
  )
  run.say(report['samples'])
  if average_last:
    averaged = average_checkpoints(run.directory.path, average_last)
    _, avg_params, _ = load_for_inference(averaged)
    values, report = _split_scores(run, avg_params, split)
    run.record(step, {f'avg_{name}': value for name, value in values.items()})
    run.say(
      f'{averaged}: mean of the last {average_last} checkpoints, {split} '
      f'{describe_scores(values, report)}'
    )


def _split_scores(run: _TrainingRun, params, split: str) -> tuple[dict[str, float], dict[str, str]]:
  translator = Translator(run.model_config, params, run.tokenizer)
  lang = run.data_config.tgt_lang if preprocessing.moses_available() else None
  return translation_scores(
    translator,
    run.dataset[split],
    evaluation_method(run.model_config),
    progress=f'decode {split}' if run.directory.is_main else None,
    lang=lang,
  )
