"""run.outputs.check_output: the one rule for an output directory a program replaces."""

import re

import pytest

from flax_transformer.run.outputs import Protected, check_output


class Refused(ValueError):
  pass


def check(output, protected, replaceable=None):
  check_output(output, protected, 'out', Refused, replaceable=replaceable, occupied='is taken')


@pytest.fixture
def tree(tmp_path):
  (tmp_path / 'data').mkdir()
  (tmp_path / 'data' / 'train.en').write_text('a\n')
  (tmp_path / 'run').mkdir()
  (tmp_path / 'link').symlink_to(tmp_path / 'data')
  return tmp_path


def test_an_output_that_is_holds_or_lies_inside_an_input_is_refused(tree):
  data = Protected(tree / 'data', f'{tree / "data"}, an input')
  for output, message in [
    (tree / 'data', f'out {tree / "data"} would replace {tree / "data"}, an input; choose'),
    (tree / 'link', 'would replace'),  # the input, by a symlink
    (tree, f'out {tree} would replace {tree / "data"}, an input'),  # holds it
    (tree / 'data' / 'new', 'would write inside'),
    (tree / 'link' / 'new', 'would write inside'),
    (tree / 'data' / 'train.en', 'would write inside'),  # inside, and a file: the rule first
  ]:
    with pytest.raises(Refused, match=re.escape(message)):
      check(output, [data])
  check(tree / 'run' / 'new', [data])
  check(tree / 'elsewhere', [data])


def test_an_input_that_may_hold_outputs_admits_one_inside_it(tree):
  run = Protected(tree / 'run', 'the run', may_hold=True)
  check(tree / 'run' / 'average', [run])
  with pytest.raises(Refused, match='would replace the run'):
    check(tree / 'run', [run])
  with pytest.raises(Refused, match='would replace the run'):
    check(tree, [run])


def test_an_existing_output_is_replaced_only_if_it_holds_what_the_program_writes(tree):
  with pytest.raises(
    Refused, match=f'out {tree / "data" / "train.en"} is a file; give a directory'
  ):
    check(tree / 'data' / 'train.en', [])
  check(tree / 'data', [], replaceable={'train.en', 'train.de'})
  check(tree / 'data', [], replaceable=None)  # consent: anything may go
  check(tree / 'run', [], replaceable=())  # empty
  with pytest.raises(Refused, match=f'out {tree / "data"} is taken'):
    check(tree / 'data', [], replaceable=())
  with pytest.raises(Refused, match='is taken'):
    check(tree / 'data', [], replaceable={'config.json'})
