#!/usr/bin/env bash
# mpi_rss.sh OUT NP ARGS...: run `onnx-train ARGS...` (target/release) on NP MPI ranks, one
# compute thread each, sampling every rank's VmRSS (kB) every 0.2 s into OUT.rss as
# "HH:MM:SS.mmm PID kB" (the run's output in OUT.log, with the debug log that marks each
# update), then print each rank's peak up to the last update's report and after it (the
# export). MIMALLOC_PURGE_DELAY=0 so that freed memory leaves each process at once.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=$1 np=$2
shift 2
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
RAYON_NUM_THREADS=1 MIMALLOC_PURGE_DELAY=0 RUST_LOG=burn_onnx_train=debug \
  timeout -k 10 1800 mpirun --oversubscribe -np "$np" "$root/target/release/onnx-train" "$@" > "$out.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2> /dev/null; do
  t=$(date -u +%H:%M:%S.%N | cut -c1-12)
  for p in $(pgrep -f "^$root/target/release/onnx-train "); do
    kb=$(awk '/^VmRSS/ {print $2}' "/proc/$p/status" 2> /dev/null)
    [ -n "$kb" ] && echo "$t $p $kb"
  done
  sleep 0.2
done > "$out.rss"
wait "$pid" || { echo "the run failed:"; tail -5 "$out.log"; exit 1; }
python3 - "$out" <<'PY'
import re, sys
out = sys.argv[1]
log = open(out + ".log").read()
end = re.findall(r"T(\d\d:\d\d:\d\d\.\d+)Z\s+INFO \S+report: train step", log)[-1][:12]
rows = [l.split() for l in open(out + ".rss")]
gib = lambda kb: kb / 2**20
for pid in sorted({r[1] for r in rows}, key=int):
    mine = [(t, int(kb)) for t, p, kb in rows if p == pid]
    during = max((kb for t, kb in mine if t <= end), default=0)
    after = max((kb for t, kb in mine if t > end), default=0)
    print(f"process {pid}: peak RSS up to the last update {gib(during):.2f} GiB, after it (export) {gib(after):.2f} GiB")
PY
