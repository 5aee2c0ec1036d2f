#!/usr/bin/env bash
# Tensor parallelism on a GPT-2 whose blocks hold the work (8 layers, width 512, 8 heads,
# vocab 512): one process against 2 MPI tensor-parallel ranks, and dp 2 for comparison.
# Then the GPT-2 example's model (2 layers, width 128, 4 heads, the GPT-2 vocabulary of
# 50257, 94% of it in the tied embedding): one process against tp 2 with and without the
# vocabulary split (`tensor_parallel_vocab`). Both with Megatron's sequence parallelism
# (`--sequence-parallel`) as well.
#   cargo build --release --features mpi -p burn-onnx-train --bin onnx-train
#   tools/tp_bench.sh [updates] [batch] [seq]
# Prints one row per run: time per update, and per rank the parameter, gradient and
# optimizer-state bytes and the peak RSS.
set -euo pipefail
source "$(dirname "$0")/bench_lib.sh"
steps="${1:-12}"; batch="${2:-16}"; seq="${3:-64}"
dir="$(mktemp -d /tmp/tp-bench.XXXX)"
"$bench_bin" gpt2 --output "$dir/gpt2_8x512.onnx" --layers 8 --heads 8 --width 512 --vocab 512 --positions "$seq" > /dev/null
write_run "$dir" "$dir/gpt2_8x512.onnx" 512 "$seq" "$batch" "$steps" adamw
run() { # name np flags...
  mpi_train "$dir" "$@"
  python3 - "$dir/$1/perf.json" "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
mib = lambda k: " ".join("%.1f" % (b / 2**20) for b in p[k])
print("| %s | %d | %.0f | %s | %s | %s | %s |" % (sys.argv[2], p["world_size"], p["avg_update_ms"], mib("parameter_bytes"), mib("gradient_bytes"), mib("optimizer_state_bytes"), mib("peak_rss_bytes")))
PY
}
echo "| run | ranks | ms/update | parameters MiB per rank | gradients MiB | optimizer state MiB | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|"
run single 1
run tp2 2 --tp 2
run tp2-seq 2 --tp 2 --sequence-parallel
run dp2 2 --dp 2 --batch-size $((batch / 2))

# The example's model: batch 8 of 64 tokens, as `cargo run --release --example gpt2`.
dir="$(mktemp -d /tmp/tp-bench-vocab.XXXX)"
gpt2_run "$dir" 2 4 128 50257 64 8 "$steps"
cp "$dir/run.toml" "$dir/whole_vocab.toml"
sed -i 's/^\[optimizer\]/tensor_parallel_vocab = false\n[optimizer]/' "$dir/whole_vocab.toml"
echo
echo "| run | ranks | ms/update | parameters MiB per rank | gradients MiB | optimizer state MiB | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|"
run single 1
run tp2-vocab 2 --tp 2
run tp2-vocab-seq 2 --tp 2 --sequence-parallel
cp "$dir/whole_vocab.toml" "$dir/run.toml"
run tp2-whole-vocab 2 --tp 2
