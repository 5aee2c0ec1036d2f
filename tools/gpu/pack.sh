#!/usr/bin/env bash
# Build the GPU verification binaries and pack what travels to a GPU machine into DIR.
#
#   tools/gpu/pack.sh DIR           # CUDA (NVRTC) + wgpu build: DIR/cuda/
#   tools/gpu/pack.sh --cuda-only DIR   # CUDA (NVRTC) without wgpu: DIR/cuda/ (smaller;
#                                       # check.sh --backends cuda)
#   tools/gpu/pack.sh --wgpu DIR    # the README's wgpu build only: DIR/wgpu/
#   tools/gpu/pack.sh --cuda-only --no-tests DIR    # onnx-train alone: for --only speed
#   tools/gpu/pack.sh --cuda-only --tests-only DIR  # gpu-tests alone: for --only NAME
#   tools/gpu/pack.sh --check-cuda  # only type-check the CUDA build (cargo check), no pack
#   PACK_OLD_ONNX_TRAIN=OLD tools/gpu/pack.sh DIR   # OLD as onnx-train.old instead of
#                                                   # gpu-tests (an A/B for --only speed)
#
# Each flavour holds `onnx-train`, `gpu-tests` (crates/burn-onnx-train/tests/gpu.rs) and
# `lib/` (the MPI libraries the binaries link, and the Vulkan loader wgpu opens), stripped
# and packed as `pack.tar.xz` beside them. The CUDA flavour also runs on wgpu, so it is the
# one that travels; `--wgpu` is what CI checks on lavapipe without building CUDA.
#
# The CUDA build cannot download cubecl-llvm's LLVM bundle here: it patches cubecl-llvm
# with the stand-in in tools/gpu/cubecl-llvm-stub and selects cubecl-cuda's C++ backend
# (feature `cuda-nvrtc`), so kernels compile through NVRTC at run time. Cargo.lock is put
# back afterwards (the patch rewrites it). The product's `--features cuda` build is
# unchanged. At the end the size of what the device tool sends (the working tree plus
# the pack) is checked against its 64 MiB.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
flavour=cuda
if [ "${1:-}" = "--check-cuda" ]; then
  # What CI runs: the CUDA code compiles (every cfg(feature = "cuda") path, tests included)
  # in a fraction of the full build's time; the pack itself is built where a GPU is lent.
  cd "$root"
  orig="$(mktemp -d)/Cargo.lock.orig"
  cp Cargo.lock "$orig"
  trap 'cp "$orig" "$root/Cargo.lock"' EXIT
  cargo --config "patch.crates-io.cubecl-llvm.path=\"$root/tools/gpu/cubecl-llvm-stub\"" \
    check --release --workspace --tests --features mpi,wgpu,cuda-nvrtc
  exit 0
fi
# The CUDA build's features: wgpu too, unless --cuda-only (the speed check and the CUDA
# tests need no wgpu, and without it each binary is smaller: the device tool's 64 MiB).
# --no-tests / --tests-only pack one of the two binaries: with the 42.2 MiB working tree,
# a CUDA pack holds ~21.8 MiB, and onnx-train alone is ~17.5 (session 34).
cuda_features=mpi,wgpu,cuda-nvrtc tests=1 cli=1
while [ $# -gt 1 ]; do
  case "$1" in
    --wgpu) flavour=wgpu ;;
    --cuda-only) cuda_features=mpi,cuda-nvrtc ;;
    --no-tests) tests=0 ;;
    --tests-only) cli=0 ;;
    *) break ;;
  esac
  shift
done
dir="${1:?usage: tools/gpu/pack.sh [--wgpu] DIR}"
mkdir -p "$dir/$flavour"
dir="$(cd "$dir" && pwd)"
out="$dir/$flavour"
cd "$root"

cargo_args=(test --release --workspace --no-run --test gpu --message-format=json-render-diagnostics)
if [ "$flavour" = cuda ]; then
  cp Cargo.lock "$dir/Cargo.lock.orig"
  trap 'cp "$dir/Cargo.lock.orig" "$root/Cargo.lock"' EXIT
  cargo --config "patch.crates-io.cubecl-llvm.path=\"$root/tools/gpu/cubecl-llvm-stub\"" \
    "${cargo_args[@]}" --features "$cuda_features" > "$dir/build.json"
else
  # CI's test features, so CI's wgpu pack reuses its test build.
  cargo "${cargo_args[@]}" --features mpi,wgpu,learner > "$dir/build.json"
fi
tests_exe="$(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "gpu" and m.get("executable"):
        print(m["executable"])' "$dir/build.json" | tail -1)"
[ -x "$tests_exe" ] || { echo "pack: no gpu test executable in the build output" >&2; exit 1; }

rm -rf "$out/stage" && mkdir -p "$out/stage/lib"
[ $cli -eq 0 ] || strip -o "$out/stage/onnx-train" target/release/onnx-train
if [ -z "${PACK_OLD_ONNX_TRAIN:-}" ]; then
  [ $tests -eq 0 ] || strip -o "$out/stage/gpu-tests" "$tests_exe"
else
  # An A/B's older binary (check.sh --only speed runs both), built beforehand from the
  # commit to compare against, in the place of the test binary: with both onnx-train
  # and the tests the pack passes the device tool's 64 MiB (66.5 MiB measured for wgpu),
  # and `--only speed` runs no tests.
  strip -o "$out/stage/onnx-train.old" "$PACK_OLD_ONNX_TRAIN"
fi
# The shared libraries the binaries link beyond the C runtime (OpenMPI and its own), and
# the Vulkan loader wgpu opens at run time.
ldd target/release/onnx-train "$tests_exe" | awk '$3 ~ /^\// {print $3}' | sort -u \
  | grep -Ev '/(libc|libm|libgcc_s|libpthread|libdl|librt|libstdc\+\+)\.so' \
  | while read -r lib; do cp -L "$lib" "$out/stage/lib/"; done
# The tests read their fixtures through the source path they were built at.
echo "$root" > "$out/stage/built_root"
[[ "$flavour" = wgpu || "$cuda_features" = *wgpu* ]] &&
  cp -L "$(ldconfig -p | awk '/libvulkan\.so\.1 / {print $NF; exit}')" "$out/stage/lib/libvulkan.so.1"
# A dictionary larger than one binary: the two share most of their code.
tar -C "$out/stage" -cf - . | xz --lzma2=preset=9,dict=256MiB -T1 > "$out/pack.tar.xz"
rm -rf "$out/stage"

# What the device tool sends: tracked and untracked-not-ignored files, plus this pack.
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk 'END {print $1}')
pack_bytes=$(stat -c %s "$out/pack.tar.xz")
total=$((tree_bytes + pack_bytes)) limit=$((64 * 1024 * 1024))
awk -v p="$pack_bytes" -v t="$tree_bytes" -v f="$out/pack.tar.xz" 'BEGIN {
  printf "pack: %s %.1f MiB + working tree %.1f MiB = %.1f MiB of 64 MiB\n", f, p / 2^20, t / 2^20, (p + t) / 2^20 }'
[ "$total" -le "$limit" ] || { echo "pack: over the device tool's 64 MiB" >&2; exit 1; }
