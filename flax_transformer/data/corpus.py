"""Parallel text -> `datasets.DatasetDict` with string columns 'source' and 'target'.

One entry point, `load_parallel`, reads three kinds of source:

  * a directory of plain-text pairs `<stem>.<lang>`, one sentence per line, line N
    of `train.en` translating line N of `train.de` (the Multi30k/WMT layout);
  * local JSON / JSONL / CSV / Parquet files, with one column per language
    ('en', 'de') or a 'translation' column of {lang: sentence} dicts;
  * a Hugging Face Hub dataset, 'name' or 'name:config' (e.g. 'wmt14:de-en').

Every split goes through the same cleaning step: both sides are stripped of
surrounding whitespace and pairs with an empty side are dropped. That count is
the only filtering done here (over-long pairs are dropped later, after
tokenisation, by `batching.encode_corpus`); it is recorded in each split's
`info.description`, which `describe` prints.

    ds = load_parallel('../shared/data/multi30k', 'en', 'de')
    print(describe(ds))
    # train: 29,000 pairs (train.en/train.de, 0 dropped with an empty side) | validation: ...
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import datasets

from flax_transformer.errors import DataError

# File extensions `load_parallel` reads as tables, mapped to the `datasets` builder.
TABLE_FORMATS = {'.json': 'json', '.jsonl': 'json', '.csv': 'csv', '.parquet': 'parquet'}
# Stems recognised as the validation split, in order of preference.
VALIDATION_STEMS = ('val', 'valid', 'validation', 'dev')
_TEXT_PAIR = datasets.Features(
  {'source': datasets.Value('string'), 'target': datasets.Value('string')}
)
_HUB_ID = re.compile(r'^[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?$')


def load_parallel(
  source: str,
  src_lang: str,
  tgt_lang: str,
  splits: Mapping[str, str] | None = None,
  *,
  valid_split: str | None = None,
  test_split: str | None = None,
) -> datasets.DatasetDict:
  """Loads a parallel corpus as {split: Dataset with 'source' and 'target' strings}.

  Args:
    source: a directory of `<stem>.<lang>` text files or of `<stem>.json|jsonl|
      csv|parquet` tables, a single table file, or a Hub dataset 'name[:config]'.
      A local path wins over a Hub name of the same spelling.
    src_lang, tgt_lang: language codes, used as file suffixes ('train.en'), column
      names or keys of the 'translation' column.
    splits: our split name -> file stem (or Hub split name), e.g.
      {'train': 'train', 'validation': 'val', 'test': 'test_2016_flickr'}.
      When None, the splits that exist are discovered: 'train'; the first of
      val, valid, validation, dev as 'validation'; 'test', or the only stem that
      starts with 'test', as 'test'. A single table file is one split, named by
      the same rules from its stem, 'train' when none applies.
    valid_split, test_split: the stem (or Hub split) discovery takes as
      'validation' or 'test' instead of the rules above (DataConfig's
      `data.valid_split`, `data.test_split`), e.g. test_split='test_2017_flickr' in a
      directory of several test sets; not with `splits`.

  Returns:
    DatasetDict keyed by our split names. Each split's `info.description` says
    where it came from and how many pairs were dropped for an empty side.

  Raises:
    DataError: missing files, mismatched line counts, invalid UTF-8, unknown
      languages, an unreachable Hub dataset, or a split left with zero pairs.
  """
  if src_lang == tgt_lang:
    raise DataError(
      f'source and target language are both {src_lang!r}; pass two different languages'
    )
  preferred = {
    name: stem
    for name, stem in (('validation', valid_split), ('test', test_split))
    if stem is not None
  }
  if splits is not None and preferred:
    raise DataError(
      f'give either splits={dict(splits)} or valid_split/test_split (got {preferred}), not both'
    )
  path = Path(source).expanduser()
  if path.is_dir():
    if _stems(path, f'.{src_lang}') or _stems(path, f'.{tgt_lang}'):
      return _load_text_dir(path, src_lang, tgt_lang, splits, preferred)
    return _load_table_dir(path, src_lang, tgt_lang, splits, preferred)
  if path.is_file():
    if path.suffix not in TABLE_FORMATS:
      raise DataError(
        f'{path}: cannot read a {path.suffix or "suffix-less"} file on its own; '
        f'point the source at the directory holding <split>.{src_lang} and '
        f'<split>.{tgt_lang}, or use one of {sorted(TABLE_FORMATS)}'
      )
    if splits is not None or preferred:
      raise DataError(
        f'{path} is a single file, so it is one split and splits cannot be '
        f'selected from it (got {dict(splits or preferred)}); point the source '
        'at a directory'
      )
    discovered = _discover({path.stem: path}, path.parent)
    name = next((ours for ours, stem in discovered.items() if stem == path.stem), 'train')
    return _load_tables({name: path}, src_lang, tgt_lang)
  if not _HUB_ID.match(source):
    raise DataError(f'{source}: no such file or directory ({path.resolve()})')
  return _load_hub(source, src_lang, tgt_lang, splits, preferred)


def describe(ds: datasets.DatasetDict) -> str:
  """One line for logs: pairs per split and what was filtered.

  For example 'train: 29,000 pairs (train.en/train.de, 0 dropped with an empty
  side) | validation: 1,014 pairs (...)'.
  """
  parts = []
  for name, split in ds.items():
    note = f' ({split.info.description})' if split.info.description else ''
    parts.append(f'{name}: {len(split):,} pair{"" if len(split) == 1 else "s"}{note}')
  return ' | '.join(parts)


def _stems(directory: Path, suffix: str) -> list[str]:
  return sorted(p.name[: -len(suffix)] for p in directory.glob(f'*{suffix}') if p.is_file())


# The DataConfig setting that picks each discovered split, for messages.
_SPLIT_SETTINGS = {'validation': 'valid_split', 'test': 'test_split'}


def _discover(
  stems: Mapping[str, object], where: Path | str, preferred: Mapping[str, str] | None = None
) -> dict[str, str]:
  """Our split name -> stem for the stems that follow the naming rules, or are `preferred`."""
  preferred = preferred or {}
  found = {}
  if 'train' in stems:
    found['train'] = 'train'
  validation = [stem for stem in VALIDATION_STEMS if stem in stems]
  if validation:
    found['validation'] = validation[0]
  tests = ['test'] if 'test' in stems else sorted(s for s in stems if s.startswith('test'))
  if len(tests) > 1 and 'test' not in preferred:
    raise DataError(
      f'{where}: several test sets {tests}; choose one with data.test_split '
      f'(train.py --data.test_split={tests[0]})'
    )
  if tests:
    found['test'] = tests[0]
  for name, stem in preferred.items():
    if stem not in stems:
      raise DataError(
        f'{where}: data.{_SPLIT_SETTINGS[name]}={stem!r} names no split (found {sorted(stems)})'
      )
    found[name] = stem
  return found


def _select(
  available: Mapping[str, object],
  splits: Mapping[str, str] | None,
  preferred: Mapping[str, str],
  where: Path | str,
  what: str,
) -> dict[str, str]:
  """Our split name -> stem, from `splits` or by discovery (which takes the `preferred` stem
  for 'validation' or 'test'); never empty."""
  if splits is None:
    chosen = _discover(available, where, preferred)
    if not chosen:
      raise DataError(
        f'{where}: found no train/val/valid/validation/dev/test* {what} '
        f'(found {sorted(available) or "nothing"}); name them with `splits`'
      )
    return chosen
  missing = {name: stem for name, stem in splits.items() if stem not in available}
  if missing:
    raise DataError(f'{where}: no {what} for splits {missing} (found {sorted(available)})')
  return dict(splits)


def text_pair_files(
  source: str,
  src_lang: str,
  tgt_lang: str,
  *,
  valid_split: str | None = None,
  test_split: str | None = None,
) -> dict[str, tuple[Path, Path]] | None:
  """{split: (source file, target file)} of a directory of `<stem>.<lang>` text pairs, the
  splits chosen as `load_parallel` chooses them; None when `source` is not such a directory.

  For reading a large split as a stream (`pair_sources.TextPairFiles`) rather than as a table.
  """
  directory = Path(source).expanduser()
  if not directory.is_dir() or not (
    _stems(directory, f'.{src_lang}') or _stems(directory, f'.{tgt_lang}')
  ):
    return None
  preferred = {
    name: stem
    for name, stem in (('validation', valid_split), ('test', test_split))
    if stem is not None
  }
  return _text_dir_files(directory, src_lang, tgt_lang, None, preferred)


def _text_dir_files(
  directory: Path,
  src_lang: str,
  tgt_lang: str,
  splits: Mapping[str, str] | None,
  preferred: Mapping[str, str],
) -> dict[str, tuple[Path, Path]]:
  stems = set(_stems(directory, f'.{src_lang}')) | set(_stems(directory, f'.{tgt_lang}'))
  chosen = _select(
    stems, splits, preferred, directory, f'files <stem>.{src_lang}/<stem>.{tgt_lang}'
  )
  files = {
    name: (directory / f'{stem}.{src_lang}', directory / f'{stem}.{tgt_lang}')
    for name, stem in chosen.items()
  }
  for pair in files.values():
    for path in pair:
      if not path.is_file():
        raise DataError(
          f'{path}: no such file, but split {path.stem!r} needs one file per language'
        )
  return files


def _load_text_dir(
  directory: Path,
  src_lang: str,
  tgt_lang: str,
  splits: Mapping[str, str] | None,
  preferred: Mapping[str, str],
) -> datasets.DatasetDict:
  result = {}
  for name, (src_file, tgt_file) in _text_dir_files(
    directory, src_lang, tgt_lang, splits, preferred
  ).items():
    src_lines, tgt_lines = _read_lines(src_file), _read_lines(tgt_file)
    if len(src_lines) != len(tgt_lines):
      raise DataError(
        f'{src_file} has {len(src_lines):,} lines but {tgt_file} has '
        f'{len(tgt_lines):,}; line N of one must translate line N of the other'
      )
    table = datasets.Dataset.from_dict({'source': src_lines, 'target': tgt_lines})
    result[name] = _clean(table, f'{src_file.name}/{tgt_file.name}', src_file.parent)
  return datasets.DatasetDict(result)


def _read_lines(path: Path) -> list[str]:
  return split_lines(path.read_bytes(), str(path))


def split_lines(data: bytes, where: str) -> list[str]:
  """The lines of UTF-8 text (a file's bytes), without line terminators.

  Splits on '\\n' only (not on the Unicode separators `str.splitlines` also
  honours), so the count agrees with `wc -l` and with the other language's file.
  A '\\r' before the '\\n' stays; text cleaning strips it. Invalid UTF-8 raises
  DataError naming `where` (a file name) and the line.
  """
  try:
    text = data.decode('utf-8')
  except UnicodeDecodeError as error:
    raise invalid_utf8(where, data, error) from None
  lines = text.split('\n')
  if lines[-1] == '':
    lines.pop()  # the newline that ends the last line starts no new line
  return lines


def invalid_utf8(
  where: str, data: bytes, error: UnicodeDecodeError, first_line: int = 0
) -> DataError:
  """The DataError for `error` in decoding `data`, lines `first_line + 1, ...` of file
  `where`: it names the file, the line and the byte within the line."""
  line_start = data.rfind(b'\n', 0, error.start) + 1
  line = first_line + data.count(b'\n', 0, error.start) + 1
  return DataError(
    f'{where}, line {line}: invalid UTF-8 ({error.reason} at byte '
    f'{error.start - line_start} of the line); re-encode the file as UTF-8'
  )


def _load_table_dir(
  directory: Path,
  src_lang: str,
  tgt_lang: str,
  splits: Mapping[str, str] | None,
  preferred: Mapping[str, str],
) -> datasets.DatasetDict:
  files: dict[str, Path] = {}
  for path in sorted(directory.iterdir()):
    if path.is_file() and path.suffix in TABLE_FORMATS:
      if path.stem in files:
        raise DataError(
          f'{directory}: both {files[path.stem].name} and {path.name} hold '
          f'split {path.stem!r}; keep one'
        )
      files[path.stem] = path
  if not files:
    found = sorted(p.name for p in directory.iterdir())[:10]
    raise DataError(
      f'{directory}: found neither <split>.{src_lang}/<split>.{tgt_lang} text '
      f'pairs nor {"/".join(sorted(TABLE_FORMATS))} files (found {found})'
    )
  chosen = _select(files, splits, preferred, directory, f'{"/".join(sorted(TABLE_FORMATS))} files')
  return _load_tables({name: files[stem] for name, stem in chosen.items()}, src_lang, tgt_lang)


def _load_tables(files: Mapping[str, Path], src_lang: str, tgt_lang: str) -> datasets.DatasetDict:
  result = {}
  for name, path in files.items():
    try:
      table = datasets.load_dataset(TABLE_FORMATS[path.suffix], data_files=str(path), split='train')
    except Exception as error:  # the builders raise many types; the file is what matters
      raise DataError(
        f'{path}: cannot read it as {TABLE_FORMATS[path.suffix]}: {_root_cause(error)}'
      ) from error
    pairs = _pair_columns(table, src_lang, tgt_lang, str(path))
    result[name] = _clean(pairs, path.name, path.parent)
  return datasets.DatasetDict(result)


def _load_hub(
  source: str,
  src_lang: str,
  tgt_lang: str,
  splits: Mapping[str, str] | None,
  preferred: Mapping[str, str],
) -> datasets.DatasetDict:
  name, _, config = source.partition(':')
  try:
    hub = datasets.load_dataset(name, config or None)
  except Exception as error:  # network, authentication and missing-config errors alike
    raise DataError(
      f'{source!r} is not a local file or directory ({Path(source).resolve()}), and '
      f'loading it as a Hugging Face Hub dataset (name {name!r}, config '
      f'{config or None!r}) failed: {type(error).__name__}: {error}. Offline? Point the source at a '
      'local directory of <split>.<lang> files, or set HF_DATASETS_OFFLINE=1 to use a '
      'copy already in the Hugging Face cache'
    ) from error
  chosen = _select(hub, splits, preferred, source, 'splits')
  result = {}
  for ours, theirs in chosen.items():
    pairs = _pair_columns(hub[theirs], src_lang, tgt_lang, f'{source} split {theirs!r}')
    result[ours] = _clean(pairs, f'{source} {theirs}', None)
  return datasets.DatasetDict(result)


def _pair_columns(
  table: datasets.Dataset, src_lang: str, tgt_lang: str, where: str
) -> datasets.Dataset:
  """Renames language columns, or unpacks a 'translation' column, to source/target."""
  columns = table.column_names
  if src_lang in columns and tgt_lang in columns:
    return table.select_columns([src_lang, tgt_lang]).rename_columns(
      {src_lang: 'source', tgt_lang: 'target'}
    )
  if 'translation' in columns:
    feature = table.features['translation']
    languages = getattr(feature, 'languages', None) or list(feature)
    missing = [lang for lang in (src_lang, tgt_lang) if lang not in languages]
    if missing:
      raise DataError(
        f'{where}: the translation column has languages {sorted(languages)}, not {missing}'
      )
    return table.map(
      lambda batch: {
        'source': [pair[src_lang] for pair in batch['translation']],
        'target': [pair[tgt_lang] for pair in batch['translation']],
      },
      batched=True,
      remove_columns=columns,
      desc='pair columns',
    )
  raise DataError(
    f'{where}: needs columns {src_lang!r} and {tgt_lang!r} or a '
    f"'translation' column, found {columns}"
  )


def _clean(pairs: datasets.Dataset, origin: str, directory: Path | None) -> datasets.Dataset:
  """Strips both sides and drops pairs with an empty side; a split may not end up empty."""
  total = len(pairs)
  stripped = pairs.map(
    lambda batch: {
      key: ['' if text is None else str(text).strip() for text in batch[key]]
      for key in ('source', 'target')
    },
    batched=True,
    features=_TEXT_PAIR,
    desc=f'strip {origin}',
  )
  kept = stripped.filter(
    lambda batch: [bool(s) and bool(t) for s, t in zip(batch['source'], batch['target'])],
    batched=True,
    desc=f'drop empty {origin}',
  )
  where = f'{directory}/{origin}' if directory else origin
  if not len(kept):
    raise DataError(f'{where}: no sentence pairs ({total:,} read, all with an empty side)')
  kept.info.description = f'{origin}, {total - len(kept):,} dropped with an empty side'
  return kept


def _root_cause(error: BaseException) -> str:
  """The innermost exception's message: the builders wrap the informative one."""
  while error.__cause__ is not None or error.__context__ is not None:
    error = error.__cause__ or error.__context__
  return f'{type(error).__name__}: {error}'
