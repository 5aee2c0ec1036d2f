"""Peak memory of a run sampled by tools/rss_timeline.sh: `rss_peak.py OUT NAME` prints the
peak of RssAnon + RssFile between the first update's start (the log's first "session run"
debug line) and the last update's report, with each part's own peak, and the whole run's
peak (loading and export included)."""
import re
import sys

out, name = sys.argv[1], sys.argv[2]
log = open(out + ".log").read()
start = re.search(r"T(\d\d:\d\d:\d\d\.\d+)Z DEBUG \S+passes: session run", log).group(1)[:12]
end = re.findall(r"T(\d\d:\d\d:\d\d\.\d+)Z\s+INFO \S+report: train step", log)[-1][:12]
rows = [r.split() for r in open(out + ".rss")]
rows = [(t, int(a), int(f)) for t, a, f in (r for r in rows if len(r) == 3)]
during = [r for r in rows if start <= r[0] <= end]
gib = lambda kb: kb / 2**20
print(
    f"{name}: peak RSS during updates {gib(max(a + f for _, a, f in during)):.2f} GiB "
    f"(anonymous {gib(max(a for _, a, _ in during)):.2f}, file-backed {gib(max(f for _, _, f in during)):.2f}); "
    f"whole run {gib(max(a + f for _, a, f in rows)):.2f} GiB"
)
