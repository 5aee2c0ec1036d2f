#!/usr/bin/env bash
# Data-parallel step time on gpt2_tiny: one process vs 2 MPI ranks, same per-rank batch.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/dp_step_bench.sh [updates] [per-rank batch] [seq]
#   DP_FLAGS=--allreduce-in-fp16 tools/dp_step_bench.sh ...   (extra flags for both runs)
# Prints the perf.json of each run (avg_update_ms, tokens/s over the last half).
set -euo pipefail
source "$(dirname "$0")/bench_lib.sh"
steps="${1:-40}"; batch="${2:-4}"; seq="${3:-64}"
dir="$(mktemp -d /tmp/dp-step-bench.XXXX)"
write_run "$dir" "$bench_root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx" 1024 "$seq" "$batch" "$steps" adamw
for np in 1 2; do
  timeout -k 10 600 mpirun --oversubscribe -np "$np" "$bench_bin" train --config "$dir/run.toml" --dp "$np" --output-dir "$dir/np$np" ${DP_FLAGS:-} > /dev/null 2>&1
  echo "np=$np: $(tr -d '\n ' < "$dir/np$np/perf.json")"
done
