"""Synthetic recordings in bench/gpu/record.py's format, for the replay tests.

Each workload is a host program run against a ground-truth GPU (one FIFO,
a launch queue of QUEUE_DEPTH launches that blocks the host when full, and
a synchronize that returns once everything launched before it finished),
with seeded jitter. What comes out is only what the recorder would see:
launches binned per millisecond and thread, synchronize calls with their
enter and return times, and NVML utilization samples. The replay's fit
(hami_bpf.sm.replay) never sees the ground truth's kernel times.

  decode      a decode loop: ~300 small launches per token, then a
              synchronize (~7 ms a token; the GPU slightly slower than the
              host, so the synchronize waits a little)
  cnn_train   cudnn-style autotuning first (a few kernels of 0.1-0.4 s, each
              timed with an event synchronize, ~4 per second), then ~50 ms
              training steps: ~1200 forward launches from the main thread,
              ~1800 backward launches from a second thread, one
              synchronize (the loss's .item()) per step
  gpu_bound   1 ms kernels launched as fast as the queue takes them, never
              synchronized
  train_slow  a GPU-bound training loop of 150 ms steps, a synchronize per step
  prefill     10 kernels of ~10 ms, then a synchronize that waits ~100 ms for them
  phased      decode (3 s), a GPU-bound stretch without a synchronize (1.5 s),
              prefill-like long kernels with a synchronize every ~0.3 s (1.5 s),
              and again
"""
from __future__ import annotations

import collections
import random

QUEUE_DEPTH = 1024          # launches the driver queues before a launch blocks
SYNC_OVERHEAD_S = 4e-6      # a synchronize's own cost with nothing left to wait for
NVML_PERIOD_S = 0.1         # utilization sample period (each sample: busy share of the last period)


class _Gpu:
    """Ground truth: host clock, one FIFO device, the recorder's raw events."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.t = 0.0
        self.gpu_free = 0.0
        self.pending: collections.deque[float] = collections.deque()
        self.launches: list[tuple[float, int, int]] = []
        self.syncs: list[list] = []
        self.busy: list[list[float]] = []

    def host(self, dt: float) -> None:
        self.t += max(dt, 0.0)

    def launch(self, tid: int, cost: int, gpu_s: float) -> None:
        pending = self.pending
        while pending and pending[0] <= self.t:
            pending.popleft()
        if len(pending) >= QUEUE_DEPTH:     # a full queue blocks the launching thread
            self.t = pending.popleft()
        start = self.t if self.t > self.gpu_free else self.gpu_free
        end = start + gpu_s
        self.gpu_free = end
        if self.busy and self.busy[-1][1] >= start:
            self.busy[-1][1] = end
        else:
            self.busy.append([start, end])
        pending.append(end)
        self.launches.append((self.t, tid, cost))

    def sync(self, tid: int, fn: str = "cuStreamSynchronize") -> None:
        enter = self.t
        ret = max(enter, self.gpu_free) + SYNC_OVERHEAD_S
        self.syncs.append([tid, round(enter * 1e6), round(ret * 1e6), fn])
        self.t = ret
        self.pending.clear()

    def recording(self, workload: str) -> dict:
        bins: dict[tuple[int, int], list[int]] = {}
        for t, tid, cost in self.launches:
            b = bins.setdefault((int(t * 1000), tid), [0, 0])
            b[0] += 1
            b[1] += cost
        launches = [[ms, tid, n, c] for (ms, tid), (n, c) in sorted(bins.items())]
        nvml = []
        periods = int(self.t / NVML_PERIOD_S) + 1
        busy_in = [0.0] * (periods + 1)
        for s, e in self.busy:
            k = int(s / NVML_PERIOD_S)
            while s < e:
                edge = min(e, (k + 1) * NVML_PERIOD_S)
                if k < len(busy_in) and edge > s:
                    busy_in[k] += edge - s
                s = max(s, edge)
                k += 1
        for k in range(periods):
            nvml.append([round((k + 1) * NVML_PERIOD_S * 1e6),
                         min(100, round(100 * busy_in[k] / NVML_PERIOD_S))])
        return {"header": {"workload": workload, "seconds": round(self.t, 6), "lost": 0,
                           "synthetic": True},
                "launches": launches, "syncs": self.syncs, "nvml": nvml}


def decode(seconds: float = 12.0, seed: int = 1) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    # a layer's kernels: (blocks, ns of GPU per block) -- the cost per block differs by kernel
    layer = [(132, 160), (264, 70), (66, 330), (132, 150), (33, 600), (132, 140)]
    while g.t < seconds:
        for i in range(300):
            blocks, ns = layer[i % len(layer)]
            g.host(rng.gauss(18e-6, 3e-6))
            g.launch(1, blocks, blocks * ns * 1e-9 * rng.uniform(0.9, 1.1))
        g.sync(1)
        g.host(rng.gauss(0.8e-3, 0.1e-3))      # sampling, detokenizing
    return g.recording("decode")


def cnn_train(seconds: float = 12.0, seed: int = 2, autotune_s: float = 3.0) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    while g.t < autotune_s:                    # each candidate algorithm timed alone
        g.host(rng.uniform(40e-6, 80e-6))
        g.launch(1, 8192, rng.uniform(0.1, 0.4))
        g.sync(1, "cuEventSynchronize")
        g.host(rng.uniform(0.1e-3, 0.3e-3))
    while g.t < seconds:
        for i in range(1200):                  # forward, main thread
            g.host(rng.gauss(8e-6, 1e-6))
            g.launch(1, 512 if i % 3 else 2048, rng.uniform(12e-6, 20e-6) * (1 if i % 3 else 1.5))
        for i in range(1800):                  # backward, the autograd thread
            g.host(rng.gauss(7e-6, 1e-6))
            g.launch(2, 1024, rng.uniform(11e-6, 19e-6))
        g.sync(1)                              # loss.item()
        g.host(rng.gauss(3e-3, 0.3e-3))        # data loading, logging
    return g.recording("cnn_train")


def gpu_bound(seconds: float = 8.0, seed: int = 3) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    while g.t < seconds:
        g.host(rng.uniform(5e-6, 15e-6))
        g.launch(1, 1000, rng.uniform(0.95e-3, 1.05e-3))
    return g.recording("gpu_bound")


def train_slow(seconds: float = 12.0, seed: int = 4, step_s: float = 0.15) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    while g.t < seconds:
        for _ in range(int(step_s / 16e-6)):
            g.host(rng.gauss(8e-6, 1e-6))
            g.launch(1, 512, rng.uniform(14e-6, 18e-6))
        g.sync(1)
        g.host(rng.gauss(2e-3, 0.2e-3))
    return g.recording("train_slow")


def prefill(seconds: float = 12.0, seed: int = 6) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    while g.t < seconds:
        for _ in range(10):
            g.host(rng.gauss(20e-6, 3e-6))
            g.launch(1, 4096, rng.uniform(9e-3, 11e-3))
        g.sync(1)
        g.host(rng.gauss(1e-3, 0.1e-3))
    return g.recording("prefill")


def phased(seconds: float = 14.0, seed: int = 5) -> dict:
    g = _Gpu(seed)
    rng = g.rng
    while g.t < seconds:
        until = g.t + 3.0
        while g.t < until:                     # decode
            for _ in range(300):
                g.host(rng.gauss(18e-6, 3e-6))
                g.launch(1, 132, rng.uniform(15e-6, 25e-6))
            g.sync(1)
            g.host(rng.gauss(0.8e-3, 0.1e-3))
        until = g.t + 1.5
        while g.t < until:                     # a GPU-bound stretch, no synchronize
            g.host(rng.uniform(5e-6, 15e-6))
            g.launch(1, 1000, rng.uniform(0.95e-3, 1.05e-3))
        g.sync(1, "cuCtxSynchronize")
        until = g.t + 1.5
        while g.t < until:                     # prefill: long kernels, ~3 synchronizes a second
            for _ in range(30):
                g.host(rng.gauss(20e-6, 3e-6))
                g.launch(1, 4096, rng.uniform(8e-3, 12e-3))
            g.sync(1)
    return g.recording("phased")


WORKLOADS = {"decode": decode, "cnn_train": cnn_train, "gpu_bound": gpu_bound,
             "train_slow": train_slow, "prefill": prefill, "phased": phased}
