"""memory.MemoryEnforcer: denials answered once each, retry loops paced and
answered in order, every queued denial answered at shutdown, meminfo of an
untracked or unlimited process resumed untouched."""
from __future__ import annotations

import collections

import pytest

from hami_bpf import abi, enforce
from hami_bpf.memory import MemoryEnforcer, Place

PID = 4242


@pytest.fixture()
def world(monkeypatch):
    calls: list[tuple[str, int, int]] = []

    def fail_call(pid, tid, ptr, stopped=None):
        calls.append(("fail", pid, ptr))
        return 0.001

    monkeypatch.setattr(enforce, "fail_call", fail_call)
    monkeypatch.setattr(enforce, "resume", lambda pid: calls.append(("resume", pid, 0)))
    events: list[tuple[str, dict]] = []
    counters: collections.Counter = collections.Counter()
    places = {PID: Place("g", 3, 1 << 20)}
    m = MemoryEnforcer(place=lambda pid, dev: places.get(pid), group_used=lambda gi, dev: 0,
                       context_reserve=lambda g, dev: 0, stopped=lambda: None,
                       record=lambda kind, msg, **data: events.append((kind, data)),
                       counters=counters)
    return m, calls, events, counters, places


def deny_event(seq: int, act: int = abi.ACT_STOP_REWRITE, pid: int = PID) -> abi.Event:
    return abi.Event(kind=abi.EV_DENY, tgid=pid, tid=pid, device=0, size=2 << 20, ptr=seq,
                     aux=act, flags=abi.F_STOPPED)


def test_a_retry_loop_is_paced_and_every_denial_is_answered_once_in_order(world):
    m, calls, events, counters, _ = world
    for i in range(40):
        m.deny(deny_event(i))
    answered_now = [c for c in calls if c[0] == "fail"]
    assert 0 < len(answered_now) < 40             # the first ones at once, the rest wait
    assert counters["denials_paced"] == 40 - len(answered_now)
    assert m.next_due() is not None
    m.drain()                                     # shutdown: every one answered now
    fails = [c[2] for c in calls if c[0] == "fail"]
    assert fails == list(range(40))               # once each, in the order they came
    assert not [c for c in calls if c[0] == "resume"]   # never a second SIGCONT
    assert m.next_due() is None
    assert m.denied(PID) == 40 and counters["denials"] == 40
    assert all(d["action"] == "stop-rewrite" and d["group"] == "g" and d["limit"] == 1 << 20
               for kind, d in events if kind == "deny")
    m.deny(deny_event(99))                        # after drain: at once, not queued
    assert calls[-1] == ("fail", PID, 99)


def test_other_actions_are_recorded_not_answered(world):
    m, calls, events, counters, _ = world
    m.deny(deny_event(1, abi.ACT_RETURN_OOM))
    m.deny(deny_event(2, abi.ACT_OBSERVE))
    m.deny(deny_event(3, abi.ACT_NONE_STALE))
    assert not calls
    assert [d["action"] for _k, d in events] == ["return-oom", "observe",
                                                  "allowed-controller-stale"]
    assert counters["would_deny"] == 2
    assert m.denied(PID) == 1                     # only the refused one
    m.forget(PID)
    assert m.denied(PID) == 0


def test_meminfo_of_an_untracked_or_unlimited_process_is_resumed_untouched(world):
    m, calls, _events, counters, places = world
    e = abi.Event(kind=abi.EV_MEMINFO, tgid=777, tid=777, device=0, ptr=1, aux=2)
    m.meminfo(e)
    places[PID] = Place("g", 3, None)
    m.meminfo(abi.Event(kind=abi.EV_MEMINFO, tgid=PID, tid=PID, device=0, ptr=1, aux=2))
    assert calls == [("resume", 777, 0), ("resume", PID, 0)]
    assert counters["meminfo_rewrites"] == 0
