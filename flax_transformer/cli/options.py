"""Settings as command-line options: ModelConfig, TrainConfig and DataConfig (train.py), and the
decoding methods' (decode.py, distill.py).

Each config field becomes `--SECTION.NAME VALUE` with the help written beside the field
(`config.setting`) and each preset's value; the values are parsed by the
field's annotation (`config.parse_overrides`). Each decoding method's field becomes
`--NAME` (underscores as dashes: `--beam-size`), read by its annotation and refused outside
its `Bounds` when parsed. Nothing here names a field.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Literal

from flax_transformer.config import (
  RENAMED,
  RUN_PRESETS,
  SECTIONS,
  Bounds,
  DataConfig,
  ModelConfig,
  TrainConfig,
  field_types,
  fields_where,
  help_of,
  lifetime_of,
  parse_overrides,
  run_preset,
)


def add_setting_options(parser: argparse.ArgumentParser) -> None:
  """The shortcuts and one option per config field (less those the tokenizer decides)."""
  shortcuts = parser.add_argument_group('shortcuts')
  shortcuts.add_argument(
    '--data',
    dest='data.source',
    metavar='SOURCE',
    help='= --data.source: a directory of <split>.<lang> files, a '
    'JSON/JSONL/CSV/Parquet file or directory, a Hub name, or "toy"',
  )
  shortcuts.add_argument('--src', dest='data.src_lang', metavar='LANG', help='= --data.src_lang')
  shortcuts.add_argument('--tgt', dest='data.tgt_lang', metavar='LANG', help='= --data.tgt_lang')
  shortcuts.add_argument('--steps', dest='train.steps', metavar='N', help='= --train.steps')
  shortcuts.add_argument(
    '--objective',
    dest='model.kind',
    choices=('autoregressive', 'cmlm'),
    help='= --model.kind: autoregressive (the paper: predict each next '
    'token) or cmlm (non-autoregressive: mask a random number of '
    'target tokens, predict them all at once from the rest, plus '
    '--train.length_loss_weight times a target-length loss; BLEU '
    'decodes with mask-predict, as decode.py --method mask_predict)',
  )
  shortcuts.add_argument(
    '--bf16',
    dest='model.dtype',
    action='store_const',
    const='bfloat16',
    help='= --model.dtype=bfloat16',
  )
  shortcuts.add_argument(
    '--init-from',
    type=Path,
    metavar='DIR',
    help='fine-tune a Hugging Face Marian model (config.json, '
    'model.safetensors, source.spm, target.spm, vocab.json): its '
    'architecture, tokenizer and parameters; --model options may only '
    'change ' + ', '.join(fields_where(ModelConfig, lambda lifetime: lifetime.fine_tunable)),
  )
  presets = {name: run_preset(name) for name in RUN_PRESETS}
  for index, (section, cls) in enumerate(SECTIONS.items()):
    group = parser.add_argument_group(
      f'{section} settings (value per preset: ' + ' | '.join(RUN_PRESETS) + ')'
    )
    for option in setting_options(section, cls):
      name = option.split('.', 1)[1]
      values = ' | '.join(str(getattr(presets[p][index], name)) for p in RUN_PRESETS)
      group.add_argument(
        f'--{option}',
        dest=option,
        metavar='VALUE',
        help=f'{help_of(cls, name)}{_resume_note(cls, name)} [{values}]',
      )
  for old in RENAMED:  # accepted only to be refused by parse_overrides, naming the new option
    if old.split('.', 1)[0] in SECTIONS:
      parser.add_argument(f'--{old}', dest=old, help=argparse.SUPPRESS)


def _resume_note(cls, name: str) -> str:
  """What --help adds to a setting a resumed run may change (its `Lifetime` says which)."""
  return '. A resumed run may change it' if lifetime_of(cls, name).resumable else ''


def setting_options(section: str, cls) -> list[str]:
  """'SECTION.NAME' of each field that is a command-line option."""
  return [f'{section}.{name}' for name in fields_where(cls, lambda lifetime: lifetime.option)]


def configs_from_args(
  args: argparse.Namespace, saved: tuple[ModelConfig, TrainConfig, DataConfig] | None = None
) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The preset's configs, or a resumed run's `saved` ones (its config.json), with every
  override given on the command line applied (raises ConfigError): a setting not given keeps
  the run's value, so a preset's changed default never strands a run."""
  configs = list(saved if saved is not None else run_preset(args.preset or 'toy'))
  for index, section in enumerate(SECTIONS):
    assignments = {
      name.split('.', 1)[1]: value
      for name, value in vars(args).items()
      if name.startswith(f'{section}.') and value is not None
    }
    configs[index] = parse_overrides(configs[index], section, assignments)
    if section == 'model' and getattr(args, 'init_from', None) is not None:
      from flax_transformer.pretrained.marian import fine_tuning_config

      configs[index] = fine_tuning_config(args.init_from, assignments)
  model_config, train_config, data_config = configs
  source = Path(data_config.source).expanduser()
  if data_config.source != 'toy' and source.exists():
    # An absolute path, so a resumed run recognises its data from any directory.
    data_config = data_config.replace(source=str(source.resolve()))
  return model_config, train_config, data_config


def run_configs(args: argparse.Namespace, workdir: Path):
  """train.py's settings for WORKDIR: a run to resume (a config.json and checkpoints, unless
  --no-resume) starts from its own config.json, with only the options given changed (and so
  compared with it); else the preset's (`configs_from_args`). Raises ConfigError."""
  from flax_transformer.run.config_file import read_config
  from flax_transformer.run.directory import saved_steps

  resuming = args.resume and (workdir / 'config.json').is_file() and bool(saved_steps(workdir))
  saved = read_config(workdir) if resuming else None
  if saved is not None and args.preset is not None:
    print(f'{workdir}: resuming with its config.json; --preset {args.preset} is not applied')
  return configs_from_args(args, saved)


def add_method_options(
  parser: argparse.ArgumentParser, methods=None, title: str = 'decoding method'
) -> None:
  """One option per setting of the decoding `methods` (default: all, chosen by --method), named
  and documented as the method class's field (`--beam-size`: `BeamSearch.beam_size`), its
  range refused when parsed; a setting not given is None, the method's own default. The old
  names in config.RENAMED are accepted only to be refused by `method_settings`, naming the new."""
  from flax_transformer.decode.methods import METHODS, renamed_methods

  choose = methods is None
  methods = list(METHODS.values()) if choose else list(methods)
  group = parser.add_argument_group(
    title,
    (
      'beam, greedy and sample decode an autoregressive checkpoint, mask_predict a cmlm one'
      if choose
      else None
    ),
  )
  if choose:
    group.add_argument(
      '--method',
      choices=[*METHODS, *renamed_methods()],
      metavar='{' + ','.join(METHODS) + '}',
      help='default: beam for an autoregressive checkpoint, mask_predict for a cmlm one (it '
      'predicts the output length, fills all positions at once, then re-predicts the '
      'least confident ones)',
    )
  for name, (field, owners) in _method_fields(methods).items():
    kind, choices = _option_type(field_types(owners[0])[name])
    default = '' if field.default is None else f' (default {field.default})'
    group.add_argument(
      f'--{name.replace("_", "-")}',
      dest=name,
      choices=choices,
      metavar=None if choices else {int: 'N', float: 'X'}.get(kind),
      type=_bounded(kind, field.metadata.get('bounds')) if choices is None else kind,
      help=(f'{", ".join(owner.name for owner in owners)}: ' if choose else '')
      + field.metadata['help']
      + default,
    )
  for old in RENAMED:
    section, old_name = old.split('.', 1)
    if any(section == method.name for method in methods):
      group.add_argument(f'--{old_name.replace("_", "-")}', dest=old, help=argparse.SUPPRESS)


def method_settings(
  parser: argparse.ArgumentParser, args: argparse.Namespace, methods=None
) -> dict[str, object]:
  """The method settings given on the command line, by field name (parser.error for an old
  option)."""
  from flax_transformer.decode.methods import METHODS

  for old, new in RENAMED.items():
    if getattr(args, old, None) is not None:
      parser.error(
        f'--{old.split(".", 1)[1].replace("_", "-")} is now called '
        f'--{new.split(".", 1)[1].replace("_", "-")}'
      )
  names = _method_fields(METHODS.values() if methods is None else methods)
  settings = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
  if settings.get('length') == 'fixed' and 'length_beam' not in settings:
    settings['length_beam'] = 1  # a fixed length is one candidate per sentence
  return settings


def _method_fields(methods) -> dict[str, tuple[dataclasses.Field, list]]:
  """Each setting's name -> (its field in the first method that has it, the methods that do)."""
  found = {}
  for method in methods:
    for field in dataclasses.fields(method):
      found.setdefault(field.name, (field, []))[1].append(method)
  return found


def _option_type(annotation) -> tuple[type, tuple | None]:
  """(the type an option's text is read as, its choices) for a field's annotation."""
  args = [a for a in typing.get_args(annotation) if a is not type(None)]
  if typing.get_origin(annotation) is Literal:
    return str, tuple(args)
  if type(None) in typing.get_args(annotation):
    return _option_type(args[0])
  return annotation, None


def _bounded(kind: type, bounds: Bounds | None):
  """An argparse type: `kind(text)`, refused unless `bounds` admits it."""
  if bounds is None:
    return kind

  def parse(text: str):
    value = kind(text)  # a ValueError: argparse's "invalid int value: 'x'"
    if not bounds.admits(value):
      raise argparse.ArgumentTypeError(f'must be {_limits(bounds)}, got {value}')
    return value

  parse.__name__ = kind.__name__
  return parse


def _limits(bounds: Bounds) -> str:
  """'>= 1', '> 0', 'in (0, 1]': a range as an option's error states it."""
  if bounds.low is None and bounds.high is None:
    return bounds.describe()
  return bounds.limits('g')


def positive_int(text: str) -> int:
  return _int_at_least(text, 1, 'a positive integer')


def nonnegative_int(text: str) -> int:
  return _int_at_least(text, 0, 'a non-negative integer')


def _int_at_least(text: str, low: int, kind: str) -> int:
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f'expected {kind}, got {text!r}') from None
  if value < low:
    raise argparse.ArgumentTypeError(f'expected {kind}, got {text!r}')
  return value


def add_unverified_option(parser: argparse.ArgumentParser) -> None:
  parser.add_argument(
    '--allow-unverified',
    action='store_true',
    help='load a checkpoint that has no recorded SHA-256s (sha256sums.json, '
    'e.g. one from an older version), saying it was not verified '
    '(default: it counts as damaged: decode.py, distill.py and export.py '
    'refuse it; train.py sets it aside and resumes from the newest '
    'verified one)',
  )


def unverified_reporter(args: argparse.Namespace, script: str):
  """With --allow-unverified: a function printing 'SCRIPT: warning: LINE' (standard error) for
  each checkpoint loaded unverified; else None (such checkpoints are refused)."""
  if not args.allow_unverified:
    return None
  return lambda line: print(f'{script}: warning: {line}', file=sys.stderr, flush=True)
