"""load_parallel on text pairs, tables and the Hub path's error; the filtering it reports."""

import json
from pathlib import Path

import datasets
import pandas as pd
import pytest

from flax_transformer.data.corpus import DataError, describe, load_parallel

EN = ['A dog runs.', '  Two men talk.  ', 'A child plays.', '', 'Birds fly.']
DE = ['Ein Hund läuft.', 'Zwei Männer reden.', '   ', 'Nichts.', 'Vögel fliegen.']


def write_pair(directory: Path, stem: str, en: list[str], de: list[str]) -> None:
  (directory / f'{stem}.en').write_text(''.join(line + '\n' for line in en), encoding='utf-8')
  (directory / f'{stem}.de').write_text(''.join(line + '\n' for line in de), encoding='utf-8')


@pytest.fixture
def text_dir(tmp_path):
  write_pair(tmp_path, 'train', EN, DE)
  write_pair(tmp_path, 'val', ['Hello.'], ['Hallo.'])
  write_pair(tmp_path, 'test_2016_flickr', ['Yes.', 'No.'], ['Ja.', 'Nein.'])
  return tmp_path


def test_text_dir_discovers_splits_strips_and_drops_empty_sides(text_dir):
  ds = load_parallel(str(text_dir), 'en', 'de')
  assert list(ds) == ['train', 'validation', 'test']
  assert ds['train'].column_names == ['source', 'target']
  # Pairs 3 ('A child plays.' / blank) and 4 (empty / 'Nichts.') have an empty side.
  assert ds['train']['source'][:] == ['A dog runs.', 'Two men talk.', 'Birds fly.']
  assert ds['train']['target'][:] == ['Ein Hund läuft.', 'Zwei Männer reden.', 'Vögel fliegen.']
  assert ds['test']['target'][:] == ['Ja.', 'Nein.']
  assert 'train.en/train.de, 2 dropped with an empty side' in ds['train'].info.description
  line = describe(ds)
  assert line.startswith('train: 3 pairs (train.en/train.de, 2 dropped with an empty side)')
  assert 'validation: 1 pair (val.en/val.de, 0 dropped' in line
  assert 'test: 2 pairs (test_2016_flickr.en/test_2016_flickr.de' in line


def test_direction_and_explicit_splits(text_dir):
  ds = load_parallel(str(text_dir), 'de', 'en', splits={'dev': 'val'})
  assert list(ds) == ['dev']
  assert ds['dev'][0] == {'source': 'Hallo.', 'target': 'Hello.'}


def test_line_terminators_other_than_newline_do_not_split(tmp_path):
  # str.splitlines would split at U+2028 and at a lone \r, desynchronising the two files.
  (tmp_path / 'train.en').write_bytes('a\u2028b\r\nc\n'.encode())
  (tmp_path / 'train.de').write_bytes(b'x\r\ny')  # no final newline
  ds = load_parallel(str(tmp_path), 'en', 'de')
  assert ds['train']['source'][:] == ['a\u2028b', 'c']
  assert ds['train']['target'][:] == ['x', 'y']


def test_missing_directory(tmp_path):
  with pytest.raises(DataError, match='nope: no such file or directory'):
    load_parallel(str(tmp_path / 'nope'), 'en', 'de')


def test_missing_counterpart_file_is_named(tmp_path):
  write_pair(tmp_path, 'train', ['a'], ['b'])
  (tmp_path / 'val.en').write_text('a\n')
  with pytest.raises(DataError, match=r"val\.de: no such file, but split 'val'"):
    load_parallel(str(tmp_path), 'en', 'de')


def test_requested_split_that_does_not_exist(text_dir):
  with pytest.raises(DataError, match=r"no files .* for splits \{'test': 'test2017'\}"):
    load_parallel(str(text_dir), 'en', 'de', splits={'test': 'test2017'})


def test_line_count_mismatch_names_both_files_and_counts(tmp_path):
  write_pair(tmp_path, 'train', ['a', 'b', 'c'], ['x', 'y'])
  with pytest.raises(DataError) as info:
    load_parallel(str(tmp_path), 'en', 'de')
  message = str(info.value)
  assert f'{tmp_path / "train.en"} has 3 lines but {tmp_path / "train.de"} has 2' in message


def test_invalid_utf8_names_file_and_line(tmp_path):
  write_pair(tmp_path, 'train', ['a', 'b', 'c'], ['x', 'y', 'z'])
  (tmp_path / 'train.de').write_bytes(b'x\ny\nz\xff\n')
  with pytest.raises(DataError, match=r'train\.de, line 3: invalid UTF-8'):
    load_parallel(str(tmp_path), 'en', 'de')


def test_split_with_zero_pairs(tmp_path):
  write_pair(tmp_path, 'train', ['a'], ['b'])
  write_pair(tmp_path, 'val', ['', 'x'], ['y', ' '])
  with pytest.raises(
    DataError,
    match=r'val\.en/val\.de: no sentence pairs \(2 read, all with an '
    'empty side',
  ):
    load_parallel(str(tmp_path), 'en', 'de')


def test_several_test_sets_need_a_choice(tmp_path):
  for stem in ('train', 'test_2016', 'test_2017'):
    write_pair(tmp_path, stem, ['a'], ['b'])
  with pytest.raises(DataError, match=r"several test sets \['test_2016', 'test_2017'\]"):
    load_parallel(str(tmp_path), 'en', 'de')
  ds = load_parallel(str(tmp_path), 'en', 'de', splits={'train': 'train', 'test': 'test_2017'})
  assert list(ds) == ['train', 'test']


@pytest.fixture
def multi30k_layout(tmp_path):
  """The official Multi30k release's stems: four test sets, told apart by their content."""
  for stem in (
    'train',
    'val',
    'test_2016_flickr',
    'test_2017_flickr',
    'test_2017_mscoco',
    'test_2018_flickr',
  ):
    write_pair(tmp_path, stem, [f'{stem} en'], [f'{stem} de'])
  write_pair(tmp_path, 'dev', ['dev en'], ['dev de'])
  return tmp_path


def test_valid_split_and_test_split_pick_among_several(multi30k_layout):
  with pytest.raises(
    DataError,
    match=r"several test sets \['test_2016_flickr', .*\]; choose one "
    r'with data.test_split \(train.py --data.test_split=test_2016_flickr\)',
  ):
    load_parallel(str(multi30k_layout), 'en', 'de')
  ds = load_parallel(str(multi30k_layout), 'en', 'de', test_split='test_2017_mscoco')
  assert list(ds) == ['train', 'validation', 'test']
  assert ds['test']['source'][:] == ['test_2017_mscoco en']
  assert ds['validation']['source'][:] == ['val en']  # discovered: val before dev
  ds = load_parallel(
    str(multi30k_layout), 'en', 'de', valid_split='dev', test_split='test_2018_flickr'
  )
  assert (ds['validation']['target'][:], ds['test']['target'][:]) == (
    ['dev de'],
    ['test_2018_flickr de'],
  )
  with pytest.raises(
    DataError,
    match=r"data.test_split='test_2019' names no split \(found "
    r"\['dev', 'test_2016_flickr'",
  ):
    load_parallel(str(multi30k_layout), 'en', 'de', test_split='test_2019')
  with pytest.raises(DataError, match='give either splits=.* or valid_split/test_split'):
    load_parallel(str(multi30k_layout), 'en', 'de', splits={'train': 'train'}, test_split='test')


def test_no_recognised_split(tmp_path):
  write_pair(tmp_path, 'corpus', ['a'], ['b'])
  with pytest.raises(DataError, match=r"found no train/val/.* \(found \['corpus'\]\)"):
    load_parallel(str(tmp_path), 'en', 'de')


def test_same_language_twice(text_dir):
  with pytest.raises(DataError, match="both 'en'"):
    load_parallel(str(text_dir), 'en', 'en')


def test_table_dir_with_language_columns_and_translation_column(tmp_path):
  rows = [
    {'en': 'A cat.', 'de': 'Eine Katze.'},
    {'en': ' ', 'de': 'Leer.'},
    {'en': 'Rain.', 'de': None},
    {'en': 'Sun.', 'de': 'Sonne.'},
  ]
  (tmp_path / 'train.jsonl').write_text('\n'.join(json.dumps(row) for row in rows) + '\n')
  (tmp_path / 'validation.json').write_text(
    json.dumps([{'translation': {'en': 'Hi.', 'de': 'Hallo.'}}])
  )
  pd.DataFrame({'de': ['Ja.', 'Nein.'], 'en': ['Yes.', 'No.'], 'id': [1, 2]}).to_csv(
    tmp_path / 'test.csv', index=False
  )
  ds = load_parallel(str(tmp_path), 'en', 'de')
  assert list(ds) == ['train', 'validation', 'test']
  assert ds['train']['source'][:] == ['A cat.', 'Sun.']
  assert ds['train']['target'][:] == ['Eine Katze.', 'Sonne.']
  assert ds['train'].info.description == 'train.jsonl, 2 dropped with an empty side'
  assert ds['validation'][0] == {'source': 'Hi.', 'target': 'Hallo.'}
  assert ds['test'].column_names == ['source', 'target']
  assert ds['test']['source'][:] == ['Yes.', 'No.']


def test_non_string_cells_become_text(tmp_path):
  # CSV readers type a column of numbers as int64; a translation pair is still text.
  pd.DataFrame({'en': [7, 42], 'de': ['sieben', 'zweiundvierzig']}).to_csv(
    tmp_path / 'numbers.csv', index=False
  )
  ds = load_parallel(str(tmp_path / 'numbers.csv'), 'en', 'de')
  assert ds['train'][:] == {'source': ['7', '42'], 'target': ['sieben', 'zweiundvierzig']}


def test_single_parquet_file_is_one_split(tmp_path):
  path = tmp_path / 'dev.parquet'
  pd.DataFrame({'en': ['One.'], 'de': ['Eins.']}).to_parquet(path)
  ds = load_parallel(str(path), 'en', 'de')
  assert list(ds) == ['validation']
  other = tmp_path / 'pairs.parquet'
  pd.DataFrame({'en': ['Two.'], 'de': ['Zwei.']}).to_parquet(other)
  assert list(load_parallel(str(other), 'de', 'en')) == ['train']
  assert load_parallel(str(other), 'de', 'en')['train'][0] == {'source': 'Zwei.', 'target': 'Two.'}


def test_table_without_the_languages(tmp_path):
  (tmp_path / 'train.jsonl').write_text(json.dumps({'fr': 'Oui.', 'de': 'Ja.'}) + '\n')
  with pytest.raises(
    DataError,
    match=r"train\.jsonl: needs columns 'en' and 'de' or a "
    r"'translation' column, found \['fr', 'de'\]",
  ):
    load_parallel(str(tmp_path), 'en', 'de')
  (tmp_path / 'train.jsonl').write_text(
    json.dumps({'translation': {'fr': 'Oui.', 'de': 'Ja.'}}) + '\n'
  )
  with pytest.raises(
    DataError,
    match=r"the translation column has languages \['de', 'fr'\], "
    r"not \['en'\]",
  ):
    load_parallel(str(tmp_path), 'en', 'de')


def test_malformed_json_names_the_file(tmp_path):
  (tmp_path / 'train.jsonl').write_text('{"en": "a", "de": \n')
  with pytest.raises(DataError, match=r'train\.jsonl: cannot read it as json'):
    load_parallel(str(tmp_path), 'en', 'de')


def test_lone_text_file_is_refused(text_dir):
  with pytest.raises(DataError, match=r'point the source at the directory holding <split>\.en'):
    load_parallel(str(text_dir / 'train.en'), 'en', 'de')


def test_hub_translation_column_is_unpacked(monkeypatch):
  translation = datasets.Features({'translation': datasets.Translation(languages=['de', 'en'])})
  hub = datasets.DatasetDict(
    {
      'train': datasets.Dataset.from_dict(
        {'translation': [{'de': 'Haus.', 'en': 'House.'}, {'de': '', 'en': 'Empty.'}]},
        features=translation,
      ),
      'validation': datasets.Dataset.from_dict(
        {'translation': [{'de': 'Baum.', 'en': 'Tree.'}]}, features=translation
      ),
    }
  )
  calls = []
  monkeypatch.setattr(
    datasets, 'load_dataset', lambda name, config: calls.append((name, config)) or hub
  )
  ds = load_parallel('wmt14:de-en', 'en', 'de')
  assert calls == [('wmt14', 'de-en')]
  assert ds['train'][:] == {'source': ['House.'], 'target': ['Haus.']}
  assert ds['train'].info.description == 'wmt14:de-en train, 1 dropped with an empty side'
  assert ds['validation'][0] == {'source': 'Tree.', 'target': 'Baum.'}


def test_hub_failure_explains_offline_use(monkeypatch):
  def offline(name, config):
    raise ConnectionError(f"Couldn't reach '{name}' on the Hub (LocalEntryNotFoundError)")

  monkeypatch.setattr(datasets, 'load_dataset', offline)
  with pytest.raises(DataError) as info:
    load_parallel('bentrevett/multi30k', 'en', 'de')
  message = str(info.value)
  assert "'bentrevett/multi30k' is not a local file or directory" in message
  assert "ConnectionError: Couldn't reach 'bentrevett/multi30k'" in message
  assert 'local directory of <split>.<lang> files' in message


def test_multi30k(multi30k_dir):
  ds = load_parallel(str(multi30k_dir), 'en', 'de')
  assert {name: len(split) for name, split in ds.items()} == {
    'train': 29_000,
    'validation': 1_014,
    'test': 1_000,
  }
  with open(multi30k_dir / 'val.de', encoding='utf-8') as f:
    last_de = f.read().split('\n')[1013]
  assert ds['validation'][1013]['target'] == last_de.strip()
  assert describe(ds).startswith('train: 29,000 pairs (train.en/train.de, 0 dropped')
