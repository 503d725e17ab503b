#!/usr/bin/env python3
"""What NVML polling by another process costs a running workload, without hami-bpf.

The daemon reads device utilization (and, where the driver reports it,
per-process utilization) while it paces a group, as often as its ticks
ask. This runs a workload (bench/gpu/workloads/, uncapped, no daemon) and,
from this process, polls NVML in turns of PHASE_S: nothing, then one kind
of query at one rate, then nothing again, and so on, twice over. Each
polling phase's rate is compared with the quiet phases either side of it
in the same process, so the workload's own drift cancels out.

Usage (nvidia-h200 or nvidia-h100-x1; no bcc needed):
  python3 bench/gpu/nvml_cost.py [--workloads "bert_infer llm_decode"] [--phase-s 6]
Prints one JSON line per polling phase and a markdown table:
  {"w", "poll", "hz", "rate", "quiet", "pct", "call_us", "calls"}
"pct": the phase's rate over its quiet neighbours' mean; "call_us": the
mean time one poll took (what the daemon's tick spends in it).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite_ab import markdown, mean_rate, reader, stop  # noqa: E402 - sibling scripts, by path
from suite_run import workload_command  # noqa: E402

# (name, rate in Hz): the daemon's tick reads at 100 Hz while it paces by
# time, 200 Hz while a group is held; the memory check reads the process list.
POLLS = [("util", 100), ("proc_util", 100), ("proc_util", 10), ("both", 200),
         ("procs", 10)]


def poller(kind: str):
    """A function doing one poll of `kind`, or None where NVML cannot."""
    import pynvml
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)

    def util():
        pynvml.nvmlDeviceGetUtilizationRates(h)

    def proc_util():
        try:
            pynvml.nvmlDeviceGetProcessUtilization(h, int((time.time() - 1.0) * 1e6))
        except pynvml.NVMLError:
            pass

    def both():
        util()
        proc_util()

    def procs():
        pynvml.nvmlDeviceGetComputeRunningProcesses(h)

    return {"util": util, "proc_util": proc_util, "both": both, "procs": procs}[kind]


def poll_for(fn, hz: float, seconds: float) -> tuple[float, int]:
    """Call `fn` `hz` times a second for `seconds`: (mean µs per call, calls)."""
    period, end = 1.0 / hz, time.monotonic() + seconds
    spent, calls, nxt = 0.0, 0, time.monotonic()
    while True:
        now = time.monotonic()
        if now >= end:
            break
        if now < nxt:
            time.sleep(min(nxt - now, end - now))
            continue
        t = time.perf_counter()
        fn()
        spent += time.perf_counter() - t
        calls += 1
        nxt += period
    return (1e6 * spent / calls if calls else 0.0), calls


def run_one(a, w: str) -> list[dict]:
    plan = [None] + [p for poll in POLLS for p in (poll, None)]
    plan = plan + plan[1:]      # twice over
    script, args = workload_command(w)
    total = a.setup_limit + len(plan) * a.phase_s + 10
    cmd = ["python3", script, "--seconds", str(total), *args]
    if a.cpus:
        cmd = ["taskset", "-c", a.cpus, *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=reader, args=(p, q), daemon=True).start()
    lines: list = []
    done: list = []

    def collect(block: float) -> bool:
        end = time.monotonic() + block
        while True:
            try:
                arrived, line = q.get(timeout=max(0.0, end - time.monotonic()) or 0.01)
            except queue.Empty:
                return True
            if line is None:
                return False
            if line.startswith("{"):
                rec = json.loads(line)
                if "rate" in rec and not rec.get("summary"):
                    lines.append((arrived, rec))
            if time.monotonic() >= end:
                return True

    try:
        deadline = time.monotonic() + a.setup_limit
        while not lines and time.monotonic() < deadline:
            if not collect(0.5):
                break
        if not lines:
            print(json.dumps({"w": w, "error": "no timed loop before the set-up limit"}))
            return []
        collect(2.0)    # its first seconds left out
        fns = {}
        for poll in plan:
            start = time.monotonic()
            if poll is None:
                collect(a.phase_s)
                done.append((start, time.monotonic(), None, 0.0, 0))
                continue
            kind, hz = poll
            fn = fns.get(kind) or fns.setdefault(kind, poller(kind))
            box: list = []
            t = threading.Thread(target=lambda: box.append(poll_for(fn, hz, a.phase_s)))
            t.start()
            collect(a.phase_s)
            t.join()
            done.append((start, time.monotonic(), poll, *box[0]))
    finally:
        stop(p)
    out = []
    for i, (s, e, poll, call_us, calls) in enumerate(done):
        if poll is None:
            continue
        rate = mean_rate(lines, s + 0.5, e)[0]
        quiet = [mean_rate(lines, done[j][0] + 0.5, done[j][1])[0]
                 for j in (i - 1, i + 1) if 0 <= j < len(done) and done[j][2] is None]
        quiet = [r for r in quiet if r]
        ref = sum(quiet) / len(quiet) if quiet else None
        r = {"w": w, "poll": poll[0], "hz": poll[1], "rate": rate and round(rate, 3),
             "quiet": ref and round(ref, 3),
             "pct": rate and ref and round(100 * rate / ref, 1),
             "call_us": round(call_us, 1), "calls": calls}
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="bert_infer llm_decode")
    ap.add_argument("--phase-s", type=float, default=6.0, dest="phase_s")
    ap.add_argument("--setup-limit", type=float, default=120.0, dest="setup_limit")
    ap.add_argument("--cpus", default=os.environ.get("AB_CPUS", "2-5"))
    a = ap.parse_args()
    rows = []
    for w in a.workloads.split():
        rows += run_one(a, w)
    markdown(rows, [("workload", "w", "l"), ("poll", "poll", "l"), ("Hz", "hz", "r"),
                    ("rate", "rate", "r"), ("quiet either side", "quiet", "r"),
                    ("% of quiet", "pct", "r"), ("µs per poll", "call_us", "r"),
                    ("polls", "calls", "r")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
