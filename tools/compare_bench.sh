#!/usr/bin/env bash
# Us against PyTorch on the same machine, runs alternating (this machine's speed drifts by
# tens of percent within minutes, so only interleaved runs compare): the GPT-2 example's
# model (8 x 64 tokens) against the same ONNX file through onnx2torch, and SqueezeNet 1.1
# (8 images) against the converted file and against torchvision's native squeezenet1_1.
# AdamW, clipping 1.0, 2 threads everywhere; ms per update over the last half of each run.
# Prints each run and the medians with their ratios (>1: we are faster).
#
#   tools/compare_bench.sh [ROUNDS=3] [STEPS=20]
#
# PyTorch comes from $TORCH_PYTHON, or a venv the script creates in /tmp/torchvenv (torch,
# torchvision, onnx2torch, onnx from PyPI). Not part of CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}" steps="${2:-20}"
py="${TORCH_PYTHON:-/tmp/torchvenv/bin/python}"
if ! "$py" -c "import torch, torchvision, onnx2torch" 2>/dev/null; then
  python3 -m venv /tmp/torchvenv
  /tmp/torchvenv/bin/pip install -q torch torchvision onnx2torch onnx numpy
  py=/tmp/torchvenv/bin/python
fi
cd "$root"
cargo build --release --example gpt2 --example squeezenet
squeezenet="$root/crates/burn-onnx-train/tests/data/refkit/models/squeezenet1_1_dynbatch.onnx"
out="$(mktemp -d /tmp/compare-bench.XXXX)"

ours() { # EXAMPLE: ms/update of one bench run
  "target/release/examples/$1" --bench --steps "$steps" --output-dir "$out/$1" > "$out/$1.log" 2>&1 \
    || { tail -5 "$out/$1.log"; exit 1; }
  python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['avg_update_ms'], 1))" "$out/$1/bench/perf.json"
}
torch() { # ARGS: ms/update of one tools/torch_bench.py run
  "$py" tools/torch_bench.py "$@" --steps "$steps" | tail -1 \
    | python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['avg_update_ms'], 1))"
}

declare -A runs
for r in $(seq "$rounds"); do
  runs[gpt2_ours]+=" $(ours gpt2)"
  runs[gpt2_onnx2torch]+=" $(torch gpt2 "$out/gpt2/bench/gpt2.onnx" --batch 8 --seq 64)"
  runs[sq_ours]+=" $(ours squeezenet)"
  runs[sq_onnx2torch]+=" $(torch squeezenet "$squeezenet" --batch 8)"
  runs[sq_native]+=" $(torch squeezenet "$squeezenet" --batch 8 --native)"
  echo "round $r:$(for k in gpt2_ours gpt2_onnx2torch sq_ours sq_onnx2torch sq_native; do printf ' %s=%s' "$k" "${runs[$k]##* }"; done)"
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
m() { echo "${runs[$1]}" | median; }
echo
echo "| model | ours ms/update | PyTorch onnx2torch | ratio | PyTorch native | ratio |"
echo "|---|---|---|---|---|---|"
g=$(m gpt2_ours) go=$(m gpt2_onnx2torch) s=$(m sq_ours) so=$(m sq_onnx2torch) sn=$(m sq_native)
ratio() { python3 -c "print(f'{$1 / $2:.2f}x')"; }
echo "| GPT-2 example (8 x 64 tokens) | $g | $go | $(ratio "$go" "$g") | - | - |"
echo "| SqueezeNet 1.1 (8 images) | $s | $so | $(ratio "$so" "$s") | $sn | $(ratio "$sn" "$s") |"
echo "(medians of $rounds alternating rounds, $steps updates each; runs in $out)"
