#!/usr/bin/env python3
"""How NVML's device utilization reads a GPU busy a known part of each period.

  nvml_duty.py [--period P] [--duty D] [--seconds S]

A child process runs 8192^2 bf16 matmuls only in the first D of every P
seconds (synchronizing after each, as bench/gpu/turns.py), alone on the GPU;
the parent reads nvmlDeviceGetUtilizationRates every 0.25 s and prints the
mean of each 1.5 s (what the daemon's turns read), then the raw samples'
spacing (nvmlDeviceGetSamples). Prints JSON lines.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

import pynvml


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--period", type=float, default=0.1)
    ap.add_argument("--duty", type=float, default=0.9)
    ap.add_argument("--seconds", type=float, default=12.0)
    a = ap.parse_args()
    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    epoch = time.monotonic() + 6
    child = subprocess.Popen([sys.executable, "bench/gpu/turns.py", "matmul", "--epoch", str(epoch),
                              "--seconds", str(a.seconds), "--period", str(a.period),
                              "--slot", f"0:{a.duty}", "--label", "duty"], stdout=subprocess.PIPE,
                             text=True)
    while time.monotonic() < epoch + 2:
        time.sleep(0.05)
    reads, windows = [], []
    t_win = time.monotonic()
    while time.monotonic() < epoch + a.seconds - 0.5:
        reads.append(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
        if time.monotonic() - t_win >= 1.5:
            windows.append(round(statistics.mean(reads), 1))
            reads, t_win = [], time.monotonic()
        time.sleep(0.25)
    single = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for _ in range(1)]
    try:
        _typ, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, 0)
        ts = [s.timeStamp for s in samples][-40:]
        vals = [s.sampleValue.uiVal for s in samples][-40:]
        gaps = [round((b - c) / 1000, 1) for c, b in zip(ts, ts[1:])]
    except pynvml.NVMLError as e:
        gaps, vals = str(e), []
    out = child.communicate()[0].strip()
    print(json.dumps({"period": a.period, "duty": a.duty, "windows_1p5s": windows,
                      "last": single, "sample_gaps_ms": gaps, "sample_values": vals,
                      "child": json.loads(out) if out else None}))


if __name__ == "__main__":
    main()
