"""The offline default task: English number words -> German number words.

    342  'three hundred forty-two'  ->  'dreihundertzweiundvierzig'

Small enough to learn in minutes on a laptop CPU, yet it exercises what
translation needs: a shared subword vocabulary, lengths that differ between the
sides, and reordering (German says the units before the tens: 'zweiundvierzig').

Conventions. English: American style, no 'and', hyphenated tens ('forty-two').
German: one word, as written in full, with 'ein' spelled out before 'hundert'
and 'tausend' (100 'einhundert', 101 'einhunderteins', 1000 'eintausend');
'eins' only as the last part of a number (1, 101, 1001), 'ein' before 'und',
'hundert' and 'tausend' (21 'einundzwanzig', 1100 'eintausendeinhundert');
'eine' is never needed below a million ('eine Million'), the largest
`max_number` allowed.
"""

from __future__ import annotations

import datasets
import numpy as np

from flax_transformer.config import POSITIVE_INT, check_bounds
from flax_transformer.errors import DataError

LARGEST = 999_999

_EN_ONES = (
  'zero one two three four five six seven eight nine ten eleven twelve thirteen '
  'fourteen fifteen sixteen seventeen eighteen nineteen'
).split()
_EN_TENS = ('', '', 'twenty', 'thirty', 'forty', 'fifty', 'sixty', 'seventy', 'eighty', 'ninety')
# Index 1 is 'ein', the form before 'und', 'hundert' and 'tausend'.
_DE_UNITS = ('', 'ein', 'zwei', 'drei', 'vier', 'fünf', 'sechs', 'sieben', 'acht', 'neun')
_DE_TEENS = (
  'zehn',
  'elf',
  'zwölf',
  'dreizehn',
  'vierzehn',
  'fünfzehn',
  'sechzehn',
  'siebzehn',
  'achtzehn',
  'neunzehn',
)
_DE_TENS = (
  '',
  '',
  'zwanzig',
  'dreißig',
  'vierzig',
  'fünfzig',
  'sechzig',
  'siebzig',
  'achtzig',
  'neunzig',
)


def english_words(n: int) -> str:
  """0 'zero', 42 'forty-two', 1234 'one thousand two hundred thirty-four'."""
  _check_range(n)
  thousands, rest = divmod(n, 1000)
  if thousands:
    return _join(f'{_english_below_1000(thousands)} thousand', _english_below_1000(rest))
  return _english_below_1000(n) or 'zero'


def _english_below_1000(n: int) -> str:
  """'' for 0, so that 'one thousand' gets no trailing 'zero'."""
  hundreds, rest = divmod(n, 100)
  if rest == 0:
    below_100 = ''
  elif rest < 20:
    below_100 = _EN_ONES[rest]
  else:
    tens, units = divmod(rest, 10)
    below_100 = _EN_TENS[tens] + (f'-{_EN_ONES[units]}' if units else '')
  return _join(f'{_EN_ONES[hundreds]} hundred' if hundreds else '', below_100)


def _join(*parts: str) -> str:
  return ' '.join(part for part in parts if part)


def german_words(n: int) -> str:
  """0 'null', 1 'eins', 21 'einundzwanzig', 1234 'eintausendzweihundertvierunddreißig'."""
  _check_range(n)
  if n == 0:
    return 'null'
  thousands, rest = divmod(n, 1000)
  prefix = _german_below_1000(thousands, last=False) + 'tausend' if thousands else ''
  return prefix + _german_below_1000(rest, last=True)


def _german_below_1000(n: int, last: bool) -> str:
  """'' for 0. `last`: nothing follows, so a final 1 is 'eins' (101), not 'ein' (101 000)."""
  hundreds, rest = divmod(n, 100)
  words = _DE_UNITS[hundreds] + 'hundert' if hundreds else ''
  if rest == 1:
    return words + ('eins' if last else 'ein')
  if rest < 10:
    return words + _DE_UNITS[rest]
  if rest < 20:
    return words + _DE_TEENS[rest - 10]
  tens, units = divmod(rest, 10)
  return words + (_DE_UNITS[units] + 'und' if units else '') + _DE_TENS[tens]


def _check_range(n: int) -> None:
  if not 0 <= n <= LARGEST:
    raise DataError(f'number words are defined for 0..{LARGEST:,}, got {n}')


def number_translation(
  num_train: int = 8000,
  num_validation: int = 1000,
  num_test: int = 1000,
  seed: int = 0,
  max_number: int = 9999,
) -> datasets.DatasetDict:
  """English -> German number words for distinct numbers drawn from 0..max_number.

  The numbers are a seeded permutation of 0..max_number cut into train,
  validation and test, so no number is in two splits and the same arguments
  give the same data. The defaults use all 10,000 numbers below 10,000.

  Returns:
    DatasetDict with 'train', 'validation', 'test', columns 'source' (English)
    and 'target' (German), like `data.load_parallel`.
  """
  counts = {'num_train': num_train, 'num_validation': num_validation, 'num_test': num_test}
  for name, count in counts.items():
    check_bounds(count, POSITIVE_INT, name, DataError)
  if not isinstance(max_number, int) or not 0 <= max_number <= LARGEST:
    raise DataError(f'max_number must be an integer in 0..{LARGEST:,}, got {max_number!r}')
  total = sum(counts.values())
  if total > max_number + 1:
    raise DataError(
      f'{total:,} distinct numbers requested ({counts}) but 0..{max_number:,} '
      f'holds only {max_number + 1:,}; raise max_number or ask for fewer'
    )
  numbers = np.random.default_rng(seed).permutation(max_number + 1)[:total]
  cuts = np.cumsum([num_train, num_validation])
  splits = dict(zip(('train', 'validation', 'test'), np.split(numbers, cuts)))
  return datasets.DatasetDict(
    {
      name: datasets.Dataset.from_dict(
        {
          'source': [english_words(int(n)) for n in chosen],
          'target': [german_words(int(n)) for n in chosen],
        },
        info=datasets.DatasetInfo(
          description=f'English->German number words, {len(chosen):,} '
          f'of 0..{max_number:,}, seed {seed}'
        ),
      )
      for name, chosen in splits.items()
    }
  )
