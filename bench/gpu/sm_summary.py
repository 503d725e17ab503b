#!/usr/bin/env python3
"""Summarize sm.jsonl from sm_bench.sh: throughput relative to uncapped.

"settled" is the start of the first 0.25 s window from which every later
window is within ±5 points of the cap (relative to the uncapped steady rate).
"own" is relative to the same process's windows of its first second, before
its budget has learned (unthrottled, launch probes attached): launch-bound
host loops on the VM run at rates ±25% apart from one process (and one
second) to the next, which a comparison across processes cannot tell from
the cap. Expect cap / (1 - probe share) there, the probe credit from the
daemon's "learned" event. Single groups only (a pair shares its first second).
"""
import json
import sys


def settled(windows, base: float, target: float, start: float = 0.0) -> str:
    """Time (from `start`) of the first window at or after `start` from which
    every later one is within ±5 points of `target`, relative to `base`."""
    ws = [(t, v) for t, v in windows if t >= start]
    for i in range(len(ws)):
        if all(abs(100 * v / base - target) <= 5 for _t, v in ws[i:]):
            return f"{ws[i][0] - start:.2f} s"
    return "never"


def main() -> None:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
    base = {r["kind"]: r["steady"] for r in rows if r["label"] == "uncapped"}
    print("| workload | cap | steady throughput | relative to uncapped | target | min window rel. | settled at "
          "| relative to own first second |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        b = base.get(r["kind"])
        if not b or r["steady"] is None:
            continue
        cap = r.get("sm_limit")
        target = float(cap) if cap else 100.0
        settled_at = settled(r["windows"], b, target) if cap else "-"
        first = [v for t, v in r["windows"] if t < 1.0]
        own = f"{100 * r['steady'] / (sum(first) / len(first)):.1f}%" if cap and first and not r["label"].startswith("pair") else "-"
        print(f"| {r['kind']} ({r['label']}) | {cap or '-'} | {r['steady']:.1f} | "
              f"{100 * r['steady'] / b:.1f}% | {target:.0f}% | {100 * r['min_window'] / b:.1f}% | {settled_at} "
              f"| {own} |")


if __name__ == "__main__":
    main()
