#!/usr/bin/env bash
# Where one optimizer update's GPU time goes, kernel by kernel, from the binaries
# tools/gpu/pack.sh packed: Nsight Compute (ncu) times every kernel of a few updates of
# `onnx-train train --device cuda`, and tools/gpu/kernel_summary.py sums the last update
# by kernel name against the update's wall time from a run without the profiler.
#
#   tools/gpu/kernel_profile.sh --pack .gpu/cuda/pack.tar.xz [--layers 12 --heads 12
#       --width 768 --batch 8 --seq 256 --precision bf16 --updates 4]
#
# Writes $OUT/kernels.csv.xz (ncu's table), $OUT/kernel_summary.json and
# $OUT/kernel_profile.log; prints the summary. Needs ncu and python3 with torch (the
# model is exported by tools/gpu/torch_gpt2.py, as check.sh's benchmark does).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
pack="" layers=12 heads=12 width=768 batch=8 seq=256 precision=bf16 updates=4
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) pack="$2" ;;
    --layers) layers="$2" ;;
    --heads) heads="$2" ;;
    --width) width="$2" ;;
    --batch) batch="$2" ;;
    --seq) seq="$2" ;;
    --precision) precision="$2" ;;
    --updates) updates="$2" ;;
    *) echo "kernel_profile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift 2
done
[ -f "$pack" ] || { echo "kernel_profile.sh: --pack FILE (from tools/gpu/pack.sh) is required" >&2; exit 2; }
ncu="$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
[ -x "$ncu" ] || { echo "kernel_profile.sh: ncu (Nsight Compute) is not on this machine" >&2; exit 2; }
out="${OUT:-$root/.gpu/out}"
mkdir -p "$out"
log="$out/kernel_profile.log"
: > "$log"
source "$root/tools/gpu/env.sh"
source "$root/tools/bench_lib.sh"

dir="$work/profile"
mkdir -p "$dir"
python3 "$root/tools/gpu/torch_gpt2.py" export "$dir/model.onnx" --layers "$layers" --heads "$heads" --width "$width" >> "$log" 2>&1
# The wall time of an update, without the profiler (last half of 10 updates).
write_run "$dir/plain" "$dir/model.onnx" 50257 "$seq" "$batch" 10 adamw
timeout 300 "$bin/onnx-train" train --config "$dir/plain/run.toml" --output-dir "$dir/plain/run" \
  --device cuda --precision "$precision" >> "$log" 2>&1 || { echo "kernel_profile.sh: the plain run failed (see $log)" >&2; exit 1; }
update_ms="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["avg_update_ms"])' "$dir/plain/run/perf.json")"
# Every kernel of a few updates, timed one at a time.
write_run "$dir/ncu" "$dir/model.onnx" 50257 "$seq" "$batch" "$updates" adamw
timeout 400 "$ncu" --csv --page raw --metrics gpu__time_duration.sum --clock-control none \
  --log-file "$dir/kernels.csv" "$bin/onnx-train" train --config "$dir/ncu/run.toml" \
  --output-dir "$dir/ncu/run" --device cuda --precision "$precision" >> "$log" 2>&1 \
  || { echo "kernel_profile.sh: the profiled run failed (see $log)" >&2; exit 1; }
xz -T0 -c "$dir/kernels.csv" > "$out/kernels.csv.xz"
python3 "$root/tools/gpu/kernel_summary.py" "$dir/kernels.csv" --update-ms "$update_ms" \
  --json "$out/kernel_summary.json" | tee -a "$log"
