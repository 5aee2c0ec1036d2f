#!/usr/bin/env bash
# Gradient averaging hidden behind backward (`--overlap N`) on 2 MPI ranks, runs alternating
# with plain data parallelism (average after backward), gpt2_tiny, AdamW:
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/overlap_bench.sh [ROUNDS=3] [UPDATES=40] [PER-RANK BATCH=4] [SEQ=128] [SEGMENTS=4]
# Per run, from perf.json (ms per update over the last half): the update, the update
# strategy (what is averaged after backward, clipping, AdamW), the communication thread's
# averaging during backward, and the part of it the update waited for after backward;
# "hidden" = 1 - exposed / overlapped.
set -euo pipefail
source "$(dirname "$0")/bench_lib.sh"
rounds="${1:-3}" steps="${2:-40}" batch="${3:-4}" seq="${4:-128}" segments="${5:-4}"
dir="$(mktemp -d /tmp/overlap-bench.XXXX)"
write_run "$dir" "$bench_root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx" 1024 "$seq" "$batch" "$steps" adamw
show() { # NAME: one line of its perf.json figures
  python3 - "$dir/$1/perf.json" "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
busy, exposed = p["avg_overlapped_sync_ms"], p["avg_exposed_sync_ms"]
hidden = f"{100 * (1 - exposed / busy):.0f}%" if busy > 0 else "-"
print(f"{sys.argv[2]:>12}: update {p['avg_update_ms']:.1f} ms, strategy {p['avg_sync_and_update_ms']:.1f} ms, "
      f"overlapped {busy:.2f} ms, exposed {exposed:.2f} ms, hidden {hidden}, {p['throughput_per_sec']:.0f} tokens/s")
PY
}
for r in $(seq "$rounds"); do
  mpi_train "$dir" "plain-$r" 2 --dp 2
  show "plain-$r"
  mpi_train "$dir" "overlap-$r" 2 --dp 2 --overlap "$segments"
  show "overlap-$r"
done
