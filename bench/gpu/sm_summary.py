#!/usr/bin/env python3
"""Summarize sm.jsonl from sm_bench.sh: throughput relative to uncapped."""
import json
import sys

rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
base = {r["kind"]: r["steady"] for r in rows if r["label"] == "uncapped"}
print("| workload | cap | steady throughput | relative to uncapped | target | min window rel. |")
print("|---|---:|---:|---:|---:|---:|")
for r in rows:
    b = base.get(r["kind"])
    if not b or r["steady"] is None:
        continue
    cap = r.get("sm_limit")
    target = f"{cap}%" if cap else "100%"
    print(f"| {r['kind']} ({r['label']}) | {cap or '-'} | {r['steady']:.1f} | "
          f"{100 * r['steady'] / b:.1f}% | {target} | {100 * r['min_window'] / b:.1f}% |")
