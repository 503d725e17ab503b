#!/usr/bin/env python3
"""Summarize sm.jsonl from sm_bench.sh: throughput relative to uncapped.

"settled" is the start of the first 0.25 s window from which every later
window is within ±5 points of the cap (relative to the uncapped steady rate).
"""
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = {r["kind"]: r["steady"] for r in rows if r["label"] == "uncapped"}
print("| workload | cap | steady throughput | relative to uncapped | target | min window rel. | settled at |")
print("|---|---:|---:|---:|---:|---:|---:|")
for r in rows:
    b = base.get(r["kind"])
    if not b or r["steady"] is None:
        continue
    cap = r.get("sm_limit")
    target = float(cap) if cap else 100.0
    settled = "-"
    if cap:
        ws = r["windows"]
        for i in range(len(ws)):
            if all(abs(100 * v / b - target) <= 5 for _t, v in ws[i:]):
                settled = f"{ws[i][0]:.2f} s"
                break
        else:
            settled = "never"
    print(f"| {r['kind']} ({r['label']}) | {cap or '-'} | {r['steady']:.1f} | "
          f"{100 * r['steady'] / b:.1f}% | {target:.0f}% | {100 * r['min_window'] / b:.1f}% | {settled} |")
