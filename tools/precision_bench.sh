#!/usr/bin/env bash
# The GPT-2 example model (2 layers, width 128, vocab 50257, 8 x 64 tokens, AdamW) in one
# process: f32 against bf16 and f16 autocast, activation recomputation, and (with
# --features wgpu and a Vulkan driver) the wgpu device, in one run. Prints time per update
# and peak RSS from each run's perf.json.
#   cargo build --release --features wgpu --example gpt2
#   tools/precision_bench.sh [updates]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
steps="${1:-10}"
bin="$root/target/release/examples/gpt2"
dir="$(mktemp -d /tmp/precision-bench.XXXX)"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$dir}"
run() { # name flags...
  local name="$1"; shift
  "$bin" --bench --steps "$steps" --output-dir "$dir/$name" "$@" > "$dir/$name.log" 2>&1 \
    || { echo "$name failed:"; tail -5 "$dir/$name.log"; exit 1; }
  python3 - "$dir/$name/bench/perf.json" "$name" "$*" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
rss = max(p["peak_rss_bytes"]) / 2**20
print("| %s | `%s` | %.0f | %.0f | %.0f |" % (sys.argv[2], sys.argv[3], p["avg_update_ms"], p["throughput_per_sec"], rss))
PY
}
echo "| run | flags | ms/update | tokens/s | peak RSS MiB |"
echo "|---|---|---|---|---|"
run f32
run bf16 --precision bf16
run f16 --precision f16
run recompute2 --recompute 2
run recompute4 --recompute 4
if [ "${WGPU:-0}" = 1 ]; then
  run wgpu --device wgpu
fi
