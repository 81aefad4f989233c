"""Several settings timed side by side: each compiled once, then timed in alternating rounds.

    reports = compare({'einsum': (config, train, shape),
                       'xla': (config.replace(attention_kernel='xla'), train, shape)}, rounds=10)
    print(reports_table(reports))

A benchmark that times one contender after another lets a burst of load on a shared machine
fall on one of them; alternating rounds spread it over all. Training steps and decoding
calls can be mixed: a contender is (model config, train config, BatchShape) for a step, or a
ready `Decoding`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from flax_transformer.bench.decoding import DecodeReport, Decoding
from flax_transformer.bench.peaks import PeakReport
from flax_transformer.bench.step import StepReport, TrainingStep
from flax_transformer.bench.timing import alternating_rounds


def compare(
  contenders: Mapping[str, tuple | Decoding | TrainingStep],
  rounds: int = 10,
  warmup: int = 2,
  peak: PeakReport | float | None = None,
  progress: Callable[[], object] | None = None,
) -> dict[str, StepReport | DecodeReport]:
  """{name: report} for each contender, compiled in turn, then timed round-robin."""
  built = {}
  for name, contender in contenders.items():
    if isinstance(contender, tuple):
      contender = TrainingStep(*contender)
    if not isinstance(contender, (TrainingStep, Decoding)):
      raise TypeError(
        f'contender {name!r}: expected (model config, train config, shape), a '
        f'TrainingStep or a Decoding, got {type(contender).__name__}'
      )
    built[name] = contender
  timings = alternating_rounds({name: c.run for name, c in built.items()}, rounds, warmup, progress)
  return {
    name: (
      c.report(timings[name], peak) if isinstance(c, TrainingStep) else c.report(timings[name])
    )
    for name, c in built.items()
  }


def reports_table(reports: Mapping[str, StepReport | DecodeReport]) -> str:
  """One line per report: name, median, p10-p90, tokens/s, compile seconds, memory, MFU."""
  width = max([16, *map(len, reports)])
  lines = [
    f'{"":{width}s} {"median ms":>10s} {"p10-p90 ms":>15s} {"tokens/s":>12s} '
    f'{"compile s":>9s} {"memory MiB":>10s} {"MFU":>6s}'
  ]
  for name, report in reports.items():
    t = report.timing
    mfu = getattr(report, 'mfu', None)
    memory = report.memory and report.memory.total / 2**20
    lines.append(
      f'{name:{width}s} {t.median_s * 1e3:10.2f} '
      f'{f"{t.p10_s * 1e3:.2f}-{t.p90_s * 1e3:.2f}":>15s} {report.tokens_per_s:12,.0f} '
      f'{report.compilation.seconds:9.2f} '
      f'{"n/a" if memory is None else f"{memory:.1f}":>10s} '
      f'{"n/a" if mfu is None else f"{100 * mfu:.1f}%":>6s}'
    )
  return '\n'.join(lines)
