#!/usr/bin/env bash
# rss_timeline.sh OUT CMD...: run CMD (its output in OUT.log), sampling its resident
# anonymous and file-backed memory (RssAnon, RssFile of /proc/PID/status, kB) every 0.1 s
# into OUT.rss as "HH:MM:SS.mmm anon file". tools/rss_peak.py reads both: the peak while
# the run's updates ran, apart from loading and export. Run the trainer with
# MIMALLOC_PURGE_DELAY=0 and RUST_LOG=burn_onnx_train=debug so that freed memory leaves
# the process at once and the log marks each update.
set -uo pipefail
out=$1
shift
"$@" > "$out.log" 2>&1 &
pid=$!
while kill -0 "$pid" 2> /dev/null; do
  line=$(grep -E "^(RssAnon|RssFile)" "/proc/$pid/status" 2> /dev/null | awk '{printf " %s", $2}')
  echo "$(date -u +%H:%M:%S.%N | cut -c1-12)$line"
  sleep 0.1
done > "$out.rss"
wait "$pid"
