#!/usr/bin/env python3
"""SM limiting against the simulated GPU, on any Linux host with BPF (no GPU).

The stand-in libcuda's simulated GPU (FAKECUDA_GPU_SIM, see
hami_bpf/fakecuda/libcuda.c) gives launches GPU time on one timeline shared
by all processes, a launch queue that pushes back, and synchronize calls that
wait for the queue: the dynamics that made the controller hard to get right on
the H200 (docs/performance.md), reproduced in seconds on a laptop. A real
daemon with real uprobes throttles real processes; this prints the same table
as bench/gpu/sm_summary.py.

  sudo /opt/hami-bpf/venv/bin/python bench/sim_sm.py [--kinds gpu,small,graph] [--caps 25,50,75]

FAKECUDA_SIM_SHARE_EFF=90 in the environment serves the simulated device by
processor sharing that loses 10% while processes share it (libcuda.c), as
two matmul processes time-slicing an H200 do; unset, one FIFO timeline.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "bpf"))

from hami_bpf.fakecuda import CudaProc, build  # noqa: E402
from helpers import Daemon, finish_daemon  # noqa: E402

# Each kind: (command, environment). 'gpu' is like an 8192^2 matmul stream
# (1 ms kernels, a 0.5 s queue); 'small' is host-bound (10 us per launch on
# the host, 2 us on the device); 'graph' replays 200 us graphs.
KINDS = {
    "gpu": ("bench launch 1000 {s} {settle}", {"FAKECUDA_NS_PER_BLOCK": "1000"}),
    "small": ("bench launch 1 {s} {settle}", {"FAKECUDA_NS_PER_BLOCK": "2000",
                                              "FAKECUDA_LAUNCH_NS": "10000"}),
    "graph": ("bench graph 1 {s} {settle}", {"FAKECUDA_GRAPH_NS": "200000"}),
}


def run_one(fake, sim: str, kind: str, group: str, cap: int | None, seconds: int,
            settle_ms: int, out: dict, label: str) -> None:
    cmd, env = KINDS[kind]
    env = {**env, "FAKECUDA_GPU_SIM": sim, "FAKECUDA_DEVICES": "1", "HAMI_GROUP": group,
           "FAKECUDA_SIM_SHARE_EFF": os.environ.get("FAKECUDA_SIM_SHARE_EFF", "")}
    if cap is not None:
        env["CUDA_DEVICE_SM_LIMIT"] = str(cap)
    with CudaProc(fake, env=env) as p:
        p.cmd("init")
        p.cmd("device 0")
        p.cmd("launch 3")     # warm-up and one synchronize, as bench/gpu/sm_workload.py
        p.cmd("sync")
        r = p.cmd(cmd.format(s=seconds, settle=settle_ms), timeout=seconds + 60)
    out[label] = (kind, cap, float(r["steady"]), float(r["min"]), r["windows"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="gpu,small,graph")
    ap.add_argument("--caps", default="25,50,75")
    ap.add_argument("--seconds", type=int, default=6)
    ap.add_argument("--settle-ms", type=int, default=2000)
    ap.add_argument("--pair", default="70,30", help="two groups side by side on the gpu kind; '' to skip")
    ap.add_argument("--pair-skew", type=float, default=0.0,
                    help="start the pair's second group this many seconds after the first "
                         "(its run and settle are that much shorter, so both are steady together)")
    ap.add_argument("--windows", action="store_true", help="print every window's rate")
    ap.add_argument("--no-turns", action="store_true", help="the daemon with --no-sm-turns")
    a = ap.parse_args()
    fake = build()
    sim = os.path.join("/dev/shm", f"hami-sim-{uuid.uuid4().hex[:8]}")
    res: dict = {}
    d = Daemon(fake, extra=["--sim-gpu", sim, "--sm-limits"] + (["--no-sm-turns"] if a.no_turns else []) + (["-v"] if os.environ.get("HAMI_SIM_VERBOSE") else [])).start()
    try:
        for kind in a.kinds.split(","):
            run_one(fake, sim, kind, f"base-{kind}-{uuid.uuid4().hex[:4]}", None, a.seconds,
                    a.settle_ms, res, f"{kind} uncapped")
            for cap in [int(c) for c in a.caps.split(",") if c]:
                run_one(fake, sim, kind, f"cap{cap}-{kind}-{uuid.uuid4().hex[:4]}", cap,
                        a.seconds, a.settle_ms, res, f"{kind} cap{cap}")
        if a.pair:
            caps = [int(c) for c in a.pair.split(",")]
            skew = int(round(a.pair_skew))
            ts = [threading.Thread(target=run_one, args=(
                fake, sim, "gpu", f"pair{c}-{uuid.uuid4().hex[:4]}", c,
                a.seconds + 4 + (0 if i else skew), a.settle_ms + 2000 + (0 if i else 1000 * skew),
                res, f"gpu pair{c}")) for i, c in enumerate(caps)]
            for i, t in enumerate(ts):
                if i:
                    time.sleep(skew)
                t.start()
            for t in ts:
                t.join()
    finally:
        log = d.log()
        try:
            from hami_bpf.server import query
            for e in query(d.socket, "events", since=0)["events"]:
                if e.get("kind") == "throttle":
                    log += f"\nevent {e.get('ts', 0) % 100:.2f} " + e["message"]
        except Exception as e:  # noqa: BLE001 - a bench: say it and go on
            log += f"\nevents: {e}"
        finish_daemon(d)
        try:
            os.unlink(sim)
        except OSError:
            pass
    base = {k: s for lab, (k, c, s, m, w) in res.items() if lab.endswith("uncapped")}
    print("| workload | cap | steady launches/s | relative to uncapped | target | min window rel. |")
    print("|---|---:|---:|---:|---:|---:|")
    for lab, (k, c, s, m, w) in res.items():
        b = base.get(k)
        if not b:
            continue
        print(f"| {lab} | {c or '-'} | {s:.1f} | {100 * s / b:.1f}% | {c or 100}% | {100 * m / b:.1f}% |")
        if a.windows:
            print(f"|   windows: {w} |")
    if os.environ.get("HAMI_SIM_LOG"):
        Path(os.environ["HAMI_SIM_LOG"]).write_text(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
