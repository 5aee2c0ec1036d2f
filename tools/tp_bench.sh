#!/usr/bin/env bash
# Tensor parallelism on a GPT-2 whose blocks hold the work (8 layers, width 512, 8 heads,
# vocab 512): one process against 2 MPI tensor-parallel ranks, and dp 2 for comparison.
# Every rank runs on one thread (RAYON_NUM_THREADS=1), one rank per core.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/tp_bench.sh [updates] [batch] [seq]
# Prints one row per run: time per update, and per rank the parameter, gradient and
# optimizer-state bytes and the peak RSS.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-12}"; batch="${2:-16}"; seq="${3:-64}"
bin="$root/target/release/onnx-train"
dir="$(mktemp -d /tmp/tp-bench.XXXX)"
mkdir -p "$dir/data"
"$bin" gpt2 --output "$dir/gpt2_8x512.onnx" --layers 8 --heads 8 --width 512 --vocab 512 --positions 128 > /dev/null
python3 "$root/tools/random_tokens.py" "$dir/data/tokens.npy" 512
cat > "$dir/run.toml" <<TOML
model_path = "$dir/gpt2_8x512.onnx"
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
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 RAYON_NUM_THREADS=1
run() { # name np flags...
  local name="$1" np="$2"; shift 2
  timeout -k 10 1200 mpirun --oversubscribe -np "$np" "$bin" train --config "$dir/run.toml" --output-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$dir/$name.log"; exit 1; }
  python3 - "$dir/$name/perf.json" "$name" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
mib = lambda k: " ".join("%.1f" % (b / 2**20) for b in p[k])
print("| %s | %d | %.0f | %s | %s | %s | %s |" % (sys.argv[2], p["world_size"], p["avg_update_ms"], mib("parameter_bytes"), mib("gradient_bytes"), mib("optimizer_state_bytes"), mib("peak_rss_bytes")))
PY
}
echo "| run | ranks | ms/update | parameters MiB per rank | gradients MiB | optimizer state MiB | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|"
run single 1
run tp2 2 --tp 2
run dp2 2 --dp 2 --batch-size $((batch / 2))
