"""The duty pacer (hami_bpf.sm.duty), stepped directly with made-up observations."""
from __future__ import annotations

import collections
import dataclasses
import random

import pytest
from hypothesis import example, given, settings, strategies as st

from hami_bpf.sm import duty, sharing
from hami_bpf.sm.duty import Ask, Mode, Observation, Use
from smexpect import allowed

KEY = (0, 0)


def DutyPacer(**kw) -> duty.DutyPacer:
    """The books' tests: nothing given back to a host-paced group for being
    held (HOST_STOP_SHARE has its own tests below), and no free samples
    (test_sm_progress.py)."""
    kw.setdefault("host_stop_share", 0.0)
    kw.setdefault("sample_share", 0.0)
    return duty.DutyPacer(**kw)


def obs(now, consumed=0, syncs=0, cap=50.0, held_since=None, key=KEY, extra=None):
    caps = {key: cap}
    use = {key: Use(consumed, syncs)}
    held = {key[0]: held_since} if held_since is not None else {}
    if extra:
        caps.update(extra["caps"])
        use.update(extra["use"])
        held.update(extra["held"])
    return Observation(now=now, caps=caps, use=use, held=held)


def idle_floor_of(cap: float) -> float:
    c = min(max(cap, 1.0), 99.0)
    return -duty.BURST_S * (100.0 - c) / c


def floor_of(cap: float, bound: float = duty.MAX_HOLD_S) -> float:
    return idle_floor_of(cap) - bound


caps = st.floats(min_value=1.0, max_value=99.0)
gaps = st.floats(min_value=0.0, max_value=0.7)


# -- (a) a group that never launches nor synchronizes ---------------------------

@given(cap=caps, start=st.tuples(st.integers(0, 10**9), st.integers(0, 10**6)),
       steps=st.lists(st.tuples(gaps, st.booleans()), min_size=1, max_size=80))
def test_a_never_active_group_accrues_no_debt_and_is_never_asked(cap, start, steps):
    p = DutyPacer()
    now, since = 100.0, None
    for gap, held in steps:
        now += gap
        since = (since if since is not None else now) if held else None
        d = p.step(obs(now, *start, cap=cap, held_since=since))
        k = d.keys[KEY]
        assert k.debt <= 0.0
        assert k.ask is Ask.NONE
        assert k.mode is Mode.BUDGET


# -- a random daemon: steps, counters, stops and releases ----------------------

def drive(p, rnd, seconds, cap, sync_every=(0.001, 0.02), tick=(0.005, 0.015),
          obey=True, random_holds=False, check=None, seen_late=False, release_late=(0.0, 0.0)):
    """Steps `p` over a group that launches all the while it runs and synchronizes.

    A stop asked for comes at a synchronize's return before the next step (the
    process synchronizes every `sync_every` seconds); a release is obeyed at the
    step that says it. With `seen_late`, the step right after a stop does not
    see it yet (its event still in the ring); the next one does, with the
    stop's own time. With `release_late`, a release takes effect that long
    after the step that says it (the daemon's next turn came late).
    Returns (seconds running, seconds held) after the first second.
    """
    seen = None
    resume_at = None
    now, consumed, syncs = 0.0, 0, 0
    since = None
    next_sync = rnd.uniform(*sync_every)
    run_s = held_s = 0.0
    d = p.step(obs(now, consumed, syncs, cap=cap))
    while now < seconds:
        k = d.keys[KEY]
        nxt = now + rnd.uniform(*tick)
        if d.next_step is not None:
            nxt = min(nxt, max(d.next_step, now + 1e-6))
        if resume_at is not None:
            nxt = min(nxt, max(resume_at, now + 1e-6))
        stop_at = None
        if since is None and obey and k.ask is not Ask.NONE:
            stop_at = next_sync if next_sync < nxt else None
        if since is None and random_holds and stop_at is None and rnd.random() < 0.05:
            stop_at = rnd.uniform(now, nxt)
        # run until the stop (or the next step), synchronizing as it goes
        t = now
        end_run = nxt if since is not None or stop_at is None else stop_at
        if since is None:
            if end_run > t:
                consumed += rnd.randint(1, 500)      # it launches all the while it runs
            while next_sync <= end_run:
                syncs += 1
                consumed += rnd.randint(1, 500)
                next_sync += rnd.uniform(*sync_every)
            if now >= 1.0:
                run_s += end_run - t
                held_s += nxt - end_run
            if stop_at is not None:
                since = stop_at
                next_sync = max(next_sync, nxt)
        elif now >= 1.0:
            held_s += nxt - now
        now = nxt
        shown = since
        if seen_late and since is not None and seen != since:
            seen, shown = since, None
        d = p.step(obs(now, consumed, syncs, cap=cap, held_since=shown))
        if check:
            check(now, since, d)
        if since is not None and resume_at is None and KEY[0] in d.release:
            resume_at = now + rnd.uniform(*release_late)
        if resume_at is not None and now >= resume_at - 1e-12:
            since, resume_at = None, None
            next_sync = now + rnd.uniform(*sync_every)
    return run_s, held_s


# -- (b) fail open --------------------------------------------------------------

@given(cap=caps, seed=st.integers(0, 2**32 - 1),
       sync_lo=st.floats(0.001, 0.6), sync_span=st.floats(0.0, 0.6))
@settings(max_examples=150, deadline=None)
def test_a_held_group_is_released_once_held_for_max_hold(cap, seed, sync_lo, sync_span):
    p = DutyPacer()

    def check(now, since, d):
        # Its bound: MAX_HOLD_S, or twice its longer quantum where its
        # launching thread sets its pace (it spends no time synchronizing here).
        assert duty.MAX_HOLD_S <= p.hold_bound(KEY[0]) <= 2 * duty.HOST_QUANTUM_MAX_S
        if since is not None and now - since >= p.hold_bound(KEY[0]):
            assert KEY[0] in d.release, (now, since, d)

    drive(p, random.Random(seed), 6.0, cap, sync_every=(sync_lo, sync_lo + sync_span),
          check=check)


# -- (c) the books stay within their bounds -------------------------------------

@given(steps=st.lists(st.tuples(gaps, caps, st.integers(0, 3), st.integers(0, 10**5),
                                st.booleans()), min_size=1, max_size=120))
@example(steps=[(0.0, 1.0, 0, 0, False), (0.0, 1.0, 0, 0, False), (0.0, 1.0, 0, 0, False),
                (0.0, 1.0, 2, 0, False), (0.0, 1.0, 2, 0, False), (0.625, 1.0, 2, 0, True),
                (0.625, 1.0, 3, 0, True), (0.0, 1.0, 3, 0, False), (0.5, 1.0, 0, 0, True),
                (0.6875, 16.0, 0, 0, True)])
def test_debt_stays_between_its_floor_and_max_debt(steps):
    p = DutyPacer()
    now, consumed, syncs, since = 0.0, 0, 0, None
    for gap, cap, nsync, ncost, held in steps:
        now += gap
        syncs += nsync
        consumed += ncost
        since = (since if since is not None else now - gap / 2) if held else None
        k = p.step(obs(now, consumed, syncs, cap=cap, held_since=since)).keys[KEY]
        assert floor_of(cap, p.hold_bound(KEY[0])) - 1e-12 <= k.debt <= duty.MAX_DEBT_S + 1e-12


@given(cap=caps, steps=st.lists(st.tuples(gaps, st.integers(0, 3), st.integers(0, 10**5)),
                               min_size=1, max_size=120))
def test_a_group_never_held_banks_no_more_than_its_idle_floor(cap, steps):
    p = DutyPacer()
    now, consumed, syncs = 0.0, 0, 0
    for gap, nsync, ncost in steps:
        now += gap
        syncs += nsync
        consumed += ncost
        k = p.step(obs(now, consumed, syncs, cap=cap)).keys[KEY]
        assert k.debt >= idle_floor_of(cap) - 1e-12


# -- (d) the share of time a synchronizing group runs is its cap ----------------

def run_share(cap, seed, **kw):
    """Percent of 20 s a prompt group (a synchronize every 2-12 ms) ran."""
    run_s, held_s = drive(DutyPacer(), random.Random(seed), 20.0, cap,
                          sync_every=(0.002, 0.012), **kw)
    return 100.0 * run_s / (run_s + held_s)


@given(cap=st.floats(10.0, 90.0), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_a_prompt_group_runs_its_cap_share_of_the_time(cap, seed):
    share = run_share(cap, seed)
    assert abs(share - cap) <= 2.0, share


@given(cap=st.floats(10.0, 90.0), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_a_stop_seen_a_step_late_is_counted_held_from_its_start(cap, seed):
    # The time between a stop and the step that first sees it was counted as
    # running; at cap 25 each such millisecond would owe three more held.
    share = run_share(cap, seed, seen_late=True)
    assert abs(share - cap) <= 2.0, share


@given(cap=st.floats(50.0, 95.0), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=25, deadline=None)
def test_a_hold_released_late_is_credited_at_any_cap(cap, seed):
    # At cap 90 the idle floor is 11 ms: a hold 20-40 ms over would lose the rest.
    share = run_share(cap, seed, release_late=(0.02, 0.04))
    assert abs(share - cap) <= 2.0, share


# -- (e) groups are independent ----------------------------------------------------

# Another device only: on the same one a paced group that runs keeps a held
# group waiting (their turns do not overlap; the next test).
@given(seed=st.integers(0, 2**32 - 1), other_cap=caps, other_dev=st.integers(1, 3),
       steps=st.integers(10, 150))
@settings(max_examples=100, deadline=None)
def test_another_groups_observations_do_not_change_a_groups_decisions(
        seed, other_cap, other_dev, steps):
    rnd = random.Random(seed)
    alone, shared = DutyPacer(), DutyPacer()
    other = (1, other_dev)
    now, consumed, syncs, since = 0.0, 0, 0, None
    o_consumed, o_syncs, o_since = 0, 0, None
    for _ in range(steps):
        now += rnd.uniform(0.0, 0.05)
        if since is None:
            syncs += rnd.randint(0, 2)
            consumed += rnd.randint(0, 1000)
        o_syncs += rnd.randint(0, 3)
        o_consumed += rnd.randint(0, 10**6)
        if rnd.random() < 0.1:
            o_since = None if o_since is not None else now
        extra = {"caps": {other: other_cap}, "use": {other: Use(o_consumed, o_syncs)},
                 "held": {other[0]: o_since} if o_since is not None else {}}
        a = alone.step(obs(now, consumed, syncs, cap=30.0, held_since=since))
        b = shared.step(obs(now, consumed, syncs, cap=30.0, held_since=since, extra=extra))
        assert a.keys[KEY] == b.keys[KEY]
        assert (KEY[0] in a.release) == (KEY[0] in b.release)
        assert (KEY[0] in a.cut_short) == (KEY[0] in b.cut_short)
        assert [c for c in a.mode_changes if c[0] == KEY] == \
            [c for c in b.mode_changes if c[0] == KEY]
        if since is None and a.keys[KEY].ask is not Ask.NONE:
            since = now
        elif since is not None and KEY[0] in a.release:
            since = None


@pytest.mark.parametrize("other_dev", [0, 1])
def test_a_held_group_waits_while_a_paced_group_runs_on_its_device(other_dev):
    p, other = DutyPacer(), (1, other_dev)

    def step(now, n, since, o):
        extra = {"caps": {other: 99.0}, "use": {other: Use(o, o)}, "held": {}}
        return p.step(obs(now, n, n, cap=50.0, held_since=since, extra=extra))
    now, n = 0.0, 0
    while step(now, n, None, n).keys[KEY].ask is Ask.NONE:
        now, n = now + 0.01, n + 1
    since, o = now, n
    while True:     # group 0 held; group 1 synchronizes every 10 ms all the while
        now, o = now + 0.01, o + 1
        d = step(now, n, since, o)
        if KEY[0] in d.release:
            break
    assert p.mode(other) is Mode.DUTY and d.keys[other].ask is Ask.NONE
    if other_dev == KEY[1]:
        # paid long before, it waited until MAX_HOLD_S
        assert now - since == pytest.approx(duty.MAX_HOLD_S, abs=0.011)
        assert KEY[0] in d.cut_short
    else:
        assert now - since < duty.MAX_HOLD_S / 2
        assert KEY[0] not in d.cut_short


# -- the mode switch ----------------------------------------------------------------

def run_at(p, hz, start, seconds, syncs, tick=0.01):
    """Synchronizes at `hz` for `seconds`, stepping every tick; returns the
    decisions and the synchronize count."""
    out = []
    now = start
    next_sync = start + 1.0 / hz
    while now < start + seconds - 1e-9:
        now += tick
        while next_sync <= now:
            syncs += 1
            next_sync += 1.0 / hz
        out.append((now, p.step(obs(now, syncs * 100, syncs, cap=50.0))))
    return out, syncs


def switches(decisions):
    return [(t, c[1]) for t, d in decisions for c in d.mode_changes if c[0] == KEY]


def test_duty_once_synchronizing_at_paced_hz():
    p = DutyPacer()
    p.step(obs(0.0))
    ds, _ = run_at(p, duty.PACED_HZ * 1.2, 0.0, 3.0, 0)
    (t, mode), = switches(ds)
    assert mode is Mode.DUTY
    assert t <= 1.0
    assert ds[-1][1].keys[KEY].mode is Mode.DUTY


def test_counters_that_start_over_start_the_books_over():
    """The probes' entry of a group goes with its cap and comes back at zero:
    a group that synchronizes fast is paced by time again within the time it
    takes a new one, not handed to the launch budget by a negative rate."""
    p = DutyPacer()
    p.step(obs(0.0))
    ds, syncs = run_at(p, 100.0, 0.0, 3.0, 0)
    assert ds[-1][1].keys[KEY].mode is Mode.DUTY
    fresh = DutyPacer()
    fresh.step(obs(10.0))
    again, _ = run_at(p, 100.0, 3.0, 1.0, 0)        # its counters read from zero
    new, _ = run_at(fresh, 100.0, 10.0, 1.0, 0)
    assert Mode.BUDGET not in [m for _t, m in switches(again)]
    became = lambda ds: next(t - ds[0][0] for t, d in ds if d.keys[KEY].mode is Mode.DUTY)  # noqa: E731
    assert became(again) <= became(new) + 0.011


@pytest.mark.parametrize("quantum", [0.02, 0.2])
def test_a_longer_quantum_holds_less_often_for_longer(quantum):
    p = DutyPacer(quantum_s=quantum, max_hold_s=2 * quantum)
    assert p.max_hold_s == max(2 * quantum, quantum)
    p.step(obs(0.0))
    ds, _ = run_at(p, 100.0, 0.0, 1.5, 0)
    asked = next(t for t, d in ds if d.keys[KEY].ask is not Ask.NONE)
    became = next(t for t, d in ds if d.keys[KEY].mode is Mode.DUTY)
    # cap 50: it owes a second per second of running, so it is asked once it owes the quantum
    assert asked - became == pytest.approx(quantum, abs=0.021)


def test_budget_below_paced_hz():
    p = DutyPacer()
    p.step(obs(0.0))
    ds, _ = run_at(p, (duty.PACED_HZ + duty.UNPACED_HZ) / 2, 0.0, 5.0, 0)
    assert switches(ds) == []
    assert all(d.keys[KEY].mode is Mode.BUDGET for _, d in ds)


def test_back_to_budget_under_unpaced_hz_and_not_between():
    p = DutyPacer()
    p.step(obs(0.0))
    ds, n = run_at(p, 20.0, 0.0, 2.0, 0)
    assert [m for _, m in switches(ds)] == [Mode.DUTY]
    # between the two rates: stays paced by time
    ds, n = run_at(p, (duty.PACED_HZ + duty.UNPACED_HZ) / 2, 2.0, 4.0, n)
    assert switches(ds) == []
    assert all(d.keys[KEY].mode is Mode.DUTY for _, d in ds)
    # under UNPACED_HZ: back to the launch budget within a rate window or so
    ds, n = run_at(p, duty.UNPACED_HZ / 2, 6.0, 3.0, n)
    (t, mode), = switches(ds)
    assert mode is Mode.BUDGET
    assert t <= 6.0 + 2 * duty.SYNC_WINDOW_S
    assert ds[-1][1].keys[KEY].debt <= 0.0


# -- plain cases -----------------------------------------------------------------------

def paced(cap=50.0, start=0.0):
    """A pacer whose group just switched to DUTY mode (no debt): (pacer, syncs, now)."""
    p = DutyPacer()
    now, syncs = start, 0
    p.step(obs(now, cap=cap))
    while True:
        now += 0.01
        syncs += 1
        k = p.step(obs(now, syncs, syncs, cap=cap)).keys[KEY]
        if k.mode is Mode.DUTY:
            assert k.debt <= 0.0
            return p, syncs, now


def test_asks_for_a_stop_at_the_quantum_then_at_a_launch():
    p, n, now = paced(cap=50.0)
    start = now
    asks = []
    while now < start + 0.5:
        now += 0.01
        n += 1
        asks.append((now, p.step(obs(now, n, n, cap=50.0)).keys[KEY]))
    first = next(t for t, k in asks if k.ask is Ask.SYNC)
    # at cap 50 a second of running owes a second
    assert first == pytest.approx(start + duty.QUANTUM_S, abs=0.011)
    launch = next(t for t, k in asks if k.ask is Ask.LAUNCH)
    assert launch == pytest.approx(first + duty.FORCE_AFTER_S, abs=0.011)


def test_a_hold_that_began_between_steps_counts_the_running_before_it():
    # Stepped 10 ms apart; the group ran for 9 ms of them, then stopped. The
    # 9 ms it ran owe 9 ms at cap 50, the 1 ms held pays 1 ms.
    p, n, now = paced(cap=50.0)
    before = p.debt(KEY)
    k = p.step(obs(now + 0.01, n + 1, n + 1, cap=50.0, held_since=now + 0.009)).keys[KEY]
    assert k.debt == pytest.approx(before + 0.009 - 0.001, abs=1e-9)


def test_release_once_paid_and_next_step_when_due():
    p, n, now = paced(cap=50.0)
    while p.debt(KEY) < duty.QUANTUM_S:
        now += 0.01
        n += 1
        p.step(obs(now, n, n, cap=50.0))
    d = p.step(obs(now + 0.001, n, n, cap=50.0, held_since=now + 0.001))
    assert KEY[0] not in d.release
    assert d.next_step == pytest.approx(now + 0.001 + d.keys[KEY].debt)
    d = p.step(obs(d.next_step, n, n, cap=50.0, held_since=now + 0.001))
    assert KEY[0] in d.release and KEY[0] not in d.cut_short
    assert p.debt(KEY) == pytest.approx(0.0, abs=1e-9)   # released because the hold paid it


def asked_then_held(cap=50.0):
    """A paced group asked to stop and stopped at that step: (pacer, syncs, now)."""
    p, n, now = paced(cap=cap)
    while True:
        now += 0.01
        n += 1
        if p.step(obs(now, n, n, cap=cap)).keys[KEY].ask is not Ask.NONE:
            return p, n, now


def test_a_hold_it_asked_for_is_released_when_the_cap_goes():
    p, n, since = asked_then_held()
    d = p.step(Observation(now=since + 0.01, caps={}, use={}, held={KEY[0]: since}))
    assert KEY[0] in d.release


def test_the_rate_counts_running_time_so_a_held_group_stays_paced():
    # A training loop that synchronizes every 40 ms it runs (25 Hz), paced at
    # cap 25: held most of the time, it synchronizes ~6 times a second of
    # wall time, under UNPACED_HZ. Its rate per second of running stays
    # 25 Hz: one switch to DUTY, none back.
    step_s = 0.04
    assert 1 / step_s >= duty.PACED_HZ and 0.25 / step_s < duty.UNPACED_HZ
    p = DutyPacer()
    now, consumed, syncs, since, ran = 0.0, 0, 0, None, 0.0
    p.step(obs(now, cap=25.0))
    changes, held_s = [], 0.0
    for i in range(1, 3000):
        now = i * 0.01
        if since is None:
            consumed += 1
            ran += 0.01
            if ran >= step_s - 1e-9:
                syncs, ran = syncs + 1, 0.0
        else:
            held_s += 0.01
        d = p.step(obs(now, consumed, syncs, cap=25.0, held_since=since))
        changes += [m for key, m in d.mode_changes if key == KEY]
        if since is not None and KEY[0] in d.release:
            since = None
        elif since is None and d.keys[KEY].ask is not Ask.NONE:
            since = now
    assert changes == [Mode.DUTY]
    assert held_s / now > 0.5


def drive_under_budget(p, seconds, sync_due, budget_run=0.015, budget_cycle=0.1, cap=50.0,
                       turns=False, alone_held=False):
    """A group the launch budget holds (BUDGET mode: `budget_run` of every
    `budget_cycle` seconds running) and the pacer holds when it asks (DUTY
    mode). `sync_due(now, ran)` says whether a synchronize returns in this
    10 ms tick (`ran`: seconds run since the last one). Returns the mode
    changes [(t, mode)] and the seconds spent in DUTY mode."""
    now, consumed, syncs, ran, since = 0.0, 0, 0, 0.0, None
    p.step(obs(now, cap=cap))
    changes, in_duty, last_sync, budget_since = [], 0.0, 0.0, None
    for i in range(1, int(seconds / 0.01)):
        now = i * 0.01
        mode = p.mode(KEY)
        if mode is Mode.DUTY:
            in_duty += 0.01
        budget_held = mode is not Mode.DUTY and (now % budget_cycle) >= budget_run - 1e-9
        if since is None and not budget_held:
            consumed += 1
            ran += 0.01
            if sync_due(now, ran, last_sync):
                syncs, ran, last_sync = syncs + 1, 0.0, now
        if budget_held:
            budget_since = now - 0.01 if budget_since is None else budget_since
        else:
            budget_since = None
        held_since = since if since is not None else budget_since
        o = obs(now, consumed, syncs, cap=cap, held_since=held_since)
        if turns:
            o = dataclasses.replace(o, turns=frozenset({KEY}))
        if alone_held and budget_held:
            o = dataclasses.replace(o, alone_held=frozenset({KEY}))
        d = p.step(o)
        changes += [(now, m) for key, m in d.mode_changes if key == KEY]
        if since is not None and KEY[0] in d.release:
            since = None
        elif since is None and d.keys[KEY].ask is not Ask.NONE:
            since = now
    return changes, in_duty


def test_a_loop_the_budget_holds_most_of_the_time_is_paced_by_time():
    # A decode loop: a synchronize every 10 ms it runs. Its launch budget
    # (learned in a warm-up unlike its steady state) lets it run 15% of the
    # time: 15 synchronizes a second of wall time, under PACED_HZ. Per
    # second of running it is a fast loop, and time pacing takes it over.
    changes, in_duty = drive_under_budget(DutyPacer(), 20.0, lambda now, ran, last: True)
    assert changes and changes[0][1] is Mode.DUTY and changes[0][0] <= 3.0, changes
    assert [m for _t, m in changes] == [Mode.DUTY]


def test_a_loop_the_budget_holds_nearly_all_the_time_is_paced_by_time():
    # Let run 10 ms a second: a handful of synchronizes in RATE_WALL_S, over
    # 50 ms of running, is a fast loop.
    changes, _ = drive_under_budget(DutyPacer(), 20.0, lambda now, ran, last: True,
                                    budget_run=0.01, budget_cycle=1.0)
    assert [m for _t, m in changes] == [Mode.DUTY], changes


def test_a_loop_that_synchronizes_by_the_wall_clock_does_not_see_saw():
    # A loop that synchronizes every 250 ms of wall time, whatever it was let
    # run: per second of running, the budget's holds make it look fast (27 Hz
    # at 15% running); paced by time, it is slow (4 Hz) and goes back. It
    # goes back and forth at most a few times, each time staying with the
    # budget longer.
    changes, in_duty = drive_under_budget(
        DutyPacer(), 120.0, lambda now, ran, last: now - last >= 0.25 - 1e-9)
    to_duty = [t for t, m in changes if m is Mode.DUTY]
    assert 1 <= len(to_duty) <= 5, changes
    gaps = [b - a for a, b in zip(to_duty, to_duty[1:])]
    assert gaps == sorted(gaps), changes
    assert in_duty < 0.15 * 120.0, (in_duty, changes)


def test_the_time_slices_of_groups_taking_turns_count_as_running():
    # Two budgets taking turns hold each other by design: a fast loop that
    # runs in its slices (15% of the time) is not taken from the turns.
    changes, in_duty = drive_under_budget(DutyPacer(), 20.0, lambda now, ran, last: True,
                                          turns=True)
    assert changes == [] and in_duty == 0.0


@pytest.mark.parametrize("alone_held", [True, False], ids=["another-learns", "its-budget"])
def test_a_group_held_while_another_learns_alone_is_not_paced_by_time(alone_held):
    # Held from its start while another group learns its rate alone (at
    # most 2 s), a loop let run a few ms synchronizes a handful of times:
    # over so little running that is hundreds a second, yet those holds are
    # not its pacing. Held so by its own budget, the same loop is paced by time.
    changes, _ = drive_under_budget(DutyPacer(), 2.0, lambda now, ran, last: True,
                                    budget_run=0.01, budget_cycle=0.25, alone_held=alone_held)
    assert (changes == []) is alone_held, changes


def test_a_hold_it_did_not_ask_for_is_not_its_to_end():
    # held by the launch budget (BUDGET mode, never asked): not released here
    p = DutyPacer()
    p.step(obs(0.0, cap=50.0))
    for i in range(1, 100):
        d = p.step(obs(i * 0.01, i * 100, 0, cap=50.0, held_since=0.005))
        assert d.release == frozenset()


@given(start=st.floats(0.0, 1e7), cap=st.floats(5.0, 95.0), run=st.floats(0.05, 1.5),
       at=st.floats(0.0, 0.01))
@settings(max_examples=300, deadline=None)
def test_stepped_at_next_step_a_hold_ends_when_due(start, cap, run, at):
    # Monotonic clocks run to 1e7 s; a step at next_step lands within rounding
    # of the debt's or its hold bound's end, and the hold must end right there.
    p, n, now = paced(cap=cap, start=start)
    t_end = now + run
    while now < t_end:
        now += 0.01
        n += 1
        p.step(obs(now, n, n, cap=cap))
    since = now + at
    owed = p.debt(KEY)
    d = p.step(obs(since, n, n, cap=cap, held_since=since))
    steps = 0
    while KEY[0] not in d.release:
        assert d.next_step is not None and d.next_step > now
        now = d.next_step
        d = p.step(obs(now, n, n, cap=cap, held_since=since))
        steps += 1
        assert steps <= 1, (owed, now - since)
    bound = p.hold_bound(KEY[0])
    assert now - since <= bound + 1e-6
    assert now - since >= min(max(owed, 0.0), bound) - 1e-6


def test_a_group_waiting_in_a_synchronize_is_active():
    # Launched 10 long kernels, then waits 150 ms for them: no counter moves,
    # but its work is on the GPU and its running time owes.
    for waiting, grows in ((1, True), (0, False)):
        p, n, now = paced(cap=50.0)
        before = p.debt(KEY)
        for _ in range(15):
            now += 0.01
            k = p.step(Observation(now=now, caps={KEY: 50.0},
                                   use={KEY: Use(n, n, waiting)}, held={})).keys[KEY]
        if grows:
            assert k.debt == pytest.approx(before + 0.15, abs=1e-9)
        else:
            assert k.debt < before + duty.ACTIVE_GRACE_S


# -- the launch probe's own time --------------------------------------------------

def run_host_loop(cap, launch_hz, probe_s, wait_share=0.0, seconds=20.0, tick=0.01,
                  pacer=None, episodes=None):
    """A loop that synchronizes every tick and launches `launch_hz` a second
    while it runs, `wait_share` of its running time inside synchronize calls
    (a number, or a function of the time); stops at its next synchronize when
    asked. Returns (share of the time it ran after its first 2 s, the last
    probe share the pacer gave). `episodes`, a list: gets (start, run s, held
    s) of each run followed by its hold, and `pacer` steps it."""
    p = pacer or DutyPacer()
    share_at = wait_share if callable(wait_share) else (lambda _t: wait_share)
    now, consumed, launches, syncs, sync_s = 0.0, 0, 0, 0, 0.0
    since, run_s, held_s = None, 0.0, 0.0
    ran_from, released = 0.0, 0.0

    def step():
        return p.step(Observation(now=now, caps={KEY: cap}, held={} if since is None else {0: since},
                                  use={KEY: Use(consumed, syncs, 0, launches, sync_s)},
                                  probe_s=probe_s))
    d = step()
    while now < seconds:
        nxt = now + tick if d.next_step is None else min(now + tick, max(d.next_step, now + 1e-6))
        dt = nxt - now
        if since is None:
            launches += round(launch_hz * dt)
            consumed += round(launch_hz * dt)
            syncs += 1
            sync_s += share_at(now) * dt
            run_s += dt if now >= 2.0 else 0.0
        else:
            held_s += dt if now >= 2.0 else 0.0
        asked = since is None and d.keys[KEY].ask is not Ask.NONE
        now = nxt
        if asked:
            since, ran_from = now, released
        d = step()
        if since is not None and 0 in d.release:
            if episodes is not None:
                episodes.append((ran_from, since - ran_from, now - since))
            since, released = None, now
    return 100.0 * run_s / (run_s + held_s), d.keys[KEY].probe_share


def test_a_host_bound_group_runs_longer_by_what_its_probes_take():
    # 50k launches a second at 2 us each: a tenth of its running time
    share, probe = run_host_loop(50.0, 50_000, 2e-6)
    assert probe == pytest.approx(0.1, abs=0.005)
    assert share == pytest.approx(50.0 / 0.9, abs=1.5)


def test_a_group_that_waits_for_the_gpu_gets_no_probe_allowance():
    share, probe = run_host_loop(50.0, 50_000, 2e-6, wait_share=0.7)
    assert probe == 0.0
    assert share == pytest.approx(50.0, abs=1.5)


def test_without_a_measured_probe_cost_a_group_runs_its_cap():
    share, probe = run_host_loop(50.0, 50_000, 0.0)
    assert probe == 0.0
    assert share == pytest.approx(50.0, abs=1.5)


def test_the_probe_allowance_is_bounded():
    share, probe = run_host_loop(25.0, 1_000_000, 2e-6)
    assert probe == duty.MAX_PROBE_SHARE
    assert share == pytest.approx(25.0 / (1 - duty.MAX_PROBE_SHARE), abs=1.5)


# -- a group its launching thread paces: longer slices ---------------------------

def reported_slices(p: DutyPacer) -> list:
    """The slice changes p's steps report from now on, in order."""
    said: list = []
    step = p.step

    def spy(o):
        d = step(o)
        said.extend(d.slice_changes)
        return d
    p.step = spy
    return said


def in_phases(phases):
    """A waited share by time: [(from, share), ...] in order."""
    return lambda t: [w for start, w in phases if t >= start][-1]


def slices(cap, wait_share, pacer=None, seconds=20.0):
    eps: list = []
    share, _ = run_host_loop(cap, 10_000, 0.0, wait_share=wait_share, seconds=seconds,
                             pacer=pacer, episodes=eps)
    return share, [e for e in eps if e[0] >= 3.0]     # after it is seen host-paced


@pytest.mark.parametrize("cap", [25.0, 50.0, 75.0])
def test_a_host_paced_group_runs_at_least_host_run_s_between_holds(cap):
    share, eps = slices(cap, 0.1)
    owes = (100.0 - cap) / cap
    quantum = min(max(duty.QUANTUM_S, duty.HOST_RUN_S * owes), duty.HOST_QUANTUM_MAX_S)
    assert eps
    tick = 0.01     # it stops at its next synchronize: up to a tick's debt more
    for _start, run, held in eps:
        assert run == pytest.approx(quantum / owes, abs=2 * tick + 0.011)
        assert held == pytest.approx(quantum, abs=(owes + 1) * tick + 0.011)
        assert held <= 2 * quantum
    # fewer, longer holds: the same share of the time
    assert share == pytest.approx(cap, abs=1.5)


def test_a_group_that_waits_for_the_gpu_keeps_the_short_quantum():
    share, eps = slices(50.0, 0.7)
    assert eps and all(held == pytest.approx(duty.QUANTUM_S, abs=0.021) for _s, _r, held in eps)
    assert share == pytest.approx(50.0, abs=1.5)


def test_host_run_s_zero_holds_a_host_paced_group_as_any_other():
    p = DutyPacer(host_run_s=0.0)
    said = reported_slices(p)
    share, eps = slices(50.0, 0.1, pacer=p)
    assert said == []
    assert eps and all(held == pytest.approx(duty.QUANTUM_S, abs=0.021) for _s, _r, held in eps)
    assert share == pytest.approx(50.0, abs=1.5)


def test_the_host_paced_test_has_hysteresis():
    # 0.1 waited, then 0.55 (between the two thresholds: stays host-paced),
    # then 0.8 (waits for the GPU), then 0.55 again (stays with the GPU)
    wait_share = in_phases([(0.0, 0.1), (6.0, 0.55), (12.0, 0.8), (18.0, 0.55)])
    eps: list = []
    run_host_loop(50.0, 10_000, 0.0, wait_share=wait_share, seconds=24.0, episodes=eps)
    held_in = lambda lo, hi: [h for s, _r, h in eps if lo + 2.0 <= s < hi]  # noqa: E731
    long_hold = duty.HOST_RUN_S     # cap 50 owes a second per second run
    assert all(h == pytest.approx(long_hold, abs=0.021) for h in held_in(0.0, 12.0))
    assert all(h == pytest.approx(duty.QUANTUM_S, abs=0.021) for h in held_in(12.0, 24.0))
    assert held_in(0.0, 12.0) and held_in(12.0, 24.0)


@given(cap=st.floats(10.0, 99.0), waited=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
@settings(max_examples=60, deadline=None)
def test_every_hold_is_bounded_and_the_share_kept(cap, waited):
    # (from cap 10: below it a run of one 10 ms tick between the longest
    # holds is already more than the cap)
    eps: list = []
    share, _ = run_host_loop(cap, 10_000, 0.0, wait_share=waited, seconds=12.0, episodes=eps)
    for _s, _r, held in eps:
        assert held <= 2 * duty.HOST_QUANTUM_MAX_S + 1e-9
    # the longest hold at low caps leaves a short run: the share still holds
    assert share == pytest.approx(cap, abs=2.5)


def test_a_change_of_slices_is_reported_once_each_way():
    p = DutyPacer()
    changes = reported_slices(p)
    run_host_loop(50.0, 10_000, 0.0, pacer=p, seconds=16.0,
                  wait_share=in_phases([(0.0, 0.1), (8.0, 0.8)]))
    assert changes == [(KEY, True, pytest.approx(duty.HOST_RUN_S)),
                       (KEY, False, duty.QUANTUM_S)]


# -- what being held costs a launch-bound loop, given back ----------------------

NVML_PERIOD_S = 1 / 6     # NVML's utilization: the busy share of its last sample period


def always_running(p, cap, waited, seconds=20.0, dt=0.002, util=None, said=None, spare=None,
                   launches=None, probe_s=0.0):
    """A group always active that stops at once when asked, spending `waited`
    of its running time inside synchronize calls (a synchronize per step).
    Returns (percent of the time it ran once what it is given back is known,
    the last decision's stop_share). With `util`, the device is that busy
    while the group runs and idle while it is held, and reads (whenever the
    pacer asks) as NVML does, the busy share of its last sample period;
    without, no reading comes, and what it is given back is known
    BUSY_WAIT_S after its first window. `said`: (time, stop_share) of each
    change is appended. `spare`: beside a neighbour, on a device of which
    that share of the time (percent) no cap claims. `launches`: a function
    giving the launches of each step it runs (none without), each costing
    `probe_s` of host time in the launch probe."""
    t, n, sync_s, since, launched = 0.0, 0, 0.0, None, 0
    ran = total = 0.0
    kd = None
    settled = 2.0 + duty.BUSY_WAIT_S
    recent = collections.deque(maxlen=round(NVML_PERIOD_S / dt))   # running, each dt
    while t < seconds:
        t += dt
        if since is None:
            n += 1
            sync_s += dt * waited
            launched += launches() if launches else 0
            if t > settled:
                ran += dt
        if t > settled:
            total += dt
        read = None
        recent.append(since is None)
        if util is not None and KEY[1] in p.wants_util(t):
            read = {KEY[1]: util * sum(recent) / len(recent)}
        beside = {} if spare is None else {"shared": frozenset({KEY}), "spare": {KEY[1]: spare}}
        d = p.step(Observation(t, {KEY: cap}, {KEY: Use(n, n, launches=launched, sync_s=sync_s)},
                               {KEY[0]: since} if since is not None else {}, util=read,
                               probe_s=probe_s, **beside))
        kd = d.keys[KEY]
        if said is not None:
            said.extend((t, share) for key, share in d.given_back if key == KEY)
        if since is not None and KEY[0] in d.release:
            since = None
        elif since is None and kd.ask is not Ask.NONE:
            since = t
    return 100.0 * ran / total, kd.stop_share


@given(cap=st.integers(10, 90), waited=st.floats(0.0, 0.04))
@settings(max_examples=15, deadline=None)
def test_a_launch_bound_group_is_given_back_what_being_held_costs_it(cap, waited):
    share, stop_share = always_running(duty.DutyPacer(), cap, waited)
    assert stop_share == duty.HOST_STOP_SHARE
    assert abs(share - allowed(cap)) <= 2.0, share


@given(cap=st.integers(10, 90), waited=st.floats(0.07, 0.95))
@settings(max_examples=15, deadline=None)
def test_a_group_that_waits_for_the_gpu_is_given_nothing_back(cap, waited):
    share, stop_share = always_running(duty.DutyPacer(), cap, waited)
    assert stop_share == 0.0
    assert abs(share - cap) <= 2.0, share


@given(cap=st.integers(10, 90), waited=st.floats(0.0, 0.04))
@settings(max_examples=10, deadline=None)
def test_a_quiet_loop_that_keeps_its_gpu_busy_is_given_nothing_back(cap, waited):
    # Little time inside synchronize calls, but a full launch queue: its
    # GPU is busy 95% of the time it runs.
    said = []
    share, stop_share = always_running(duty.DutyPacer(), cap, waited, util=95.0, said=said)
    assert stop_share == 0.0 and said == []
    assert abs(share - cap) <= 2.0, share


@given(cap=st.integers(10, 80), spare=st.floats(0.0, 40.0))
@settings(max_examples=15, deadline=None)
def test_beside_a_neighbour_a_launch_bound_group_is_given_back_only_time_no_cap_claims(cap, spare):
    share, stop_share = always_running(duty.DutyPacer(), cap, 0.0, spare=spare)
    assert stop_share == pytest.approx(min(duty.HOST_STOP_SHARE, 1 - cap / (cap + spare)))
    assert abs(share - min(allowed(cap), cap + spare)) <= 2.0, share


def test_what_is_given_back_out_of_unclaimed_time_is_said_when_it_moves_a_point_not_each_step():
    # The launch probes' share of its running time moves with its launch
    # rate at every step, and with it the share that fills the unclaimed time.
    rng = random.Random(7)
    said = []
    share, stop_share = always_running(duty.DutyPacer(), 50, 0.0, spare=10.0, said=said,
                                       launches=lambda: rng.randint(0, 80), probe_s=2e-6)
    assert 0 < len(said) <= 3, said
    exact = 1 - 50 / ((1 - 0.02) * 60)      # 20,000 launches a second of 2 µs
    assert abs(stop_share - exact) < 2 * duty.SPARE_STEP, stop_share
    assert abs(share - 60) <= 2.0, share


def test_beside_a_neighbour_with_no_time_spare_nothing_is_given_back():
    said = []
    share, stop_share = always_running(duty.DutyPacer(), 70, 0.0, spare=0.0, said=said)
    assert stop_share == 0.0 and said == [] and abs(share - 70) <= 2.0, share


def test_spare_time_is_what_no_active_group_s_cap_claims():
    caps = {(0, 0): 30.0, (1, 0): 50.0, (0, 1): 40.0}
    assert sharing.spare_time(caps, [(0, 0), (1, 0)]) == {0: 20.0}
    assert sharing.spare_time(caps, [(0, 0), (1, 0), (0, 1)]) == {0: 20.0, 1: 60.0}
    # a group with no cap on the device is promised nothing: it claims none
    assert sharing.spare_time(caps, [(0, 0), (2, 0)]) == {0: 70.0}
    assert sharing.spare_time(caps, [(0, 0), (1, 1)]) == {0: 70.0, 1: 100.0}
    assert sharing.spare_time(caps, [(0, 0), (1, 0), (2, 0)]) == {0: 20.0}
    assert sharing.spare_time({(0, 0): 70.0, (1, 0): 50.0}, [(0, 0), (1, 0)]) == {0: 0.0}


def test_uncapped_beside_is_true_only_where_every_neighbour_is_uncapped():
    caps = {(0, 0): 50.0, (1, 0): 30.0, (0, 1): 40.0}
    assert sharing.uncapped_beside((0, 0), caps, [(0, 0), (2, 0)])
    assert sharing.uncapped_beside((0, 1), caps, [(0, 1), (1, 1), (2, 1)])
    assert not sharing.uncapped_beside((0, 0), caps, [(0, 0), (1, 0), (2, 0)])
    assert not sharing.uncapped_beside((0, 0), caps, [(0, 0), (2, 1)])    # alone on its device
    assert not sharing.uncapped_beside((0, 0), caps, [(0, 0), (0, 1)])    # its own, elsewhere


def test_shared_keys_are_those_beside_another_group_on_their_device():
    caps = {(0, 0): 50.0, (1, 0): 30.0, (0, 1): 40.0}
    assert sharing.shared(caps, [(0, 0), (1, 0), (0, 1), (2, 1)]) == {(0, 0), (1, 0), (0, 1)}
    # (1, 0) beside the active (0, 0); an iterator is read once for every key
    assert sharing.shared(caps, iter([(0, 0), (0, 1), (2, 2)])) == {(1, 0)}


def test_a_quiet_loop_between_idle_and_busy_keeps_what_it_was():
    # Busy 42% of its running time: neither; it starts with nothing given back.
    said = []
    share, stop_share = always_running(duty.DutyPacer(), 50, 0.0, util=42.0, said=said)
    assert stop_share == 0.0 and said == [] and abs(share - 50) <= 2.0, share


def test_a_quiet_loop_whose_gpu_idles_is_given_back_once_the_device_says_so():
    said = []
    share, stop_share = always_running(duty.DutyPacer(), 50, 0.0, util=25.0, said=said)
    assert stop_share == duty.HOST_STOP_SHARE and abs(share - allowed(50)) <= 2.0, share
    # Once it has run BUSY_MIN_RUN_S under readings, not BUSY_WAIT_S later.
    assert [s for _t, s in said] == [duty.HOST_STOP_SHARE]
    assert said[0][0] < 1.0 + duty.BUSY_WAIT_S


def reads_asked(waited: float, util: float, seconds: float = 4.0, dt: float = 0.002) -> list:
    """When the pacer asks for the device's reading of a group that runs all
    along, `waited` of its time inside synchronize calls; each is given."""
    p, t, n, asked = duty.DutyPacer(), 0.0, 0, []
    while t < seconds:
        t += dt
        n += 1
        read = KEY[1] in p.wants_util(t)
        if read:
            asked.append(t)
        p.step(Observation(t, {KEY: 50.0}, {KEY: Use(n, n, sync_s=n * dt * waited)}, {},
                           util={KEY[1]: util} if read else None))
    return asked


def test_the_device_is_read_for_a_quiet_loop_only_and_at_most_every_busy_read_s():
    assert reads_asked(0.5, 90.0) == []     # it waits for its GPU: nothing to read
    asked = reads_asked(0.0, 20.0)
    assert asked and all(b - a >= duty.BUSY_READ_S - 1e-9 for a, b in zip(asked, asked[1:]))


def test_host_stop_share_zero_gives_nothing_back():
    share, stop_share = always_running(duty.DutyPacer(host_stop_share=0.0), 50, 0.0)
    assert stop_share == 0.0 and abs(share - 50) <= 2.0, share


def test_launch_bound_has_hysteresis_and_each_change_is_reported():
    p = duty.DutyPacer()
    t, n, sync_s, said = 0.0, 0, 0.0, []

    def run(seconds, waited):
        nonlocal t, n, sync_s
        for _ in range(int(seconds / 0.005)):
            t += 0.005
            n += 1
            sync_s += 0.005 * waited
            d = p.step(Observation(t, {KEY: 50.0}, {KEY: Use(n, n, sync_s=sync_s)}, {}))
            said.extend(share for key, share in d.given_back if key == KEY)
        return d.keys[KEY].stop_share

    # Launch-bound, once no device reading came for BUSY_WAIT_S
    assert run(1.0 + duty.BUSY_WAIT_S, 0.01) == duty.HOST_STOP_SHARE
    assert run(3.0, 0.07) == duty.HOST_STOP_SHARE      # between the two: it keeps what it was
    assert run(3.0, 0.2) == 0.0                        # slack again
    assert run(3.0, 0.07) == 0.0
    assert said == [duty.HOST_STOP_SHARE, 0.0]
