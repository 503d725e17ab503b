"""The turns capped groups take on a device, and their check against it.

GPU-bound groups capped on one device take turns (throttle.turns: a slot of
every period, as long as the group's cap) where two or more have their rates.
Every TURN_CALIBRATE_S the device's utilization says whether the turns fill
it: where it idles, rates learned side by side are raised (throttle.turn_gains);
where it idles far more, the rates are wrong, not the GPU, and the turns end
on that device for TURNS_OFF_S (fail open: the groups are paced side by side,
each budget checked by sm.guard).
"""
from __future__ import annotations

import collections
import logging
from typing import Callable

from ..throttle import TURN_CALIBRATE_S, Turn, gpu_bound, scale_rate, turn_gains, turns

log = logging.getLogger("hami_bpf")

TURNS_IDLE_SHARE = 0.5   # a device this far under what its turns should fill ...
TURNS_OFF_S = 30.0       # ... takes no turns for this long
TURNS_SETTLE_S = 2.0     # turns this young are not judged (NVML reads the second before)


class TurnTable:
    """Owns the slots (by (group index, device)) and what was read of them."""

    def __init__(self, period_s: float, record: Callable, counters: collections.Counter,
                 epoch: float = 0.0) -> None:
        self.period_s = period_s
        self.record, self.counters = record, counters
        self.slots: dict[tuple[int, int], Turn] = {}
        self._epoch = epoch                     # slots are counted from this (the daemon's start)
        self._read: float | None = None         # when the devices were last read
        self._util: dict[int, float | None] = {}    # ... and what was read
        self._off: dict[int, float] = {}        # device -> no turns there until (monotonic)
        self._began: dict[int, float] = {}      # device -> its turns as they are since
        self._low: dict[int, int] = {}          # device -> idle readings in a row
        self._gone: set[int] = set()            # devices whose slots lost a group since the plan

    def forget(self, key: tuple[int, int]) -> None:
        """The group is no longer paced by its budget there: no slot for it."""
        self.slots.pop(key, None)

    def forget_group(self, group_index: int) -> None:
        """The group is gone: its slots too (the next plan shares its devices anew)."""
        for key in [k for k in self.slots if k[0] == group_index]:
            del self.slots[key]
            self._gone.add(key[1])

    def due(self, now: float) -> bool:
        """Whether `calibrate` at `now` reads the devices."""
        return self._read is None or now - self._read >= TURN_CALIBRATE_S

    def due_after(self, new: dict, now: float) -> bool:
        """Whether `calibrate` at `now` reads the devices once `plan` made
        `new` (`select`) the slots: a change starts the readings over."""
        return self.due(now) or bool(self._gone) or set(new) != set(self.slots)

    def plan(self, use: dict, now: float, budgets: dict, lending: set,
             names: Callable[[], dict]) -> None:
        """Who takes turns where (`select`); a change is recorded, and the
        readings of the turns before it are dropped."""
        new = self.select(use, now, budgets, lending)
        for dev in sorted({d for _g, d in new} | {d for _g, d in self.slots} | self._gone):
            mine = sorted(k for k in new if k[1] == dev)
            if mine == sorted(k for k in self.slots if k[1] == dev) and dev not in self._gone:
                continue
            named = names()
            self.record("throttle", "turns", device=dev, period_ms=round(self.period_s * 1000, 3),
                        turns={named.get(k[0], str(k[0])): round(new[k].length, 4) for k in mine})
            self._read = None     # the utilization of other turns says nothing
            self._util.pop(dev, None)
            self._began[dev] = now
            self._low.pop(dev, None)
        self._gone.clear()
        self.slots = new

    def select(self, use: dict, now: float, budgets: dict, lending: set) -> dict:
        """Who would take turns where (pure): groups with their rates, not
        learning (it runs free), lending idle time, host-bound
        (throttle.gpu_bound), or launching on another device too (a hold
        stops all of a group's processes, so its turns on two devices would
        stop it in both)."""
        devices = collections.defaultdict(set)
        for (gi, dev), (consumed, *_r) in use.items():
            if consumed:
                devices[gi].add(dev)
        caps = collections.defaultdict(dict)
        for key, b in budgets.items():
            if (not b.learning and gpu_bound(b) and key not in lending
                    and devices.get(key[0]) == {key[1]} and self._off.get(key[1], 0) <= now):
                caps[key[1]][key] = b.cap
        new = {}
        for dev, on in caps.items():
            new.update(turns(on, epoch=self._epoch, period=self.period_s))
        return new

    def calibrate(self, now: float, budgets: dict, util: dict,
                  names: Callable[[], dict], learning: bool = False) -> None:
        """Check the turns against the devices' utilization (`util`, device ->
        percent, read for this tick where `due`): every TURN_CALIBRATE_S, from
        the readings since the last one; the first reading only starts the
        count. While a budget learns (`learning`) only idle turns are looked
        for: the rates are not final."""
        if not self.due(now):
            return
        first, self._read = self._read is None, now
        self._check_idle(now, util)
        if learning:
            self._util.clear()      # readings while a budget learns say nothing of the rates
            return
        for dev in sorted({d for _g, d in self.slots}):
            keys = [k for k in self.slots if k[1] == dev and k in budgets]
            group = [budgets[k] for k in keys]
            # The mean of two readings since the last change: NVML's swing
            # by 5-8 points between windows in one steady state. Not one
            # taken while slots came up short (turns settling in, or
            # overrunning): idle then is no measure of the rates.
            prev = self._util.pop(dev, None)
            both = None if prev is None or util.get(dev) is None else (prev + util[dev]) / 2
            gains = None if first else turn_gains(both, [self.slots[k] for k in keys], group)
            # Kept for the next reading unless a change follows it: readings
            # from before a change say nothing after it.
            if not first and gains is None and not any(b.turn_short for b in group):
                self._util[dev] = util.get(dev)
            log.debug("turns on device %d: %s%% busy, slots %s, short %s, gains %s", dev,
                      util.get(dev), [b.turn_slots for b in group],
                      [b.turn_short for b in group], gains)
            if gains is not None:
                busy = 100 * sum(self.slots[k].length for k in keys)
                named = names()
                for b, gain in zip(group, gains):
                    scale_rate(b, gain)
                self.record("throttle", "turns_rescaled", device=dev, target=busy,
                            gains=dict(zip((named.get(k[0], str(k[0])) for k in keys), gains)),
                            util=both)
            for b in group:
                b.turn_short_before, b.turn_slots, b.turn_short = b.turn_short, 0, 0

    def _check_idle(self, now: float, util: dict) -> None:
        """Fail open: turns that keep their device under TURNS_IDLE_SHARE of
        what they should fill, in two readings in a row (and TURNS_SETTLE_S
        after they began: NVML lags), end on that device for TURNS_OFF_S.
        Whatever the budgets say: the rates are wrong, not the GPU, and the
        groups are paced side by side, each budget checked by sm.guard. Also
        while budgets learn (turns can starve a learner)."""
        for dev in sorted({d for _g, d in self.slots}):
            busy = 100 * sum(t.length for k, t in self.slots.items() if k[1] == dev)
            cur = util.get(dev)
            if cur is None or cur >= busy * TURNS_IDLE_SHARE \
                    or now - self._began.setdefault(dev, now) < TURNS_SETTLE_S:
                self._low.pop(dev, None)
                continue
            self._low[dev] = self._low.get(dev, 0) + 1
            if self._low[dev] < 2:
                continue
            self._low.pop(dev, None)
            self._off[dev] = now + TURNS_OFF_S
            self.counters["sm_corrections_turns_idle"] += 1
            self.record("throttle", "turns_idle", device=dev, sm_correction="turns_idle",
                        util=cur, target=busy, off_s=TURNS_OFF_S)
