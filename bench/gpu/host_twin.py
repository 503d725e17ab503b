#!/usr/bin/env python3
"""Does host-only work on other CPUs follow a launch-bound loop's own speed?

A launch-bound loop (an LLM decode step of a few hundred small kernels) is
paced by its host thread, and on the GPU VM that thread's speed moves by
8-46% between free stretches a minute apart (docs/facts.md). A cap is
judged against the same process's free stretches either side, so that
drift lands in the figure. If host-only work on another CPU moves with
it, its rate is a reference that runs beside a capped stretch without
touching the GPU.

Runs each workload free (no daemon) for --seconds beside twins, each
pinned to a CPU of its own:
  torch: PyTorch's CPU dispatcher (add_ on a 16-float tensor), the host
         path of a launch without the driver;
  py:    the interpreter alone.
Prints one JSON line per workload: its per-second rates, each twin's rate
over the same seconds, their correlation, and the coefficient of variation
of 10 s block means of the workload's rate, raw and divided by each twin's.

Usage (nvidia-h200): python3 bench/gpu/host_twin.py llm_decode bert_infer --seconds 90
Twin alone: python3 bench/gpu/host_twin.py --twin torch
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite_run import workload_command  # noqa: E402 - a sibling script, by path

REPORT_S = 0.25     # a twin reports its count this often
BLOCK_S = 10.0      # drift is judged over blocks this long


def twin(kind: str) -> None:
    """Count host-only work units forever; print (monotonic time, count)."""
    if kind == "torch":
        import torch
        torch.set_num_threads(1)
        x = torch.zeros(16)

        def unit() -> None:
            x.add_(1)
    else:
        d: dict = {}

        def unit() -> None:
            d[len(d) & 63] = [len(d)] * 4
    n, next_t = 0, time.monotonic() + REPORT_S
    while True:
        for _ in range(200):
            unit()
        n += 200
        now = time.monotonic()
        if now >= next_t:
            print(json.dumps({"t": now, "n": n}), flush=True)
            next_t = now + REPORT_S


def at(marks: list, t: float) -> float | None:
    """A twin's count at time t, interpolated between its reports."""
    for (t0, n0), (t1, n1) in zip(marks, marks[1:]):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0)
    return None


def cv(xs: list) -> float | None:
    return round(statistics.pstdev(xs) / statistics.mean(xs), 4) if len(xs) > 1 else None


def corr(a: list, b: list) -> float | None:
    """Pearson's correlation; None where it is undefined (too few, or constant)."""
    try:
        return round(statistics.correlation(a, b), 3) if len(a) >= 3 else None
    except statistics.StatisticsError:
        return None


def measure(w: str, seconds: float, kinds: list, cpus: list) -> dict:
    twins = {}
    for kind, cpu in zip(kinds, cpus):
        twins[kind] = subprocess.Popen(["taskset", "-c", str(cpu), sys.executable, __file__,
                                        "--twin", kind], stdout=subprocess.PIPE, text=True)
    script, extra = workload_command(w)
    p = subprocess.Popen([sys.executable, script, "--seconds", str(seconds)] + extra,
                         stdout=subprocess.PIPE, text=True)
    lines = []
    for line in p.stdout:
        arrived = time.monotonic()
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if "rate" in rec and "dt" in rec and not rec.get("summary"):
            lines.append((arrived - rec["dt"], arrived, rec["n"] / rec["dt"]))
    p.wait()
    marks = {}
    for kind, tp in twins.items():
        tp.kill()
        out = tp.communicate()[0]
        marks[kind] = [(r["t"], r["n"]) for r in map(json.loads, out.split("\n")[:-1])]
    rows = []
    for s, e, rate in lines[1:]:
        tw = {}
        for kind, m in marks.items():
            a, b = at(m, s), at(m, e)
            tw[kind] = None if a is None or b is None else (b - a) / (e - s)
        if all(v for v in tw.values()):
            rows.append((s, rate, tw))
    out = {"w": w, "seconds": len(rows), "rate": [round(r[1], 2) for r in rows]}
    t0 = rows[0][0] if rows else 0.0
    blocks: dict = {}
    for s, rate, tw in rows:
        blocks.setdefault(int((s - t0) // BLOCK_S), []).append((rate, tw))
    blocks = {k: v for k, v in blocks.items() if len(v) >= BLOCK_S * 0.8}
    out["block_rate"] = [round(statistics.mean(r for r, _ in v), 2) for v in blocks.values()]
    out["block_cv"] = cv(out["block_rate"])
    for kind in marks:
        tws = [r[2][kind] for r in rows]
        out[f"{kind}_rate"] = [round(x) for x in tws]
        out[f"{kind}_corr"] = corr([r[1] for r in rows], tws)
        norm = [statistics.mean(r / t[kind] for r, t in v) for v in blocks.values()]
        out[f"{kind}_block_cv"] = cv(norm)
        out[f"{kind}_block"] = [round(statistics.mean(t[kind] for _, t in v)) for v in blocks.values()]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workloads", nargs="*", help="workloads of bench/gpu/workloads to run free")
    ap.add_argument("--seconds", type=float, default=90.0, help="each workload's timed loop")
    ap.add_argument("--twins", default="torch,py", help="twin kinds beside it")
    ap.add_argument("--cpus", default="13,14", help="a CPU per twin")
    ap.add_argument("--twin", default=None, help="be a twin of this kind (internal)")
    a = ap.parse_args()
    if a.twin:
        twin(a.twin)
        return
    kinds, cpus = a.twins.split(","), a.cpus.split(",")
    for w in a.workloads:
        print(json.dumps(measure(w, a.seconds, kinds, cpus)), flush=True)


if __name__ == "__main__":
    main()
