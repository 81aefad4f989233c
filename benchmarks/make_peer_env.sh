#!/usr/bin/env bash
# The python environment of benchmarks.solo's FlaxMarian peer: Hugging Face FlaxMarianMTModel lives
# in transformers < 5 only, which cannot share an environment with the main one's transformers 5.
# It needs no more than this: the worker imports nothing of flax_transformer (PYTHONPATH does the rest).
#
#   bash benchmarks/make_peer_env.sh /work/venvs/flaxmarian     # a path outside the repository
#   python -m benchmarks.solo --peer-python flaxmarian=/work/venvs/flaxmarian/bin/python
set -euo pipefail
venv=${1:?usage: bash benchmarks/make_peer_env.sh /path/to/new/venv (outside the repository)}
python -m venv "$venv"
# The versions benchmarks/results/solo.json was measured with; jax, flax and optax as in the main env.
"$venv/bin/pip" install 'transformers==4.57.6' 'jax==0.10.2' 'flax==0.12.8' 'optax==0.2.8' \
  'numpy==2.4.6'
echo "made $venv; run: python -m benchmarks.solo --peer-python flaxmarian=$venv/bin/python"
