#!/usr/bin/env bash
# An A/B pack for one device call: HEAD's `onnx-train` (tools/gpu/pack.sh) plus the
# `onnx-train` of an older commit as `onnx-train.old`, built here with the same features,
# so `tools/gpu/check.sh --pack DIR/<flavour>/pack.tar.xz --only speed` runs both, old
# first, in the same call on the same GPU. It holds no `gpu-tests` (with it the pack
# passes the device tool's 64 MiB): the tests travel in pack.sh's own pack.
#
#   tools/gpu/pack_ab.sh OLD_COMMIT DIR          # CUDA (NVRTC), no wgpu: DIR/cuda/pack.tar.xz
#   tools/gpu/pack_ab.sh --wgpu OLD_COMMIT DIR   # wgpu only (lavapipe): DIR/wgpu/pack.tar.xz
#
# The CUDA flavour leaves wgpu out (`pack.sh --cuda-only`): `--only speed` runs on CUDA
# only. Measured in session 34: 25.9 MiB with wgpu in both binaries, 23.5 without; with
# the 42.2 MiB working tree both pass the device tool's 64 MiB, and pack.sh refuses them.
# Until the tree or the binaries shrink, an A/B is two speed-only packs (`pack.sh
# --cuda-only --no-tests`, 17.4 MiB), the older one's call first on the warm machine.
#
# The old commit is checked out in a temporary git worktree and built into this
# repository's target directory (dependencies built with the same features are reused; a
# feature that differs, such as autotune, rebuilds what it touches), its binary copied to
# DIR/onnx-train.old before HEAD's build overwrites target/release/onnx-train.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
flavour=cuda
if [ "${1:-}" = "--wgpu" ]; then flavour=wgpu; shift; fi
old="${1:?usage: tools/gpu/pack_ab.sh [--wgpu] OLD_COMMIT DIR}"
dir="${2:?usage: tools/gpu/pack_ab.sh [--wgpu] OLD_COMMIT DIR}"
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
tree="$dir/old-tree"
git -C "$root" worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
git -C "$root" worktree add --detach "$tree" "$old" > /dev/null
trap 'git -C "$root" worktree remove --force "$tree"' EXIT

echo "pack_ab: building onnx-train at $(git -C "$tree" rev-parse --short HEAD) ($flavour)"
cd "$tree"
if [ "$flavour" = cuda ]; then
  # pack.sh's CUDA build: NVRTC kernels, the cubecl-llvm stand-in of that commit.
  CARGO_TARGET_DIR="$root/target" cargo \
    --config "patch.crates-io.cubecl-llvm.path=\"$tree/tools/gpu/cubecl-llvm-stub\"" \
    build --release --workspace --bin onnx-train --features mpi,cuda-nvrtc
else
  # CI's test features, as pack.sh --wgpu builds.
  CARGO_TARGET_DIR="$root/target" cargo build --release --workspace --bin onnx-train \
    --features mpi,wgpu,learner
fi
cp "$root/target/release/onnx-train" "$dir/onnx-train.old"
cd "$root"
# Gone before pack.sh measures the working tree it would send.
git -C "$root" worktree remove --force "$tree"
trap - EXIT

flag=(--cuda-only)
[ "$flavour" = cuda ] || flag=(--wgpu)
PACK_OLD_ONNX_TRAIN="$dir/onnx-train.old" "$root/tools/gpu/pack.sh" "${flag[@]}" "$dir"
