#!/usr/bin/env python3
"""Markdown tables from loadgen's reports, for docs/benchmarks.md.

    ops/bench/table.py DIR SCENARIO [ROW ...]

reads DIR/SCENARIO-{ours,etcd,zookeeper}.json (with `--runs N`, the median reports) and
prints one row per figure or latency statistic: each system's value, with its range over
the runs when there was more than one, and the failures next to every latency. A ROW is a
figure's name, or `LATENCY:STAT` with STAT one of p50, p90, p99, p99.9, max, count,
failed; without ROWs, every latency's p50, p99 and failed and every figure.
"""

import json
import os
import sys

SYSTEMS = [("ours", "ours"), ("etcd", "etcd"), ("zookeeper", "ZooKeeper")]
STAT_KEY = {"p99.9": "p999"}


def load(d, scenario):
    out = {}
    for file, name in SYSTEMS:
        p = os.path.join(d, f"{scenario}-{file}.json")
        if os.path.exists(p):
            with open(p) as f:
                out[name] = json.load(f)
    return out


def fmt(x):
    if x is None:
        return "–"
    if abs(x) >= 100 or x == int(x):
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def cell(report, row):
    """The value of ROW in REPORT, with its range."""
    ranges = report.get("ranges", {})
    if ":" in row and row not in report["figures"]:
        lat, stat = row.rsplit(":", 1)
        s = report["latencies"].get(lat)
        if s is None:
            return "–"
        v = s.get(STAT_KEY.get(stat, stat))
        rk = f"{lat} {stat}"
    else:
        v = report["figures"].get(row)
        rk = row
    if v is None:
        return "–"
    text = fmt(v)
    if rk in ranges and report.get("runs", 1) > 1:
        lo, hi = ranges[rk]
        if lo != hi:
            text += f" ({fmt(lo)}–{fmt(hi)})"
    return text


def main():
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    d, scenario, rows = sys.argv[1], sys.argv[2], sys.argv[3:]
    reports = load(d, scenario)
    if not reports:
        sys.exit(f"no {scenario}-*.json in {d}")
    if not rows:
        lats = sorted({k for r in reports.values() for k in r["latencies"]})
        figs = sorted({k for r in reports.values() for k in r["figures"]})
        rows = [f"{k}:{s}" for k in lats for s in ("p50", "p99", "failed")] + figs
    names = [n for _, n in SYSTEMS if n in reports]
    runs = {n: reports[n].get("runs", 1) for n in names}
    print("| | " + " | ".join(f"{n} ({runs[n]} runs)" for n in names) + " |")
    print("|---" * (len(names) + 1) + "|")
    figures = {k for r in reports.values() for k in r["figures"]}
    for row in rows:
        label = row
        if row not in figures:
            label = row.replace(":", " ")
            if not row.endswith((":failed", ":count")):
                label += " (ms)"
        print(f"| {label} | " + " | ".join(cell(reports[n], row) for n in names) + " |")


if __name__ == "__main__":
    main()
