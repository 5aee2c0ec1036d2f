#!/usr/bin/env bash
# Load, run and export a big GPT-2 (external data), each step a fresh process measured with
# /usr/bin/time -v, and onnxruntime's session on the same file. Not part of CI (6 GB of
# weights for the XL shape); the figures go to BENCHMARKS.md.
#
#   cargo build --release -p burn-onnx-train --bin onnx-train
#   PY=/path/to/python-with-onnxruntime-and-onnx tools/big_model_bench.sh [layers heads width]
#
# Defaults: the GPT-2 XL shape (48 layers, 25 heads, width 1600: 1.56 B parameters).
set -euo pipefail
cd "$(dirname "$0")/.."
LAYERS=${1:-48} HEADS=${2:-25} WIDTH=${3:-1600}
DIR=${DIR:-runs/gpt2-big}
BIN=target/release/onnx-train
PY=${PY:-python3}
mkdir -p "$DIR"
measure() { /usr/bin/time -v "$@" 2>&1 | grep -E "^(wrote|exported|  ort|  max)|Elapsed|Maximum resident" | sed "s/^/  /"; }
echo "== build (onnx-train gpt2, weights to external data)"
measure $BIN gpt2 --output "$DIR/model.onnx" --layers "$LAYERS" --heads "$HEADS" --width "$WIDTH"
ls -l "$DIR"
echo "== load (onnx-train inspect)"
measure $BIN inspect "$DIR/model.onnx"
echo "== forward, one batch of 1 x 64 tokens (onnx-train run)"
$PY -c "import numpy as np; np.save('$DIR/ids.npy', (np.arange(64, dtype=np.int64) * 7919 % 50257).reshape(1, 64))"
measure $BIN run "$DIR/model.onnx" --input "input_ids=$DIR/ids.npy" --output-dir "$DIR/ours"
echo "== export (onnx-train export --model, to external data)"
measure $BIN export --model "$DIR/model.onnx" --output "$DIR/exported/model.onnx"
echo "== onnxruntime: session on the exported file, same batch, compared with ours"
measure $PY -c "
import numpy as np, onnxruntime as ort, time
t = time.time(); s = ort.InferenceSession('$DIR/exported/model.onnx', providers=['CPUExecutionProvider']); print('  ort session', round(time.time() - t, 2), 's')
got = s.run(None, {'input_ids': np.load('$DIR/ids.npy')})[0]; ours = np.load('$DIR/ours/logits.npy')
print('  max |ort - ours| =', float(np.abs(got - ours).max()))"
echo "== onnx.checker on the exported file (follows external data)"
$PY -c "import onnx; onnx.checker.check_model('$DIR/exported/model.onnx'); print('  checker: ok')"
