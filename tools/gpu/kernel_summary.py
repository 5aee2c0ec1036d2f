#!/usr/bin/env python3
"""Sum the GPU kernel times of one optimizer update from an Nsight Compute CSV
(`ncu --csv --page raw --metrics gpu__time_duration.sum`, as tools/gpu/kernel_profile.sh
writes it), by kernel name.

    python3 tools/gpu/kernel_summary.py kernels.csv [--update-ms MS] [--json OUT.json]

The update is the last one in the file: the kernels after the second-to-last run of
optimizer kernels (names matching `adam|lamb`) up to the end of the last run. The first
updates hold run-time compilation and autotuning, which this leaves out. With
`--update-ms` (the update's wall time measured without the profiler) it also prints the
share of the update the GPU spent in kernels: far below 1 means the host, not the GPU,
sets the pace.
"""
import argparse
import csv
import json
import re
import sys
from collections import defaultdict

p = argparse.ArgumentParser()
p.add_argument("csv")
p.add_argument("--update-ms", type=float)
p.add_argument("--json")
p.add_argument("--top", type=int, default=25)
a = p.parse_args()

rows = []
with open(a.csv, newline="") as f:
    # ncu prints its own log lines (==PROF==) before the table.
    lines = [l for l in f if l.startswith('"')]
reader = csv.DictReader(lines)
for r in reader:
    t = r.get("gpu__time_duration.sum", "")
    try:
        ns = float(t.replace(",", ""))
    except ValueError:
        continue  # the units row
    rows.append((r.get("Kernel Name") or r.get("Function Name") or "?", ns, r.get("Grid Size", "")))
if not rows:
    sys.exit(f"kernel_summary: no kernel rows in {a.csv}")

optimizer = re.compile(r"adam|lamb", re.IGNORECASE)
runs, start = [], None
for i, (name, _, _) in enumerate(rows):
    if optimizer.search(name):
        start = i if start is None else start
    elif start is not None:
        runs.append((start, i))
        start = None
if start is not None:
    runs.append((start, len(rows)))
if len(runs) >= 2:
    window = rows[runs[-2][1]:runs[-1][1]]
    which = f"the last update ({len(runs)} optimizer steps seen)"
else:
    window = rows
    which = "every kernel (no update boundary found)"

by_name = defaultdict(lambda: [0, 0.0])
for name, ns, _ in window:
    by_name[name][0] += 1
    by_name[name][1] += ns
total_ms = sum(ns for _, ns, _ in window) / 1e6
ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])
print(f"kernel_summary: {which}: {len(window)} kernels, {total_ms:.2f} ms of kernel time")
if a.update_ms:
    print(f"  GPU busy {total_ms / a.update_ms:.0%} of the {a.update_ms:.1f} ms update")
print(f"  {'ms':>8} {'share':>6} {'calls':>6}  kernel")
for name, (calls, ns) in ranked[: a.top]:
    print(f"  {ns / 1e6:8.3f} {ns / 1e6 / total_ms:6.1%} {calls:6d}  {name[:110]}")
if a.json:
    json.dump({"window": which, "kernels": len(window), "kernel_ms": total_ms,
               "update_ms": a.update_ms,
               "by_name": [{"name": n, "calls": c, "ms": ns / 1e6} for n, (c, ns) in ranked]},
              open(a.json, "w"), indent=1)
