#!/usr/bin/env bash
# Wheels of what a GPU machine without a network lacks, into .whl/ (git ignores it there only if
# .git/info/exclude says so), for benchmarks/gpu.sh and benchmarks.multi30k_grid to install:
#
#   bash benchmarks/gpu_wheels.sh            # here, where pip reaches the registry
#   # there: bash benchmarks/gpu.sh, or
#   #   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site ...
#
# The lent H200's image (2026-12-04) holds jax 0.11.2, flax 0.12.10, optax 0.2.8, orbax, tokenizers,
# sacrebleu, tqdm and pyarrow 25.0.1, but not datasets (and its dill, multiprocess) or sacremoses.
# Python 3.12 there; about 1.7 MB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
for package in 'datasets==5.2.0' 'dill<0.4.2' 'multiprocess<0.70.20' 'sacremoses<1'; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$package"
done
ls -la .whl
