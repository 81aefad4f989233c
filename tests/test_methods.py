"""Decoding methods as values (flax_transformer/decode/methods.py): settings checked when made, the
model kinds they decode, their descriptions, the paper's defaults, and decode.py's names."""

import dataclasses

import pytest

from flax_transformer import ConfigError, ModelConfig
from flax_transformer.decode import autoregressive
from flax_transformer.decode.methods import (
  METHODS,
  BeamSearch,
  Greedy,
  MaskPredict,
  Sampling,
  default_method,
  method_from_name,
)


@pytest.mark.parametrize(
  'make, message',
  [
    (lambda: Sampling(top_p=1.5), r'top_p must be in \(0, 1\]'),
    (lambda: Sampling(temperature=0.0), 'sample.temperature must be a positive number, got 0.0'),
    (lambda: BeamSearch(beam_size=0), 'beam_size must be a positive integer, got 0'),
    (lambda: BeamSearch(alpha=-1.0), r'beam\.alpha must be >= 0, got -1.0'),
    (lambda: Greedy(max_len=0), r'greedy\.max_len must be a positive integer, got 0'),
    (lambda: MaskPredict(iterations=0), 'iterations must be a positive integer, got 0'),
    (lambda: MaskPredict(length='fixed'), "length='fixed' decodes one length per sentence"),
    (lambda: MaskPredict(length='auto'), 'length must be one of predict, fixed'),
    (lambda: MaskPredict(length_ratio=-0.5), r'length_ratio must be in \(0, 65536\], got -0.5'),
    (
      lambda: MaskPredict(length_offset=10**12),
      r'length_offset must be an integer in \[-65536, 65536\], got 1000000000000',
    ),
    (lambda: Sampling(seed=2**63), 'sample.seed must be an integer in'),
    (lambda: MaskPredict(length_offset='2'), "length_offset must be an integer .*, got '2'"),
  ],
)
def test_settings_are_checked_when_a_method_is_made(make, message):
  with pytest.raises(ConfigError, match=message):
    make()


@pytest.mark.parametrize(
  'name, settings, message',
  [
    ('nucleus', {}, 'method must be one of beam, greedy, sample, mask_predict'),
    ('nat', {}, "method 'nat' is now called 'mask_predict'"),
    ('greedy', dict(beam_size=8), "beam_size only applies to method 'beam', not 'greedy'"),
    ('beam', dict(temperature=0.7), "temperature only applies to method 'sample', not 'beam'"),
    (
      'mask_predict',
      dict(max_len=5),
      "max_len only applies to method 'beam' or 'greedy' or 'sample', not 'mask_predict'",
    ),
    ('greedy', dict(length_beam=1), "length_beam only applies to method 'mask_predict'"),
    ('beam', dict(length_ratio=0.8), "length_ratio only applies to method 'mask_predict'"),
  ],
)
def test_a_method_by_name_refuses_settings_of_another(name, settings, message):
  with pytest.raises(ConfigError, match=message):
    method_from_name(name, **settings)


def test_a_method_by_name_is_the_value_with_those_settings():
  assert method_from_name('beam', alpha=1.0) == BeamSearch(beam_size=4, alpha=1.0)
  assert method_from_name('sample', top_p=0.9, seed=3) == Sampling(top_p=0.9, seed=3)
  assert method_from_name('mask_predict', iterations=4) == MaskPredict(iterations=4)
  assert set(METHODS) == {'beam', 'greedy', 'sample', 'mask_predict'}


def test_the_papers_defaults_are_written_once():
  assert (BeamSearch().beam_size, BeamSearch().alpha) == (4, 0.6)
  # The functional API has no defaults of its own for a method's settings: it builds the method.
  for function, method in (
    (autoregressive.beam_search, BeamSearch),
    (autoregressive.greedy, Greedy),
    (autoregressive.sample, Sampling),
  ):
    own = set(function.__kwdefaults__) & {f.name for f in dataclasses.fields(method)}
    assert not own, f'{function.__name__} repeats the defaults of {own}'


def test_methods_describe_their_decoding():
  assert MaskPredict().describe() == 'mask-predict decoding (10 iterations, length beam 3)'
  assert MaskPredict(iterations=4, length_beam=1, length='fixed').describe() == (
    'mask-predict decoding (4 iterations, fixed length)'
  )
  assert MaskPredict(length_ratio=0.8, length_offset=2).describe() == (
    'mask-predict decoding (10 iterations, length beam 3, lengths x 0.8 +2)'
  )
  assert Greedy().describe() == 'greedy decoding'
  assert BeamSearch().describe() == 'beam search (beam 4, alpha 0.6)'
  assert Sampling(top_k=5).describe() == 'sampling (temperature 1.0, top-k 5, top-p 1.0, seed 0)'


def test_each_model_kind_has_its_default_method():
  assert default_method(ModelConfig.tiny()) == BeamSearch()
  assert default_method(ModelConfig.tiny(), autoregressive=Greedy()) == Greedy()
  assert default_method(ModelConfig.tiny(kind='cmlm')) == MaskPredict()
  # The length beam never exceeds the model's length classes: one class when the offset is 0.
  assert default_method(ModelConfig.tiny(kind='cmlm', max_length_offset=0)) == MaskPredict(
    length_beam=1
  )


def test_check_model_refuses_a_length_beam_beyond_the_length_classes_and_long_outputs():
  config = ModelConfig.tiny(kind='cmlm', max_length_offset=1)
  MaskPredict(length_beam=3).check_model(config)
  with pytest.raises(ConfigError, match=r"length_beam=4 exceeds the model's 3 length classes"):
    MaskPredict(length_beam=4).check_model(config)
  with pytest.raises(ConfigError, match=r'max_len must be in \[1, 64\]'):
    Greedy(max_len=65).check_model(ModelConfig.tiny())


def test_the_default_method_takes_the_settings_given_without_a_method():
  assert default_method(ModelConfig.tiny(), beam_size=8) == BeamSearch(beam_size=8)
  assert default_method(ModelConfig.tiny(kind='cmlm', max_length_offset=0), iterations=2) == (
    MaskPredict(iterations=2, length_beam=1)
  )
  with pytest.raises(ConfigError, match="temperature only applies to method 'sample', not 'beam'"):
    default_method(ModelConfig.tiny(), temperature=0.5)


def test_every_setting_is_a_documented_option_of_decode_py():
  """A method's field is its setting: its help, its option, its range (cli/options.py)."""
  from flax_transformer.cli.decode import parse_args

  for cls in METHODS.values():
    for field in dataclasses.fields(cls):
      assert field.metadata['help'].strip(), f'{cls.__name__}.{field.name} has no help'
      option = '--' + field.name.replace('_', '-')
      value = {str: field.default}.get(type(field.default), 1)
      args = parse_args(['--checkpoint', 'run', '--method', cls.name, option, str(value)])
      assert args.method_settings[field.name] == value, option


def test_a_method_class_lists_itself_under_its_name_and_a_taken_name_is_refused():
  """DecodingMethod's subclasses enter METHODS as they are defined, in that order; the
  modules that run them still answer their names."""
  from flax_transformer.decode import methods, non_autoregressive

  assert list(METHODS) == ['beam', 'greedy', 'sample', 'mask_predict']
  assert METHODS['beam'] is autoregressive.BeamSearch is methods.BeamSearch
  assert METHODS['mask_predict'] is non_autoregressive.MaskPredict is methods.MaskPredict
  with pytest.raises(AttributeError, match="has no attribute 'Beam'"):
    methods.Beam  # noqa: B018
  with pytest.raises(TypeError, match="name 'greedy' of .*Impostor is taken by .*Greedy"):

    class Impostor(methods.DecodingMethod):
      name = 'greedy'

  assert METHODS['greedy'] is Greedy

  class Lookahead(methods.DecodingMethod):
    name = 'lookahead'

  try:
    assert METHODS['lookahead'] is Lookahead
    # check_model names every method of the model's kind, the new one among them.
    with pytest.raises(ConfigError, match="use method 'beam', 'greedy', 'sample' or 'lookahead'"):
      MaskPredict().check_model(ModelConfig.tiny())
  finally:
    del METHODS['lookahead']
