#!/usr/bin/env bash
# A GPT-2 124M-shaped model (12 layers, 12 heads, width 768, vocabulary 50257; PyTorch's
# TorchScript export of tools/export_gpt2_124m.py) trained by `onnx-train train`, by PyTorch
# on the same ONNX file through onnx2torch, and by transformers' native GPT2LMHeadModel of the
# same sizes; AdamW, no clipping, 2 threads, runs alternating (this machine's speed drifts).
# Prints each round's ms per update (over the last half of each run) and the medians with
# their ratios (>1: we are faster).
#
#   cargo build --release -p burn-onnx-train --bin onnx-train
#   tools/gpt2_124m_bench.sh [ROUNDS=3] [STEPS=6] [BATCH=2] [SEQ=128]
#
# PyTorch from $TORCH_PYTHON or /tmp/torchvenv (tools/compare_bench.sh creates it). Not part
# of CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}" steps="${2:-6}" batch="${3:-2}" seq="${4:-128}"
py="${TORCH_PYTHON:-/tmp/torchvenv/bin/python}"
model=/tmp/gpt2_124m_bench/gpt2_124m.onnx
[ -f "$model" ] || "$py" "$root/tools/export_gpt2_124m.py" "$model" > /dev/null
out="$(mktemp -d /tmp/gpt2-124m-bench.XXXX)"
source "$root/tools/bench_lib.sh"
write_run "$out" "$model" 50257 "$seq" "$batch" "$steps" adamw
sed -i 's/^\[optimizer\]$/max_grad_norm = 0.0\n[optimizer]/' "$out/run.toml"
last_ms() { tail -1 | python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['avg_update_ms'], 1))"; }
ours() {
  "$bench_bin" train --config "$out/run.toml" --output-dir "$out/run" > "$out/ours.log" 2>&1 \
    || { tail -5 "$out/ours.log"; exit 1; }
  python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['avg_update_ms'], 1))" "$out/run/perf.json"
}
torch() { "$py" "$root/tools/torch_bench.py" gpt2 "$model" --batch "$batch" --seq "$seq" --max-norm 0 --steps "$steps" "$@" 2>/dev/null | last_ms; }
declare -A runs
for r in $(seq "$rounds"); do
  runs[ours]+=" $(ours)"
  runs[onnx2torch]+=" $(torch)"
  runs[native]+=" $(torch --native --heads 12)"
  echo "round $r: ours=${runs[ours]##* } onnx2torch=${runs[onnx2torch]##* } native=${runs[native]##* }"
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
o=$(echo "${runs[ours]}" | median) t=$(echo "${runs[onnx2torch]}" | median) n=$(echo "${runs[native]}" | median)
ratio() { python3 -c "print(f'{$1 / $2:.2f}x')"; }
echo "| GPT-2 124M ($batch x $seq tokens) | $o | $t | $(ratio "$t" "$o") | $n | $(ratio "$n" "$o") |"
echo "(ms/update: ours, PyTorch onnx2torch, ratio, PyTorch native, ratio; medians of $rounds alternating rounds, $steps updates each; runs in $out)"
