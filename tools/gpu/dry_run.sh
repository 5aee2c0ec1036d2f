#!/usr/bin/env bash
# tools/gpu/dry_run.sh OUT [gpt2 example flags]: what an update costs the host and where
# its device memory sits, with no GPU and no kernel run: cubecl's dry run on wgpu
# (lavapipe included) compiles every launch and plans every allocation, then drops them.
#
# Builds the GPT-2 example with wgpu from the committed HEAD, in a worktree at OUT/tree
# with tools/gpu/dry_run.patch applied (the working tree is not touched), into OUT/target
# (kept: later builds are incremental; the first takes ~15 minutes on 2 cores). It runs
# with every update dry (XDRY=0) and the memory probes on (XMEM=1): per update the host's
# milliseconds, and cubecl's pools after the forward, after the backward, at the end of
# the update and after each evaluation (bytes in use, reserved, pages and their peak, the
# largest allocation). The
# values a dry run reads are meaningless: its losses are not the model's.
#
# Lavapipe caps a buffer at 128 MiB, which would cap the pools' pages and refuse GPT-2
# 124M's embedding (154 MB). The build therefore takes cubecl-wgpu from OUT/cubecl-wgpu, a
# copy of the registry's with one change: XMAXPAGE (bytes) replaces the device's largest
# buffer as the pools' largest page. A dry run backs no allocation made in it, so planning
# with GPU-sized pages costs no memory; set XMAXPAGE above the shape's largest tensor.
# Examples (BENCHMARKS.md, Sessions 35, 39 and 40):
#   tools/gpu/dry_run.sh /tmp/dry --layers 12 --heads 6 --width 384 --seq-len 256 \
#     --batch-size 4 --steps 4 --precision f16
#   XMAXPAGE=17179869184 tools/gpu/dry_run.sh /tmp/dry --layers 12 --heads 12 --width 768 \
#     --seq-len 1024 --batch-size 16 --steps 3 --precision f16 --text BIG.txt
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:?usage: tools/gpu/dry_run.sh OUT [gpt2 example flags]}"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"

# The worktree: HEAD with the probes.
rm -rf "$out/tree"
git -C "$root" worktree prune
git -C "$root" worktree add --detach -q "$out/tree" HEAD
trap 'git -C "$root" worktree remove --force "$out/tree"' EXIT
git -C "$out/tree" apply tools/gpu/dry_run.patch

# cubecl-wgpu with the page cap taken from XMAXPAGE: copied once with the registry's
# timestamps and patched in place only when not yet patched, so that later builds into
# OUT/target do not rebuild cubecl-wgpu and everything above it.
version="$(cargo metadata --format-version 1 --manifest-path "$root/Cargo.toml" |
  python3 -c 'import json, sys; print(next(p["version"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cubecl-wgpu"))')"
src="$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cubecl-wgpu-"$version" | head -1)"
if ! grep -qx "version = \"$version\"" "$out/cubecl-wgpu/Cargo.toml" 2>/dev/null; then
  rm -rf "$out/cubecl-wgpu"
  cp -a "$src" "$out/cubecl-wgpu"
fi
python3 - "$out/cubecl-wgpu/src/runtime.rs" <<'EOF'
import sys
path = sys.argv[1]
text = open(path).read()
cap = """        limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size),"""
patched = """        std::env::var("XMAXPAGE").ok().and_then(|v| v.parse::<u64>().ok()).unwrap_or(
            limits.max_storage_buffer_binding_size.min(limits.max_buffer_size)),"""
if patched in text:
    sys.exit(0)
if text.count(cap) != 1:
    sys.exit(f"dry_run.sh: {path} no longer sizes its pages as expected; update the patch")
open(path, "w").write(text.replace(cap, patched))
EOF

(cd "$out/tree" && CARGO_TARGET_DIR="$out/target" cargo build --release --example gpt2 \
  --features wgpu --config "patch.crates-io.cubecl-wgpu.path=\"$out/cubecl-wgpu\"")
cp "$out/target/release/examples/gpt2" "$out/gpt2-dry"

# A fresh output directory: the run would resume from a checkpoint left there.
rm -rf "$out/run"
if ! XDRY=0 XMEM=1 "$out/gpt2-dry" --device wgpu --output-dir "$out/run" "$@" \
  2>"$out/log.txt" >/dev/null; then
  tail -5 "$out/log.txt" >&2
  exit 1
fi
grep -E '^XMEM|^XDRY' "$out/log.txt"
grep '^XDRY' "$out/log.txt" | awk 'NR > 1 { print $5 }' | sort -n |
  awk '{ v[NR] = $1 } END { if (NR) printf "host ms per update (median of updates 2..): %.2f\n", v[int((NR + 1) / 2)] }'
