"""The launch budget's check against the GPU itself: fail open. Pure.

The launch budget (hami_bpf.throttle) prices work in grid blocks at a rate
learned while the group ran free. A rate learned in one phase (cudnn's
autotuning, a model's warm-up) can be wrong by orders of magnitude in the
next. A group that the budget holds while its device sits idle shows such an
error: it is kept under its cap by the estimate, not by the GPU. Every
WINDOW_S the guard compares the device's utilization (NVML, the mean of the
readings in the window) with what the cap allows the group, and scales the
group's rate. What the cap allows (its target) is cap% of what the group
kept the device busy while it ran free (its reference, read while its budget
learned): a loop that left the GPU idle a third of the time uncapped does its
cap's share of work at a third less utilization. Where none was read (its
budget learned in less than REF_LAG_S: NVML had not caught up), the window's
own running utilization stands in: u / (1 - h) at u% busy while held h of
the window, at most 100. A launch-bound loop runs at its free speed between
holds, so that is what it used running free; taking the whole device as its
reference instead reads such a loop, paced right, as starved, and raises it
until it runs free.
Against that target, for a group the budget held in the window:

- utilization under target - IDLE_PTS (idle_pts()): the rate was far too
  low. Raised at once, by target / utilization (at least x FAST_MIN, at most
  x FAST_MAX), so a job never crawls for more than a few windows. Windows
  idle in a row compound: each raises by its own ratio times the last
  raise, at most x STREAK_MAX (a rate learned in another phase can be off by
  10^3-10^4, and x8 a window took 8 s to undo that on the H200);
- under target - TRIM_PTS: raised by a small step (sqrt of the same ratio,
  at most x TRIM_MAX);
- over the cap itself + TRIM_PTS, with no other group active on the device,
  in any window but the first after the budget took hold (NVML lags, and
  reads the group running free there): lowered, by cap / utilization (at
  most / LOWER_MAX): a phase whose blocks cost more than the learned ones.
  Not against the target: the reference is read in whatever phase the
  budget learned in (a model's warm-up keeps the GPU a few percent busy),
  and a group using less of the device than its cap cannot be shown over
  it, so it is never lowered (fail open).

A window counts as held also where the budget stopped the group MIN_STOPS
times or more, however briefly: a loop its launching thread paces runs
slower for a while after each stop, so many short holds bind it far beyond
their length (a diffusion sampler capped at 99 on an H100 ran at half its
free speed, held 0.1% of the time, for the 11 s until one window was held
10%). Otherwise a window in which the budget held the group under MIN_HELD
of the time says nothing of the budget's price (the group ran as it would
uncapped), and a rate far too high never holds its group again, so no held
window would come to lower it a step at a time (a rate learned 20x too low
and raised in two idle windows, x8 then x41, is 16x too high). So a group
over its cap by TRIM_PTS, alone on the device (or read by its own
per-process utilization), in two such windows in a row and not in the
first after the budget took hold, has its rate re-based on what it did
(RUNS_FREE): it launched C units a second at u% of the device, so its full
rate is C x 100 / u, and its cap lets it run at cap / u of that.

Utilization is the device's: next to other groups a reading over the target
says nothing about this group (no lowering then), a reading under it still
bounds this group's part (raising stays right). Where NVML reports
per-process utilization, the group's own part is used instead, and each
correction says which source it came from.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

WINDOW_S = 1.0
MIN_HELD = 0.1        # held this part of a window at least: the budget is what binds
MIN_STOPS = 5         # ... or stopped this many times in it
MIN_READINGS = 3
REF_LAG_S = 1.0       # NVML's utilization reads what ran this long ago
MIN_REF = 20.0        # a reference is taken as at least this: one read while the group
                      # mostly waited (on a peer, a barrier, its input) would make a target
                      # so low that a starved group never counts as idle
IDLE_PTS = 10.0
TRIM_PTS = 5.0
FAST_MIN, FAST_MAX = 1.5, 8.0
STREAK_MAX = 64.0     # idle windows in a row: the raise compounds up to this
TRIM_MAX = 1.25
LOWER_MAX = 1.25


def idle_pts(cap: float) -> float:
    """How far under its cap a held group's device must be to count as idle
    (half the cap for caps of 20 and under, where 10 points is most of it)."""
    return min(IDLE_PTS, cap / 2)


class Reason(str, Enum):
    HELD_WHILE_IDLE = "held_while_idle"   # far under the cap while held: raised at once
    UNDER_CAP = "under_cap"               # a little under: raised a step
    OVER_CAP = "over_cap"                 # over the cap alone on the device: lowered
    RUNS_FREE = "runs_free"               # over the cap and not held: re-based on what it did


class Source(str, Enum):
    DEVICE = "nvml_device"
    PROCESS = "nvml_process"


@dataclass(frozen=True)
class Correction:
    reason: Reason
    gain: float
    util: float
    target: float          # utilization the cap allows the group (percent)
    cap: float
    source: Source


@dataclass
class _Window:
    start: float
    last: float
    held_s: float = 0.0
    stops: int = 0          # holds that began in it
    util_sum: float = 0.0
    readings: int = 0
    shared: bool = False
    consumed: int | None = None     # the group's cost units launched, at the window's start
    # The first window after its budget took hold: NVML's readings in it
    # (REF_LAG_S behind) are still of the group running free, no sign of
    # its being over its cap
    first: bool = False


class Guard:
    """One window per (group, device) paced by the launch budget."""

    def __init__(self) -> None:
        self._w: dict[tuple[int, int], _Window] = {}
        # (first reading offered, sum, readings taken) while it runs free
        self._ref: dict[tuple[int, int], tuple[float, float, int]] = {}
        self._streak: dict[tuple[int, int], float] = {}   # the last window's idle raise
        self._free: set[tuple[int, int]] = set()    # the last window barely held the group
        self._since: dict[tuple[int, int], float] = {}  # the last hold seen began then

    def forget(self, key: tuple[int, int]) -> None:
        self.restart(key)
        self._ref.pop(key, None)
        self._since.pop(key, None)

    def restart(self, key: tuple[int, int]) -> None:
        """Drop the window being filled (its reference stays): what it saw
        was not the budget's doing."""
        self._w.pop(key, None)
        self._streak.pop(key, None)
        self._free.discard(key)

    def forget_group(self, group_index: int) -> None:
        for key in [k for k in self._w if k[0] == group_index]:
            del self._w[key]
        for key in [k for k in self._ref if k[0] == group_index]:
            del self._ref[key]
        for key in [k for k in self._streak if k[0] == group_index]:
            del self._streak[key]
        for key in [k for k in self._since if k[0] == group_index]:
            del self._since[key]
        self._free = {k for k in self._free if k[0] != group_index}

    def reference(self, key: tuple[int, int], util: float | None, now: float) -> None:
        """A reading while the group runs free (its budget learning). NVML's
        utilization lags by about a second: readings from the first REF_LAG_S
        are of whatever ran before (a neighbour's learning, an idle device),
        and are not taken."""
        first, total, n = self._ref.setdefault(key, (now, 0.0, 0))
        if util is not None and now - first >= REF_LAG_S:
            self._ref[key] = (first, total + util, n + 1)

    def target(self, key: tuple[int, int], cap: float, running: float = 100.0) -> float:
        """Utilization the cap allows the group: cap% of its reference, or
        where none was read, of `running` (what it used between holds)."""
        _first, total, n = self._ref.get(key, (0.0, 0.0, 0))
        ref = total / n if n >= MIN_READINGS else running
        return cap * min(max(ref, MIN_REF), 100.0) / 100.0

    def observe(self, key: tuple[int, int], *, now: float, cap: float, held: bool,
                util: float | None, shared: bool,
                source: Source = Source.DEVICE, consumed: int | None = None,
                full_rate: float | None = None,
                hold_since: float | None = None) -> Correction | None:
        """One tick of a budget-paced group: `held` whether the budget holds
        it now (`hold_since`: since when, where known: each hold is counted
        once), `util` the utilization reading (None: none), `shared`
        whether another group was active on the device, `consumed` the cost
        units it launched so far and `full_rate` its budget's learned full
        rate (units/s; either None: no re-basing). Returns the correction to
        apply to its rate at the end of a window, if any."""
        w = self._w.get(key)
        if w is None:
            self._w[key] = _Window(start=now, last=now, first=True, consumed=consumed)
            return None
        dt = max(0.0, now - w.last)
        w.last = now
        if held:
            w.held_s += dt
            if hold_since is not None and hold_since != self._since.get(key):
                self._since[key] = hold_since
                w.stops += 1
        if util is not None:
            w.util_sum += util
            w.readings += 1
        w.shared = w.shared or shared
        if now - w.start < WINDOW_S:
            return None
        self._w[key] = _Window(start=now, last=now, consumed=consumed)
        last_raise = self._streak.pop(key, 1.0)
        span = now - w.start
        free, was_free = w.held_s < MIN_HELD * span and w.stops < MIN_STOPS, key in self._free
        (self._free.add if free else self._free.discard)(key)
        if w.readings < MIN_READINGS:
            return None
        u = w.util_sum / w.readings
        t = self.target(key, cap, _running(u, w.held_s / span))
        if free:
            if not (was_free and u > cap + TRIM_PTS and not w.shared and not w.first):
                return None
            c = _rebase(w, span, u, t, cap, source, consumed, full_rate)
        else:
            c = self._check(key, w, u, t, cap, source, last_raise)
        if c is not None and c.gain < 1.0:
            # NVML reads a second behind: the next window still shows the
            # group as it ran before it was lowered.
            self._w[key].first = True
        return c

    def _check(self, key: tuple[int, int], w: _Window, u: float, t: float, cap: float,
               source: Source, last_raise: float) -> Correction | None:
        """A window in which the budget held the group."""
        ratio = t / max(u, 1.0)
        if u < t - idle_pts(t):
            gain = min(min(max(ratio, FAST_MIN), FAST_MAX) * last_raise, STREAK_MAX)
            self._streak[key] = gain
            return Correction(Reason.HELD_WHILE_IDLE, gain, u, t, cap, source)
        if u < t - TRIM_PTS:
            return Correction(Reason.UNDER_CAP, min(math.sqrt(ratio), TRIM_MAX), u, t, cap, source)
        if u > cap + TRIM_PTS and not w.shared and not w.first:
            return Correction(Reason.OVER_CAP, max(cap / u, 1 / LOWER_MAX), u, t, cap, source)
        return None


def _running(u: float, held: float) -> float:
    """Utilization while running of a group `u`% busy, held `held` of the
    time (NVML's second of lag aside): at most the whole device."""
    return 100.0 if held >= 1.0 - u / 100.0 else u / (1.0 - held)


def _rebase(w: _Window, span: float, u: float, t: float, cap: float, source: Source,
            consumed: int | None, full_rate: float | None) -> Correction | None:
    """The rate of a group its budget no longer holds, from what it launched
    over the window at `u`% of the device: lowered only."""
    if consumed is None or w.consumed is None or not full_rate or consumed <= w.consumed:
        return None
    gain = (consumed - w.consumed) / span * 100.0 / u / full_rate
    return Correction(Reason.RUNS_FREE, gain, u, t, cap, source) if gain < 1.0 else None
