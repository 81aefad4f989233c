"""The training loop's cadence (`train.cadence.due`): what is due at each step boundary, on a
table written out by hand from the settings' meanings."""

import dataclasses

import pytest

from flax_transformer.config import TrainConfig
from flax_transformer.train.cadence import Due, due

CONFIG = TrainConfig(
  steps=12,
  log_every=3,
  eval_every=4,
  checkpoint_every=6,
  bleu_every=8,
  warmup_steps=2,
  profile='5,7',
)

# done: the names that are True in due(CONFIG, done, start=0); the rest are False.
TABLE = {
  0: set(),  # the run's start: the trace begins after step 5
  1: set(),
  3: {'log'},
  4: {'validate', 'patience'},
  5: {'profile_start'},
  6: {'log', 'save'},
  7: {'profile_stop'},
  8: {'validate', 'patience', 'bleu'},
  9: {'log'},
  11: set(),
  12: {'log', 'validate', 'patience', 'save', 'final'},
}


@pytest.mark.parametrize('done', sorted(TABLE))
def test_what_is_due_at_each_step(done):
  got = due(CONFIG, done, start=0)
  assert {f.name for f in dataclasses.fields(Due) if getattr(got, f.name)} == TABLE[done]
  assert got.fetch == bool(TABLE[done] & {'log', 'validate', 'bleu', 'save'})


def test_patience_follows_the_best_metrics_own_validations():
  bleu = CONFIG.replace(best_metric='bleu')
  assert not due(bleu, 4, 0).patience and due(bleu, 4, 0).validate
  assert due(bleu, 8, 0).patience and due(bleu, 8, 0).bleu
  # Without a validation split there is no BLEU to decode, so none is due.
  assert not due(bleu, 8, 0, has_validation=False).bleu


def test_a_stop_logs_and_saves_and_evaluates_nothing():
  stopping = due(CONFIG, 8, 0, stopping=True)
  assert (stopping.log, stopping.save) == (True, True)
  assert not (stopping.validate or stopping.bleu or stopping.patience or stopping.profile_start)
  # Inside the traced range the trace stops with the run.
  assert due(CONFIG, 6, 0, stopping=True).profile_stop
  assert not due(CONFIG, 4, 0, stopping=True).profile_stop


@pytest.mark.parametrize(
  'profile,start,steps,starts,stops',
  [
    ('5,7', 0, 12, 5, 7),  # as asked
    ('5,7', 6, 12, 6, 7),  # resumed inside: from the resumed step
    ('5,7', 7, 12, None, None),  # resumed at its end: nothing
    ('5,9', 0, 8, 5, 8),  # the run ends inside: stopped at the last step
    ('0,3', 0, 12, 0, 3),  # from the first step: started before it (at done == start)
  ],
)
def test_the_profiles_start_and_stop_are_clipped_to_the_steps_this_run_trains(
  profile, start, steps, starts, stops
):
  config = CONFIG.replace(profile=profile, steps=steps)
  started = [d for d in range(start, steps + 1) if due(config, d, start).profile_start]
  stopped = [d for d in range(start, steps + 1) if due(config, d, start).profile_stop]
  assert started == ([] if starts is None else [starts])
  assert stopped == ([] if stops is None else [stops])


def test_before_the_first_step_only_the_trace_may_start():
  assert due(CONFIG, 4, start=4) == Due()  # resumed at a validation step: done already
  assert due(CONFIG.replace(profile='4,6'), 4, start=4) == Due(profile_start=True)
