"""Whose turn it is on a device (hami_bpf.sm.handoff), and two groups paced
by time on one device (hami_bpf.sm.duty): launch-bound groups run beside
each other, others take turns."""
from __future__ import annotations

import collections

from hypothesis import given, settings, strategies as st

from hami_bpf.sm import duty, handoff, sharing
from hami_bpf.sm.duty import Ask, Observation, Use
from smexpect import allowed

P = handoff.Paced


def paced(owed=0.0, devices=(0,), bound=duty.MAX_HOLD_S, light=True) -> handoff.Paced:
    return P(owed=owed, devices=frozenset(devices), bound=bound, light=light)


def test_a_paid_group_runs_when_no_one_runs_on_its_device():
    out, cut, nxt = handoff.release(1.0, {7: 0.9}, {7: paced(light=False)},
                                    handoff.Running.of([(1, False)]))
    assert out == {7} and cut == set() and nxt is None


def test_a_launch_bound_group_runs_beside_a_launch_bound_one():
    out, cut, _ = handoff.release(1.0, {7: 0.9}, {7: paced()}, handoff.Running.of([(0, True)]))
    assert out == {7} and cut == set()


def test_a_launch_bound_group_waits_for_one_that_is_not():
    out, _, nxt = handoff.release(1.0, {7: 0.9}, {7: paced()}, handoff.Running.of([(0, False)]))
    assert out == set() and nxt == 1.0 + handoff.DUTY_WAIT_S


def test_a_group_that_is_not_launch_bound_waits_for_any():
    out, _, _ = handoff.release(1.0, {7: 0.9}, {7: paced(light=False)},
                                handoff.Running.of([(0, True)]))
    assert out == set()


def test_one_released_ahead_blocks_the_next_unless_both_are_launch_bound():
    held = {1: 0.9, 2: 0.95}
    heavy = {1: paced(light=False), 2: paced(light=False)}
    out, _, _ = handoff.release(1.0, held, heavy, handoff.Running.of([]))
    assert out == {1}       # the older hold first; the other waits for its turn
    out, _, _ = handoff.release(1.0, held, {1: paced(), 2: paced()}, handoff.Running.of([]))
    assert out == {1, 2}


def test_a_group_not_the_pacers_is_left_alone():
    out, cut, nxt = handoff.release(9.0, {3: 0.0}, {}, handoff.Running.of([]))
    assert (out, cut, nxt) == (set(), set(), None)


@given(st.dictionaries(st.integers(0, 5), st.tuples(
    st.floats(0.0, 2.0), st.floats(-1.0, 1.0), st.sets(st.integers(0, 2), max_size=3),
    st.floats(0.05, 0.8), st.booleans()), max_size=6),
    st.lists(st.tuples(st.integers(0, 2), st.booleans()), max_size=4))
@settings(max_examples=300, deadline=None)
def test_no_hold_outlives_its_bound_and_none_ends_early(groups, runners):
    now = 2.0
    held = {gi: now - g[0] for gi, g in groups.items()}
    ps = {gi: paced(g[1], g[2], g[3], g[4]) for gi, g in groups.items()}
    out, cut, nxt = handoff.release(now, held, ps, handoff.Running.of(runners))
    for gi, p in ps.items():
        if now - held[gi] >= p.bound - handoff.DUE_EPS_S:
            assert gi in out        # whatever anyone runs or owes
        elif gi in out:
            assert p.owed <= handoff.DUE_EPS_S and gi not in cut
        else:
            assert nxt is not None and now < nxt <= held[gi] + p.bound + 1e-9
    assert cut <= out


NVML_PERIOD_S = 1 / 6     # NVML's utilization: the busy share of its last sample period


def pair(caps, waited, busy, seconds=30.0, dt=0.002, launched_lately=False,
         waited_beside=None, busy_from=None):
    """Two groups on device 0, each active whenever it is not held and
    stopping at once when asked, spending `waited` of its running time inside
    synchronize calls; the device is busy `busy` percent per group running
    (together, the sum), read as NVML does whenever the pacer asks. Returns
    each one's share of the time it ran after settling (percent), the share
    of the time both ran, the last decisions, the overlap changes, and the
    holds cut short after settling (released at their bound with debt left,
    or into the other's turn). `launched_lately`: who shares the device as
    the daemon tells it (sharing.active: a group held longer than BUSY_S
    has not launched lately), not both all the time. `waited_beside`: its
    share inside synchronize calls while the other runs too (their work
    delays it); `busy_from`: (time, busy from then on)."""
    keys = [(0, 0), (1, 0)]
    n = [0, 0]
    sync_s = [0.0, 0.0]
    since: list = [None, None]
    ran, both, total = [0.0, 0.0], 0.0, 0.0
    settled = 4.0 + duty.BUSY_WAIT_S
    recent = collections.deque(maxlen=round(NVML_PERIOD_S / dt))
    p, t, d, changes, cut = duty.DutyPacer(sample_share=0.0), 0.0, None, [], 0
    capmap = dict(zip(keys, caps))
    last = {k: 0.0 for k in keys}
    while t < seconds:
        t += dt
        running = [since[i] is None for i in range(2)]
        for i in range(2):
            if running[i]:
                last[keys[i]] = t
                n[i] += 1
                sync_s[i] += dt * (waited_beside or waited)[i] if all(running) else dt * waited[i]
                ran[i] += dt if t > settled else 0.0
        if t > settled:
            total += dt
            both += dt if all(running) else 0.0
        now_busy = busy_from[1] if busy_from and t >= busy_from[0] else busy
        recent.append(min(100.0, sum(b for b, r in zip(now_busy, running) if r)))
        util = {0: sum(recent) / len(recent)} if 0 in p.wants_util(t) else None
        active = frozenset(sharing.active(last, t) if launched_lately else keys)
        d = p.step(Observation(
            t, capmap, {k: Use(n[i], n[i], launches=n[i], sync_s=sync_s[i])
                        for i, k in enumerate(keys)},
            {i: since[i] for i in range(2) if since[i] is not None}, util=util,
            shared=sharing.shared(keys, active),
            active=active, spare=sharing.spare_time(capmap, active)))
        changes.extend(d.overlaps)
        cut += len(d.cut_short) if t > settled else 0
        for i, k in enumerate(keys):
            if since[i] is not None and i in d.release:
                since[i] = None
            elif since[i] is None and d.keys[k].ask is not Ask.NONE:
                since[i] = t
    return [100 * r / total for r in ran], 100 * both / total, d, changes, cut


def test_two_launch_bound_groups_run_beside_each_other_each_given_back_its_holds_cost():
    caps = (30.0, 70.0)
    shares, both, d, changes, cut = pair(caps, waited=(0.01, 0.01), busy=(14.0, 14.0))
    for k, cap, share in zip(((0, 0), (1, 0)), caps, shares):
        kd = d.keys[k]
        assert kd.overlap and kd.stop_share == duty.HOST_STOP_SHARE
        assert abs(share - allowed(cap)) <= 3.0, shares
        assert (k, True) in changes
    assert both >= 15.0, both       # their running times overlap
    assert cut == 0                 # neither waits for the other's turn


def test_a_launch_bound_group_alone_for_moments_runs_beside_its_kind_all_the_same():
    """Capped together at caps that leave no time unclaimed, so no reading
    alone says either is launch-bound; the one at 30, held 0.4 s at a time,
    leaves the other alone on the device for moments: their readings beside
    each other still decide."""
    caps = (30.0, 70.0)
    shares, both, d, changes, cut = pair(caps, waited=(0.01, 0.01), busy=(14.0, 14.0),
                                         launched_lately=True)
    assert all(kd.overlap for kd in d.keys.values()), changes
    assert both >= 15.0, both
    for cap, share in zip(caps, shares):
        assert abs(share - allowed(cap)) <= 3.0, shares


def test_a_pair_whose_turns_read_over_idle_keeps_taking_turns():
    """Taking turns a loop reads LAUNCH_IDLE_BUSY or more, theirs included:
    two such loops at 70 / 30 on an H100 (read 33-46 in turns) read 56-63
    together and went back and forth; they stay in turns."""
    shares, both, d, changes, cut = pair((70.0, 30.0), waited=(0.01, 0.01), busy=(42.0, 14.0))
    assert changes == [] and not any(kd.overlap for kd in d.keys.values()), changes
    assert d.keys[(0, 0)].read_busy >= duty.LAUNCH_IDLE_BUSY
    assert both <= 1.0, both


def test_launch_bound_groups_keep_running_beside_each_other_though_each_slows_the_other():
    """Each reads 33% busy alone, 66% with the other's work (53% per second
    it ran, under OVERLAP_BUSY, as two launch-bound loops on an H100);
    each waits 12% of its running time beside the other: more than a quiet
    loop does alone, less than a hold costs it."""
    caps = (30.0, 70.0)
    shares, both, d, changes, cut = pair(caps, waited=(0.01, 0.01), busy=(33.0, 33.0),
                                         waited_beside=(0.12, 0.12))
    assert changes == [((0, 0), True), ((1, 0), True)] or \
        changes == [((1, 0), True), ((0, 0), True)], changes     # never off again
    assert all(kd.overlap for kd in d.keys.values())
    at30 = d.keys[(0, 0)]    # beside the other most of the time it runs
    assert at30.read_busy > duty.LAUNCH_BOUND_BUSY and at30.waited > duty.LAUNCH_BOUND_SHARE
    assert both >= 15.0 and cut == 0, (both, cut)
    for cap, share in zip(caps, shares):
        assert abs(share - allowed(cap)) <= 3.0, shares


def test_groups_that_slow_each_other_more_than_a_hold_does_go_back_to_turns_for_a_while():
    shares, both, d, changes, cut = pair((50.0, 50.0), waited=(0.01, 0.01), busy=(30.0, 30.0),
                                         waited_beside=(0.3, 0.3), seconds=60.0)
    offs = [c for c in changes if not c[1]]
    assert offs, changes
    # turns make them quiet again at once: each comes back only once a retry
    # (OVERLAP_RETRY_S, 10 s) is over, in 60 s at most 5 times (7 without)
    assert sum(1 for c in changes if c[1]) <= 10, changes
    assert not any(kd.overlap for kd in d.keys.values()) or both < 30.0


def test_a_phase_that_fills_the_gpu_beside_its_kind_ends_running_beside_it():
    """A full launch queue: its synchronizes stay quiet, the reading does not."""
    shares, both, d, changes, cut = pair((50.0, 50.0), waited=(0.01, 0.01), busy=(20.0, 20.0),
                                         busy_from=(15.0, (20.0, 80.0)))
    assert ((0, 0), False) in changes and ((1, 0), False) in changes, changes
    assert not any(kd.overlap for kd in d.keys.values())
    off = [kd.read_busy for kd in d.keys.values()]
    assert max(off) >= duty.OVERLAP_BUSY, off


def test_a_group_that_keeps_the_gpu_busy_takes_turns_with_a_launch_bound_one():
    shares, both, d, changes, cut = pair((30.0, 70.0), waited=(0.01, 0.01), busy=(90.0, 14.0))
    assert changes == [] and not any(kd.overlap for kd in d.keys.values())
    assert all(kd.stop_share == 0.0 for kd in d.keys.values())
    assert both <= 1.0, both        # turns: one at a time (the handoffs aside)
    assert all(abs(s - c) <= 3.0 for s, c in zip(shares, (30.0, 70.0))), shares


def test_groups_that_wait_for_the_gpu_take_turns():
    shares, both, d, changes, cut = pair((50.0, 50.0), waited=(0.3, 0.3), busy=(14.0, 14.0))
    assert changes == [] and both <= 1.0, both
