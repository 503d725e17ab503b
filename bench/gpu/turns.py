#!/usr/bin/env python3
"""Does a GPU lose throughput to two processes time-slicing it, and do turns
avoid the loss? No hami-bpf: the processes take turns by the clock.

  turns.py KIND --epoch E --seconds S [--period P --slot A:B]

KIND matmul or small (as sm_workload.py). Without --period the process runs
freely. With it, it launches only while (now - E) mod P lies in [A, B)
seconds, synchronizing after every step so that little of its work runs
past its slot. Prints one JSON line: throughput over the run.
"""
import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["matmul", "small"])
    ap.add_argument("--epoch", type=float, required=True, help="time.monotonic() to start at")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--period", type=float, default=None)
    ap.add_argument("--slot", default="0:1", help="A:B, fractions of the period")
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.kind == "matmul":
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        work, per = 2 * 8192 ** 3 / 1e12, 1

        def step():
            torch.mm(x, x)
    else:
        x = torch.zeros(4096, device=dev)
        work, per = 1, 32

        def step():
            x.add_(1)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    lo, hi = (float(v) for v in a.slot.split(":"))
    while time.monotonic() < a.epoch:
        time.sleep(0.001)
    n = 0
    end = a.epoch + a.seconds
    while (now := time.monotonic()) < end:
        if a.period is not None:
            phase = ((now - a.epoch) % a.period) / a.period
            if not lo <= phase < hi:
                time.sleep(min(0.0005, a.period / 100))
                continue
        for _ in range(per):
            step()
        n += per
        if a.period is not None:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    took = time.monotonic() - a.epoch
    print(json.dumps({"label": a.label, "kind": a.kind, "pid": os.getpid(), "period": a.period,
                      "slot": a.slot, "rate": n * work / took}), flush=True)


if __name__ == "__main__":
    main()
