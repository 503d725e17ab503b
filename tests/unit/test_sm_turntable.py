"""The turns groups take on a device (sm.turntable), checked against the device."""
from __future__ import annotations

import collections

from hami_bpf.sm import turntable
from hami_bpf.sm.turntable import TurnTable
from hami_bpf.throttle import Budget, Turn


USE = {(1, 0): (10, 1, 1, 0, 0, 1), (2, 0): (10, 1, 1, 0, 0, 1)}


def table() -> tuple[TurnTable, dict, list]:
    said: list = []
    t = TurnTable(0.1, lambda kind, msg, **data: said.append((kind, data)), collections.Counter())
    budgets = {}
    for gi, (start, length) in {1: (0.0, 0.3), 2: (0.3, 0.7)}.items():
        budgets[(gi, 0)] = Budget(cap=100 * length, rate=1e6, full_rate=1e6 / length,
                                  by_completion=True)
        t.slots[(gi, 0)] = Turn(epoch=0.0, period=0.1, start=start, length=length)
    return t, budgets, said


def calibrate(t: TurnTable, budgets: dict, util: float, start: float, steps: int = 3,
              learning: bool = False) -> float:
    """Readings TURN_CALIBRATE_S apart, from the turns' start at `start`."""
    t.plan(USE, start, budgets, set(), dict)
    now = start
    for _ in range(steps):
        now += 2.0
        for b in budgets.values():
            b.turn_slots = 5
        t.calibrate(now, budgets, {0: util}, dict, learning=learning)
    return now


def test_one_idle_reading_or_young_turns_end_nothing():
    t, budgets, _said = table()
    calibrate(t, budgets, 3.0, 100.0, steps=1)
    assert t.counters["sm_corrections_turns_idle"] == 0
    t.plan(USE, 102.5, budgets, set(), dict)
    assert set(t.slots) == set(budgets)


def test_turns_that_leave_their_device_idle_end_there_for_a_while():
    t, budgets, said = table()
    now = calibrate(t, budgets, 3.0, 100.0)
    assert t.counters["sm_corrections_turns_idle"] >= 1
    ended = [d for _k, d in said if d.get("sm_correction") == "turns_idle"]
    assert ended and ended[0]["device"] == 0 and ended[0]["util"] == 3.0
    t.plan(USE, now, budgets, set(), dict)
    assert t.slots == {}
    # ... and may take turns again once the time is up
    t.plan(USE, now + turntable.TURNS_OFF_S + 1, budgets, set(), dict)
    assert set(t.slots) == set(budgets)


def test_turns_that_keep_their_device_busy_go_on():
    t, budgets, said = table()
    now = calibrate(t, budgets, 90.0, 100.0)
    assert t.counters["sm_corrections_turns_idle"] == 0
    t.plan(USE, now, budgets, set(), dict)
    assert set(t.slots) == set(budgets)


def test_a_group_lending_or_on_two_devices_takes_no_turn():
    t, budgets, _said = table()
    t.plan(USE, 0.0, budgets, {(1, 0)}, dict)
    assert t.slots == {}
    t.plan({**USE, (2, 1): (5, 1, 1, 0, 0, 1)}, 0.0, budgets, set(), dict)
    assert t.slots == {}


def test_idle_turns_end_while_a_budget_learns_too():
    t, budgets, said = table()
    calibrate(t, budgets, 3.0, 100.0, learning=True)
    assert t.counters["sm_corrections_turns_idle"] == 1
    assert not any("gains" in d for _k, d in said)
