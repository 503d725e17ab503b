"""SmControl's turns checked against the device: turns that leave it idle end."""
from __future__ import annotations

import collections
import types

from hami_bpf import smcontrol
from hami_bpf.smcontrol import SmControl
from hami_bpf.throttle import Budget, Turn


class Devices:
    has_utilization = True
    nvml = None

    def __init__(self, util: float) -> None:
        self.util = util

    def utilization(self) -> dict[int, float]:
        return {0: self.util}


def control(util: float) -> tuple[SmControl, list]:
    said: list = []
    devices = Devices(util)
    sc = SmControl(types.SimpleNamespace(sm_hold_ms=50, sm_turn_ms=100),
                   probes=lambda: None, table=lambda: types.SimpleNamespace(groups=lambda: []),
                   devices=lambda: devices,
                   stopped=lambda: None, libs=lambda: None, mechanisms=lambda: {},
                   record=lambda kind, msg, **data: said.append((kind, data)),
                   counters=collections.Counter())
    for gi, (start, length) in {1: (0.0, 0.3), 2: (0.3, 0.7)}.items():
        b = Budget(cap=100 * length, rate=1e6, full_rate=1e6 / length, by_completion=True)
        b.turn_slots = 5
        sc.budgets[(gi, 0)] = b
        sc.turns[(gi, 0)] = Turn(epoch=0.0, period=0.1, start=start, length=length)
    return sc, said


def calibrate(sc: SmControl, start: float) -> float:
    """Three readings TURN_CALIBRATE_S apart (the first only starts the count)."""
    now = start
    for _ in range(3):
        for b in sc.budgets.values():
            b.turn_slots = 5
        sc._calibrate_turns(now)
        now += 2.0
    return now


def test_turns_that_leave_their_device_idle_end_there_for_a_while():
    sc, said = control(util=3.0)
    now = calibrate(sc, 100.0)
    assert sc.counters["sm_corrections_turns_idle"] >= 1
    ended = [d for _k, d in said if d.get("sm_correction") == "turns_idle"]
    assert ended and ended[0]["device"] == 0 and ended[0]["util"] == 3.0
    use = {k: (10, 1, 1, 0, 0, 1) for k in sc.budgets}
    sc._take_turns(use, now)
    assert sc.turns == {}
    # ... and may take turns again once the time is up
    sc._take_turns(use, now + smcontrol.TURNS_OFF_S + 1)
    assert set(sc.turns) == set(sc.budgets)


def test_turns_that_keep_their_device_busy_go_on():
    sc, said = control(util=90.0)
    now = calibrate(sc, 100.0)
    assert sc.counters["sm_corrections_turns_idle"] == 0
    sc._take_turns({k: (10, 1, 1, 0, 0, 1) for k in sc.budgets}, now)
    assert set(sc.turns) == set(sc.budgets)
