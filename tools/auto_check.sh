#!/usr/bin/env bash
# `--auto` against trying every layout: `onnx-train plan --auto --np N` (planned memory
# and 4-update speed probes of each layout), then each layout trained for UPDATES updates
# as its own process (perf.json: throughput over the last half, peak RSS); prints the
# chosen layout's measured speed against the best measured one, and its predicted peak
# against its measured peak. Not part of CI (minutes per model); the figures go to
# BENCHMARKS.md.
#
#   cargo build --release -p burn-onnx-train --bin onnx-train
#   tools/auto_check.sh [layers heads width vocab seq batch np updates]
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-4} HEADS=${2:-4} WIDTH=${3:-256} VOCAB=${4:-8192} SEQ=${5:-128} BATCH=${6:-8}
NP=${7:-2} UPDATES=${8:-12}
DIR=${DIR:-runs/auto-check-$LAYERS-$WIDTH}
BIN=$PWD/target/release/onnx-train
source tools/bench_lib.sh
gpt2_run "$DIR" "$LAYERS" "$HEADS" "$WIDTH" "$VOCAB" "$SEQ" "$BATCH" "$UPDATES"
$BIN plan --config "$DIR/run.toml" --output-dir "$DIR/out" --auto --np "$NP" --json > "$DIR/auto.json" 2> "$DIR/auto.log"
python3 - "$DIR" "$BIN" "$DIR/run.toml" <<'PY'
import json, subprocess, sys
dir, bin, cfg = sys.argv[1:4]
trials = [t for t in json.load(open(f"{dir}/auto.json")) if t["refused"] is None]
rows = []
for t in trials:
    flags = ["--dp", t["dp"], "--tp", t["tp"], "--pp", t["pp"], "--zero", t["zero_stage"],
             "--batch-size", t["batch_size"], "--accumulation", t["accumulation"]]
    if t["micro_batches"]:
        flags += ["--micro-batches", t["micro_batches"], "--virtual-stages", t["chunks"]]
    if t["sequence"]:
        flags += ["--sequence-parallel"]
    if t["recompute"]:
        flags += ["--recompute", t["recompute"]]
    if t["offload"]:
        flags += ["--offload-optimizer", "disk"]
    out = f"{dir}/out"
    subprocess.run(["rm", "-rf", out], check=True)
    subprocess.run([bin, "train", "--config", cfg, "--output-dir", out] + [str(f) for f in flags],
                   check=True, capture_output=True)
    perf = json.load(open(f"{out}/perf.json"))
    rows.append((t, perf["throughput_per_sec"], perf["peak_rss_bytes"][0]))
best = max(r[1] for r in rows)
mib = lambda b: b / 2**20
print("| layout (dp tp pp zero batch accum micro v) | probe /s | measured /s | predicted peak | measured peak | |")
print("|---|---|---|---|---|---|")
for i, (t, speed, peak) in enumerate(rows):
    name = f'{t["dp"]} {t["tp"]} {t["pp"]} {t["zero_stage"]} {t["batch_size"]} {t["accumulation"]} {t["micro_batches"] or "-"} {t["chunks"]}'
    note = "chosen" if i == 0 else ""
    print(f'| {name} | {t["throughput_per_sec"]:.0f} | {speed:.0f} | {mib(t["predicted_peak_bytes"]):.0f} MiB | '
          f'{mib(peak):.0f} MiB ({100 * (t["predicted_peak_bytes"] - peak) / peak:+.1f}%) | {note} |')
chosen = rows[0]
print(f"chosen: {100 * chosen[1] / best:.1f}% of the best measured layout's speed")
PY
