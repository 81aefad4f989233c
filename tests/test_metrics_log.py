"""MetricsLog: metrics.jsonl written and read back, a resumed run's lines, optional TensorBoard."""

import sys
import types

import pytest

from flax_transformer.run.metrics_log import MetricsLog


def test_metrics_log_writes_tensorboard_when_installed(tmp_path, monkeypatch):
  scalars = []

  class SummaryWriter:
    def __init__(self, logdir):
      self.logdir = logdir

    def add_scalar(self, name, value, step):
      scalars.append((name, value, step))

    def close(self):
      scalars.append('closed')

  monkeypatch.setitem(
    sys.modules, 'tensorboardX', types.SimpleNamespace(SummaryWriter=SummaryWriter)
  )
  log = MetricsLog(tmp_path / 'metrics.jsonl', tensorboard_dir=tmp_path / 'tb')
  log.write(3, {'loss': 1.5, 'val_loss': 2.0})
  log.close()
  assert scalars == [('loss', 1.5, 3), ('val_loss', 2.0, 3), 'closed']
  assert MetricsLog.read(tmp_path / 'metrics.jsonl') == [{'step': 3, 'loss': 1.5, 'val_loss': 2.0}]


def test_metrics_log_without_tensorboard_writes_json_lines_only(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'tensorboardX', None)  # import fails
  log = MetricsLog(tmp_path / 'metrics.jsonl', tensorboard_dir=tmp_path / 'tb')
  log.write(1, {'loss': 2.5})
  log.close()
  assert not (tmp_path / 'tb').exists()
  assert MetricsLog.read(tmp_path / 'metrics.jsonl') == [{'step': 1, 'loss': 2.5}]


def test_metrics_log_drops_a_line_cut_short_and_names_a_malformed_one(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
  assert MetricsLog.read(path) == [{'step': 1, 'loss': 2.0}, {'step': 2, 'loss': 1.5}]
  MetricsLog(path, resume_step=2).close()
  assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
  path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
  with pytest.raises(ValueError, match=f'{path}, line 2: not a JSON object'):
    MetricsLog.read(path)


def test_resumed_log_reports_the_clock_it_reached(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  assert MetricsLog(path).elapsed_s == 0.0
  path.write_text(
    '{"step": 2, "elapsed_s": 5.0}\n{"step": 2, "val_loss": 3.0}\n'
    '{"step": 4, "elapsed_s": 9.5}\n{"step": 6, "elapsed_s": 14.0}\n'
  )
  # Step 6 is dropped (to be repeated): the clock resumes from step 4's line.
  log = MetricsLog(path, resume_step=4)
  log.close()
  assert log.elapsed_s == 9.5
