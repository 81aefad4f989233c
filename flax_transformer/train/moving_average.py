"""WORKDIR/ema: the parameters' exponential moving average (train.ema_decay) as a decodable run.

The average itself lives in the optimizer's state (`optimizer.with_parameter_ema`), so every
checkpoint holds it and a resumed run continues it exactly. At the end of training it is
written out like WORKDIR/best: config.json marked with the step and the decay, the tokenizer,
one params-only checkpoint, so `decode.py --checkpoint WORKDIR/ema` and `export.py
WORKDIR/ema` take it like an average. It is written beside, into WORKDIR/.ema.tmp, then moved
into place: a crash leaves the previous one or the new one.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import jax

from flax_transformer.run.directory import EMA_DIR, EMA_KEY
from flax_transformer.run.loading import write_params_run
from flax_transformer.train.optimizer import ema_params


def write_ema(workdir: Path, step: int, opt_state, decay: float) -> Path | None:
  """Writes WORKDIR/ema from the average in `opt_state` (host arrays) at `step`; returns its
  path, or None when the run keeps no average."""
  average = ema_params(opt_state)
  if average is None:
    return None
  staged, output = workdir / f'.{EMA_DIR}.tmp', workdir / EMA_DIR
  write_params_run(
    workdir, staged, [step], average, extra={EMA_KEY: {'decay': decay, 'step': step}}
  )
  if jax.process_index() == 0:
    shutil.rmtree(output, ignore_errors=True)
    os.replace(staged, output)
  return output
