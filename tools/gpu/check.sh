#!/usr/bin/env bash
# One command that checks a GPU end to end, from the binaries tools/gpu/pack.sh packed.
# Writes $OUT/gpu_check.json (one entry per check) and $OUT/gpu_check.log.
#
#   tools/gpu/check.sh --pack .gpu/cuda/pack.tar.xz                  # on the GPU machine
#   tools/gpu/check.sh --pack .gpu/wgpu/pack.tar.xz --backends wgpu --no-bench  # lavapipe
#
# Checks, per backend (--backends, default cuda,wgpu):
#   - gpu-tests (crates/burn-onnx-train/tests/gpu.rs) with ONNX_TRAIN_TEST_GPU=<backend>:
#     the refkit models' forward passes against onnxruntime, forward+backward and 10 AdamW
#     steps of gpt2_tiny against PyTorch, the runner against the CPU run (checkpoints
#     resuming across the two), ZeRO-3, f16 (and on CUDA bf16) with loss scaling against
#     the CPU, the fused kernels (cross-entropy, unscale, multi-tensor Adam/AdamW/LAMB)
#     against their references; on CUDA also NCCL through the real library (world size 1);
#   - `onnx-train train --dp 1 --device <backend>` on gpt2_tiny (the CLI's runner path);
#   - with CUDA and without --no-bench: throughput and peak GPU memory of the GPT-2
#     example's model (f32) and of a GPT-2 124M shape (bf16), onnx-train against PyTorch on
#     the same model (tools/gpu/torch_gpt2.py) in the same run; and ZeRO-Offload's cost:
#     the 124M and GPT-2 large (774M) shapes with AdamW's moments on the GPU and in host
#     memory (`--offload-optimizer cpu`), and ZeRO-3 with the parameter chunks in host memory
#     too (`--zero 3 --offload-params cpu`) and on disk (`--offload-params disk`): update
#     time, peak GPU memory and peak host RSS.
#   - with CUDA and without --no-bench: the 124M shape under several layouts on the one GPU
#     (thread ranks sharing it): one rank, tp 2 without and with sequence parallelism,
#     ZeRO-3 without and with prefetch.
# `--only offload` runs just the offload test of gpu-tests and the offload comparison (a
# short call to measure a change of the offloaded update); `--only layouts` the parallel
# GPU tests and the layouts comparison; `--only speed` just the throughput benchmarks (no
# tests): the example's shape in f32, 124M bf16 at 8 x 256 and 16 x 1024, each against
# PyTorch eager, fast and compiled, and against the pack's `onnx-train.old` when it holds
# one (`PACK_OLD_ONNX_TRAIN=BINARY tools/gpu/pack.sh DIR`: the A/B of a change).
# Exits non-zero when any check fails. Needs python3 (with torch, for the benchmark).
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
backends=cuda,wgpu pack="" bench=1 only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --pack) pack="$2"; shift 2 ;;
    --backends) backends="$2"; shift 2 ;;
    --no-bench) bench=0; shift ;;
    --only) only="$2"; shift 2 ;;
    *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$pack" ] || { echo "check.sh: --pack FILE (from tools/gpu/pack.sh) is required" >&2; exit 2; }
out="${OUT:-$root/.gpu/out}"
mkdir -p "$out"
log="$out/gpu_check.log" records="$out/records.jsonl"
: > "$log"; : > "$records"
source "$root/tools/gpu/env.sh"

# record NAME BACKEND STATUS SECONDS DETAIL-JSON (SECONDS "-": not timed on its own)
record() {
  python3 -c 'import json, sys; t = sys.argv[4]; print(json.dumps({"check": sys.argv[1], "backend": sys.argv[2], "status": sys.argv[3], "seconds": None if t == "-" else round(float(t), 1), "detail": json.loads(sys.argv[5])}))' \
    "$1" "$2" "$3" "$4" "$5" >> "$records"
  local took=""
  [ "$4" = - ] || took=" (${4}s)"
  echo "== $1 [$2]: $3$took" | tee -a "$log"
}
now() { date +%s.%N; }
since() { python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$1" "$(now)"; }

machine="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
record machine none info - "$(python3 -c 'import json, sys, platform; print(json.dumps({"gpu": sys.argv[1], "host": platform.node(), "cpus": __import__("os").cpu_count()}))' "${machine:-none}")"

# The test binary, one run per backend; each test's result becomes an entry.
run_tests() {
  local backend="$1" args=() start status
  [ "$backend" = cuda ] || args=(--skip nccl::)
  case "$only" in  # a name filter: the tests whose names hold it
    "") ;;
    layouts) args+=(parallel) ;;
    *) args+=("$only") ;;
  esac
  [ -x "$bin/gpu-tests" ] || {
    echo "check.sh: this pack holds no gpu-tests (an A/B pack from pack_ab.sh: run it with --only speed)" >&2
    exit 2
  }
  start="$(now)"
  ONNX_TRAIN_TEST_GPU="$backend" timeout 1500 "$bin/gpu-tests" --test-threads=1 "${args[@]}" > "$work/tests-$backend.log" 2>&1
  status=$?
  cat "$work/tests-$backend.log" >> "$log"
  grep -E '^test .* \.\.\. (ok|FAILED|ignored)$' "$work/tests-$backend.log" | while read -r _ name _ result; do
    record "$name" "$backend" "$([ "$result" = ok ] && echo pass || echo fail)" - '{}'
  done
  record gpu-tests "$backend" "$([ $status -eq 0 ] && echo pass || echo fail)" "$(since "$start")" \
    "$(tail -3 "$work/tests-$backend.log" | python3 -c 'import json, sys; print(json.dumps({"tail": sys.stdin.read()}))')"
}

# write_run DIR MODEL VOCAB SEQ BATCH STEPS OPTIMIZER: random tokens and a run config (no
# evaluation, no logs), as the CPU benchmark scripts write them.
source "$root/tools/bench_lib.sh"

# The CLI's runner path on one GPU.
run_cli() {
  local backend="$1" dir="$work/cli-$backend" start status
  write_run "$dir" "$root/crates/burn-onnx-train/tests/data/refkit/models/gpt2_tiny.onnx" 256 16 4 10 adamw
  start="$(now)"
  timeout 600 "$bin/onnx-train" train --config "$dir/run.toml" --output-dir "$dir/run" --dp 1 --device "$backend" > "$dir/log" 2>&1
  status=$?
  cat "$dir/log" >> "$log"
  [ -f "$dir/run/gpt2_tiny_trained.onnx" ] && [ -f "$dir/run/perf.json" ] || status=1
  record "onnx-train train --dp 1" "$backend" "$([ $status -eq 0 ] && echo pass || echo fail)" "$(since "$start")" \
    "$(cat "$dir/run/perf.json" 2>/dev/null || echo '{}')"
}

# Peak GPU memory in use (MiB, whole device) while a command runs, sampled by nvidia-smi.
with_peak_memory() {
  local samples="$work/mem.$$"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$samples" 2>/dev/null &
  local sampler=$!
  "$@"; local status=$?
  kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
  peak_mib="$(sort -n "$samples" | tail -1)"
  return $status
}

# bench NAME LAYERS HEADS WIDTH BATCH SEQ PRECISION STEPS: onnx-train (and, when the pack
# holds one, the older `onnx-train.old` of an A/B, run first) against PyTorch eager, fast
# (SDPA, fused AdamW) and compiled (tools/gpu/torch_gpt2.py --variant) on the same exported
# model, same batch, AdamW; per run: update time, tokens/s, peak GPU memory (nvidia-smi),
# MFU against the H100/H200's 989 TFLOP/s dense bf16 (6 N + 12 L d T FLOPs a token, as
# nanoGPT counts), and for ours the kernel launches per update and CubeCL's pools' reserved
# memory.
bench() {
  local name="$1" layers="$2" heads="$3" width="$4" batch="$5" seq="$6" precision="$7" steps="$8"
  local dir="$work/bench-$name" start status=0 runs="" run binary variant
  mkdir -p "$dir"
  python3 "$root/tools/gpu/torch_gpt2.py" export "$dir/model.onnx" --layers "$layers" --heads "$heads" --width "$width" >> "$log" 2>&1
  write_run "$dir" "$dir/model.onnx" 50257 "$seq" "$batch" "$steps" adamw
  start="$(now)"
  # onnx-train+graph: the new binary with its updates replayed from a recorded one
  # (train.cuda_graph; its kernel launches an update are the few outside the replay).
  for run in onnx-train.old onnx-train onnx-train+graph; do
    binary="${run%%+*}"
    [ -x "$bin/$binary" ] || continue
    local flags=()
    [ "$run" = "$binary" ] || flags=(--set train.cuda_graph=true)
    with_peak_memory timeout 600 "$bin/$binary" train --config "$dir/run.toml" --output-dir "$dir/$run" \
      --device cuda --precision "$precision" ${flags[@]+"${flags[@]}"} > "$dir/$run.log" 2>&1 || status=1
    cat "$dir/$run.log" >> "$log"
    cp "$dir/$run/perf.json" "$dir/$run.json" 2>/dev/null || echo '{}' > "$dir/$run.json"
    runs="$runs ours:$run=$peak_mib"
  done
  for variant in eager fast compile; do
    with_peak_memory timeout 600 python3 "$root/tools/gpu/torch_gpt2.py" train --layers "$layers" --heads "$heads" \
      --width "$width" --batch "$batch" --seq "$seq" --steps "$steps" --precision "$precision" \
      --variant "$variant" > "$dir/torch-$variant.log" 2>>"$log" || status=1
    tail -1 "$dir/torch-$variant.log" > "$dir/torch-$variant.json"
    runs="$runs torch:torch-$variant=$peak_mib"
  done
  record "throughput $name" cuda "$([ $status -eq 0 ] && echo pass || echo fail)" "$(since "$start")" \
    "$(python3 -c '
import json, os, sys
d, L, width, seq = sys.argv[1], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
params = 12 * L * width * width + 50257 * width
flops_per_token = 6 * params + 12 * L * width * seq
out = {"shape": sys.argv[2], "flops_per_token": flops_per_token}
for run in sys.argv[6:]:
    kind, rest = run.split(":")
    name, peak = rest.split("=")
    try:
        r = json.load(open(os.path.join(d, name + ".json")))
    except (OSError, ValueError):
        r = {}
    rate = r.get("throughput_per_sec") if kind == "ours" else r.get("tokens_per_sec")
    out[name] = {"update_ms": r.get("avg_update_ms"), "tokens_per_sec": rate,
                 "peak_gpu_mib": float(peak or 0),
                 "mfu": rate * flops_per_token / 989.4e12 if rate else None}
    if kind == "ours":
        out[name]["kernel_launches_per_update"] = r.get("kernel_launches_per_update")
        # What the CubeCL pools reserved (end of the last update), to set beside the
        # dry run plan of the same shape (tools/gpu/dry_run.sh) and the nvidia-smi peak.
        reserved = r.get("device_memory_reserved_bytes")
        out[name]["pools_reserved_mib"] = reserved / 2**20 if reserved else None
        out[name]["kernel_launches_top"] = r.get("kernel_launches_by_kernel", [])[:12]
    else:
        out[name]["peak_allocated_mib"] = r.get("peak_allocated_mib")
print(json.dumps(out))' "$dir" "$layers layers, $heads heads, width $width, batch $batch x $seq, $precision" \
      "$layers" "$width" "$seq" $runs)"
}

# variants CHECK DIR PRECISION VARIANT...: DIR/run.toml trained once per VARIANT
# ("name:flags") on GPU 0, and CHECK recorded with each variant's update time, peak GPU
# memory (sampled by nvidia-smi), peak host RSS, optimizer state and throughput.
variants() {
  local check="$1" dir="$2" precision="$3" start status=0 runs="" run name
  shift 3
  start="$(now)"
  for run in "$@"; do
    name="${run%%:*}"
    # shellcheck disable=SC2086
    RUST_LOG=info,burn_onnx_train::kernels::offload_step=debug \
      with_peak_memory timeout 600 "$bin/onnx-train" train --config "$dir/run.toml" --output-dir "$dir/$name" \
      --device cuda:0 --precision "$precision" ${run#*:} > "$dir/$name.log" 2>&1 || status=1
    cat "$dir/$name.log" >> "$log"
    runs="$runs $name=$peak_mib"
  done
  record "$check" cuda "$([ $status -eq 0 ] && echo pass || echo fail)" "$(since "$start")" \
    "$(python3 -c '
import json, os, sys
out = {"shape": open(os.path.join(sys.argv[1], "shape")).read()}
for run in sys.argv[2:]:
    name, peak = run.split("=")
    perf = os.path.join(sys.argv[1], name, "perf.json")
    p = json.load(open(perf)) if os.path.exists(perf) else {}
    out[name] = {"update_ms": p.get("avg_update_ms"), "peak_gpu_mib": float(peak or 0),
                 "peak_rss_mib": max(p.get("peak_rss_bytes") or [0]) / 2**20,
                 "optimizer_state_mib": sum(p.get("optimizer_state_bytes") or [0]) / 2**20,
                 "tokens_per_sec": p.get("throughput_per_sec")}
print(json.dumps(out))' "$dir" $runs)"
}

# gpt2_dir DIR LAYERS HEADS WIDTH BATCH SEQ PRECISION STEPS: the `onnx-train gpt2` model of
# that shape, random tokens and an AdamW run.toml in DIR (and its description in DIR/shape).
gpt2_dir() {
  local dir="$1" layers="$2" heads="$3" width="$4" batch="$5" seq="$6" precision="$7" steps="$8"
  mkdir -p "$dir"
  "$bin/onnx-train" gpt2 --output "$dir/model.onnx" --layers "$layers" --heads "$heads" --width "$width" \
    --positions "$seq" >> "$log" 2>&1
  write_run "$dir" "$dir/model.onnx" 50257 "$seq" "$batch" "$steps" adamw
  printf '%s' "$layers layers, $heads heads, width $width, batch $batch x $seq, $precision" > "$dir/shape"
}

# offload NAME LAYERS HEADS WIDTH BATCH SEQ PRECISION STEPS: the same run with AdamW's
# moments on the GPU, in host memory (the update on the CPU), and under ZeRO-3 with the
# parameter chunks in host memory too (`--zero 3 --offload-params cpu`) or in a file under
# the run's directory (`--offload-params disk`), one process each.
offload() {
  local dir="$work/offload-$1"
  gpt2_dir "$dir" "${@:2}"
  variants "offload $1" "$dir" "$7" "none:--offload-optimizer none" "cpu:--offload-optimizer cpu" \
    "params:--zero 3 --offload-params cpu" "params-disk:--zero 3 --offload-params disk"
}

# layouts NAME LAYERS HEADS WIDTH BATCH SEQ PRECISION STEPS: one model under several layouts,
# every rank a thread on the one GPU (so peak memory is all ranks' together): one rank,
# tensor parallel without and with sequence parallelism, ZeRO-3 without and with prefetch.
# (`--auto` is not among them: its probes of 8 layouts, each a process compiling its
# kernels, ran past 2 minutes on an H200.)
layouts() {
  local dir="$work/layouts-$1"
  gpt2_dir "$dir" "${@:2}"
  variants "layouts $1" "$dir" "$7" "one:--dp 1" "tp2:--tp 2" "tp2-seq:--tp 2 --sequence-parallel" \
    "zero3:--dp 2 --zero 3" "zero3-prefetch2:--dp 2 --zero 3 --set parallel.zero3_prefetch=2"
}

for backend in ${backends//,/ }; do
  [ "$only" = speed ] && break
  run_tests "$backend"
  [ -n "$only" ] || run_cli "$backend"
done
if [ $bench -eq 1 ] && [[ ",$backends," == *,cuda,* ]]; then
  if [ -z "$only" ] || [ "$only" = speed ]; then
    bench example 2 4 128 8 64 f32 30
    bench gpt2-124m 12 12 768 8 256 bf16 20
    bench gpt2-124m-16x1024 12 12 768 16 1024 bf16 20
  fi
  [ "$only" = speed ] && only=none
  [ -n "$only" ] && [ "$only" != offload ] || offload gpt2-124m 12 12 768 8 256 bf16 10
  [ -n "$only" ] && [ "$only" != offload ] || offload gpt2-large 36 20 1280 4 256 bf16 6
  [ -n "$only" ] && [ "$only" != layouts ] || layouts gpt2-124m 12 12 768 8 256 bf16 10
fi

python3 - "$records" "$out/gpu_check.json" <<'PY'
import json, sys
entries = [json.loads(l) for l in open(sys.argv[1])]
failed = [e for e in entries if e["status"] == "fail"]
json.dump({"failed": len(failed), "checks": entries}, open(sys.argv[2], "w"), indent=1)
print(f"gpu_check: {len(entries)} entries, {len(failed)} failed -> {sys.argv[2]}")
for e in failed:
    print(f"  FAILED {e['check']} [{e['backend']}]")
sys.exit(1 if failed else 0)
PY
