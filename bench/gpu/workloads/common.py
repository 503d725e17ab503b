"""Shared pieces of the real workloads (bench/gpu/workloads/*.py).

Every workload prints one JSON line per second of its timed loop:

  {"w": NAME, "t": START_S, "dt": SECONDS, "n": UNITS, "rate": UNITS/S, "unit": "steps/s",
   "phase": optional}

`t` is the interval's start in seconds since the timed loop began (after
set-up and warm-up), `n` the work units finished in it; an interval also ends
where the phase changes, so `dt` is at most 1 s. A last line carries
"summary": true with the totals, the set-up time and the process's group and cap.
With BENCH_UNIT_TRACE=FILE set, the timed loop also writes FILE at its end:
{"t": [monotonic seconds at each add()], "n": [units added then]}, so a
bench can place every unit against the stops it saw (bench/gpu/stopcont.py).

Start-up hand-off (--sync-dir D, used by bench/gpu/suite_run.py): the script
imports its libraries, then waits for D/go before touching the GPU, builds and
warms up, creates D/ready and waits for D/start before its timed loop. That
lets the suite import the next run's libraries while the current one is
measured, and start the two sides of a pair together.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

T_PROC = time.monotonic()
MARKS = {"imported": None, "go": None, "ready": None}


def parser(doc: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--seconds", type=float, default=12.0, help="length of the timed loop")
    ap.add_argument("--sync-dir", default=None,
                    help="wait for DIR/go before the GPU is touched, create DIR/ready after the "
                         "warm-up and wait for DIR/start before the timed loop")
    ap.add_argument("--wait-limit", type=float, default=900.0,
                    help="give up (exit 3) after this long waiting for go or start, or "
                         "once the parent has gone")
    return ap


PARENT = os.getppid()


def _wait_for(path: str, limit: float) -> None:
    end = time.monotonic() + limit
    while not os.path.exists(path):
        if time.monotonic() > end or os.getppid() != PARENT:   # timed out, or orphaned
            print(json.dumps({"error": f"gave up waiting for {path}"}), flush=True)
            sys.exit(3)
        time.sleep(0.01)


def wait_go(a) -> None:
    """Called once the libraries are imported, before the GPU is touched."""
    MARKS["imported"] = time.monotonic()
    if a.sync_dir:
        _wait_for(os.path.join(a.sync_dir, "go"), a.wait_limit)
    MARKS["go"] = time.monotonic()


def ready_start(a) -> None:
    """Called after the warm-up: say so, and wait for the word to start."""
    MARKS["ready"] = time.monotonic()
    if a.sync_dir:
        open(os.path.join(a.sync_dir, "ready"), "a").close()
        _wait_for(os.path.join(a.sync_dir, "start"), a.wait_limit)


class Reporter:
    """Counts work units and prints one JSON line per second (and per phase change)."""

    def __init__(self, name: str, unit: str, seconds: float):
        self.name, self.unit, self.seconds = name, unit, seconds
        self.t_go = None
        self.t0 = None
        self.phase = None
        self.start_t = 0.0
        self.n = 0.0
        self.total = 0.0
        self.after5 = [0.0, 0.0]      # units, seconds of intervals starting at >= 5 s
        self.extra: dict = {}
        self.trace_path = os.environ.get("BENCH_UNIT_TRACE")
        self.trace_t: list[float] = []
        self.trace_n: list[float] = []

    def begin(self, phase: str | None = None) -> None:
        self.t0 = time.monotonic()
        self.mono0 = self.t0
        self.phase = phase
        self.start_t = 0.0

    def now(self) -> float:
        return time.monotonic() - self.t0

    def done(self) -> bool:
        return self.now() >= self.seconds

    def _emit(self, end_t: float) -> None:
        dt = end_t - self.start_t
        if dt <= 0:
            return
        line = {"w": self.name, "t": round(self.start_t, 4), "dt": round(dt, 4), "n": self.n,
                "rate": round(self.n / dt, 4), "unit": self.unit}
        if self.phase is not None:
            line["phase"] = self.phase
        print(json.dumps(line), flush=True)
        if self.start_t >= 5.0:
            self.after5[0] += self.n
            self.after5[1] += dt
        self.total += self.n
        self.n = 0.0
        self.start_t = end_t

    def add(self, units: float) -> None:
        """Count `units` finished now (in the current phase)."""
        self.n += units
        t = self.now()
        if self.trace_path:
            self.trace_t.append(round(self.t0 + t, 6))
            self.trace_n.append(units)
        if t - self.start_t >= 1.0:
            self._emit(t)

    def set_phase(self, phase: str) -> None:
        if phase != self.phase:
            self._emit(self.now())
            self.phase = phase

    def finish(self, **extra) -> None:
        t = self.now()
        m = MARKS
        imported = (m["imported"] or self.t0) - T_PROC
        gpu_setup = (m["ready"] or self.t0) - (m["go"] or m["imported"] or T_PROC)
        self._emit(t)
        a5 = self.after5
        print(json.dumps({
            "w": self.name, "summary": True, "unit": self.unit, "seconds": round(t, 3),
            "units": self.total, "rate": round(self.total / t, 4) if t > 0 else None,
            "rate_after5": round(a5[0] / a5[1], 4) if a5[1] > 0 else None,
            "import_s": round(imported, 3), "gpu_setup_s": round(gpu_setup, 3), "mono0": self.mono0, "pid": os.getpid(),
            "group": os.environ.get("HAMI_GROUP"), "sm_limit": os.environ.get("CUDA_DEVICE_SM_LIMIT"),
            **self.extra, **extra}), flush=True)
        if self.trace_path:
            with open(self.trace_path, "w") as f:
                json.dump({"t": self.trace_t, "n": self.trace_n}, f)


def run_steps(a, name: str, unit: str, step, units: float = 1, warmup: int = 3, **extra) -> None:
    """The plain timed loop: `warmup` calls of `step` (then a synchronize, so
    nothing of them is queued), the start hand-off, then `step` until the
    loop's seconds are up, counting `units` per call; the summary carries
    `extra`."""
    import torch
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter(name, unit, a.seconds)
    rep.begin()
    while not rep.done():
        step()
        rep.add(units)
    rep.finish(**extra)


def run_requests(a, name: str, unit: str, request, **extra) -> None:
    """The timed loop of a server: one request(None) to warm up (then a
    synchronize), the start hand-off, then request(rep) until the loop's
    seconds are up. A request counts its own units on rep and returns once
    rep.done(); the summary carries the requests served and `extra`."""
    import torch
    request(None)
    torch.cuda.synchronize()
    ready_start(a)
    rep = Reporter(name, unit, a.seconds)
    rep.begin()
    requests = 0
    while not rep.done():
        request(rep)
        requests += 1
    rep.finish(requests=requests, **extra)
