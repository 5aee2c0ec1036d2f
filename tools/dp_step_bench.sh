#!/usr/bin/env bash
# Data-parallel step time on gpt2_tiny: one process vs 2 MPI ranks, same per-rank batch.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/dp_step_bench.sh [updates] [per-rank batch] [seq]
# Prints the perf.json of each run (avg_update_ms, tokens/s over the last half).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-40}"; batch="${2:-4}"; seq="${3:-64}"
dir="$(mktemp -d /tmp/dp-step-bench.XXXX)"
mkdir -p "$dir/data"
python3 "$root/tools/random_tokens.py" "$dir/data/tokens.npy" 1024
cat > "$dir/run.toml" <<TOML
model_path = "$root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx"
train_data_dir = "$dir/data"
seq_len = $seq
batch_size = $batch
num_train_steps = $steps
evaluation_period = 0
progress = false
log_dir = ""
TOML
bin="$root/target/release/onnx-train"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for np in 1 2; do
  timeout -k 10 600 mpirun --oversubscribe -np "$np" "$bin" train --config "$dir/run.toml" --dp "$np" --output-dir "$dir/np$np" > /dev/null 2>&1
  echo "np=$np: $(tr -d '\n ' < "$dir/np$np/perf.json")"
done
