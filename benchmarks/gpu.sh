#!/usr/bin/env bash
# The GPU check, one command, on a machine with an NVIDIA GPU and jax[cuda] installed:
#
#   bash benchmarks/gpu.sh                    # every part, within 8 minutes on an H200
#   bash benchmarks/gpu.sh --parts mfu,decode # some of them (benchmarks/gpu_check.py --help)
#
# benchmarks/gpu_check.py: the fused attention kernel's numerics against einsum; training-step
# MFU for base and big in bfloat16, each attention kernel and remat policy, at 768 x 32+32 and
# 390 x 64+64 tokens; greedy and beam tokens/s at batch 32 and 256; the input side on the 4.5M
# stand-in (host seconds per batch against device seconds per step); and the Multi30k preset to
# its end with its test BLEU (the corpus from ../shared/data/multi30k, or --multi30k DIR).
# Then the base step per attention kernel at rows of 128 and 256 tokens, 8,192 tokens a batch
# (flax-transformer-bench sweep --kernels einsum,xla,cudnn; the CPU's: docs/training_step.md).
# Results: benchmarks/results/gpu_check_{numerics,mfu,decode,input,multi30k}.json and
# attention_kernels_gpu_{128,256}.json.
# More, when there is time: python3 -m benchmarks.solo --contenders ours --tasks train ...
# (float32 too) and python3 -m benchmarks.complexity (Table 1's per-layer cost).
set -euo pipefail
cd "$(dirname "$0")/.."

python3 - <<'PY'
import sys
import jax
if jax.default_backend() != 'gpu':
  sys.exit(f'benchmarks/gpu.sh: JAX sees no GPU (backend {jax.default_backend()!r}, devices '
           f'{jax.devices()}); install jax[cuda12] or jax[cuda13] first')
print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}')
PY

source benchmarks/gpu_deps.sh

python3 -m benchmarks.gpu_check "$@"
# The step per attention kernel by row length (einsum, xla, cudnn): what auto's choice rests on.
for length in 128 256; do
  python3 -m flax_transformer.bench sweep --preset base --batches $((8192 / length)) --length "$length" \
    --kernels einsum,xla,cudnn --rounds 5 --json "benchmarks/results/attention_kernels_gpu_$length.json"
done
