#!/usr/bin/env bash
# tools/gpu/dry_run.sh OUT [gpt2 example flags]: what an update costs the host and where
# its device memory sits, with no GPU and no kernel run: cubecl's dry run on wgpu
# (lavapipe included) compiles every launch and plans every allocation, then drops them.
#
# Applies tools/gpu/dry_run.patch to a clean tree, builds the GPT-2 example with wgpu into
# OUT/gpt2-dry, puts the tree back, and runs it with every update dry (XDRY=0) and the
# memory probes on (XMEM=1): per update the host's milliseconds, and cubecl's pools after
# the forward, after the backward and at the end of the update (bytes in use, reserved,
# pages and their peak, the largest allocation). The values a dry run reads are
# meaningless: its losses are not the model's. Lavapipe caps one buffer at 128 MiB, so a
# shape whose largest tensor is bigger cannot be planned here. Example (BENCHMARKS.md,
# Sessions 35 and 39):
#   tools/gpu/dry_run.sh /tmp/dry --layers 12 --heads 6 --width 384 --seq-len 256 \
#     --batch-size 4 --steps 4 --precision f16
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${1:?usage: tools/gpu/dry_run.sh OUT [gpt2 example flags]}"
shift
cd "$root"
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  echo "dry_run.sh patches the source tree: commit or stash your changes first" >&2
  exit 1
fi
mkdir -p "$out"
git apply tools/gpu/dry_run.patch
trap 'git apply -R tools/gpu/dry_run.patch' EXIT
cargo build --release --example gpt2 --features wgpu
cp target/release/examples/gpt2 "$out/gpt2-dry"
git apply -R tools/gpu/dry_run.patch
trap - EXIT
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
