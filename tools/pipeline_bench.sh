#!/usr/bin/env bash
# Pipeline parallelism on a balanced GPT-2 (8 layers, width 256, vocab 512: the blocks hold
# the work, so an automatic cut gives equal stages): one process against 2 MPI stages, the
# bubble against (p-1)/(m+p-1), GPipe against 1F1B peak memory, and dp 2 for comparison.
# Every rank runs on one thread (RAYON_NUM_THREADS=1), one rank per core.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/pipeline_bench.sh [updates] [batch] [seq]
# Prints one row per run: time per update, each rank's idle fraction and peak RSS.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-12}"; batch="${2:-16}"; seq="${3:-64}"
bin="$root/target/release/onnx-train"
dir="$(mktemp -d /tmp/pipeline-bench.XXXX)"
mkdir -p "$dir/data"
"$bin" gpt2 --output "$dir/gpt2_8x256.onnx" --layers 8 --heads 4 --width 256 --vocab 512 --positions 128 > /dev/null
python3 "$root/tools/random_tokens.py" "$dir/data/tokens.npy" 512
cat > "$dir/run.toml" <<TOML
model_path = "$dir/gpt2_8x256.onnx"
train_data_dir = "$dir/data"
input_name = "input_ids"
output_name = "logits"
loss = "lm_cross_entropy"
seq_len = $seq
batch_size = $batch
num_train_steps = $steps
evaluation_period = 0
progress = false
log_dir = ""
[optimizer]
kind = "adamw"
TOML
"$bin" inspect "$dir/gpt2_8x256.onnx" --stages 2 | sed -n '/^pipeline/,$p'
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1
run() { # name np flags...
  local name="$1" np="$2"; shift 2
  timeout -k 10 1200 mpirun --oversubscribe -np "$np" "$bin" train --config "$dir/run.toml" --output-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$dir/$name.log"; exit 1; }
  python3 - "$dir/$name/perf.json" "$name" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
s, m = p["pipeline_stages"], p["pipeline_micro_batches"]
theory = (s - 1) / (m + s - 1)
idle = " ".join("%.2f" % f for f in p["pipeline_idle_fraction"])
rss = " ".join("%d" % (b / 2**20) for b in p["peak_rss_bytes"])
print("| %s | %d | %d | %.0f | %s | %.2f | %s |" % (sys.argv[2], p["world_size"], m, p["avg_update_ms"], idle, theory, rss))
PY
}
echo "| run | ranks | micro-batches | ms/update | idle fraction per rank | (p-1)/(m+p-1) | peak RSS MiB per rank |"
echo "|---|---|---|---|---|---|---|"
run single 1
run dp2 2 --dp 2 --batch-size $((batch / 2))
for m in 1 2 4 8 16; do
  run "pp2-1f1b-m$m" 2 --pp 2 --micro-batches "$m"
done
for m in 8 16; do
  run "pp2-gpipe-m$m" 2 --pp 2 --micro-batches "$m" --pipeline-schedule gpipe
done
