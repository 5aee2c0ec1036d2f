#!/usr/bin/env bash
# `onnx-train plan` against real runs: for each layout, a 6-update run (perf.json: the
# strategy's byte counts and the kernel's peak resident set) and the plan of the same
# command line; prints a markdown row per layout. Not part of CI (the test
# `plan_predicts_each_layouts_memory_against_its_measured_run` in tests/integration/cli.rs checks a
# small model); the figures go to BENCHMARKS.md.
#
#   cargo build --release -p burn-onnx-train --bin onnx-train
#   tools/plan_check.sh [layers heads width vocab seq batch]
#
# Defaults: 4 layers x 256 wide, 8192 words, 8 x 128 tokens per micro-step.
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-4} HEADS=${2:-4} WIDTH=${3:-256} VOCAB=${4:-8192} SEQ=${5:-128} BATCH=${6:-8}
DIR=${DIR:-runs/plan-check-$LAYERS-$WIDTH}
BIN=$PWD/target/release/onnx-train
source tools/bench_lib.sh
gpt2_run "$DIR" "$LAYERS" "$HEADS" "$WIDTH" "$VOCAB" "$SEQ" "$BATCH" 6
echo "| layout | measured peak RSS | predicted | error | parameters / gradients / optimizer per rank (plan = run) |"
echo "|---|---|---|---|---|"
LAYOUTS=${LAYOUTS:-"|--recompute 2|--accumulation 2|--dp 2|--zero 1 --dp 2|--tp 2|--pp 2"}
IFS='|' read -ra ALL <<< "$LAYOUTS"
for layout in "${ALL[@]}"; do
  rm -rf "$DIR/out"
  # shellcheck disable=SC2086
  $BIN train --config "$DIR/run.toml" --output-dir "$DIR/out" $layout > "$DIR/train.log" 2>&1
  # shellcheck disable=SC2086
  $BIN plan --config "$DIR/run.toml" --output-dir "$DIR/out" --json $layout 2> "$DIR/plan.log" > "$DIR/plan.json"
  python3 - "$DIR/out/perf.json" "$DIR/plan.json" "${layout:-one process}" <<'PY'
import json, sys
perf, plan, name = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
mib = lambda b: b / 2**20
ranks = plan["ranks"]
predicted = plan["process_base_bytes"] + plan["dp"] * sum(r["peak_bytes"] for r in ranks)
peak = perf["peak_rss_bytes"][0]
same = all(
    r["parameter_bytes"] == perf["parameter_bytes"][r["stage"] * plan["dp"] * plan["tp"] + r["tp_rank"] * plan["dp"]]
    and r["gradient_bytes"] == perf["gradient_bytes"][r["stage"] * plan["dp"] * plan["tp"] + r["tp_rank"] * plan["dp"]]
    for r in ranks)
r0 = ranks[0]
print(f"| `{name}` | {mib(peak):.0f} MiB | {mib(predicted):.0f} MiB | {100 * (predicted - peak) / peak:+.1f}% | "
      f"{mib(r0['parameter_bytes']):.1f} / {mib(r0['gradient_bytes']):.1f} / {mib(r0['optimizer_state_bytes']):.1f} MiB (rank 0){'' if same else ' MISMATCH'} |")
PY
done
