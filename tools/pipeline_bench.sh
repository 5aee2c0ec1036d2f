#!/usr/bin/env bash
# Pipeline parallelism on a balanced GPT-2 (8 layers, width 256, vocab 512: the blocks hold
# the work, so an automatic cut gives equal stages): one process against 2 MPI stages, the
# bubble against (p-1)/(v m+p-1) (v: virtual stages, interleaved 1F1B), GPipe against 1F1B
# peak memory, and dp 2 for comparison.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/pipeline_bench.sh [updates] [batch] [seq]
# Prints one row per run: time per update, each rank's idle fraction and peak RSS.
set -euo pipefail
source "$(dirname "$0")/bench_lib.sh"
steps="${1:-12}"; batch="${2:-16}"; seq="${3:-64}"
dir="$(mktemp -d /tmp/pipeline-bench.XXXX)"
"$bench_bin" gpt2 --output "$dir/gpt2_8x256.onnx" --layers 8 --heads 4 --width 256 --vocab 512 --positions 128 > /dev/null
write_run "$dir" "$dir/gpt2_8x256.onnx" 512 "$seq" "$batch" "$steps" adamw
"$bench_bin" inspect "$dir/gpt2_8x256.onnx" --stages 2 | sed -n '/^pipeline/,$p'
run() { # name np flags...
  mpi_train "$dir" "$@"
  python3 - "$dir/$1/perf.json" "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
s, m, v = p["pipeline_stages"], p["pipeline_micro_batches"], p.get("pipeline_virtual_stages", 1)
theory = (s - 1) / (v * m + s - 1)
idle = " ".join("%.2f" % f for f in p["pipeline_idle_fraction"])
rss = " ".join("%d" % (b / 2**20) for b in p["peak_rss_bytes"])
print("| %s | %d | %d | %d | %.0f | %s | %.2f | %s |" % (sys.argv[2], p["world_size"], v, m, p["avg_update_ms"], idle, theory, rss))
PY
}
echo "| run | ranks | chunks per rank v | micro-batches m | ms/update | idle fraction per rank | (p-1)/(v m+p-1) | peak RSS MiB per rank |"
echo "|---|---|---|---|---|---|---|---|"
run single 1
run dp2 2 --dp 2 --batch-size $((batch / 2))
for m in 1 2 4 8 16; do
  run "pp2-1f1b-m$m" 2 --pp 2 --micro-batches "$m"
done
for m in 8 16; do
  run "pp2-gpipe-m$m" 2 --pp 2 --micro-batches "$m" --pipeline-schedule gpipe
done
for v in 2 4; do
  for m in 2 4 8; do
    run "pp2-v$v-m$m" 2 --pp 2 --virtual-stages "$v" --micro-batches "$m"
  done
done
