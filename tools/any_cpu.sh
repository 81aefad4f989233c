#!/usr/bin/env bash
# The whole suite under the float32 arithmetic of other x86 CPUs, on this one.
#
#   bash tools/any_cpu.sh                  # native, then avx2 (the two runs every change needs)
#   bash tools/any_cpu.sh native avx2 avx  # and a run without FMA, the strictest of the three
#
# XLA's CPU compiler emits code for the host's instructions, so float32 sums round in an
# order that depends on the machine; a test that holds only on the machine its numbers came
# from fails elsewhere. Each variant runs README's test command with XLA_FLAGS set (tests that
# start JAX processes pass the flags on: tests/support/environment.py):
#   native  this CPU as it is;
#   avx2    --xla_cpu_max_isa=AVX2: no AVX-512, as on the AVX2-only machines that build and test
#           this project, and --xla_cpu_multi_thread_eigen=false: Eigen's matrix products on one
#           thread, as on a one-core machine (Eigen may split a product by thread count);
#   avx     --xla_cpu_max_isa=AVX: no FMA either, so every dot and layer rounds differently
#           from the native run (measured: native and AVX2 round alike where XLA keeps to
#           256-bit vectors, AVX does not). No supported machine lacks FMA; this variant
#           shows that no test leans on the last bits of any sum.
# Each variant's pytest summary is printed at the end; the status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

declare -A FLAGS=(
  [native]=''
  [avx2]='--xla_cpu_max_isa=AVX2 --xla_cpu_multi_thread_eigen=false'
  [avx]='--xla_cpu_max_isa=AVX --xla_cpu_multi_thread_eigen=false'
)
variants=("$@")
[ ${#variants[@]} -eq 0 ] && variants=(native avx2)
for variant in "${variants[@]}"; do
  if [ -z "${FLAGS[$variant]+set}" ]; then
    echo "any_cpu.sh: unknown variant '$variant' (native, avx2, avx)" >&2
    exit 2
  fi
done

status=0
summaries=()
for variant in "${variants[@]}"; do
  flags="${XLA_FLAGS:-} ${FLAGS[$variant]}"
  echo "== $variant: XLA_FLAGS='${flags# }'"
  log="$(mktemp)"
  start=$SECONDS
  XLA_FLAGS="${flags# }" python -m pytest -q 2>&1 | tee "$log"
  code=${PIPESTATUS[0]}
  [ "$code" -eq 0 ] || status=1
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -1)"
  summaries+=("$variant ($((SECONDS - start)) s, exit $code): $summary")
  rm -f "$log"
done
echo
printf '%s\n' "${summaries[@]}"
exit $status
