"""The SM-share controller: a launch budget per (group, device). Pure: no I/O.

The launch probes add each launch's cost (its grid's block count; a graph
launch costs `graph_cost`) to `sm_use.consumed`; a launch that finds
`consumed > granted` stops its process until the controller grants more.
This module decides `granted` on every tick.

How the rate is found:
1. Learn. A new (group, device) runs unthrottled for `learn_s` and its peak
   launch-cost rate is taken as its full rate F.
2. Open loop. The allowed rate R starts at cap% x F. For one workload in a
   group the units cancel out: throughput relative to uncapped is R / F,
   whatever a block or a graph really costs on the GPU.
3. Feedback. Where the device's utilization is known (NVML), the group's
   share of it (utilization x its part of the device's launch cost) is driven
   to the cap by an integral step on log R, so a wrong cost model, other
   groups on the GPU and a changing workload are corrected.
The bank is bounded to `burst_s` of rate, so an idle group cannot save up a
long uncapped burst.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

LEARN_S = 0.3
BURST_S = 0.05
GAIN = 2.0            # per second, on log R, per unit of relative error
MIN_RATE = 1.0        # cost units per second


@dataclass
class Budget:
    cap: float                      # percent, 0 < cap < 100
    granted: int = 0
    rate: float | None = None       # allowed cost units per second
    full_rate: float = 0.0          # learned unthrottled rate
    started: float | None = None
    last_t: float | None = None
    last_consumed: int = 0
    last_share: float | None = None  # measured share of the device, percent

    @property
    def learning(self) -> bool:
        return self.rate is None


def tick(b: Budget, *, now: float, consumed: int, share: float | None = None,
         learn_s: float = LEARN_S, burst_s: float = BURST_S, gain: float = GAIN) -> int:
    """Advance one budget to `now` given the probes' cumulative `consumed`;
    return the new `granted` (it only grows, except once, when learning ends)."""
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
        b.full_rate = max(b.full_rate, rate_seen)
        if now - b.started < learn_s or b.full_rate == 0:
            return b.granted
        b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
        b.granted = consumed   # withdraw the learning grant: the bank starts empty
        return b.granted

    if share is not None:
        b.last_share = share
        err = (b.cap - share) / b.cap
        err = max(-1.0, min(1.0, err))
        b.rate *= math.exp(gain * err * dt)
    b.rate = max(MIN_RATE, b.rate)
    bank_cap = consumed + b.rate * burst_s
    b.granted = int(max(b.granted, min(b.granted + b.rate * dt, bank_cap)))
    return b.granted


def shares(device_util: float | None, rates: dict) -> dict:
    """Attribute a device's utilization (percent) to groups by the launch cost
    each put on it over the last tick: {key: rate} -> {key: share percent}."""
    total = sum(rates.values())
    if device_util is None or total <= 0:
        return {k: None for k in rates}
    return {k: device_util * r / total for k, r in rates.items()}
