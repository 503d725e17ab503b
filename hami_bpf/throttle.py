"""The SM-share controller: a launch budget per (group, device). Pure: no I/O.

The launch probes add each launch's cost (its grid's block count; a graph
launch costs `graph_cost`) to `sm_use.consumed`; a launch that finds
`consumed > granted` stops its process until the controller grants more.
This module decides `granted` on every tick.

How the rate is found (measured on the H200, docs/benchmarks.md). Where the
workload synchronizes (cuStreamSynchronize, cuCtxSynchronize,
cuEventSynchronize: PyTorch does at every .item(), .cpu() and
torch.cuda.synchronize()), the probes report `completed`: cost known done on
the GPU. Its rate is the GPU's real pace, so it is used for learning and as
the feedback signal. Without synchronizations the host-side fallback below is
used:
1. Learn. A new (group, device) runs unthrottled for `learn_s`. The host can
   queue a second or more of GPU work before the driver pushes back, so the
   first moments say nothing about GPU throughput; only the second part of the
   window, when the queue is full and launches proceed at the GPU's pace, gives
   the full rate F (and, with NVML, the group's busy share U_full).
2. Open loop. The allowed rate is R0 = cap% x F. For one workload in a group
   the units cancel out: throughput relative to uncapped is R / F, whatever a
   block or a graph really costs on the GPU.
3. Feedback, bounded. With NVML, the group's share of device utilization,
   normalized by U_full, trims R around R0 (x0.5 .. x1.5). The bound matters:
   utilization stays high while the GPU drains work queued earlier, and an
   unbounded integrator throttles a graph-replay workload to nothing (seen).
The bank holds at most `burst_s` of rate, so an idle group cannot save up a
long uncapped burst.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

LEARN_S = 1.0
LEARN_FROM = 0.4      # fraction of the learning window ignored (queue filling)
BURST_S = 0.05
GAIN = 1.0            # per second, on log R, per unit of relative error
TRIM_MIN, TRIM_MAX = 0.5, 1.5
TRIM_MIN_DONE, TRIM_MAX_DONE = 0.3, 3.0   # the completion signal is direct: a wider trim
MIN_RATE = 1.0        # cost units per second


@dataclass
class Budget:
    cap: float                      # percent, 0 < cap < 100
    granted: int = 0
    rate: float | None = None       # allowed cost units per second (None while learning)
    full_rate: float = 0.0          # learned unthrottled rate F
    full_util: float | None = None  # learned unthrottled utilization share U_full
    trim: float = 1.0
    started: float | None = None
    mark: tuple[float, int] | None = None   # (time, consumed) where learning starts to count
    last_t: float | None = None
    last_consumed: int = 0
    credit: float | None = None      # granted, unrounded
    last_share: float | None = None  # measured share, percent of uncapped
    utils: list = field(default_factory=list)
    done: list = field(default_factory=list)   # (time, completed) when completed advanced
    by_completion: bool = False       # F came from completions (the GPU's pace)

    @property
    def learning(self) -> bool:
        return self.rate is None


DONE_WINDOW_S = 1.0    # completion rate is measured over about this long
DONE_MIN_SPAN_S = 0.4
LEARN_MAX_S = 3.0      # give up waiting for completions; use the host-side rate


def completion_rate(b: Budget, now: float) -> float | None:
    pts = [(t, c) for t, c in b.done if now - t <= DONE_WINDOW_S + 0.5]
    if len(pts) < 2 or pts[-1][0] - pts[0][0] < DONE_MIN_SPAN_S:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


def tick(b: Budget, *, now: float, consumed: int, util: float | None = None,
         completed: int | None = None, learn_s: float = LEARN_S, burst_s: float = BURST_S,
         gain: float = GAIN) -> int:
    """Advance one budget to `now` given the probes' cumulative `consumed`
    and `completed` and, where known, the group's part of its device's
    utilization (percent); return the new `granted`."""
    if completed is not None and (not b.done or completed > b.done[-1][1]):
        b.done.append((now, completed))
        b.done = [(t, c) for t, c in b.done if now - t <= DONE_WINDOW_S + 0.5]
    if b.started is None:
        b.started = b.last_t = now
        b.last_consumed = consumed
        b.granted = max(b.granted, consumed + (1 << 40))   # unthrottled while learning
        return b.granted
    dt = now - b.last_t
    if dt <= 0:
        return b.granted
    rate_seen = max(0, consumed - b.last_consumed) / dt
    b.last_t, b.last_consumed = now, consumed

    if b.rate is None:
        age = now - b.started
        if age < learn_s * LEARN_FROM:
            return b.granted
        pace = completion_rate(b, now)
        if pace and b.done[0][0] - b.started >= learn_s * LEARN_FROM * 0.5:
            b.full_rate, b.by_completion = pace, True
            b.full_util = (sum(b.utils) / len(b.utils)) if b.utils else None
            b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
            b.granted, b.credit = consumed, float(consumed)
            return b.granted
        if b.done and age < LEARN_MAX_S:
            if util is not None:
                b.utils.append(util)
            return b.granted       # it synchronizes: wait for its GPU pace
        if b.mark is None:
            b.mark = (now, consumed)
            return b.granted
        if util is not None:
            b.utils.append(util)
        if age < learn_s or consumed == b.mark[1]:
            return b.granted       # not long enough, or idle: nothing to cap yet
        b.full_rate = (consumed - b.mark[1]) / (now - b.mark[0])
        b.full_util = (sum(b.utils) / len(b.utils)) if b.utils else None
        b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
        b.granted, b.credit = consumed, float(consumed)   # the bank starts empty
        return b.granted

    base = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
    pace = completion_rate(b, now) if b.by_completion else None
    if pace is not None:
        share = 100.0 * pace / b.full_rate
        b.last_share = share
        err = max(-0.5, min(0.5, (b.cap - share) / b.cap))
        b.trim = max(TRIM_MIN_DONE, min(TRIM_MAX_DONE, b.trim * math.exp(gain * err * dt)))
    elif util is not None and b.full_util:
        share = 100.0 * util / b.full_util
        b.last_share = share
        err = max(-0.5, min(0.5, (b.cap - share) / b.cap))
        b.trim = max(TRIM_MIN, min(TRIM_MAX, b.trim * math.exp(gain * err * dt)))
    elif b.full_rate:
        b.last_share = 100.0 * rate_seen / b.full_rate
    b.rate = base * b.trim
    # Credit is kept as a float: at a few units per second, rounding each
    # tick's grant down to an integer would grant nothing, ever.
    bank_cap = consumed + b.rate * burst_s
    b.credit = max(b.credit if b.credit is not None else float(b.granted),
                   min((b.credit if b.credit is not None else float(b.granted)) + b.rate * dt,
                       bank_cap))
    b.granted = max(b.granted, int(math.ceil(b.credit)))
    return b.granted


def shares(device_util: float | None, rates: dict) -> dict:
    """Attribute a device's utilization (percent) to groups by the launch cost
    each put on it over the last tick: {key: rate} -> {key: utilization}."""
    total = sum(rates.values())
    if device_util is None or total <= 0:
        return {k: None for k in rates}
    return {k: device_util * r / total for k, r in rates.items()}
