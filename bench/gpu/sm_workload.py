#!/usr/bin/env python3
"""One SM-limit workload process: prints a JSON line with its throughput.

  matmul  bf16 8192x8192 matmuls (compute-bound); unit: TFLOP/s
  small   x.add_(1) on 4096 floats (launch-bound); unit: kernels/s
  graph   CUDA-graph replay of 32 small kernels; unit: kernels/s

Throughput is measured in windows of 0.25 s (synchronizing at each window's
end); "steady" is the mean over windows starting after --settle seconds.
"""
import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=["matmul", "small", "graph"])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--settle", type=float, default=2.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--mark-at", type=float, default=None,
                    help="create --mark-file once this many seconds of windows have run "
                         "(sm_inproc.sh then gives the group its cap)")
    ap.add_argument("--mark-file", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.kind == "matmul":
        x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        work = 2 * 8192 ** 3 / 1e12

        def step():
            torch.mm(x, x)
        per = 4
    elif a.kind == "small":
        x = torch.zeros(4096, device=dev)
        work = 1

        def step():
            x.add_(1)
        per = 256
    else:
        x = torch.zeros(4096, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                for _ in range(32):
                    x.add_(1)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(32):
                x.add_(1)
        work = 32

        def step():
            g.replay()
        per = 16
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    windows = []
    t_start = time.monotonic()
    while time.monotonic() - t_start < a.seconds:
        t0 = time.monotonic()
        n = 0
        while time.monotonic() - t0 < 0.25:
            for _ in range(per):
                step()
            n += per
        torch.cuda.synchronize()
        t1 = time.monotonic()
        windows.append((round(t0 - t_start, 3), n * work / (t1 - t0)))
        if a.mark_at is not None and a.mark_file and t1 - t_start >= a.mark_at:
            open(a.mark_file, "a").close()
            a.mark_at = None
    steady = [v for t, v in windows if t >= a.settle]
    print(json.dumps({"label": a.label, "kind": a.kind, "pid": os.getpid(),
                      "sm_limit": os.environ.get("CUDA_DEVICE_SM_LIMIT"),
                      "steady": sum(steady) / len(steady) if steady else None,
                      "min_window": min(steady) if steady else None,
                      "windows": windows}), flush=True)


if __name__ == "__main__":
    main()
