#!/usr/bin/env bash
# Two or more builds of `onnx-train` against each other on refkit's gpt2_tiny (4 x 128
# tokens, AdamW, no clipping, 30 updates; the run of tools/compare_bench.sh), runs
# alternating (this machine's speed drifts by tens of percent within minutes); prints each
# round's ms per update (`avg_update_ms` of perf.json) and the medians.
#
#   cp target/release/onnx-train /tmp/new; git stash; cargo build --release ...; cp target/release/onnx-train /tmp/old; git stash pop
#   tools/ab_bench.sh 8 /tmp/old /tmp/new
#
# Not part of CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="$1"; shift
out="$(mktemp -d /tmp/ab-bench.XXXX)"
source "$root/tools/bench_lib.sh"
write_run "$out" "$root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx" 1024 128 4 30 adamw
sed -i 's/^\[optimizer\]$/max_grad_norm = 0.0\n[optimizer]/' "$out/run.toml"
declare -A runs
for r in $(seq "$rounds"); do
  line="round $r:"
  for i in $(seq 1 $#); do
    bin="${!i}"
    "$bin" train --config "$out/run.toml" --output-dir "$out/run$i" > "$out/run$i.log" 2>&1 \
      || { tail -5 "$out/run$i.log"; exit 1; }
    ms=$(python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['avg_update_ms'], 2))" "$out/run$i/perf.json")
    runs[$i]+=" $ms"; line+=" $bin=$ms"
  done
  echo "$line"
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
for i in $(seq 1 $#); do echo "${!i}: median $(echo "${runs[$i]}" | median) ms/update (${runs[$i]# })"; done
