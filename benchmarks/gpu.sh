#!/usr/bin/env bash
# Our training step on an NVIDIA GPU: base and big models, float32 and bfloat16, with
# model FLOPs utilisation against the card's measured matmul peak (8192^3, same dtype).
#
#   bash benchmarks/gpu.sh            # from a checkout, on a machine with jax[cuda] installed
#
# benchmarks.solo with ours alone (no peer), two shapes: the CPU table's 32 x 32+32 tokens,
# and 768 rows of the same lengths (24,576 target tokens, about the paper's 25k-token batches),
# where a GPU is busy enough for the utilisation to mean something. "float32" is JAX's default
# matmul precision, which uses TF32 tensor cores on Ampere and newer, in the step and in the peak
# alike. A few minutes on an H100, most of it compilation (build times are in the table).
# Then Table 1's complexity per layer: one attention layer, full against banded (radius 64), for
# n = 128 .. 16,384 (benchmarks/complexity.py; about a minute).
# Results: benchmarks/results/solo_gpu_{base,big}[_32rows].json, complexity_gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 - <<'EOF'
import sys
import jax
if jax.default_backend() != 'gpu':
  sys.exit(f'benchmarks/gpu.sh: JAX sees no GPU (backend {jax.default_backend()!r}, devices '
           f'{jax.devices()}); install jax[cuda12] or jax[cuda13] first')
print(f'jax {jax.__version__} on {jax.devices()[0].device_kind}')
EOF

# The benchmark needs flax and optax beside jax (it runs from this checkout, so the package itself
# needs no install); add them if missing, never replacing the jax (and its CUDA plugin) installed here.
if ! python3 -c 'import flax, optax' 2>/dev/null; then
  constraints=$(mktemp)
  python3 -m pip freeze | grep -iE '^(jax|jaxlib|jax[-_]cuda[0-9]+[-_](plugin|pjrt))==' > "$constraints" || true
  python3 -m pip install --quiet -c "$constraints" flax optax
  rm -f "$constraints"
fi

run() {
  python3 -m benchmarks.solo --contenders ours --tasks train --train-dtypes float32,bfloat16 \
    --rounds 10 --warmup 3 --peak-size 8192 "$@"
}
for model in base big; do
  run --model "$model" --shape 768x32x32 --output "benchmarks/results/solo_gpu_$model.json"
  run --model "$model" --shape 32x32x32 --output "benchmarks/results/solo_gpu_${model}_32rows.json"
done
python3 -m benchmarks.complexity --output benchmarks/results/complexity_gpu.json
