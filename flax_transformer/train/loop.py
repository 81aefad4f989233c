"""The training loop as a library function; train.py is a command line over it.

    model_config, train_config, data_config = run_preset('toy')
    result = train(model_config, train_config, data_config, 'runs/toy')
    result.scores          # {'bleu': ..., 'exact_match': ..., 'val_loss': ...}

A run goes through four stages, each a function or a small object (`setup` prepares the
run, `report` scores it):

  1. `setup`'s stages, each a frozen value: the parallel text (`data_config.source`, or the
     `dataset` given, `load_run_data`), where the run writes (`open_writers`: the run
     directory, writable, cleared unless resuming, and its checkpoints), then the
     `TrainingRun` (`prepare_training_run`: the tokenizer, WORKDIR/tokenizer.json or trained
     on a bounded sample of the training split, `data.tokenizer_sample`, and saved; the
     settings checked against WORKDIR/config.json, and written once the state is restored);
  2. `setup.initial_state`: the latest checkpoint in WORKDIR/checkpoints, or fresh
     parameters;
  3. `TrainingLoop.train_from`: trains to `train_config.steps` with the batch of each step
     (`data.pipeline.make_batcher`: each process builds its own rows, a background thread
     `train.prefetch` steps ahead), so the batches and dropout keys depend on the step
     alone and a resumed run continues exactly where an uninterrupted one would; the
     training split is encoded once into a cache on disk (`data.cache`) that a resumed
     run reads; logs to a progress bar
     and WORKDIR/metrics.jsonl, evaluates the validation loss and saves
     checkpoints at their cadence;
  4. `_final_evaluation`, `report.final_scores`: decodes the test split (else validation) with
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

`check_settings`, `checkpoints_kept`, `load_data` (`setup`'s) and `NonFiniteError` are
importable from here too, as before the stages moved out.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import jax
import numpy as np
from tqdm.auto import tqdm

from flax_transformer import signals
from flax_transformer.config import DataConfig, ModelConfig, TrainConfig
from flax_transformer.data.batching import Batch
from flax_transformer.data.pipeline import Prefetcher, make_batcher
from flax_transformer.errors import NonFiniteError as NonFiniteError
from flax_transformer.errors import WriteError
from flax_transformer.run.config_file import read_config
from flax_transformer.run.directory import RunDirectory, saved_steps
from flax_transformer.run.metrics_log import MetricsLog
from flax_transformer.tokenizer import Tokenizer
from flax_transformer.train.best import BestCheckpoint
from flax_transformer.train.budget import fit_steps, resumed_steps
from flax_transformer.train.cadence import Due, due
from flax_transformer.train.evaluation import describe_scores
from flax_transformer.train.interruption import Interrupted, StopSignals
from flax_transformer.train.metrics import ScoreRecord
from flax_transformer.train.moving_average import write_ema
from flax_transformer.train.parallel import DataParallel
from flax_transformer.train.profiling import StepTrace, profile_plan
from flax_transformer.train.report import final_scores, split_scores
from flax_transformer.train.setup import (
  TrainingRun,
  Writers,
  check_settings,
  encode_training_split,
  eval_batches,
  initial_state,
  load_run_data,
  local_devices,
  open_writers,
  prepare_training_run,
  speaker,
)
from flax_transformer.train.setup import checkpoints_kept as checkpoints_kept
from flax_transformer.train.setup import load_data as load_data
from flax_transformer.train.step import TrainState, compiled_training, make_parallel_eval
from flax_transformer.train.step_metrics import MetricBuffer, check_finite, metrics_of_sums

# Steps dispatched ahead of the one the loop last waited for. JAX dispatches asynchronously,
# so without a bound the loop (and its progress bar) ran ~36 steps ahead of a 2 s CPU step,
# and a Ctrl-C was acted on a minute and more later; two keep the devices fed.
MAX_STEPS_IN_FLIGHT = 2


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
  clock: Callable[[], float] = time.perf_counter,
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
    clock: what train.time_budget is measured with (seconds; tests pass a fake one).

  Raises:
    Interrupted: SIGTERM or SIGINT arrived during training; the step reached
      is saved.
    NonFiniteError: more than `skip_nonfinite` steps had a non-finite loss or
      gradient; the checkpoints on disk are those saved before.
    WriteError: WORKDIR or a checkpoint could not be written.
    ConfigError, DataError, TokenizerError, CheckpointError: bad settings,
      data, or run directory, before training starts.
  """
  began = clock()
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
    # A run with a time budget keeps the steps its budget fixed when it began.
    budgeted = train_config.time_budget is not None and resume
    saved = read_config(directory.path)[1] if budgeted and directory.has_settings() else None
    train_config = resumed_steps(saved, train_config)
    # Setup's stages, each handing on a value: the devices, the data (read before WORKDIR
    # is cleared), where the run writes, then the tokenizer and the settings it fixes.
    say = speaker(directory, print_fn)
    data_parallel = DataParallel(local_devices(devices), mode=parallel)
    train_data = load_run_data(train_config, data_config, dataset, say)
    writers = open_writers(directory, train_config, resume, say, allow_unverified)
    run = prepare_training_run(
      model_config, train_config, data_config, train_data, data_parallel, writers, init_from
    )
    record = ScoreRecord()
    loop = TrainingLoop(run, writers, skip_nonfinite, record)
    state, start = initial_state(run, writers, loop.model, loop.optimizer, parallel)
    if train_config.time_budget is not None and saved is None:
      train_config = fit_steps(run, loop, state, start, clock() - began, average_last, clock)
      run = dataclasses.replace(run, train_config=train_config)
      loop.use(run)
    signals.check()  # a signal while loading stops before anything of the run is written
    # Only now, with the checkpoint restored, is anything of the run directory rewritten.
    directory.write_settings(run.model_config, train_config, data_config, loop.packing_plan)
    if directory.is_main:
      record.attach(
        MetricsLog(
          directory.metrics_file, resume_step=start, tensorboard_dir=directory.tensorboard_dir
        )
      )
    try:
      state = loop.train_from(state, start)
      final_state = run.data_parallel.unreplicate(state)
      _final_evaluation(run, writers, loop, final_state, start, average_last)
    finally:
      record.close()
  return TrainResult(
    workdir=directory.path,
    model_config=run.model_config,
    tokenizer=run.tokenizer,
    state=final_state,
    scores=record.scores,
  )


class TrainingLoop:
  """Steps from the start to train.steps, with their logging, validation and checkpoints."""

  def __init__(self, run: TrainingRun, writers: Writers, skip_nonfinite: int, record: ScoreRecord):
    self.run = run
    self.writers = writers
    self.skip_nonfinite = skip_nonfinite
    self.record = record
    config = run.train_config
    self.compile_step()
    self.eval_fn = make_parallel_eval(self.model, config, run.data_parallel)
    corpus = encode_training_split(run, writers)
    self.packing_plan = writers.directory.packing_plan(
      writers.checkpoints.latest_step() is not None
    )
    self.batcher = make_batcher(
      corpus, config, run.data_parallel.num_devices, self.packing_plan, run.resegmenting
    )
    writers.say(
      f'train: {self.batcher.describe()}; {corpus.num_dropped:,} pairs dropped (a side '
      f'longer than model.max_len={run.model_config.max_len} tokens with EOS)'
    )
    self.val_batches = eval_batches(run, 'validation', writers.say)
    has_validation = 'validation' in run.dataset
    self.best = BestCheckpoint(writers.directory.path, config) if has_validation else None

  def compile_step(self) -> None:
    """The model, optimizer and mapped step for the run's settings."""
    self.model, self.optimizer, self.step_fn = compiled_training(
      self.run.model_config, self.run.train_config, self.run.data_parallel
    )

  def use(self, run: TrainingRun) -> None:
    """Trains `run` instead: the same data and devices, settings fixed since (a time
    budget's train.steps, a constant of the step's schedule), so the step is recompiled."""
    self.run = run
    self.compile_step()

  def local_batch(self, step: int) -> Batch:
    """This process's rows of step `step`'s batch, split over the devices."""
    index, count = jax.process_index(), jax.process_count()
    local = self.batcher.local_batch_at(step, index, count)
    return self.run.data_parallel.shard_local_batch(local, local.src.shape[0] * count)

  def train_from(self, state: TrainState, start: int) -> TrainState:
    """Trains from `start`; raises Interrupted after saving when a signal asked to stop."""
    run, config = self.run, self.run.train_config
    writers = self.writers
    # The clock carries on from the log's last line, so a resumed run's elapsed_s is the
    # whole run's training time (the time stopped in between not counted).
    logged_s = self.record.elapsed_s
    buffer, run_start, done = MetricBuffer(run.data_parallel), time.perf_counter() - logged_s, start
    bar = self._progress_bar(start)
    if self.best is not None and self.best.exhausted(start):
      writers.say(
        f'stopped early at step {start}: {config.patience} validations without a better '
        f'{config.best_metric} (train.patience); {self.best.describe()}'
      )
      return state
    batches = Prefetcher(self.local_batch, start, config.steps, config.prefetch)
    in_flight = collections.deque()  # the metrics of the steps dispatched, not yet waited for
    trace = StepTrace(writers.directory.profile_dir, writers.say)
    if (planned := profile_plan(config.profile_steps, start, config.steps)) is not None:
      writers.say(planned)
    has_validation = 'validation' in run.dataset
    try:
      with StopSignals() as stop, batches, contextlib.closing(trace):
        if due(config, start, start).profile_start:
          trace.start(state, start)
        for step, batch in batches:
          state, metrics = self.step_fn(state, batch)
          in_flight.append(metrics)
          if len(in_flight) > MAX_STEPS_IN_FLIGHT:
            jax.block_until_ready(in_flight.popleft())
          bar.update()
          buffer.add(metrics)
          done, stopping = step + 1, stop.requested(step + 1)
          now = due(config, done, start, stopping=stopping, has_validation=has_validation)
          if now.profile_stop:
            trace.stop(state, done)
          writers.checkpoints.check_saved()
          if self._after_step(state, done, stopping, now, buffer, bar, run_start):
            break
          if now.profile_start:
            trace.start(state, done)
        bar.close()
        # Still under StopSignals: a signal now waits for the last save to be committed.
        writers.checkpoints.close()
    except Exception:
      bar.close()
      # Let the saves already under way finish: the error raised is the one to report.
      with contextlib.suppress(WriteError):
        writers.checkpoints.close()
      raise
    if stop.received() is not None:
      # Stopped at a step, saved. A signal after the last step, while its checkpoint was
      # written, also ends here: the evaluation is left to the next run ("already trained").
      raise Interrupted(stop.signal_number, done, writers.checkpoints.directory / str(done))
    return state

  def _progress_bar(self, start: int) -> tqdm:
    """The training bar from `start` to train.steps, shown by process 0 only."""
    config = self.run.train_config
    return tqdm(
      initial=start,
      total=config.steps,
      desc='train' if config.time_budget is None else f'train ({config.time_budget} budget)',
      unit='step',
      disable=not self.writers.directory.is_main,
      dynamic_ncols=True,
    )

  def _after_step(
    self,
    state: TrainState,
    done: int,
    stopping: bool,
    now: Due,
    buffer: MetricBuffer,
    bar,
    run_start: float,
  ) -> bool:
    """Does what `now` (`cadence.due`) says is due after step `done`: the log line, the
    finiteness check, validation, save, BLEU, patience.

    Returns whether to stop: asked before (`stopping`), a signal during an evaluation, which
    is then abandoned, or patience spent; whichever, step `done` is saved.
    """
    run, config = self.run, self.run.train_config
    writers = self.writers
    # Checked before a save (which an evaluation's signal may bring): a state after too many
    # non-finite steps is not saved.
    new = buffer.fetch() if now.fetch else []
    if now.log:
      values = {**buffer.summary(), 'elapsed_s': time.perf_counter() - run_start}
      self.record.record(done, values)
      if 'loss' in values:
        bar.set_postfix(loss=f'{values["loss"]:.3f}', tok_s=f'{values["tokens_per_s"]:,.0f}')
    check_finite(
      new,
      done - len(new) + 1,
      buffer.skipped,
      self.skip_nonfinite,
      writers.checkpoints,
      writers.say,
    )
    if now.validate:
      stopping = _abandoned_on_signal(lambda: self.validate(done, state.params))
    spent = lambda: not stopping and self.best is not None and self.best.exhausted(done)
    early = now.patience and config.best_metric == 'loss' and spent()
    if stopping or now.save or early:
      writers.checkpoints.save(run.data_parallel.unreplicate(state))
    if now.bleu and not stopping and not early:
      stopping = _abandoned_on_signal(lambda: self._validation_bleu(done, state.params))
      early = now.patience and config.best_metric == 'bleu' and spent()
      if (stopping or early) and not now.save:
        writers.checkpoints.save(run.data_parallel.unreplicate(state))
    if early:
      writers.say(
        f'step {done}: stopping early, {config.patience} validations without a better '
        f'{config.best_metric} (train.patience); {self.best.describe()}'
      )
    return stopping or early

  def _validation_bleu(self, step: int, params) -> None:
    run = self.run
    params = run.data_parallel.unreplicate(params)
    values, report = split_scores(run, params, 'validation', self.writers.directory.is_main)
    self.record.record(step, {f'val_{name}': value for name, value in values.items()})
    self.writers.say(f'step {step}: validation {describe_scores(values, report)}')
    if run.train_config.best_metric == 'bleu':
      # Tokenized BLEU: the literature's, and blind to case, which a lowercased run lacks.
      self._consider_best(step, values.get('bleu_tok', values['bleu']), params)

  def _consider_best(self, step: int, value: float, params) -> None:
    """WORKDIR/best follows a better validation score (`best.BestCheckpoint`)."""
    if self.best.consider(step, value, params):
      self.record.record(step, {f'best_val_{self.best.best.metric}': value})

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
      disable=not self.writers.directory.is_main,
      dynamic_ncols=True,
    ):
      signals.check()
      outputs.append(self.eval_fn(params, run.data_parallel.shard_batch(batch)))
    sums = jax.tree.map(lambda *xs: float(np.sum(xs)), *run.data_parallel.unreplicate(outputs))
    values = metrics_of_sums(sums)
    self.record.record(step, {f'val_{name}': value for name, value in values.items()})
    length = (
      f', length accuracy {values["length_accuracy"]:.1%}' if 'length_accuracy' in values else ''
    )
    self.writers.say(
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


def _final_evaluation(
  run: TrainingRun,
  writers: Writers,
  loop: TrainingLoop,
  state: TrainState,
  start: int,
  average_last: int,
) -> None:
  """The final scores (after the validation loss, for a run that was trained already); a
  signal abandons them, and the next run evaluates the saved final step again."""
  steps = run.train_config.steps
  written = write_ema(
    writers.directory.path, int(state.step), state.opt_state, run.train_config.ema_decay
  )
  if written is not None:
    writers.say(f'wrote {written}: the moving average of the parameters at the last step')
  try:
    if start >= steps:
      writers.say(
        f'{writers.directory.path} is already trained to step {start} '
        f'(train.steps={steps}); evaluating it'
      )
      loop.validate(start, state.params, keep_best=False)  # validated when it was trained
    final_scores(run, writers, loop.record, state, average_last)
  except signals.Stopped as stop:
    step = max(start, steps)
    raise Interrupted(
      stop.signal_number, step, writers.checkpoints.directory / str(step), evaluating=True
    ) from None
