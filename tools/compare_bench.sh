#!/usr/bin/env bash
# Us against PyTorch and onnxruntime-training on the same machine, runs alternating (this
# machine's speed drifts by tens of percent within minutes, so only interleaved runs
# compare); 2 threads everywhere, AdamW; ms per update over the last half of each run:
#  - the GPT-2 example's model (8 x 64 tokens, clipping 1.0) against the same ONNX file
#    through onnx2torch;
#  - SqueezeNet 1.1 (8 images, clipping 1.0) against the converted file and torchvision's
#    native squeezenet1_1;
#  - refkit's gpt2_tiny (4 x 128 tokens, no clipping; `onnx-train train`) against the file
#    through onnx2torch, transformers' native GPT2LMHeadModel of the same sizes, and
#    onnxruntime-training 1.19 on the same file.
# Prints each run and the medians with their ratios (>1: we are faster).
#
#   tools/compare_bench.sh [ROUNDS=3] [STEPS=20]
#
# PyTorch comes from $TORCH_PYTHON, or a venv the script creates in /tmp/torchvenv (torch,
# torchvision, onnx2torch, onnx, transformers from PyPI); onnxruntime-training from
# $ORT_TRAINING_PYTHON, or a venv it creates in /tmp/ortt (see tools/ort_train_bench.py).
# Not part of CI.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
rounds="${1:-3}" steps="${2:-20}"
py="${TORCH_PYTHON:-/tmp/torchvenv/bin/python}"
if ! "$py" -c "import torch, torchvision, onnx2torch, transformers" 2>/dev/null; then
  python3 -m venv /tmp/torchvenv
  /tmp/torchvenv/bin/pip install -q torch torchvision onnx2torch onnx numpy transformers
  py=/tmp/torchvenv/bin/python
fi
ortpy="${ORT_TRAINING_PYTHON:-/tmp/ortt/bin/python}"
if ! "$ortpy" -c "from onnxruntime.training import artifacts" 2>/dev/null; then
  python3 -m venv /tmp/ortt
  /tmp/ortt/bin/pip install -q onnxruntime-training onnx==1.16.2 numpy
  # onnxruntime-training imports torch: borrow the PyTorch venv's (after its own packages).
  "$py" -c "import site; print(site.getsitepackages()[0])" \
    > "$(/tmp/ortt/bin/python -c "import site; print(site.getsitepackages()[0])")/zz_torch.pth"
  ortpy=/tmp/ortt/bin/python
fi
cd "$root"
cargo build --release --workspace --example gpt2 --example squeezenet --bin onnx-train
squeezenet="$root/crates/burn-onnx-train/tests/data/refkit/models/squeezenet1_1_dynbatch.onnx"
tiny="$root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx"
out="$(mktemp -d /tmp/compare-bench.XXXX)"
source "$root/tools/bench_lib.sh"
write_run "$out/tiny" "$tiny" 1024 128 4 "$steps" adamw
sed -i 's/^\[optimizer\]$/max_grad_norm = 0.0\n[optimizer]/' "$out/tiny/run.toml"

ours() { # EXAMPLE: ms/update of one bench run
  "target/release/examples/$1" --bench --steps "$steps" --output-dir "$out/$1" > "$out/$1.log" 2>&1 \
    || { tail -5 "$out/$1.log"; exit 1; }
  python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['avg_update_ms'], 1))" "$out/$1/bench/perf.json"
}
tiny_ours() { # ms/update of one `onnx-train train` run on gpt2_tiny
  target/release/onnx-train train --config "$out/tiny/run.toml" --output-dir "$out/tiny/run" \
    > "$out/tiny.log" 2>&1 || { tail -5 "$out/tiny.log"; exit 1; }
  python3 -c "import json,sys; print(round(json.load(open(sys.argv[1]))['avg_update_ms'], 1))" "$out/tiny/run/perf.json"
}
last_ms() { tail -1 | python3 -c "import json,sys; print(round(json.loads(sys.stdin.read())['avg_update_ms'], 1))"; }
torch() { # ARGS: ms/update of one tools/torch_bench.py run
  "$py" tools/torch_bench.py "$@" --steps "$steps" 2>/dev/null | last_ms
}
ort_training() { # ARGS: ms/update of one tools/ort_train_bench.py run
  "$ortpy" tools/ort_train_bench.py "$@" --steps "$steps" 2>/dev/null | last_ms
}

declare -A runs
for r in $(seq "$rounds"); do
  runs[gpt2_ours]+=" $(ours gpt2)"
  runs[gpt2_onnx2torch]+=" $(torch gpt2 "$out/gpt2/bench/gpt2.onnx" --batch 8 --seq 64)"
  runs[sq_ours]+=" $(ours squeezenet)"
  runs[sq_onnx2torch]+=" $(torch squeezenet "$squeezenet" --batch 8)"
  runs[sq_native]+=" $(torch squeezenet "$squeezenet" --batch 8 --native)"
  runs[tiny_ours]+=" $(tiny_ours)"
  runs[tiny_onnx2torch]+=" $(torch gpt2 "$tiny" --batch 4 --seq 128 --vocab 1024 --max-norm 0)"
  runs[tiny_native]+=" $(torch gpt2 "$tiny" --batch 4 --seq 128 --vocab 1024 --max-norm 0 --native --heads 4)"
  runs[tiny_ort]+=" $(ort_training "$tiny" --batch 4 --seq 128 --vocab 1024)"
  echo "round $r:$(for k in gpt2_ours gpt2_onnx2torch sq_ours sq_onnx2torch sq_native tiny_ours tiny_onnx2torch tiny_native tiny_ort; do printf ' %s=%s' "$k" "${runs[$k]##* }"; done)"
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
m() { echo "${runs[$1]}" | median; }
echo
echo "| model | ours ms/update | PyTorch onnx2torch | ratio | PyTorch native | ratio | onnxruntime-training | ratio |"
echo "|---|---|---|---|---|---|---|---|"
g=$(m gpt2_ours) go=$(m gpt2_onnx2torch) s=$(m sq_ours) so=$(m sq_onnx2torch) sn=$(m sq_native)
t=$(m tiny_ours) to=$(m tiny_onnx2torch) tn=$(m tiny_native) tr=$(m tiny_ort)
ratio() { python3 -c "print(f'{$1 / $2:.2f}x')"; }
echo "| GPT-2 example (8 x 64 tokens) | $g | $go | $(ratio "$go" "$g") | - | - | - | - |"
echo "| SqueezeNet 1.1 (8 images) | $s | $so | $(ratio "$so" "$s") | $sn | $(ratio "$sn" "$s") | - | - |"
echo "| gpt2_tiny (4 x 128 tokens, no clipping) | $t | $to | $(ratio "$to" "$t") | $tn | $(ratio "$tn" "$t") | $tr | $(ratio "$tr" "$t") |"
echo "(medians of $rounds alternating rounds, $steps updates each; runs in $out)"
