"""The training loop as a library function; train.py is a command line over it.

    model_config, train_config, data_config = run_preset('toy')
    result = train(model_config, train_config, data_config, 'runs/toy')
    result.scores          # {'bleu': ..., 'exact_match': ..., 'val_loss': ...}

What a run does, in order:
  1. loads the parallel text (`data_config.source`, or the `dataset` given);
  2. loads WORKDIR/tokenizer.json, or trains the shared vocabulary on the
     training split and saves it there; model.vocab_size becomes its size;
  3. resumes from the latest checkpoint in WORKDIR/checkpoints when there is
     one (after checking that the settings match WORKDIR/config.json), else
     starts from fresh parameters;
  4. trains to `train_config.steps` with `Batcher.batch_at(step)`, so the
     batches and dropout keys depend on the step alone and a resumed run
     continues exactly where an uninterrupted one would;
  5. logs to a progress bar and WORKDIR/metrics.jsonl, evaluates the validation
     loss, saves checkpoints, and ends with greedy-decoding BLEU (sacreBLEU,
     signature printed), exact-match accuracy and sample translations.

A model.kind='cmlm' run (train.py --objective cmlm) trains the non-autoregressive
`nat.CMLMTransformer` on the conditional masked LM objective
(`train_step.cmlm_objective`): its loss, ppl and accuracy are over the masked
target positions, beside length_loss and length_accuracy of the length
classifier, and its BLEU comes from mask-predict decoding (10 iterations, the 3
most probable lengths) instead of greedy decoding.

Failures, and what they leave on disk:
  * SIGTERM or SIGINT during training: the step in progress finishes, its
    checkpoint is saved, and `interruption.Interrupted` is raised (train.py
    exits with 128 + the signal number). A second SIGINT stops at once.
  * A step whose loss or gradient is not finite applies no update (see
    `train_step.train_step`); the run raises `NonFiniteError` naming the step,
    or skips up to `skip_nonfinite` such steps. Such a step's metrics are read
    before any later checkpoint is saved, so every checkpoint on disk is finite.
  * A checkpoint that cannot be written (full disk, no permission) raises
    `checkpoint.WriteError` as soon as its background write ends; an
    unwritable WORKDIR is refused before the data is loaded.
  * Killed at any moment (kill -9): every checkpoint on disk is complete, and
    running again resumes from the latest one.

Multi-host: run the same command on every host after `jax.distributed.initialize()`
(train.py --distributed). Every process builds each step's global batch from the
same seed and puts only its own rows on its own devices; the step's collectives
span all devices. Process 0 alone prints, shows the progress bar, writes
config.json and metrics.jsonl, and trains the tokenizer (the others wait, then
load its file). Every process takes part in orbax's checkpoint saves, which
write one copy, and restores from them. The validation loss evaluates each
sentence once, on one device; BLEU's greedy decoding is split between the
processes. WORKDIR must be on a filesystem that every host sees.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import datasets
import jax
import numpy as np
import sacrebleu
from jax.experimental import multihost_utils
from tqdm.auto import tqdm

from flax_transformer import checkpoint, nat
from flax_transformer.batching import Batcher, encode_corpus
from flax_transformer.config import ConfigError, DataConfig, ModelConfig, TrainConfig
from flax_transformer.data import DataError, describe, load_parallel
from flax_transformer.interruption import Interrupted, StopSignals
from flax_transformer.metrics_log import MetricsLog
from flax_transformer.model import count_params
from flax_transformer.tokenizer import FILE_NAME as TOKENIZER_FILE
from flax_transformer.tokenizer import SPECIAL_TOKENS, Tokenizer
from flax_transformer.toy_task import number_translation
from flax_transformer.train_step import (DataParallel, TrainState, create_train_state,
                                         length_metrics, make_optimizer, make_parallel_eval,
                                         make_parallel_step, token_metrics)
from flax_transformer.translate import Search, Translator

# Sentences per decoding batch when computing BLEU.
DECODE_BATCH = 128
# Translations printed at the end of a run.
NUM_SAMPLES = 5


def evaluation_search(model_config: ModelConfig) -> Search:
  """How BLEU is decoded during and after training: greedy for an autoregressive model (the
  usual, cheap model-selection signal); for a cmlm one, mask-predict with the CMLM paper's
  10 iterations over the 3 most probable lengths (fewer if there are fewer length classes)."""
  if model_config.kind == 'cmlm':
    classes = nat.num_length_classes(model_config)
    return Search(method='nat', iterations=10, length_beam=min(3, classes))
  return Search(method='greedy')


class NonFiniteError(RuntimeError):
  """Training stopped at a step whose loss or gradient was not finite.

  step: the step (numbered as in metrics.jsonl and the checkpoints: the s-th batch).
  """

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


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
  return load_parallel(data_config.source, data_config.src_lang, data_config.tgt_lang)


def check_settings(model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig,
                   average_last: int = 0, skip_nonfinite: int = 0) -> None:
  """Raises ConfigError for settings that are each valid but cannot make a run together.

  Checked before any data is loaded, rather than found out later (the vocabulary
  when the tokenizer is trained, the averaging after the last step).
  """
  if data_config.vocab_size <= len(SPECIAL_TOKENS):
    raise ConfigError(f'data.vocab_size={data_config.vocab_size} leaves no room for text: the '
                      f'{len(SPECIAL_TOKENS)} special tokens {", ".join(SPECIAL_TOKENS)} take '
                      f'ids 0-{len(SPECIAL_TOKENS) - 1}; ask for more')
  if model_config.max_len < 2:
    raise ConfigError(f'model.max_len={model_config.max_len} cannot hold a token and EOS; '
                      'it must be at least 2')
  if average_last < 0 or average_last > train_config.keep_checkpoints:
    raise ConfigError(f'--average-last={average_last} needs that many checkpoints on disk, but '
                      f'train.keep_checkpoints={train_config.keep_checkpoints} keeps fewer; raise '
                      'it or average fewer')
  if not isinstance(skip_nonfinite, int) or skip_nonfinite < 0:
    raise ConfigError(f'--skip-nonfinite must be a non-negative integer, got {skip_nonfinite!r}')


def train(model_config: ModelConfig, train_config: TrainConfig, data_config: DataConfig,
          workdir: str | Path, *, dataset: datasets.DatasetDict | None = None,
          devices: int | None = None, parallel: str = 'shard_map', resume: bool = True,
          average_last: int = 0, skip_nonfinite: int = 0,
          print_fn: Callable[[str], None] = print) -> TrainResult:
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
    print_fn: where process 0's messages go.

  Raises:
    Interrupted: SIGTERM or SIGINT arrived during training; the step reached
      is saved.
    NonFiniteError: more than `skip_nonfinite` steps had a non-finite loss or
      gradient; the checkpoints on disk are those saved before.
    checkpoint.WriteError: WORKDIR or a checkpoint could not be written.
    ConfigError, DataError, TokenizerError, CheckpointError: bad settings,
      data, or run directory, before training starts.
  """
  check_settings(model_config, train_config, data_config, average_last, skip_nonfinite)
  is_main = jax.process_index() == 0
  say = print_fn if is_main else (lambda message: None)
  workdir = Path(workdir)
  checkpoint.ensure_writable(workdir)
  if devices is not None and jax.process_count() > 1:
    raise ConfigError('--devices selects local devices of a single process; with several '
                      'processes every device takes part')
  device_list = None if devices is None else _local_devices(devices)
  data_parallel = DataParallel(device_list, mode=parallel)

  dataset = load_data(data_config) if dataset is None else dataset
  if 'train' not in dataset:
    raise DataError(f'the data has no train split (splits: {", ".join(dataset)})')
  say(f'data: {describe(dataset)}')

  if not resume and is_main:
    _clear_run(workdir)
  multihost_utils.sync_global_devices('run directory ready')
  checkpoints = checkpoint.Checkpoints(workdir, keep=train_config.keep_checkpoints)
  start = checkpoints.latest_step()
  if start is not None and not (workdir / TOKENIZER_FILE).is_file():
    raise checkpoint.CheckpointError(f'{workdir} has checkpoints but no {TOKENIZER_FILE}; the '
                                     'token ids in them mean nothing without it')
  if start is not None:
    checkpoint.check_tokenizer(workdir)
  tokenizer = _tokenizer(workdir, dataset['train'], data_config, say, is_main)
  model_config = model_config.replace(vocab_size=tokenizer.vocab_size)
  tokenizer.check_compatible(model_config)
  if (workdir / checkpoint.CONFIG_FILE).is_file():
    # Also before the first checkpoint: the saved tokenizer belongs to the saved settings.
    checkpoint.check_resumable(workdir, model_config, train_config, data_config)
  if is_main:
    checkpoint.write_config(workdir, model_config, train_config, data_config)

  corpus = encode_corpus(dataset['train'], tokenizer, model_config.max_len)
  batcher = Batcher(corpus, train_config.max_tokens, train_config.seed,
                    row_multiple=data_parallel.num_devices)
  say(f'train: {batcher.describe()}; {corpus.num_dropped:,} pairs dropped (a side longer than '
      f'model.max_len={model_config.max_len} tokens with EOS)')
  val_batches = _eval_batches(dataset, 'validation', tokenizer, model_config, train_config,
                              data_parallel.num_devices, say)

  model = checkpoint.build_model(model_config)
  optimizer = make_optimizer(train_config, model_config)
  step_fn = make_parallel_step(model, optimizer, train_config, data_parallel)
  eval_fn = make_parallel_eval(model, train_config, data_parallel)
  abstract_state = jax.eval_shape(lambda: create_train_state(model, optimizer, train_config.seed))
  if start is None:
    state = create_train_state(model, optimizer, train_config.seed)
    start = 0
  else:
    state = checkpoints.restore(start, abstract_state)
    say(f'resumed from {checkpoints.directory / str(start)}')
  state = data_parallel.replicate(state)
  processes = f' in {jax.process_count()} processes' if jax.process_count() > 1 else ''
  kind = ' cmlm (non-autoregressive),' if model_config.kind == 'cmlm' else ''
  say(f'model: {count_params(abstract_state.params):,} parameters,{kind} {model_config.dtype} '
      'compute; '
      f'{data_parallel.num_devices} device(s){processes} via {parallel}; steps {start} -> '
      f'{train_config.steps}')

  log = MetricsLog(workdir / checkpoint.METRICS_FILE, resume_step=start,
                   tensorboard_dir=workdir / 'tensorboard') if is_main else None
  scores: dict[str, float] = {}

  def record(step: int, values: dict[str, float]):
    scores.update(values)
    if log is not None:
      log.write(step, values)

  def validate(step: int):
    if val_batches:
      values = _evaluate(eval_fn, state.params, val_batches, data_parallel)
      record(step, {f'val_{name}': value for name, value in values.items()})
      length = (f', length accuracy {values["length_accuracy"]:.1%}'
                if 'length_accuracy' in values else '')
      say(f'step {step}: validation loss {values["loss"]:.3f}, ppl {values["ppl"]:.2f}, '
          f'token accuracy {values["accuracy"]:.1%}{length}')

  # Step metrics stay on the device until a log line or a save needs them (`pending`),
  # then wait on the host for the interval's log line (`fetched`).
  pending, fetched, skipped = [], [], []
  interval_start = run_start = time.perf_counter()
  done = start
  bar = tqdm(range(start, train_config.steps), initial=start, total=train_config.steps,
             desc='train', unit='step', disable=not is_main, dynamic_ncols=True)
  try:
    with StopSignals() as stop:
      for step in bar:
        state, metrics = step_fn(state, data_parallel.shard_batch(batcher.batch_at(step)))
        pending.append(metrics)
        done = step + 1
        checkpoints.check_saved()
        stopping = stop.requested(done)
        final = done == train_config.steps
        save_now = stopping or final or done % train_config.checkpoint_every == 0
        log_now = stopping or final or done % train_config.log_every == 0
        new = []
        if save_now or log_now:
          new, pending = data_parallel.unreplicate(pending), []
          fetched += new
        if log_now:
          values = _summarize(fetched, time.perf_counter() - interval_start)
          values['elapsed_s'] = time.perf_counter() - run_start
          record(done, values)
          if 'loss' in values:
            bar.set_postfix(loss=f'{values["loss"]:.3f}', tok_s=f'{values["tokens_per_s"]:,.0f}')
          fetched, interval_start = [], time.perf_counter()
        # Before the save: a state after too many non-finite steps is not saved.
        _check_finite(new, done - len(new) + 1, skipped, skip_nonfinite, checkpoints, say)
        if not stopping and (done % train_config.eval_every == 0 or final):
          validate(done)
        if save_now:
          checkpoints.save(data_parallel.unreplicate(state))
        if stopping:
          break
        if (train_config.bleu_every and done % train_config.bleu_every == 0
            and 'validation' in dataset):
          params = data_parallel.unreplicate(state.params)
          values = _translation_scores(model_config, params, tokenizer,
                                        dataset['validation'])[0]
          record(done, {f'val_{name}': value for name, value in values.items()})
          say(f'step {done}: validation BLEU {values["bleu"]:.2f}')
      bar.close()
      # Still under StopSignals: a signal now waits for the last save to be committed.
      checkpoints.close()
  except Exception:
    bar.close()
    # Let the saves already under way finish: the error raised is the one to report.
    with contextlib.suppress(checkpoint.WriteError):
      checkpoints.close()
    if log is not None:
      log.close()
    raise
  if stop.signal_number is not None:
    # Stopped at step `done`, saved. A signal after the last step, while its checkpoint was
    # written, also ends here: the evaluation is left to the next run ("already trained").
    if log is not None:
      log.close()
    raise Interrupted(stop.signal_number, done, checkpoints.directory / str(done))
  if start >= train_config.steps:
    say(f'{workdir} is already trained to step {start} (train.steps={train_config.steps}); '
        'evaluating it')
    validate(start)

  final_state = data_parallel.unreplicate(state)
  split = 'test' if 'test' in dataset else 'validation' if 'validation' in dataset else None
  if split is not None:
    values, lines = _translation_scores(model_config, final_state.params, tokenizer,
                                          dataset[split])
    record(int(final_state.step), values)
    say(f'{split}, {evaluation_search(model_config).describe()} of '
        f'{len(dataset[split]):,} sentences: BLEU '
        f'{values["bleu"]:.2f}, chrF {values["chrf"]:.2f}, exact match '
        f'{values["exact_match"]:.1%}\n  ({lines["signature"]})')
    say(lines['samples'])
    if average_last:
      averaged = checkpoint.average_checkpoints(workdir, average_last)
      _, avg_params, _ = checkpoint.load_for_inference(averaged)
      values, _ = _translation_scores(model_config, avg_params, tokenizer, dataset[split])
      record(int(final_state.step), {f'avg_{name}': value for name, value in values.items()})
      say(f'{averaged}: mean of the last {average_last} checkpoints, {split} BLEU '
          f'{values["bleu"]:.2f}, chrF {values["chrf"]:.2f}, exact match '
          f'{values["exact_match"]:.1%}')
  elif average_last:
    say(f'wrote {checkpoint.average_checkpoints(workdir, average_last)}')
  if log is not None:
    log.close()
  return TrainResult(workdir=workdir, model_config=model_config, tokenizer=tokenizer,
                     state=final_state, scores=scores)


# --- pieces of the run ------------------------------------------------------------

def _local_devices(count: int) -> list[jax.Device]:
  available = jax.local_devices()
  if not 1 <= count <= len(available):
    raise ConfigError(f'--devices={count}: this process has {len(available)} device(s) '
                      f'({available[0].platform}); on CPU, simulate more with '
                      f'XLA_FLAGS=--xla_force_host_platform_device_count={count}')
  return available[:count]


def _clear_run(workdir: Path) -> None:
  """Deletes what a previous run wrote to `workdir`, and nothing else."""
  for name in (checkpoint.CONFIG_FILE, TOKENIZER_FILE, checkpoint.METRICS_FILE):
    (workdir / name).unlink(missing_ok=True)
  for directory in [workdir / checkpoint.CHECKPOINT_DIR, workdir / 'tensorboard',
                    *workdir.glob('average-last*')]:
    if directory.is_dir():
      shutil.rmtree(directory)


def _tokenizer(workdir: Path, train_split: datasets.Dataset, data_config: DataConfig,
               say: Callable[[str], None], is_main: bool) -> Tokenizer:
  """WORKDIR/tokenizer.json, trained on the training split (source + target) if absent.

  Process 0 alone looks for the file and trains when it is missing; every process
  then loads process 0's file. One vocabulary for all ('unigram' training is not
  bit-exact across runs), and no process can see the file half-written and skip
  the barrier that the others wait at.
  """
  trained = is_main and not (workdir / TOKENIZER_FILE).is_file()
  if trained:
    texts = list(train_split['source']) + list(train_split['target'])
    tokenizer = Tokenizer.train(texts, data_config.vocab_size, data_config.tokenizer)
    tokenizer.save(workdir)
    say(f'tokenizer: trained {data_config.tokenizer} on {len(texts):,} sentences, '
        f'{tokenizer.vocab_size:,} tokens (asked for {data_config.vocab_size:,}), saved to '
        f'{workdir / TOKENIZER_FILE}')
  multihost_utils.sync_global_devices('tokenizer ready')
  tokenizer = Tokenizer.load(workdir)
  if not trained:
    say(f'tokenizer: {workdir / TOKENIZER_FILE} ({tokenizer.vocab_size:,} tokens)')
  return tokenizer


def _eval_batches(dataset, split: str, tokenizer: Tokenizer, model_config: ModelConfig,
                  train_config: TrainConfig, num_devices: int, say) -> list:
  """The split's batches in a fixed order (no shuffling), or [] when it is absent."""
  if split not in dataset:
    say(f'no {split} split: validation loss is not computed')
    return []
  corpus = encode_corpus(dataset[split], tokenizer, model_config.max_len)
  if corpus.num_dropped:
    say(f'{split}: {corpus.num_dropped:,} pairs longer than model.max_len left out of the loss')
  batcher = Batcher(corpus, train_config.max_tokens, train_config.seed, row_multiple=num_devices,
                    shuffle=False)
  return list(batcher.epoch(0))


def _evaluate(eval_fn, params, batches: Sequence, data_parallel: DataParallel) -> dict[str, float]:
  outputs = [eval_fn(params, data_parallel.shard_batch(batch)) for batch in batches]
  sums = jax.tree.map(lambda *xs: float(np.sum(xs)), *data_parallel.unreplicate(outputs))
  return _metrics(sums)


def _metrics(sums: dict[str, float]) -> dict[str, float]:
  """Loss, ppl, accuracy per token (masked token for cmlm), plus a cmlm model's length metrics."""
  return {**token_metrics(sums), **(length_metrics(sums) if 'sentences' in sums else {})}


def _summarize(metrics: list[dict], seconds: float) -> dict[str, float]:
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
    values = {**_metrics(sums), 'learning_rate': float(good[-1]['learning_rate']),
              'grad_norm': float(np.mean([m['grad_norm'] for m in good]))}
  tokens = 'target_tokens' if 'target_tokens' in metrics[0] else 'tokens'
  values['tokens_per_s'] = float(np.sum([m[tokens] for m in metrics])) / seconds
  if len(good) < len(metrics):
    values['nonfinite_steps'] = len(metrics) - len(good)
  return values


def _check_finite(metrics: list[dict], first_step: int, skipped: list[int], limit: int,
                  checkpoints: checkpoint.Checkpoints, say: Callable[[str], None]) -> None:
  """Notes the steps among `metrics` (steps first_step, first_step + 1, ...) that were skipped.

  Raises NonFiniteError once `skipped` holds more than `limit` steps, after the
  saves under way have finished, naming the last checkpoint.
  """
  for step, values in enumerate(metrics, start=first_step):
    if not values['nonfinite']:
      continue
    skipped.append(step)
    what = (f'step {step}: the loss or the gradient is not finite (loss sum '
            f'{float(values["loss_sum"])}, gradient norm {float(values["grad_norm"])}); its '
            'update was not applied')
    if len(skipped) <= limit:
      say(f'{what}, skipped ({len(skipped)} of at most {limit}, --skip-nonfinite)')
      continue
    checkpoints.close()
    latest = checkpoints.latest_step()
    kept = (f'the last checkpoint, {checkpoints.directory / str(latest)}, holds the last good '
            'parameters' if latest is not None else 'no checkpoint was saved before it')
    count = (f'; {len(skipped)} such steps ({", ".join(map(str, skipped))}), more than '
             f'--skip-nonfinite={limit} allows' if limit else '')
    raise NonFiniteError(
        f'{what}{count}. Training stopped; {kept}. Usual causes: a learning rate too high for '
        'the model (--train.lr_scale, --train.warmup_steps), bfloat16 overflow, corrupt data. '
        'To skip such steps and go on, pass --skip-nonfinite N.', step)


def _translation_scores(model_config: ModelConfig, params, tokenizer: Tokenizer,
                        split: datasets.Dataset) -> tuple[dict[str, float], dict[str, str]]:
  """Decodes a split with the model's `evaluation_search`:
  ({'bleu', 'chrf', 'exact_match'}, {'signature', 'samples'}).

  The processes share the decoding (`translate_across_processes`) and every one
  scores the whole split. chrF is reported beside BLEU because BLEU's 4-grams
  say little about one-word outputs such as the toy task's German numbers.
  """
  sources, references = list(split['source']), list(split['target'])
  hypotheses = translate_across_processes(Translator(model_config, params, tokenizer), sources,
                                          search=evaluation_search(model_config))
  bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
  bleu_score = bleu.corpus_score(hypotheses, [references])
  chrf_score = chrf.corpus_score(hypotheses, [references])
  exact = float(np.mean([h == r for h, r in zip(hypotheses, references)]))
  samples = '\n'.join(f'  source:    {s}\n  reference: {r}\n  output:    {h}'
                      for s, r, h in list(zip(sources, references, hypotheses))[:NUM_SAMPLES])
  signature = f'BLEU {bleu.get_signature()}, chrF {chrf.get_signature()}'
  return ({'bleu': bleu_score.score, 'chrf': chrf_score.score, 'exact_match': exact},
          {'signature': signature, 'samples': samples})


def translate_across_processes(translator: Translator, sentences: Sequence[str],
                               batch_size: int = DECODE_BATCH,
                               search: Search = Search(method='greedy')) -> list[str]:
  """Translations of `sentences` (greedy by default) in their order, on every process.

  Process p of P decodes sentences p, p + P, p + 2P, ...: each sentence once,
  and shares of alike length mix even when the corpus is sorted by length. Call
  it on every process (it gathers across them); with one process it is
  `translator.translate(sentences, method='greedy')` (or `search`'s settings).
  """
  index, count = jax.process_index(), jax.process_count()
  share = translator.translate(list(sentences[index::count]), **dataclasses.asdict(search),
                               batch_size=batch_size)
  translations = [''] * len(sentences)
  for process, texts in enumerate(_allgather_texts(share)):
    translations[process::count] = texts
  return translations


def _allgather_texts(texts: list[str]) -> list[list[str]]:
  """Each process's list of strings -> every process's list, on every process, in process order.

  Collectives move arrays of one shape everywhere, so the strings travel as
  UTF-8 bytes in a zero-padded uint8 `[P, R, W]` array with their byte lengths
  `[P, R]`, after a first exchange agrees on R (the longest list) and W (the
  longest string, in bytes).
  """
  if jax.process_count() == 1:
    return [list(texts)]
  encoded = [text.encode() for text in texts]
  sizes = multihost_utils.process_allgather(
      np.array([len(encoded), max(map(len, encoded), default=0)], np.int32))     # [P, 2]
  rows, width = max(int(sizes[:, 0].max()), 1), max(int(sizes[:, 1].max()), 1)
  data, lengths = np.zeros((rows, width), np.uint8), np.zeros(rows, np.int32)
  for row, raw in enumerate(encoded):
    data[row, :len(raw)] = np.frombuffer(raw, np.uint8)
    lengths[row] = len(raw)
  data, lengths = multihost_utils.process_allgather((data, lengths))        # [P, R, W], [P, R]
  return [[data[p, r, :lengths[p, r]].tobytes().decode() for r in range(sizes[p, 0])]
          for p in range(len(sizes))]
