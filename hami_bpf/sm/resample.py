"""A budget-paced group's full rate, checked in free samples. Pure.

The launch budget prices a group's work at the rate it launched while it
learned. A loop whose launching thread sets its pace and synchronizes
rarely (a diffusion sampler reading its images back once per batch, its GPU
half idle) runs at the speed of its CPU, which on a virtual machine moves by
2x from one few-second stretch to the next. A rate learned while it ran
slow holds it under its cap from then on, and the guard cannot tell: its
device is exactly as busy as that rate says.

So a group its budget holds (at least MIN_HELD of the time since its last
sample), alone on its device, runs free every SAMPLE_EVERY_S for SAMPLE_S;
one its launching thread paces (throttle.gpu_bound: not) first
FIRST_HOST_S after its budget learned (a diffusion sampler learned in
the slow seconds after a cap came, then held at 58% of its speed where its
cap was 75, for the 10 s until its first sample), and again FIRST_HOST_S
after a sample that read it slower than the rate it checked: that sample
fell in a slow spell of its CPU, which says nothing of the fast one that
may follow (a sampler that learned and was sampled in slow spells alike ran
at 51% of its speed under a cap of 75 until its next sample, 10 s on).
Its launch rate over the last MEASURE_S of that sets its full rate where
it differs from the current one by DEADBAND or more, but never under the
rate its budget holds without the samples (learned, and as the guard
corrected it), and never over GAIN_MAX times that: a sample may undo an
earlier sample's raise once the loop slowed again, and the guard alone
lowers a rate under what was learned (a launch-bound group keeps its
device too idle for the guard to see it over its cap, so raises that only
ever added up would carry it over on the noise of its own speed).
The sample's own work is then repaid by the budget (nothing more is granted
until its credit catches up), at most REPAY_MAX_S of its rate: beyond that
it is forgiven, and the group runs over its cap for a moment rather than
being held for long (fail open).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..throttle import MIN_RATE, Budget, correct_rate

SAMPLE_EVERY_S = 10.0  # paced this long between samples
FIRST_HOST_S = 3.0     # ... before the first and after one that read it slower, for a group its launching thread paces
SAMPLE_S = 1.0         # run free this long
MEASURE_S = 0.5        # ... its launch rate taken over the last this-long of it
MIN_HELD = 0.1         # held this part of the time since the last sample: the budget binds
DEADBAND = 0.1         # a free rate this far from the full rate (a share of it) sets it
GAIN_MAX = 4.0         # ... at most this many times the rate without the samples
REPAY_MAX_S = 3.0      # a sample's work repaid up to this many seconds of its rate

Key = tuple[int, int]


@dataclass(frozen=True)
class Result:
    """A finished sample: the launch rate it measured, the full rate it
    found and the gain it applies to that (1.0: none)."""
    free_rate: float
    full_rate: float
    gain: float

    @property
    def changed(self) -> bool:
        return self.gain != 1.0


@dataclass
class _Key:
    since: float                    # paced since (or since its last sample ended)
    last: float                     # the last tick
    held_s: float = 0.0             # held since `since`
    free_from: float | None = None  # sampling since
    mark: tuple[float, int] | None = None   # (time, consumed) where the measure starts
    quiet_until: float = 0.0        # its sample's work repaid by then
    applied: float = 1.0            # the samples' gains on its full rate, in all
    soon: bool = True               # none checked yet, or the last read it slower


class Resampler:
    """Free samples of every budget-paced (group, device)."""

    def __init__(self) -> None:
        self._k: dict[Key, _Key] = {}

    def forget(self, key: Key) -> None:
        self._k.pop(key, None)

    def forget_group(self, group_index: int) -> None:
        for key in [k for k in self._k if k[0] == group_index]:
            del self._k[key]

    def sampling(self, key: Key) -> bool:
        k = self._k.get(key)
        return k is not None and k.free_from is not None

    def quiet(self, key: Key, until: float) -> None:
        """Its last sample's work is repaid by `until`."""
        k = self._k.get(key)
        if k is not None:
            k.quiet_until = until

    def guarded(self, key: Key, now: float) -> bool:
        """Whether the guard may judge its budget now: not while it samples,
        nor while it repays a sample."""
        k = self._k.get(key)
        return k is None or (k.free_from is None and now >= k.quiet_until)

    def step(self, key: Key, *, now: float, consumed: int, held: bool, alone: bool,
             full_rate: float, host_bound: bool = False) -> tuple[bool, Result | None]:
        """One tick of a group its budget paces on a device: `consumed` its
        cost units launched so far, `held` whether it is held now, `alone`
        whether no other group is busy on the device, `host_bound` whether
        its launching thread set its pace as its budget learned. Returns
        whether it runs free this tick, and the result of a sample that
        ended in it."""
        k = self._k.get(key)
        if k is None:
            self._k[key] = _Key(since=now, last=now)
            return False, None
        dt, k.last = max(0.0, now - k.last), now
        if k.free_from is None:
            if held:
                k.held_s += dt
            span = now - k.since
            every = FIRST_HOST_S if k.soon and host_bound else SAMPLE_EVERY_S
            if span < every or not alone or full_rate <= 0:
                return False, None
            if k.held_s < MIN_HELD * span:
                # Its budget barely binds: nothing to check; look again later.
                k.since, k.held_s, k.soon = now, 0.0, False
                return False, None
            k.free_from, k.mark = now, None
            return True, None
        ran = now - k.free_from
        if not alone:
            # A neighbour came: its launches would say nothing of this group's
            # own rate. Given up, not measured.
            self._end(k, now)
            return False, None
        if k.mark is None and ran >= SAMPLE_S - MEASURE_S:
            k.mark = (now, consumed)
        if ran < SAMPLE_S:
            return True, None
        t0, c0 = k.mark or (now, consumed)
        self._end(k, now)
        if now - t0 <= 0 or consumed <= c0:
            return False, Result(0.0, full_rate, 1.0)
        free = (consumed - c0) / (now - t0)
        want = free / (full_rate / k.applied)     # against the rate without the samples
        k.soon = want <= (1.0 - DEADBAND) * k.applied
        if abs(want - k.applied) < DEADBAND * k.applied:
            return False, Result(free, full_rate, 1.0)
        applied = min(max(want, 1.0), GAIN_MAX)
        gain, k.applied = applied / k.applied, applied
        return False, Result(free, full_rate, gain)

    @staticmethod
    def _end(k: _Key, now: float) -> None:
        k.free_from, k.mark, k.since, k.held_s, k.soon = None, None, now, 0.0, False


def settle(b: Budget, res: Result, consumed: int) -> float:
    """A finished sample's effect on its budget: the full rate set as the
    sample found it, and what it launched beyond its credit owed (REPAY_MAX_S
    of its rate at most, the rest forgiven). Returns the seconds owed."""
    if res.changed:
        correct_rate(b, res.gain)
    rate = b.rate or MIN_RATE
    credit = b.credit if b.credit is not None else float(b.granted)
    b.credit = max(credit, consumed - rate * REPAY_MAX_S)
    b.granted = max(b.granted, int(math.ceil(b.credit)))
    return max(0.0, consumed - b.credit) / rate
