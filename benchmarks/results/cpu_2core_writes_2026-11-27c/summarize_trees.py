"""Medians (ranges) of ab_write_trees.txt: one ab_cpu_write.py round per process, the code before
(``base``) and after (``new``) taking turns; ours ÷ tensorstore within each process, and new ÷ base
(ours' GB/s) between the two processes of a round.

    python summarize_trees.py ab_write_trees.txt
"""

import re
import statistics
import sys
from collections import defaultdict

rows = defaultdict(lambda: defaultdict(dict))  # layout -> round -> tree -> figures
loads = []
tree = rnd = None
for line in open(sys.argv[1]):
    head = re.match(r"## round (\d+) tree (\w+) \S+ ([\d.]+)", line)
    if head:
        rnd, tree = int(head.group(1)), head.group(2)
        loads.append(float(head.group(3)))
        continue
    engine = r" ([\d.]+) GB/s ([\d.]+) CPU-s/GB \(append ([\d.]+)\);"
    m = re.match(r"(\S+): ts" + engine + r" \w+" + engine, line)
    if m:
        ts, ts_cpu, _, ours, ours_cpu, append = (float(x) for x in m.groups()[1:])
        rows[m.group(1)][rnd][tree] = dict(ts=ts, ts_cpu=ts_cpu, ours=ours, ours_cpu=ours_cpu, append=append)


def spread(values):
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


print(f"load (1-min average at each process's start): {min(loads):.2f}-{max(loads):.2f}")
print("| layout | rounds | base ÷ ts | new ÷ ts | new ÷ base | CPU-s/GB ts / base / new | GB/s ts / base / new |")
print("|---|---|---|---|---|---|---|")
for layout, by_round in rows.items():
    pairs = [r for r in by_round.values() if "base" in r and "new" in r]
    base_ts = [r["base"]["ours"] / r["base"]["ts"] for r in pairs]
    new_ts = [r["new"]["ours"] / r["new"]["ts"] for r in pairs]
    new_base = [r["new"]["ours"] / r["base"]["ours"] for r in pairs]
    ts_cpu = statistics.median([r[t]["ts_cpu"] for r in pairs for t in ("base", "new")])
    ts_gbps = statistics.median([r[t]["ts"] for r in pairs for t in ("base", "new")])
    print(
        f"| {layout} | {len(pairs)} | {spread(base_ts)} | {spread(new_ts)} | {spread(new_base)} | "
        f"{ts_cpu:.2f} / {statistics.median(r['base']['ours_cpu'] for r in pairs):.2f} / "
        f"{statistics.median(r['new']['ours_cpu'] for r in pairs):.2f} | "
        f"{ts_gbps:.3f} / {statistics.median(r['base']['ours'] for r in pairs):.3f} / "
        f"{statistics.median(r['new']['ours'] for r in pairs):.3f} |"
    )
