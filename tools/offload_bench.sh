#!/usr/bin/env bash
# AdamW with its moments in memory and on disk (`--offload-optimizer disk`) on a big GPT-2,
# each run a fresh process measured with /usr/bin/time -v (peak RSS, file-system blocks
# written) and perf.json (ms per update). Not part of CI (GB of weights); the figures go
# to BENCHMARKS.md.
#
#   cargo build --release -p burn-onnx-train --bin onnx-train
#   tools/offload_bench.sh [layers heads width updates [modes]]
#
# Defaults: the GPT-2 large shape (36 layers, 20 heads, width 1280: 774 M parameters),
# 3 updates of 1 x 64 tokens, modes "none disk". The XL shape (48 25 1600, 1.56 B) with
# mode "disk" is the run that does not fit 24 GiB in memory. EXTRA adds training flags,
# e.g. EXTRA="--dp 2 --zero 2" for ZeRO's shards on disk (thread ranks, 1 sample each).
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-36} HEADS=${2:-20} WIDTH=${3:-1280} UPDATES=${4:-3} MODES=${5:-"none disk"}
DIR=${DIR:-runs/offload-bench-$LAYERS-$WIDTH}
BIN=target/release/onnx-train
source tools/bench_lib.sh
gpt2_run "$DIR" "$LAYERS" "$HEADS" "$WIDTH" 50257 64 1 "$UPDATES"
for mode in $MODES; do
  out="$DIR/$mode"
  rm -rf "$out"
  /usr/bin/time -v $BIN train --config "$DIR/run.toml" --output-dir "$out" --offload-optimizer "$mode" ${EXTRA:-} \
    > "$DIR/$mode.log" 2>&1 || { echo "$mode failed:"; tail -5 "$DIR/$mode.log"; continue; }
  python3 - "$DIR/$mode.log" "$out/perf.json" "$mode" <<'PY'
import json, re, sys
log, perf, mode = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), sys.argv[3]
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)) / 2**20
out = int(re.search(r"File system outputs: (\d+)", log).group(1)) * 512 / 2**30
wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", log).group(1)
print(f"{mode}: peak RSS {rss:.2f} GiB, {perf['avg_update_ms'] / 1000:.1f} s/update, "
      f"{out:.2f} GiB written to disk in all, wall {wall}")
PY
done
