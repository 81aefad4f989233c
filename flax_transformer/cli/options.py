"""The settings of ModelConfig, TrainConfig and DataConfig as command-line options.

Each field becomes `--SECTION.NAME VALUE` with the help written beside the field
(`config.setting`) and each preset's value; the values are parsed by the
field's annotation (`config.parse_overrides`), so nothing here names a field.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from flax_transformer.config import (RENAMED, RUN_PRESETS, SECTIONS, DataConfig, ModelConfig,
                                     TrainConfig, help_of, parse_overrides, run_preset)


def add_setting_options(parser: argparse.ArgumentParser) -> None:
  """The shortcuts and one option per config field (less those the tokenizer decides)."""
  shortcuts = parser.add_argument_group('shortcuts')
  shortcuts.add_argument('--data', dest='data.source', metavar='SOURCE',
                         help='= --data.source: a directory of <split>.<lang> files, a '
                              'JSON/JSONL/CSV/Parquet file or directory, a Hub name, or "toy"')
  shortcuts.add_argument('--src', dest='data.src_lang', metavar='LANG', help='= --data.src_lang')
  shortcuts.add_argument('--tgt', dest='data.tgt_lang', metavar='LANG', help='= --data.tgt_lang')
  shortcuts.add_argument('--steps', dest='train.steps', metavar='N', help='= --train.steps')
  shortcuts.add_argument('--objective', dest='model.kind', choices=('autoregressive', 'cmlm'),
                         help='= --model.kind: autoregressive (the paper: predict each next '
                              'token) or cmlm (non-autoregressive: mask a random number of '
                              'target tokens, predict them all at once from the rest, plus '
                              '--train.length_loss_weight times a target-length loss; BLEU '
                              'decodes with mask-predict, as decode.py --method mask_predict)')
  shortcuts.add_argument('--bf16', dest='model.dtype', action='store_const', const='bfloat16',
                         help='= --model.dtype=bfloat16')
  shortcuts.add_argument('--init-from', type=Path, metavar='DIR',
                         help='fine-tune a Hugging Face Marian model (config.json, '
                              'model.safetensors, source.spm, target.spm, vocab.json): its '
                              'architecture, tokenizer and parameters; --model options may only '
                              'change dropout_rate, attention_dropout_rate and dtype')
  presets = {name: run_preset(name) for name in RUN_PRESETS}
  for index, (section, cls) in enumerate(SECTIONS.items()):
    group = parser.add_argument_group(f'{section} settings (value per preset: '
                                      + ' | '.join(RUN_PRESETS) + ')')
    for option in setting_options(section, cls):
      name = option.split('.', 1)[1]
      values = ' | '.join(str(getattr(presets[p][index], name)) for p in RUN_PRESETS)
      group.add_argument(f'--{option}', dest=option, metavar='VALUE',
                         help=f'{help_of(cls, name)} [{values}]')
  for old in RENAMED:  # accepted only to be refused by parse_overrides, naming the new option
    parser.add_argument(f'--{old}', dest=old, help=argparse.SUPPRESS)


def setting_options(section: str, cls) -> list[str]:
  """'SECTION.NAME' of each field that is a command-line option."""
  hidden = ModelConfig.TOKENIZER_FIELDS if cls is ModelConfig else ()
  return [f'{section}.{field.name}' for field in dataclasses.fields(cls)
          if field.name not in hidden]


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, DataConfig]:
  """The preset's configs with every given override applied (raises ConfigError)."""
  configs = list(run_preset(args.preset))
  for index, section in enumerate(SECTIONS):
    assignments = {name.split('.', 1)[1]: value for name, value in vars(args).items()
                   if name.startswith(f'{section}.') and value is not None}
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


# Options that set a field of the decoding method, named as the field.
METHOD_SETTINGS = ('beam_size', 'alpha', 'temperature', 'top_k', 'top_p', 'seed', 'iterations',
                   'length_beam', 'length', 'length_ratio', 'length_offset', 'max_len')


def add_method_options(parser: argparse.ArgumentParser) -> None:
  """--method and its settings; a setting not given is None (the method's own default)."""
  from flax_transformer.decode.methods import METHODS, RENAMED_METHODS, BeamSearch, MaskPredict
  method = parser.add_argument_group('decoding method', 'beam, greedy and sample decode an '
                                     'autoregressive checkpoint, mask_predict a cmlm one')
  add = method.add_argument
  add('--method', choices=[*METHODS, *RENAMED_METHODS], metavar='{' + ','.join(METHODS) + '}',
      help='default: beam for an autoregressive checkpoint, mask_predict for a cmlm one (it '
           'predicts the output length, fills all positions at once, then re-predicts the '
           'least confident ones)')
  add('--beam-size', type=int, help=f'beam: beams (default {BeamSearch.beam_size})')
  add('--alpha', type=float,
      help=f'beam: length penalty ((5 + |Y|) / 6)^alpha (default {BeamSearch.alpha})')
  add('--temperature', type=float, help='sample: temperature (default 1)')
  add('--top-k', type=int, help='sample: keep the k best (default 0: all)')
  add('--top-p', type=float, help='sample: nucleus mass (default 1: all)')
  add('--seed', type=int, help='sample: random seed (default 0)')
  add('--iterations', type=int, help='mask_predict: decoding passes; each after the first '
      f're-masks the least confident tokens (default {MaskPredict.iterations})')
  add('--length-beam', type=int, help='mask_predict: output lengths decoded per sentence, the '
      f'best kept (default {MaskPredict.length_beam}; 1 with --length fixed)')
  add('--length', choices=('predict', 'fixed'), help='mask_predict: predict the length '
      "(default), or decode source length + the model's max_length_offset, cut at the first EOS")
  add('--length-ratio', type=float, metavar='X', help='mask_predict: multiply each length '
      '(predicted, or with --length fixed the canvas) by X > 0 and round (default 1)')
  add('--length-offset', type=int, metavar='N', help='mask_predict: add N tokens (may be '
      "negative) to each length after --length-ratio; lengths stay in [1, the model's max_len] "
      '(default 0)')
  add('--max-len', type=int, help='beam, greedy, sample: output tokens per sentence (default: '
      "source length + 50, at most the model's max_len)")
  add('--nat-length', help=argparse.SUPPRESS)


def method_settings(args: argparse.Namespace) -> dict[str, object]:
  """The method settings given on the command line, by field name."""
  settings = {name: getattr(args, name) for name in METHOD_SETTINGS
              if getattr(args, name) is not None}
  if args.length == 'fixed' and args.length_beam is None:
    settings['length_beam'] = 1  # a fixed length is one candidate per sentence
  return settings


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
