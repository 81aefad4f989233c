"""The number-words task: hand-checked spellings, determinism, disjoint splits."""

import pytest

from flax_transformer.data.corpus import DataError
from flax_transformer.data.toy_task import english_words, german_words, number_translation

# Written out by hand from German orthography (Duden: numbers below a million are one word).
GERMAN = {
  0: 'null',
  1: 'eins',
  2: 'zwei',
  7: 'sieben',
  11: 'elf',
  12: 'zwölf',
  16: 'sechzehn',
  17: 'siebzehn',
  20: 'zwanzig',
  21: 'einundzwanzig',
  30: 'dreißig',
  42: 'zweiundvierzig',
  66: 'sechsundsechzig',
  77: 'siebenundsiebzig',
  99: 'neunundneunzig',
  100: 'einhundert',
  101: 'einhunderteins',
  111: 'einhundertelf',
  121: 'einhunderteinundzwanzig',
  342: 'dreihundertzweiundvierzig',
  600: 'sechshundert',
  1000: 'eintausend',
  1001: 'eintausendeins',
  1100: 'eintausendeinhundert',
  1234: 'eintausendzweihundertvierunddreißig',
  2021: 'zweitausendeinundzwanzig',
  7070: 'siebentausendsiebzig',
  9999: 'neuntausendneunhundertneunundneunzig',
  21_000: 'einundzwanzigtausend',
  101_001: 'einhunderteintausendeins',
  999_999: 'neunhundertneunundneunzigtausendneunhundertneunundneunzig',
}
ENGLISH = {
  0: 'zero',
  1: 'one',
  13: 'thirteen',
  40: 'forty',
  42: 'forty-two',
  100: 'one hundred',
  101: 'one hundred one',
  342: 'three hundred forty-two',
  1000: 'one thousand',
  1234: 'one thousand two hundred thirty-four',
  9090: 'nine thousand ninety',
  21_000: 'twenty-one thousand',
  101_001: 'one hundred one thousand one',
}


@pytest.mark.parametrize('number, words', sorted(GERMAN.items()))
def test_german_spelling(number, words):
  assert german_words(number) == words


@pytest.mark.parametrize('number, words', sorted(ENGLISH.items()))
def test_english_spelling(number, words):
  assert english_words(number) == words


def test_spellings_are_one_to_one():
  # A translation task needs distinct targets; a wrong rule (say 'ein' vs 'eins') would collide.
  numbers = range(100_000)
  assert len({german_words(n) for n in numbers}) == len(numbers)
  assert len({english_words(n) for n in range(10_000)}) == 10_000
  assert all(' ' not in german_words(n) for n in range(10_000))


def test_range_is_checked():
  with pytest.raises(DataError, match=r'defined for 0\.\.999,999, got 1000000'):
    german_words(1_000_000)
  with pytest.raises(DataError, match='got -1'):
    english_words(-1)


@pytest.fixture(scope='module')
def default_task():
  return number_translation()


def test_splits_are_disjoint_and_cover_the_range(default_task):
  sizes = {name: len(split) for name, split in default_task.items()}
  assert sizes == {'train': 8000, 'validation': 1000, 'test': 1000}
  sources = {name: set(split['source']) for name, split in default_task.items()}
  assert not sources['train'] & sources['validation']
  assert not sources['train'] & sources['test']
  assert not sources['validation'] & sources['test']
  assert set().union(*sources.values()) == {english_words(n) for n in range(10_000)}


def test_pairs_are_translations(default_task):
  to_german = {english_words(n): german_words(n) for n in range(10_000)}
  for split in default_task.values():
    assert all(to_german[s] == t for s, t in zip(split['source'], split['target']))
  assert default_task['train'].column_names == ['source', 'target']


def test_deterministic_from_seed(default_task):
  again = number_translation(seed=0)
  other = number_translation(seed=1)
  assert again['train'][:] == default_task['train'][:]
  assert again['test'][:] == default_task['test'][:]
  assert other['train']['source'][:] != default_task['train']['source'][:]


def test_small_range_and_sizes():
  ds = number_translation(num_train=50, num_validation=5, num_test=5, seed=3, max_number=99)
  numbers = {
    name: {english_words(n) for n in range(100)} & set(split['source'])
    for name, split in ds.items()
  }
  assert [len(numbers[name]) for name in ('train', 'validation', 'test')] == [50, 5, 5]
  assert ds['train'].info.description == 'English->German number words, 50 of 0..99, seed 3'


def test_argument_errors():
  with pytest.raises(
    DataError,
    match=r'110 distinct numbers requested .* but 0\.\.99 holds only '
    r'100; raise max_number',
  ):
    number_translation(num_train=100, num_validation=5, num_test=5, max_number=99)
  with pytest.raises(DataError, match='num_test must be a positive integer, got 0'):
    number_translation(num_test=0)
  with pytest.raises(DataError, match=r'max_number must be an integer in 0\.\.999,999'):
    number_translation(max_number=10**6)
