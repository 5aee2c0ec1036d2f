# Sourced by the GPU tools (check.sh, kernel_profile.sh) with $root (the repository) and
# $pack (from tools/gpu/pack.sh) set: unpacks the binaries into a fresh $work (= $bin) and
# sets up the libraries, the Vulkan driver and the paths they need on the GPU machine.
work="$(mktemp -d /tmp/gpu-tools.XXXX)"
# Scratch only (every result goes to $out): removed on exit, so repeated checks do not fill
# the disk (36 left-behind unpacks, 160 MB each, once filled this machine's).
trap 'rm -rf "$work"' EXIT
tar -C "$work" -xJf "$pack"
bin="$work"

# The test binary finds the refkit through the path it was built at; point it here.
built_root="$(cat "$bin/built_root")"
if [ -n "$built_root" ] && [ "$built_root" != "$root" ] && [ ! -e "$built_root" ]; then
  mkdir -p "$(dirname "$built_root")" && ln -s "$root" "$built_root"
fi

# Libraries: the packed ones, then CUDA's (NVRTC, NCCL) from the toolkit or from the
# Python wheels PyTorch brings; cudarc looks for unversioned names, so link those.
libdirs="$bin/lib"
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia, os; p = nvidia.__path__[0]; print(" ".join(sorted({os.path.dirname(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs if ".so" in f})))' 2>/dev/null); do
  [ -d "$d" ] && libdirs="$libdirs:$d"
done
mkdir -p "$bin/cudalinks"
for name in nvrtc nccl; do
  found="$(IFS=:; for d in $libdirs; do ls "$d"/lib$name.so.[0-9]* 2>/dev/null; done | grep -v alt | sort -V | tail -1)"
  [ -n "$found" ] && ln -sf "$found" "$bin/cudalinks/lib$name.so"
done
export LD_LIBRARY_PATH="$bin/cudalinks:$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
[ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] && [ -z "${VK_DRIVER_FILES:-}" ] \
  && export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$work/xdg}"; mkdir -p "$XDG_RUNTIME_DIR"; chmod 700 "$XDG_RUNTIME_DIR"
