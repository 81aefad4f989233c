"""Encoding by words (data/word_memo.py): exactly `tokenizers`' ids, on any text, at any memo size.

The reference is the tokenizer's own batch call on whole lines (`Tokenizer(memo_words=0)`),
on generated lines made of the characters where word-by-word encoding could go wrong: the
spaces NFKC makes (U+00A0, U+2000, U+3000, '´'), the '▁' Metaspace uses, double and
leading spaces, tabs, newlines, combining marks, compatibility characters, emoji, characters
the vocabulary lacks, and the special tokens' strings.
"""

import pickle

import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import models, normalizers, pre_tokenizers

from flax_transformer.tokenizer import SPECIAL_TOKENS, Tokenizer, word_memo

CORPUS = [
  'A man in an orange hat starring at something.',
  'Ein Mann mit einem orangefarbenen Hut, der etwas anstarrt.',
  'Große Hunde spielen im Schnee; zwei Jungen schauen zu!',
  'Two dogs (one black, one white) run across the grass?',
] * 20
# Pieces of generated lines: ordinary words and every awkward case of the module docstring.
PARTS = [
  'Mann',
  'Hunde',
  'a',
  'Große',
  'the',
  '.',
  ' ',
  ' ',
  ' ',
  '  ',
  '\t',
  '\n',
  '\u00a0',
  '\u2000',
  '\u3000',
  '\u00b4',
  '▁',
  '\u200b',
  'ﬁ',
  'Ａ',
  '①',
  'e\u0301',
  '\u0301',
  '\u1100\u1161',
  '😀',
  '漢',
  '\x1c',
  *SPECIAL_TOKENS,
]
LINES = st.lists(st.sampled_from(PARTS), max_size=14).map(''.join)


@pytest.fixture(scope='module', params=['bpe', 'unigram'])
def pair(request):
  """(the tokenizer with its memo, the same backend line by line through `tokenizers`)."""
  trained = Tokenizer.train(CORPUS, 120, model=request.param)
  return Tokenizer(trained._backend), Tokenizer(trained._backend, memo_words=0)


def _plain_ids(plain: Tokenizer, texts):
  return [
    encoding.ids
    for encoding in plain._encoder.encode_batch_fast(list(texts), add_special_tokens=False)
  ]


@settings(
  max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=st.lists(LINES, min_size=1, max_size=30))
def test_ids_equal_tokenizers_on_awkward_lines(pair, batch):
  memo, plain = pair
  assert memo._memo is not None and plain._memo is None
  ids, lengths = memo.encode_flat(batch)
  expected = _plain_ids(plain, batch)
  assert lengths.tolist() == [len(row) for row in expected]
  assert ids.tolist() == [token for row in expected for token in row]
  assert ids.dtype == np.int32 and lengths.dtype == np.int64


@pytest.mark.parametrize(
  'line',
  [
    'x \u00a0b',
    'x ▁b',
    '▁b x',
    'x \u00b4a',
    'a  b',
    ' a',
    'a ',
    '',
    ' ',
    'a\u00a0',
    'a\tb',
    'x \u3000y',
    '</s>',
    'forty </s> two',
    'a <pad>',
    '<unk> b',
  ],
)
def test_words_whose_ids_depend_on_their_line_are_encoded_with_it(pair, line):
  memo, plain = pair
  assert memo.encode([line, 'Mann ' + line, line + ' Hunde']) == _plain_ids(
    plain, [line, 'Mann ' + line, line + ' Hunde']
  )


def test_chunks_that_normalise_to_a_leading_space_are_marked_unsafe(pair):
  memo, _ = pair
  memo.encode(['x \u00a0b ▁c \u00b4d \u3000e f'])
  rows = memo._memo._row
  assert [rows[word] for word in ('\u00a0b', '▁c', '\u00b4d', '\u3000e')] == [word_memo._UNSAFE] * 4
  assert rows['f'] >= 0 and rows['x'] >= 0


def test_each_distinct_word_is_encoded_once_and_the_memo_is_used(pair):
  memo, plain = pair
  fresh = Tokenizer(memo._backend)
  assert fresh.encode(['Mann']) == plain.encode(['Mann'])
  lines = ['Mann Hunde Mann', 'Hunde a Mann .', 'a a a']
  fresh.encode(lines)
  assert len(fresh._memo) == 4  # Mann, Hunde, a, . (seen in batches after the first)
  # The memo answers from its tables: change one remembered id and the output follows it.
  row = fresh._memo._row['Hunde']
  fresh._memo._ids[fresh._memo._starts[row]] = 7
  assert fresh.encode(['Hunde'])[0][0] == 7 != plain.encode(['Hunde'])[0][0]


@pytest.mark.parametrize('capacity', [0, 1, 3, 50])
def test_a_full_memo_sends_lines_with_new_words_to_tokenizers(pair, capacity):
  memo, plain = pair
  small = Tokenizer(memo._backend, memo_words=capacity)
  lines = [' '.join(CORPUS[i].split()[::-1]) for i in range(4)] * 3 + CORPUS[:8]
  assert small.encode(lines) == _plain_ids(plain, lines)
  assert (small._memo is None) == (capacity == 0)
  assert capacity == 0 or len(small._memo) <= capacity


def test_the_memo_is_kept_from_tokenizers_it_does_not_fit():
  backend = tokenizers.Tokenizer(models.BPE(unk_token='<unk>'))
  backend.add_special_tokens(list(SPECIAL_TOKENS))
  backend.normalizer = normalizers.NFKC()
  backend.pre_tokenizer = pre_tokenizers.Whitespace()  # splits at punctuation too
  backend.encode_special_tokens = True
  assert not word_memo.applies_to(backend)
  with pytest.raises(ValueError, match='applies_to'):
    word_memo.WordMemo(backend)
  assert Tokenizer(backend)._memo is None


def test_a_pickled_tokenizer_keeps_its_settings(pair):
  memo, _ = pair
  copy = pickle.loads(pickle.dumps(memo))
  # tokenizer.json and tokenizers' pickle drop encode_special_tokens; the constructor sets it.
  assert copy._encoder.encode_special_tokens and copy.memo_words == memo.memo_words
  assert copy._memo is not None and len(copy._memo) == 0  # a process fills its own
  assert copy.encode(['forty </s> two']) == memo.encode(['forty </s> two'])
  assert Tokenizer.eos_id not in copy.encode(['forty </s> two'])[0]
