"""A run's translation scores: the test split's (else validation's) at the end, and the
validation split's during training (`train.bleu_every`).

`final_scores` decodes the final parameters, their moving average (train.ema_decay), and
the mean of the last checkpoints when asked (--average-last), with `evaluation_method`: greedy for the paper's model,
mask-predict for a cmlm one; BLEU and chrF (sacreBLEU, signatures printed), exact match
and sample translations (`evaluation.translation_scores`).
"""

from __future__ import annotations

from flax_transformer.config import ModelConfig
from flax_transformer.data import preprocessing
from flax_transformer.decode.methods import Greedy, default_method
from flax_transformer.decode.translator import Translator
from flax_transformer.run.directory import EMA_DIR
from flax_transformer.run.loading import average_checkpoints, load_for_inference
from flax_transformer.train.evaluation import describe_scores, translation_scores
from flax_transformer.train.metrics import ScoreRecord
from flax_transformer.train.optimizer import ema_params
from flax_transformer.train.setup import TrainingRun, Writers
from flax_transformer.train.step import TrainState


def evaluation_method(model_config: ModelConfig):
  """How BLEU is decoded during and after training: greedy for an autoregressive model (the
  usual, cheap model-selection signal), the model's default (mask-predict) for a cmlm one."""
  return default_method(model_config, autoregressive=Greedy())


def final_scores(
  run: TrainingRun, writers: Writers, record: ScoreRecord, state: TrainState, average_last: int
) -> None:
  """Test (else validation) scores of the final parameters, their moving average and the
  averaged checkpoints, kept and logged in `record`."""
  say, workdir, progress = writers.say, writers.directory.path, writers.directory.is_main
  split = next((name for name in ('test', 'validation') if name in run.dataset), None)
  if split is None:
    if average_last:
      say(f'wrote {average_checkpoints(workdir, average_last)}')
    return
  step = int(state.step)
  values, report = split_scores(run, state.params, split, progress)
  record.record(step, values)
  say(
    f'{split}, {evaluation_method(run.model_config).describe()} of '
    f'{len(run.dataset[split]):,} sentences: {describe_scores(values, report)}\n'
    f'  ({report["signature"]})'
  )
  say(report['samples'])
  average = ema_params(state.opt_state)
  if average is not None:
    values, report = split_scores(run, average, split, progress)
    record.record(step, {f'ema_{name}': value for name, value in values.items()})
    say(
      f'{workdir / EMA_DIR}: the moving average of the parameters (decay '
      f'{run.train_config.ema_decay}), {split} {describe_scores(values, report)}'
    )
  if average_last:
    averaged = average_checkpoints(workdir, average_last)
    _, avg_params, _ = load_for_inference(averaged)
    values, report = split_scores(run, avg_params, split, progress)
    record.record(step, {f'avg_{name}': value for name, value in values.items()})
    say(
      f'{averaged}: mean of the last {average_last} checkpoints, {split} '
      f'{describe_scores(values, report)}'
    )


def split_scores(
  run: TrainingRun, params, split: str, progress: bool
) -> tuple[dict[str, float], dict[str, str]]:
  """The translation scores of `params` on `split`; `progress`: show a progress bar."""
  translator = Translator(run.model_config, params, run.tokenizer)
  lang = run.data_config.tgt_lang if preprocessing.moses_available() else None
  return translation_scores(
    translator,
    run.dataset[split],
    evaluation_method(run.model_config),
    progress=f'decode {split}' if progress else None,
    lang=lang,
  )
