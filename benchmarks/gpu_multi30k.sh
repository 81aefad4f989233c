#!/usr/bin/env bash
# Multi30k quality runs on a lent GPU, all at once, within one call of a fixed length:
#
#   DATA=.m30k RESULTS=$OUT bash benchmarks/gpu_multi30k.sh fairseq-ende-s1,fairseq-ende-s2 540
#
# Trains the named recipes of benchmarks.multi30k_grid side by side (--parallel: these 2M-parameter
# models leave an H200 mostly idle one at a time), stops the training with SIGTERM (each run saves
# its step) EVALUATE_SECONDS before BUDGET seconds are up, then scores each from the mean of its
# last 10 checkpoints and its best one, greedy and beam 5 at length penalties 0.6 and 1.0.
# Every 30 s, and at the end, the results so far (logs, curves, scores, grid.json, nvidia-smi's
# utilisation) are packed into RESULTS/multi30k_grid.tar.gz, one file, so a call cut short still
# returns what it measured. DATA: a copy of ../shared/data/multi30k inside the checkout (a lent
# machine gets only the checkout), in a folder .git/info/exclude ignores. EVALUATE: the options of
# benchmarks.multi30k evaluate, or 'none'; TRAIN_OPTIONS: train.py options added to every run.
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:?recipes, comma-separated (python -m benchmarks.multi30k_grid --list)}
budget=${2:-540}
data=${DATA:-../shared/data/multi30k}
results=${RESULTS:-benchmarks/results}
work=$(mktemp -d)
mkdir -p "$work/grid" "$results"
source benchmarks/gpu_deps.sh
nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 10 \
  > "$work/grid/nvidia_smi.csv" 2>/dev/null &
smi=$!
pack() { tar czf "$results/.multi30k_grid.tar.gz" -C "$work" grid 2>/dev/null \
           && mv "$results/.multi30k_grid.tar.gz" "$results/multi30k_grid.tar.gz"; }
( while sleep 30; do pack; done ) &
packer=$!
PYTHONUNBUFFERED=1 python3 -m benchmarks.multi30k_grid --parallel --runs "$runs" --budget "$budget" \
  --evaluate-seconds "${EVALUATE_SECONDS:-150}" --data "$data" --workroot "$work/runs" \
  --results "$work/grid" \
  --evaluate "${EVALUATE:---average-last 10 --weights average-last10,best --beams 5 --alphas 0.6,1.0 --batch-size 256}" \
  ${TRAIN_OPTIONS:-}
code=$?
kill "$packer" "$smi" 2>/dev/null
pack
exit $code
