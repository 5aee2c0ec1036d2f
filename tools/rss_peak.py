"""Peak memory of a run sampled by tools/rss_timeline.sh: `rss_peak.py OUT NAME` prints the
peak of RssAnon + RssFile in each phase of the run: loading (up to the first update's
start, the log's first "session run" debug line), the updates (up to the last update's
report, with each part's own peak) and export (after it), and the whole run's peak."""
import re
import sys

out, name = sys.argv[1], sys.argv[2]
log = open(out + ".log").read()
start = re.search(r"T(\d\d:\d\d:\d\d\.\d+)Z DEBUG \S+passes: session run", log).group(1)[:12]
end = re.findall(r"T(\d\d:\d\d:\d\d\.\d+)Z\s+INFO \S+report: train step", log)[-1][:12]
rows = [r.split() for r in open(out + ".rss")]
rows = [(t, int(a), int(f)) for t, a, f in (r for r in rows if len(r) == 3)]
loading = [r for r in rows if r[0] < start]
during = [r for r in rows if start <= r[0] <= end]
export = [r for r in rows if r[0] > end]
gib = lambda kb: kb / 2**20
peak = lambda rs: gib(max((a + f for _, a, f in rs), default=0))
print(
    f"{name}: peak RSS loading {peak(loading):.2f} GiB; during updates {peak(during):.2f} GiB "
    f"(anonymous {gib(max(a for _, a, _ in during)):.2f}, file-backed {gib(max(f for _, _, f in during)):.2f}); "
    f"export {peak(export):.2f} GiB; whole run {peak(rows):.2f} GiB"
)
