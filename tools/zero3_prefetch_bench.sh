#!/usr/bin/env bash
# ZeRO-3's parameter gathers inline against prefetched on a communication thread
# (`zero3_prefetch` 0 and 2): a GPT-2 of the given shape under mpirun -np 2, one thread per
# rank, AdamW, 1 x 64 tokens per rank and update. Prints ms per update and perf.json's
# prefetch figures (gather time, its exposed part, the hidden fraction).
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/zero3_prefetch_bench.sh [layers heads width updates]
set -euo pipefail
source "$(dirname "$0")/bench_lib.sh"
layers="${1:-12}" heads="${2:-12}" width="${3:-768}" steps="${4:-6}"
dir="$(mktemp -d /tmp/zero3-prefetch.XXXX)"
gpt2_run "$dir" "$layers" "$heads" "$width" 50257 64 1 "$steps"
echo "| zero3_prefetch | ms/update | gather ms/update | exposed ms/update | hidden |"
echo "|---|---|---|---|---|"
cp "$dir/run.toml" "$dir/base.toml"
for depth in 0 2; do
  sed "s/^\[optimizer\]/zero3_prefetch = $depth\n[optimizer]/" "$dir/base.toml" > "$dir/run.toml"
  mpi_train "$dir" "prefetch-$depth" 2 --dp 2 --zero 3
  python3 - "$dir/prefetch-$depth/perf.json" "$depth" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
h = p["prefetch_hidden_fraction"]
print("| %s | %.0f | %.1f | %.1f | %s |" % (sys.argv[2], p["avg_update_ms"], p["avg_prefetch_gather_ms"], p["avg_prefetch_exposed_ms"], "-" if h is None else "%.0f%%" % (100 * h)))
PY
done
rm -rf "$dir"
