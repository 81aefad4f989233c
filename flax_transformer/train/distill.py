"""Sequence-level knowledge distillation: a training set whose targets are a teacher's translations.

Non-autoregressive students learn much better from an autoregressive teacher's
beam-search outputs than from the human references (Kim & Rush, 2016; Gu et
al., 2018; the CMLM paper, Ghazvininejad et al., 2019): one consistent
translation per source is easier to predict position by position than the
many ways people translate. The recipe:

    python train.py --preset multi30k --data ../shared/data/multi30k --workdir runs/m30k
    python distill.py --checkpoint runs/m30k/average-last5 \\
        --data ../shared/data/multi30k --output data/m30k-distilled
    python train.py --preset multi30k --objective cmlm --data data/m30k-distilled ...  # as printed

`distill` translates the source side of the training split with the checkpoint's
beam search and writes OUTPUT as a directory of plain-text `<split>.<lang>` files
that `data.load_parallel` reads: train.<src> holds the training sources (as
loading cleaned them: stripped, pairs with an empty side dropped) and
train.<tgt> their translations, line by line. The validation and test splits
keep their human references, so model selection and test scores measure the
real task: from a directory of text files they are copied byte for byte, from
other sources (a table, the Hub, the toy task) written one sentence per line.
The languages are the checkpoint's (config.json's data.src_lang, data.tgt_lang).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from flax_transformer.config import RUN_PRESETS, run_preset
from flax_transformer.decode.methods import BeamSearch, DecodingMethod
from flax_transformer.decode.translator import Translator
from flax_transformer.errors import DataError, DistillError
from flax_transformer.run.config_file import read_config
from flax_transformer.run.directory import averaged_run
from flax_transformer.run.outputs import Protected, check_output
from flax_transformer.train.setup import load_data

# config.json fields a student's train.py command does not repeat: the tokenizer decides the
# vocabulary and special ids, --objective the kind, --data/--src/--tgt the data.
_NOT_REPEATED = {
  'model': {'vocab_size', 'pad_id', 'bos_id', 'eos_id', 'unk_id', 'kind'},
  'train': set(),
  'data': {'source', 'src_lang', 'tgt_lang'},
}


# The file that marks OUTPUT as distill.py's, so that --overwrite replaces nothing else (no
# suffix: loading the directory's <split>.<lang> files never reads it).
MARKER = '.written-by-distill'


@dataclasses.dataclass(frozen=True)
class DistillResult:
  """What `distill` wrote.

  output: the directory of `<split>.<lang>` files.
  sentences: training sources translated.
  empty: translations that came out empty (their pairs are dropped when loaded).
  truncated: sources longer than the teacher's max_len, translated from their first
    max_len - 1 subwords.
  command: a train.py command that trains a cmlm student on `output` with the
    teacher's settings.
  """

  output: Path
  sentences: int
  empty: int
  truncated: int
  command: str


def distill(
  checkpoint_dir: str | Path,
  output: str | Path,
  *,
  data: str | None = None,
  method: DecodingMethod = BeamSearch(),
  batch_size: int = 64,
  overwrite: bool = False,
  progress: bool = True,
  on_unverified: Callable[[str], object] | None = None,
) -> DistillResult:
  """Writes OUTPUT: the training split with the checkpoint's beam translations as targets.

  Args:
    checkpoint_dir: an autoregressive run directory (or its average-lastK).
    output: the directory to write; it must not exist or be empty, unless
      `overwrite`, which replaces an earlier output of distill (marked by MARKER).
    data: the parallel text, as train.py's --data (a directory, a table file,
      a Hub name or 'toy'); None: the checkpoint's own data.source.
    method: how the teacher decodes (default: the paper's beam search).
    batch_size: sentences per decoding batch.
    progress: show a progress bar (standard error) while translating.
    on_unverified: load a teacher checkpoint without recorded SHA-256s, telling this
      function (None: refuse it as damaged; `loading.load_for_inference`).

  Raises:
    DistillError: a cmlm checkpoint, an output that exists and is not empty
      (without `overwrite`; with it: one distill did not write), an output that
      would replace the data, the checkpoint or an averaged checkpoint's run, or
      a teacher whose translations are all empty (nothing is written then). CheckpointError, DataError, ConfigError: as their names say.
  """
  checkpoint_dir, output = Path(checkpoint_dir), Path(output)
  model_config, train_config, data_config = read_config(checkpoint_dir)
  _check_teacher(checkpoint_dir, model_config, method, batch_size)
  if data is not None:
    data_config = data_config.replace(source=data)
  source = Path(data_config.source).expanduser()
  _check_output(checkpoint_dir, output, source, overwrite)

  dataset = load_data(data_config)
  if 'train' not in dataset:
    raise DataError(f'{data_config.source} has no train split (splits: {", ".join(dataset)})')
  sources = list(dataset['train']['source'])
  translations, truncated = _teacher_translations(
    checkpoint_dir, sources, method, batch_size, progress, on_unverified
  )
  _write_output(output, checkpoint_dir, method, source, dataset, sources, translations, data_config)

  command = student_command(output, model_config, train_config, data_config, checkpoint_dir)
  return DistillResult(
    output=output,
    sentences=len(sources),
    empty=sum(not text for text in translations),
    truncated=truncated,
    command=command,
  )


def _check_teacher(
  checkpoint_dir: Path, model_config, method: DecodingMethod, batch_size: int
) -> None:
  """Refuses a teacher that cannot decode as asked: a cmlm model, a bad batch size, a beam
  too large for the memory."""
  if model_config.kind != 'autoregressive':
    raise DistillError(
      f'{checkpoint_dir} holds a {model_config.kind} model '
      f'(model.kind={model_config.kind!r}); the teacher must be autoregressive, '
      'decoded with beam search'
    )
  method.check_model(model_config)
  if not isinstance(batch_size, int) or batch_size < 1:
    raise DistillError(f'--batch-size must be a positive integer, got {batch_size!r}')
  method.check_fits(model_config, batch_size)


def _check_output(checkpoint_dir: Path, output: Path, source: Path, overwrite: bool) -> None:
  """Refuses an output over an input (the checkpoint, an averaged checkpoint's run, the
  data), or, with `overwrite`, a directory distill did not write."""
  teacher_run = averaged_run(checkpoint_dir)  # an average-lastK's own run is an input too
  inputs = [checkpoint_dir] + [
    path for path in (teacher_run, source) if path is not None and path.exists()
  ]
  check_output(
    output,
    [Protected(path, f'{path}, an input of the distillation') for path in inputs],
    '--output',
    DistillError,
    replaceable=None if overwrite else (),
    occupied='exists and is not empty; choose another directory or pass --overwrite to replace it',
  )
  if overwrite and output.is_dir() and any(output.iterdir()) and not (output / MARKER).is_file():
    raise DistillError(
      f'--output {output} was not written by distill.py (it has no {MARKER}): '
      '--overwrite replaces only an earlier output of distill.py; choose '
      'another directory'
    )


def _teacher_translations(
  checkpoint_dir: Path,
  sources: list[str],
  method: DecodingMethod,
  batch_size: int,
  progress: bool,
  on_unverified: Callable[[str], object] | None = None,
) -> tuple[list[str], int]:
  """The teacher's translation of each source, under a progress bar, and how many sources were
  cut to the model's max_len; refuses all-empty translations."""
  translator = Translator.from_checkpoint(checkpoint_dir, on_unverified=on_unverified)
  encoded = translator.encode(sources)
  total = sum(ids is not None for ids in encoded.ids)
  with (
    tqdm(
      total=total,
      unit='sent',
      desc='distill',
      disable=not progress,
      file=sys.stderr,
      dynamic_ncols=True,
    ) as bar,
    warnings.catch_warnings(),
  ):
    # "source length + 50 exceeds max_len: output capped", once per batch of long sources,
    # would bury the bar; the cap is the model's own limit, as in training's BLEU decoding.
    warnings.filterwarnings('ignore', message='source length .* output capped')
    translations = translator.translate_sources(encoded, method, batch_size, on_batch=bar.update)
  if not any(translations):
    raise DistillError(
      f'every translation by {checkpoint_dir} is empty (it ends each sentence at '
      'once), which would leave no training pairs; distil from a trained model'
    )
  return translations, len(encoded.truncated)


def _write_output(
  output: Path,
  checkpoint_dir: Path,
  method: DecodingMethod,
  source: Path,
  dataset,
  sources: list[str],
  translations: list[str],
  data_config,
) -> None:
  """Writes the splits and the MARKER beside OUTPUT and renames them into place: OUTPUT is
  either complete or untouched."""
  partial = output.with_name(f'.{output.name}.partial-{os.getpid()}')
  try:
    partial.mkdir(parents=True)
    _write_splits(partial, source, dataset, sources, translations, data_config)
    (partial / MARKER).write_text(
      json.dumps(
        {
          'written_by': 'flax_transformer distill.py',
          'teacher': str(checkpoint_dir.resolve()),
          'method': method.describe(),
        }
      )
      + '\n'
    )
    if output.exists():
      shutil.rmtree(output)
    partial.rename(output)
  finally:
    if partial.exists():
      shutil.rmtree(partial)


def _write_splits(
  directory: Path,
  source: Path,
  dataset,
  sources: Sequence[str],
  translations: Sequence[str],
  data_config,
) -> None:
  """train.<src> and train.<tgt> (the translations), and the other splits as they were."""
  src, tgt = data_config.src_lang, data_config.tgt_lang
  _write_lines(directory / f'train.{src}', sources)
  _write_lines(directory / f'train.{tgt}', translations)
  if source.is_dir() and (any(source.glob(f'*.{src}')) or any(source.glob(f'*.{tgt}'))):
    # A text directory (as load_parallel decides): every other split's files, byte for
    # byte, under their own names, so loading the output finds the same splits.
    for path in sorted(source.iterdir()):
      if path.is_file() and path.suffix in (f'.{src}', f'.{tgt}') and path.stem != 'train':
        shutil.copyfile(path, directory / path.name)
    return
  for split in ('validation', 'test'):  # file stems that load_parallel discovers as these splits
    if split in dataset:
      _write_lines(directory / f'{split}.{src}', dataset[split]['source'])
      _write_lines(directory / f'{split}.{tgt}', dataset[split]['target'])


def _write_lines(path: Path, lines: Sequence[str]) -> None:
  """One sentence per line; a line break inside a sentence (possible in tables and Hub
  datasets) becomes a space, so that line N stays pair N."""
  text = ''.join(line.replace('\r', ' ').replace('\n', ' ') + '\n' for line in lines)
  path.write_text(text, encoding='utf-8')


def student_command(
  output: Path, model_config, train_config, data_config, checkpoint_dir: Path
) -> str:
  """`python train.py --objective cmlm --data OUTPUT ...` with the teacher's settings: the
  named preset closest to them and an option for each setting that differs from it."""
  teacher = {'model': model_config, 'train': train_config, 'data': data_config}

  def differences(preset: str) -> list[str]:
    configs = dict(zip(('model', 'train', 'data'), run_preset(preset)))
    return [
      f'--{section}.{f.name}={getattr(config, f.name)}'
      for section, config in teacher.items()
      for f in dataclasses.fields(config)
      if f.name not in _NOT_REPEATED[section]
      and getattr(config, f.name) != getattr(configs[section], f.name)
    ]

  preset = min(RUN_PRESETS, key=lambda name: len(differences(name)))
  options = differences(preset)
  if train_config.packing and train_config.eos_fill_rate:
    # The cmlm recipe fills the PAD after each target with EOS, which a packed row's PAD
    # (after the last of several pairs) cannot take: the student trains unpacked.
    options = [o for o in options if not o.startswith('--train.packing=')] + ['--train.packing=0']
  run = checkpoint_dir.resolve()
  if run.name.startswith('average-last'):
    run = run.parent  # the averaged checkpoints' own run
  workdir = run.parent / f'{run.name}-cmlm-distilled'
  words = [
    'python',
    'train.py',
    '--preset',
    preset,
    '--objective',
    'cmlm',
    '--data',
    str(output),
    '--src',
    data_config.src_lang,
    '--tgt',
    data_config.tgt_lang,
    *options,
    '--workdir',
    str(workdir),
  ]
  return shlex.join(words)
