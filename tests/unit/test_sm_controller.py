"""The SM controller (hami_bpf.sm.controller) stepped directly with made-up
observations: what it decides, never how it says it."""
from __future__ import annotations

import collections
import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hami_bpf.sm import duty
from hami_bpf.sm.controller import (Group, Observation, Phase, Settings, SmController, SmUse)
from hami_bpf.throttle import UNLIMITED, Budget, correct_rate

DEV = 0
PLAIN = Settings(turns=False, lend_idle=False, learn_alone=False, sample_share=0.0)


def controller(caps: dict[str, int], cfg: Settings = PLAIN) -> SmController:
    c = SmController(cfg, epoch=0.0)
    for name, cap in caps.items():
        assert c.set_cap(name, DEV, cap)
    return c


def groups(**index: int) -> dict[str, Group]:
    return {name: Group(gi, pids=frozenset({100 * gi})) for name, gi in index.items()}


class Load:
    """One group's counters on DEV, as the probes would count them."""

    def __init__(self, gi: int):
        self.key = (gi, DEV)
        self.consumed = self.launches = self.completed = self.done_ns = self.syncs = 0

    def run(self, now: float, cost: int = 1000, sync: bool = False) -> None:
        self.consumed += cost
        self.launches += 10
        if sync:    # a synchronize's return: what was launched is done
            self.syncs += 1
            self.completed, self.done_ns = self.consumed, int(now * 1e9)

    def use(self) -> SmUse:
        return SmUse(self.consumed, self.launches, self.completed, 0, self.done_ns, self.syncs)


def step(c: SmController, now: float, gs: dict, loads, **kw):
    use = {ld.key: ld.use() for ld in loads}
    return c.step(Observation(now=now, use=use, groups=gs, **kw))


def events(d, name: str) -> list[dict]:
    return [e.fields for e in d.events if e.name == name]


def learn(c: SmController, gs: dict, load: Load, t: float, others=(), limit_s: float = 4.0):
    """Run `load` alone, synchronizing 5 times a second, until its budget
    learned; returns (time, the decision where it did)."""
    end = t + limit_s
    n = 0
    while t < end:
        t += 0.05
        n += 1
        load.run(t, sync=n % 4 == 0)
        d = step(c, t, gs, [load, *others])
        if events(d, "learned"):
            return t, d
    raise AssertionError("did not learn")


def test_a_newly_capped_group_learns_unthrottled_then_is_granted_at_its_cap():
    c, gs, a = controller({"a": 30}), groups(a=1), Load(1)
    a.run(100.0)
    d = step(c, 100.0, gs, [a])
    g = d.grants[a.key]
    assert g.phase is Phase.LEARNING and g.checkpoint and not g.hold_at_sync
    assert g.granted >= a.consumed + UNLIMITED
    t, d = learn(c, gs, a, 100.0)
    (learned,) = events(d, "learned")
    assert learned["group"] == "a" and learned["cap"] == 30 and learned["by_completion"]
    b = c.budgets[a.key]
    assert b.rate == 0.3 * b.full_rate
    a.run(t + 0.05)
    d = step(c, t + 0.05, gs, [a])
    g = d.grants[a.key]
    assert g.phase is Phase.PACED and not g.checkpoint
    assert g.granted < a.consumed + UNLIMITED


def test_a_group_that_never_synchronizes_is_paced_by_time_beside_one_that_is():
    # Its launch budget would spread its work over the paced group's turns;
    # paced by time beside it, it is stopped at its next launch instead.
    c, gs = controller({"a": 50, "b": 50}), groups(a=1, b=2)
    a, b = Load(1), Load(2)
    t, said, grant = 100.0, [], None
    for _ in range(300):
        t += 0.01
        a.run(t, cost=100, sync=True)
        b.run(t, cost=100)
        d = step(c, t, gs, [a, b])
        said += [e for e in events(d, "mode") if e["group"] == "b"]
        if d.grants[b.key].hold_at_sync:
            grant = d.grants[b.key]
            break
    assert said == [dict(group="b", device=DEV, sm_mode=duty.Mode.DUTY.value, beside=True)]
    assert b.key not in c.budgets
    assert grant is not None and grant.phase is Phase.DUTY
    assert grant.granted == b.consumed     # asked to stop at its next launch


def test_a_group_that_synchronizes_often_is_paced_by_time_held_at_sync_and_released():
    c, gs, a = controller({"a": 30}), groups(a=1), Load(1)
    t, asked, said = 100.0, None, []
    modes = collections.Counter()
    for _ in range(100):                      # 100 synchronizes a second of running
        t += 0.01
        a.run(t, cost=100, sync=True)
        d = step(c, t, gs, [a])
        modes.update(d.counters)
        said += events(d, "mode")
        if d.grants[a.key].hold_at_sync:
            asked = d
            break
    assert asked is not None and modes["sm_mode_duty"] == 1
    assert said == [dict(group="a", device=DEV, sm_mode=duty.Mode.DUTY.value, beside=False)]
    assert asked.grants[a.key].phase is Phase.DUTY
    assert asked.next_step is not None
    # Paced by time, not by budget: no device reading is wanted for it.
    assert not c.wants(t, {a.key: a.use()}, gs).util
    held_since = t + 0.001                    # BPF stopped it at its next synchronize's return
    released_at = None
    for _ in range(100):
        t += 0.01
        d = step(c, t, gs, [a], held={"a": held_since})
        assert not d.grants[a.key].hold_at_sync      # held: nothing more to ask
        if "a" in d.release:
            released_at = t
            break
    assert released_at is not None and "a" not in d.cut_short
    assert released_at - held_since <= c.hold_bound(1)


def test_a_group_held_while_its_device_idles_under_its_cap_is_corrected():
    c, gs, a = controller({"a": 30}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    rate = c.budgets[a.key].rate
    held_since = t
    assert c.wants(t, {a.key: a.use()}, gs).util     # the guard reads the device
    corrected = []
    counters = collections.Counter()
    for _ in range(40):                       # held 2 s, the device 2% busy
        t += 0.05
        d = step(c, t, gs, [a], held={"a": held_since}, util={DEV: 2.0})
        corrected += events(d, "corrected")
        counters.update(d.counters)
    assert corrected and corrected[0]["sm_correction"] == "held_while_idle"
    assert corrected[0]["group"] == "a" and corrected[0]["source"] == "nvml_device"
    assert counters["sm_corrections_held_while_idle"] == len(corrected)
    assert c.budgets[a.key].rate > rate


def test_a_group_stopped_briefly_and_often_while_its_device_idles_is_corrected():
    """Ten stops a second of one 5 ms tick each: held 5% of the time, under
    what a window needs, but each stop slows a loop its launching thread
    paces for a while after."""
    c, gs, a = controller({"a": 30}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    rate = c.budgets[a.key].rate
    corrected = []
    for i in range(600):                      # 3 s
        t += 0.005
        a.run(t, cost=10)
        held = {"a": t - 0.001} if i % 20 == 19 else {}
        d = step(c, t, gs, [a], held=held, util={DEV: 2.0})
        corrected += events(d, "corrected")
    assert corrected and corrected[0]["sm_correction"] == "held_while_idle", corrected
    assert c.budgets[a.key].rate > rate


def test_without_a_reading_the_guard_corrects_nothing():
    c, gs, a = controller({"a": 30}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    for _ in range(40):
        t += 0.05
        d = step(c, t, gs, [a], held={"a": t - 0.05})
        assert not events(d, "corrected")


def test_a_launch_bound_group_paced_right_is_not_raised_when_no_reference_was_read():
    """Its budget learned before NVML read anything of it (no reference). It
    runs at the rate it learned, its process 55% busy while running (per-
    process utilization): held half the time at cap 50, it is where its cap
    puts it, and the guard leaves it there."""
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    learned = c.budgets[a.key].full_rate
    held_since, corrected, start, begun = None, [], t, a.consumed
    for n in range(int(9.0 / 0.05)):
        t += 0.05
        if held_since is None:
            a.run(t, sync=n % 4 == 0)
        d = step(c, t, gs, [a], held={"a": held_since} if held_since is not None else {},
                 util={DEV: 60.0},
                 process_util={DEV: {100: 0.0 if held_since is not None else 55.0}})
        corrected += events(d, "corrected")
        if "a" in d.release:
            held_since = None
        if held_since is None and a.consumed >= d.grants[a.key].granted:
            held_since = t
    assert corrected == []
    done = (a.consumed - begun) / (t - start)
    assert abs(done - 0.5 * learned) <= 0.1 * 0.5 * learned, (done, learned)


def alone_pair() -> tuple[SmController, dict, Load, Load, float]:
    """Groups a and b capped on one device, both launching from the start."""
    cfg = dataclasses.replace(PLAIN, learn_alone=True)
    c, gs = controller({"a": 30, "b": 70}, cfg), groups(a=7, b=8)
    a, b = Load(7), Load(8)
    a.run(100.0)
    b.run(100.0)
    step(c, 100.0, gs, [a, b])
    return c, gs, a, b, 100.0


def test_a_group_learning_alone_holds_the_devices_other_capped_group_then_releases_it():
    c, gs, a, b, t = alone_pair()
    t += 0.05
    a.run(t)
    b.run(t)
    d = step(c, t, gs, [a, b])
    (began,) = events(d, "alone_learning")
    assert began["group"] == "a" and began["held"] == ["b"]
    assert d.grants[b.key].phase is Phase.HELD_ALONE
    assert d.grants[b.key].granted == b.consumed and not d.grants[b.key].checkpoint
    # a learns; b, held, launches nothing more
    t, d = learn(c, gs, a, t, others=[b])
    done = [e for e in events(d, "alone_done") if e["group"] == "a"]
    if not done:      # said on the tick after it learned
        t += 0.05
        a.run(t)
        d = step(c, t, gs, [a, b])
        done = [e for e in events(d, "alone_done") if e["group"] == "a"]
    assert done and done[0]["outcome"] == "learned" and done[0]["released"] == ["b"]
    assert d.grants[b.key].phase is not Phase.HELD_ALONE
    assert c.alone.devices[DEV].learner == b.key


def test_forgetting_a_group_leaves_no_trace_of_it():
    c, gs, a, b, t = alone_pair()
    for n in range(10):
        t += 0.05
        a.run(t, sync=n % 4 == 0)
        step(c, t, gs, [a, b], held={"b": t - 0.01}, util={DEV: 50.0})
    assert any(k[0] == 7 for k in c.budgets) and c.alone.devices[DEV].learner == a.key
    assert list(traces(c, 7))        # the search finds what is there
    ended = c.forget_group("a", 7)
    assert [(e.name, e.fields["outcome"]) for e in ended] == [("alone_done", "stopped")]
    assert "a" not in c.caps
    assert not list(traces(c, 7)), list(traces(c, 7))
    assert any(k[0] == 8 for k in c.budgets)     # the other group's are kept


def traces(obj, index: int, seen=None):
    """Where `index` appears as a group index in the controller's state:
    a dict key or set member, or the first of an (index, device) pair."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, tuple) and len(obj) == 2 and all(type(x) is int for x in obj):
        if obj[0] == index:
            yield obj
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == index and type(k) is int:
                yield ("key", k)
            yield from traces(k, index, seen)
            yield from traces(v, index, seen)
    elif isinstance(obj, (set, frozenset, list, tuple, collections.deque)):
        for v in obj:
            if v == index and type(v) is int and isinstance(obj, (set, frozenset)):
                yield ("member", v)
            yield from traces(v, index, seen)
    elif type(obj).__module__.startswith("hami_bpf") and hasattr(obj, "__dict__"):
        for v in vars(obj).values():
            yield from traces(v, index, seen)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cap=st.sampled_from([10, 30, 70]),
       steps=st.lists(st.tuples(st.sampled_from([0.005, 0.01, 0.05, 0.2]),
                                st.integers(0, 50_000), st.booleans(), st.booleans()),
                      min_size=5, max_size=60))
def test_a_hold_never_outlives_its_bound(cap, steps):
    c, gs, a = controller({"a": cap}), groups(a=1), Load(1)
    # A budget learned at a crawl: held, it runs out at once.
    c.budgets[a.key] = Budget(cap=cap, rate=1.0, full_rate=100.0 / cap, started=100.0,
                              last_t=100.0, credit=0.0)
    t, since = 100.0, None
    for dt, cost, sync, stopped in steps:
        t += dt
        if since is None:
            a.run(t, cost=cost, sync=sync)
            if stopped:
                since = t      # BPF stopped it at a launch or synchronize
        d = step(c, t, gs, [a], held={} if since is None else {"a": since})
        if since is not None:
            if t - since > c.hold_bound(1):
                assert "a" in d.release
            if "a" in d.release:
                since = None


def test_the_device_is_read_only_when_a_decision_needs_it():
    cfg = dataclasses.replace(PLAIN, turns=True)
    c, gs = controller({"a": 30, "b": 70}, cfg), groups(a=1, b=2)
    a, b = Load(1), Load(2)
    a.run(100.0)
    b.run(100.0)
    assert c.wants(100.0, {a.key: a.use(), b.key: b.use()}, gs).util   # new budgets learn
    for ld in (a, b):   # both learned, GPU-bound: they take turns, unchecked by the guard
        c.budgets[ld.key] = Budget(cap=c.caps["a" if ld is a else "b"][DEV], rate=1e4,
                                   full_rate=1e5, by_completion=True, started=100.0,
                                   last_t=100.0, credit=float(ld.consumed))
    use = {a.key: a.use(), b.key: b.use()}
    reads = c.wants(100.05, use, gs)
    assert not reads.util and reads.turn_util         # the turns' first reading is due
    step(c, 100.05, gs, [a, b], turn_util={DEV: 90.0})
    assert set(c.turns) == {a.key, b.key}
    assert not c.wants(100.1, use, gs).turn_util      # read again TURN_CALIBRATE_S later
    assert c.wants(100.05 + 1.6, use, gs).turn_util


def test_a_launch_bound_group_is_said_to_be_given_back_its_stop_cost_once():
    # 100 synchronizes a second of running and no time inside them: launch-bound
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, given, counts = 100.0, [], collections.Counter()
    for _ in range(600):        # no device reading: the synchronize calls decide
        t += 0.01
        a.run(t, cost=100, sync=True)
        d = step(c, t, gs, [a])
        given += events(d, "given_back")
        counts.update(d.counters)
    assert given == [dict(group="a", device=DEV, stop_share=duty.HOST_STOP_SHARE, spare_pct=None,
                          gpu_busy=None)]
    assert counts["sm_giveback_on"] == 1 and counts["sm_giveback_off"] == 0


def given_back_as_b_comes(caps: dict[str, int]) -> list[tuple]:
    """a launch-bound, alone for 6 s, then b launching on its device too:
    a's stop_share at each change, and the time no cap claims it came from."""
    c, gs = controller(caps), groups(a=1, b=2)
    a, b = Load(1), Load(2)
    t, given = 100.0, []
    for i in range(900):
        t += 0.01
        a.run(t, cost=100, sync=True)
        if i >= 600:
            b.run(t, cost=100)
        given += [(e["stop_share"], e["spare_pct"])
                  for e in events(step(c, t, gs, [a, b]), "given_back")]
    return given


def test_beside_an_uncapped_group_a_launch_bound_group_keeps_what_it_is_given_back():
    # b uncapped claims no time: what a's holds cost it still comes back to it
    assert given_back_as_b_comes({"a": 50}) == [(duty.HOST_STOP_SHARE, None)]


def test_beside_a_capped_neighbour_a_launch_bound_group_is_given_back_what_no_cap_claims():
    # 5% of the device's time is no one's: a runs 55% of it at most
    assert given_back_as_b_comes({"a": 50, "b": 45}) == [
        (duty.HOST_STOP_SHARE, None), (pytest.approx(1 - 50 / 55), pytest.approx(5.0))]
    # caps that add up to the whole device: nothing
    assert given_back_as_b_comes({"a": 50, "b": 50}) == [(duty.HOST_STOP_SHARE, None),
                                                         (0.0, 0.0)]


def test_a_giveback_of_zero_gives_nothing_back():
    c = SmController(dataclasses.replace(PLAIN, host_stop_share=0.0), epoch=0.0)
    assert c.set_cap("a", DEV, 50)
    gs, a = groups(a=1), Load(1)
    t, given = 100.0, []
    for _ in range(300):
        t += 0.01
        a.run(t, cost=100, sync=True)
        given += events(step(c, t, gs, [a]), "given_back")
    assert given == []


def test_a_budget_that_no_longer_holds_its_group_over_its_cap_is_rebased_on_what_it_did():
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    b = c.budgets[a.key]
    # Raised far past its pace (two idle windows compounding): never held.
    correct_rate(b, 1000.0)
    corrected, counters = [], collections.Counter()
    for n in range(80):         # 4 s: 20,000 units/s, the device 92% busy
        t += 0.05
        a.run(t, cost=1000, sync=n % 4 == 0)
        d = step(c, t, gs, [a], util={DEV: 92.0})
        corrected += events(d, "corrected")
        counters.update(d.counters)
    assert [e["sm_correction"] for e in corrected] == ["runs_free"]
    assert corrected[0]["util"] == 92.0 and corrected[0]["cap"] == 50
    assert counters["sm_corrections_runs_free"] == 1
    # Its cap's share of what it did: 20,000 x 50 / 92 units/s.
    assert abs(b.rate - 2e4 * 50 / 92) <= 0.06 * b.rate


def test_a_cap_that_comes_back_paces_its_group_afresh():
    # A group paced by time loses its cap, runs uncapped (no step counts its
    # synchronizes then), and gets it back: paced by time again, with no
    # moment handed to the launch budget.
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, said = 100.0, []
    for _ in range(100):
        t += 0.01
        a.run(t, cost=100, sync=True)
        said += events(step(c, t, gs, [a]), "mode")
    assert [e["sm_mode"] for e in said] == ["duty"]
    c.clear_caps("a")
    c.uncap(1, [DEV])
    t += 6.0                    # uncapped: the launch probes are gone
    assert c.set_cap("a", DEV, 50)
    said = []
    for _ in range(100):
        t += 0.01
        a.run(t, cost=100, sync=True)
        said += events(step(c, t, gs, [a]), "mode")
    assert [e["sm_mode"] for e in said] == ["duty"]


def test_a_quiet_group_whose_device_is_busy_is_read_and_given_nothing_back():
    # No time inside its synchronizes, as a launch-bound loop, but its
    # device is busy all the time it runs (a full launch queue).
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, given, reads = 100.0, [], 0
    for _ in range(600):
        t += 0.01
        a.run(t, cost=100, sync=True)
        util = None
        if c.wants(t, {a.key: a.use()}, gs).util:
            reads += t > 103.0      # paced by time by then: read BUSY_READ_S apart
            util = {DEV: 100.0}
        given += events(step(c, t, gs, [a], util=util), "given_back")
    assert 0 < reads <= 3.0 / duty.BUSY_READ_S + 1
    assert given == []


def overlap_events(util_pct: float, then: float | None = None,
                   steps: int = 800) -> tuple[list, collections.Counter]:
    """a at 30 and b at 70 on one device, both launch-bound from the start
    (100 synchronizes a second of running, no time inside them), the device
    read as `util_pct` busy whenever asked (`then` after 8 s): their overlap
    events and counters."""
    c, gs = controller({"a": 30, "b": 70}), groups(a=1, b=2)
    a, b = Load(1), Load(2)
    t, said, counts = 100.0, [], collections.Counter()
    for i in range(steps):
        t += 0.01
        a.run(t, cost=100, sync=True)
        b.run(t, cost=100, sync=True)
        pct = then if then is not None and i >= 800 else util_pct
        util = {DEV: pct} if c.wants(t, {a.key: a.use(), b.key: b.use()}, gs).util else None
        d = step(c, t, gs, [a, b], util=util)
        said += events(d, "overlap")
        counts.update(d.counters)
    return said, counts


def test_two_launch_bound_groups_are_said_to_run_beside_each_other():
    said, counts = overlap_events(20.0)
    assert sorted(said, key=lambda e: e["group"]) == [
        dict(group=g, device=DEV, overlap=True, gpu_busy=20.0, waited=0.0) for g in "ab"]
    assert counts["sm_overlap_on"] == 2 and counts["sm_overlap_off"] == 0


def test_a_reading_that_fills_the_device_ends_it_and_says_by_what():
    said, counts = overlap_events(20.0, then=90.0, steps=1200)
    off = [e for e in said if not e["overlap"]]
    assert sorted(e["group"] for e in off) == ["a", "b"], said
    assert max(e["gpu_busy"] for e in off) >= duty.OVERLAP_BUSY
    assert counts["sm_overlap_off"] == 2


def test_groups_whose_device_reads_busy_take_turns_and_nothing_is_said():
    said, counts = overlap_events(80.0)
    assert said == [] and counts["sm_overlap_on"] == 0
