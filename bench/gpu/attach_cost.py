#!/usr/bin/env python3
"""What a counting uprobe on libcuda's launch entry points costs a running
workload, with no daemon: the probe attached while it runs against the
probe attached before it started. Needs bcc (bench/gpu: setup-bcc) and root.

Two children run the same command, one after the other. Each prints a JSON
line per second (bench/gpu/workloads/common.py). PLAN is a list of
STATE:SECONDS stretches of its timed loop, STATE `free` (no probe) or
`probe` (attached):

  late   the probe is attached and detached as PLAN says, on a running process
         (as the daemon attaches it when a cap is set)
  early  the probe is attached before the child starts and stays on until
         PLAN first says `free` after its first stretch (those stretches
         read `early`), then PLAN is followed

Prints one JSON line per stretch (child, state, mean rate, its share of the
child's free stretches) and a summary table.

  python3 bench/gpu/attach_cost.py --cmd "python3 bench/gpu/workloads/unet_sample.py --seconds 40" \\
      [--plan "free:8 probe:10 free:8 probe:10 free:4"] [--lib PATH] [--only late|early]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from hami_bpf import libcuda  # noqa: E402
from hami_bpf.probetable import LAUNCH_SYMBOLS  # noqa: E402

# The daemon's launch probe, less its budget: one hash update per launch.
PROG = r'''
BPF_HASH(counts, u32, u64, 4096);
int count(struct pt_regs *ctx) {
    u32 tgid = bpf_get_current_pid_tgid() >> 32;
    u64 one = 1, *n = counts.lookup(&tgid);
    if (n)
        __sync_fetch_and_add(n, 1);
    else
        counts.update(&tgid, &one);
    return 0;
}
'''


def default_lib() -> str:
    d = "/usr/local/nvidia/lib64"
    return os.path.join(d, sorted(p for p in os.listdir(d) if p.startswith("libcuda.so."))[-1])


class Probe:
    def __init__(self, lib: str):
        from bcc import BPF
        self.lib = lib
        self.syms = [s for s in LAUNCH_SYMBOLS if s in libcuda.read_symbols(lib)]
        self.b = BPF(text=PROG)
        self.on = False

    def attach(self) -> float:
        t = time.monotonic()
        for s in self.syms:
            self.b.attach_uprobe(name=self.lib.encode(), sym=s.encode(), fn_name=b"count")
        self.on = True
        return time.monotonic() - t

    def detach(self) -> float:
        t = time.monotonic()
        for s in self.syms:
            self.b.detach_uprobe(name=self.lib.encode(), sym=s.encode())
        self.on = False
        return time.monotonic() - t

    def launches(self) -> int:
        return sum(v.value for v in self.b["counts"].values())


def parse_plan(text: str) -> list[tuple[str, float]]:
    plan = []
    for item in text.split():
        state, _, secs = item.partition(":")
        if state not in ("free", "probe"):
            raise SystemExit(f"--plan: {item!r}: a stretch is free:S or probe:S")
        plan.append((state, float(secs)))
    return plan


def run_child(name: str, cmd: str, plan, probe: Probe, early: bool) -> list[dict]:
    if early:
        probe.attach()
    child = subprocess.Popen(shlex.split(cmd), stdout=subprocess.PIPE, text=True)
    lines: list[dict] = []
    started = threading.Event()

    def read():
        for line in child.stdout:
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if "rate" in d and not d.get("summary"):
                lines.append(d)
                started.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started.wait(600)
    t0 = time.monotonic()
    marks = []     # (start s since the loop's first line, state, attach/detach seconds)
    at = 0.0
    from_start = early      # the probe attached before the child started, still on
    for i, (state, secs) in enumerate(plan):
        want = state == "probe" or (early and i == 0)
        took = 0.0
        if want and not probe.on:
            took = probe.attach()
        elif not want and probe.on:
            took = probe.detach()
            from_start = False
        marks.append((at, "early" if want and from_start else state, took))
        at += secs
        time.sleep(max(0.0, t0 + at - time.monotonic()))
    if probe.on:
        probe.detach()
    child.wait()
    reader.join(5)
    rows = []
    for j, (start, state, took) in enumerate(marks):
        end = marks[j + 1][0] if j + 1 < len(marks) else at
        # the loop's seconds whole inside the stretch, the first one left out
        sec = [d for d in lines if d["t"] >= start + 1.0 and d["t"] + d["dt"] <= end + 0.5]
        n = sum(d["n"] for d in sec)
        dt = sum(d["dt"] for d in sec)
        rows.append({"child": name, "state": state, "from_s": start, "s": round(dt, 1),
                     "rate": round(n / dt, 3) if dt else None, "switch_s": round(took, 3),
                     "series": [round(d["rate"], 2) for d in sec]})
    free = [r["rate"] for r in rows if r["state"] == "free" and r["rate"]]
    ref = sum(free) / len(free) if free else None
    for r in rows:
        r["pct_of_free"] = round(100 * r["rate"] / ref, 1) if ref and r["rate"] else None
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cmd", required=True, help="the workload (prints a JSON line per second)")
    ap.add_argument("--plan", default="free:8 probe:10 free:8 probe:10 free:4",
                    help="stretches of its timed loop, STATE:SECONDS (free or probe)")
    ap.add_argument("--lib", default=None, help="the libcuda to probe (default: the driver's)")
    ap.add_argument("--only", choices=("late", "early"), help="run one child only")
    a = ap.parse_args()
    plan = parse_plan(a.plan)
    probe = Probe(a.lib or default_lib())
    rows = []
    for name in ("late", "early"):
        if a.only in (None, name):
            rows += run_child(name, a.cmd, plan, probe, early=name == "early")
    print("| child | stretch | from s | rate | % of its free stretches | attach/detach s |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['child']} | {r['state']} | {r['from_s']:.0f} | {r['rate']} | {r['pct_of_free']} "
              f"| {r['switch_s']} |")


if __name__ == "__main__":
    main()
