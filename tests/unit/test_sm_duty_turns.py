"""Duty pacing of several groups on one device: their turns do not overlap."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from hami_bpf.sm import duty
from hami_bpf.sm.duty import Ask, Observation, Use
from smexpect import allowed


def DutyPacer(**kw) -> duty.DutyPacer:
    """Turns and what is given back for being held, without free samples
    (their tests: test_sm_progress.py)."""
    kw.setdefault("sample_share", 0.0)
    return duty.DutyPacer(**kw)

DT = 0.002


def simulate(caps: dict[tuple[int, int], float], seconds: float, idle: set[int] = frozenset(),
             waited: float | dict = 0.9, step_s: dict | None = None, pacer=None,
             releases: list | None = None):
    """Groups that are always active, spending `waited` of their running
    time inside synchronize calls (0: their launching thread sets their
    pace; a dict: per key). Without `step_s` each stops at once when asked;
    with it, a key synchronizes every step_s[key] seconds of running and
    stops only at such a return (or, asked to stop at a launch, at once).
    Returns (running share per group, seconds two groups of one device ran
    at once, longest hold); each release's (group, hold) goes to `releases`."""
    p = pacer or DutyPacer()
    sync_s = {k: 0.0 for k in caps}
    t = 0.0
    c = {k: 0 for k in caps}
    syncs = {k: 0 for k in caps}
    into_step = {k: 0.0 for k in caps}
    asked: dict[tuple[int, int], Ask] = {}
    held: dict[int, float] = {}
    ran = {k: 0.0 for k in caps}
    overlap = 0.0
    longest = 0.0
    for _ in range(int(seconds / DT)):
        t += DT
        running = [k for k in caps if k[0] not in held and k[0] not in idle]
        for k in running:
            c[k] += 1
            ran[k] += DT
            sync_s[k] += DT * (waited[k] if isinstance(waited, dict) else waited)
            if step_s is None:
                syncs[k] = c[k]
                continue
            into_step[k] += DT
            returned = into_step[k] >= step_s[k] - 1e-9
            if returned:
                into_step[k] = 0.0
                syncs[k] += 1
            if asked.get(k) is Ask.LAUNCH or asked.get(k) is Ask.SYNC and returned:
                held[k[0]] = t
        if len({k[1] for k in running}) < len(running):
            overlap += DT
        # as the controller says it: a device another group launched on lately
        shared = frozenset(k for k in caps if any(o[1] == k[1] and o != k and o[0] not in idle
                                                  for o in caps))
        d = p.step(Observation(t, caps, {k: Use(c[k], syncs[k], launches=c[k], sync_s=sync_s[k])
                                         for k in caps}, dict(held), shared=shared))
        for g in d.release:
            if releases is not None:
                releases.append((g, t - held[g]))
            longest = max(longest, t - held.pop(g))
        for k, kd in d.keys.items():
            asked[k] = kd.ask
            if step_s is None and kd.ask is not Ask.NONE and k[0] not in held:
                held[k[0]] = t
    return {k: 100 * v / t for k, v in ran.items()}, overlap, longest


def test_two_groups_30_70_alternate_at_their_caps():
    share, overlap, longest = simulate({(1, 0): 30, (2, 0): 70}, 20)
    assert abs(share[(1, 0)] - 30) <= 3 and abs(share[(2, 0)] - 70) <= 3, share
    # Only the first second, while neither is paced yet, runs side by side.
    assert overlap <= duty.SYNC_WINDOW_S + 0.2, overlap
    assert longest <= duty.MAX_HOLD_S + 2 * DT


def test_two_host_paced_groups_30_70_take_longer_turns_at_their_caps():
    share, overlap, longest = simulate({(1, 0): 30, (2, 0): 70}, 20, waited=0.2)
    assert abs(share[(1, 0)] - 30) <= 3 and abs(share[(2, 0)] - 70) <= 3, share
    assert overlap <= duty.SYNC_WINDOW_S + 0.2, overlap
    # the group at 30 owes 7/3 s per second run: held for HOST_RUN_S x 7/3 at a time
    assert duty.MAX_HOLD_S < longest <= 2 * duty.HOST_QUANTUM_MAX_S + 2 * DT, longest


@pytest.mark.parametrize("turn_run_s", [0.4, 0.6])
def test_host_paced_groups_taking_turns_run_turn_run_s_between_holds(turn_run_s):
    # every turn hands the GPU over: with longer runs between holds the
    # host-paced group at 70 (beside one that waits for the GPU) is held
    # less often, each hold within its raised bound, and both keep their
    # caps and still take turns
    caps = {(1, 0): 30, (2, 0): 70}
    waited = {(1, 0): 0.9, (2, 0): 0.2}
    counts = {}
    for run_s in (duty.HOST_RUN_S, turn_run_s):
        rel: list = []
        p = DutyPacer(turn_run_s=run_s)
        share, overlap, longest = simulate(caps, 20, waited=waited, pacer=p, releases=rel)
        assert abs(share[(1, 0)] - 30) <= 3 and abs(share[(2, 0)] - 70) <= 3, (run_s, share)
        assert overlap <= duty.SYNC_WINDOW_S + 0.2, (run_s, overlap)
        assert longest <= max(2 * duty.HOST_QUANTUM_MAX_S, run_s + 2 * duty.FORCE_AFTER_S) + 2 * DT
        counts[run_s] = sum(1 for g, _h in rel if g == 2)
    assert counts[turn_run_s] < 0.8 * counts[duty.HOST_RUN_S], counts


def test_turn_run_s_is_never_under_host_run_s():
    assert DutyPacer(turn_run_s=0.1).turn_run_s == duty.HOST_RUN_S
    assert DutyPacer(host_run_s=0.0, turn_run_s=0.6).turn_run_s == 0.0


def test_two_launch_bound_groups_30_70_on_one_device_are_given_nothing_back():
    # What being held costs a launch-bound loop is given back only from time
    # no other group wants: here each runs its cap.
    share, overlap, longest = simulate({(1, 0): 30, (2, 0): 70}, 20, waited=0.0)
    assert abs(share[(1, 0)] - 30) <= 3 and abs(share[(2, 0)] - 70) <= 3, share
    assert duty.MAX_HOLD_S < longest <= 2 * duty.HOST_QUANTUM_MAX_S + 2 * DT, longest


@pytest.mark.parametrize("cnn_cap,decode_cap", [(30, 70), (50, 50)])
def test_a_training_step_and_a_decode_loop_take_turns_at_their_own_synchronizes(cnn_cap, decode_cap):
    # A CNN training step (30 ms, a fifth of it waiting in its .item()) and
    # a launch-bound decode loop (a token every 10 ms), each stopping only
    # when it next synchronizes: their turns still do not overlap past the
    # first second, and each runs its cap's share.
    cnn, decode = (1, 0), (2, 0)
    share, overlap, longest = simulate({cnn: cnn_cap, decode: decode_cap}, 20,
                                       waited={cnn: 0.2, decode: 0.0},
                                       step_s={cnn: 0.03, decode: 0.01})
    assert abs(share[cnn] - cnn_cap) <= 3 and abs(share[decode] - decode_cap) <= 3, share
    assert overlap <= duty.SYNC_WINDOW_S + 0.2, overlap
    assert longest <= 2 * duty.HOST_QUANTUM_MAX_S + 2 * DT, longest


@pytest.mark.parametrize("train_cap,prefill_cap", [(30, 70), (50, 50), (70, 30)])
def test_a_loop_that_never_synchronizes_takes_turns_beside_one_paced_by_time(train_cap, prefill_cap):
    # A training loop that never reads its loss back (alone, its launch
    # budget paces it) next to an LLM prefill that synchronizes every 30 ms:
    # beside a group paced by time it is paced by time too, stopped at its
    # launches, and the two take turns at their caps instead of time-slicing.
    train, prefill = (1, 0), (2, 0)
    share, overlap, longest = simulate({train: train_cap, prefill: prefill_cap}, 20,
                                       waited={train: 0.0, prefill: 0.2},
                                       step_s={train: math.inf, prefill: 0.03})
    assert abs(share[train] - train_cap) <= 3 and abs(share[prefill] - prefill_cap) <= 3, share
    # Side by side only until the prefill's rate is known, and one step after.
    assert overlap <= duty.SYNC_WINDOW_S + 0.2, overlap
    assert longest <= 2 * duty.HOST_QUANTUM_MAX_S + 2 * DT, longest


class BesideLoad:
    """A training loop and a decode loop capped at 50, stepped every 5 ms:
    each launches every step; the decode loop synchronizes every step it
    runs, the training loop only where told."""

    def __init__(self, train: tuple[int, int], decode: tuple[int, int], probe_s: float = 0.0):
        self.p, self.train, self.decode, self.probe_s = DutyPacer(), train, decode, probe_s
        self.t, self.launches, self.syncs, self.train_syncs, self.decode_at = 0.0, 0, 0, 0, 0

    def step(self, train_syncs: bool = False, decode_runs: bool = True) -> duty.Decision:
        self.t += 0.005
        self.launches += 10
        self.train_syncs += train_syncs
        if decode_runs:
            self.syncs += 1
            self.decode_at = self.launches
        return self.p.step(Observation(self.t, {self.train: 50, self.decode: 50}, {
            self.train: Use(self.launches, self.train_syncs, launches=self.launches),
            self.decode: Use(self.decode_at, self.syncs, launches=self.decode_at)}, {},
            probe_s=self.probe_s))


def test_a_loop_that_never_synchronizes_is_left_to_its_budget_without_a_paced_neighbour():
    # On another device than the paced group, and once that group is gone,
    # it is the launch budget's again (its queue is what a hold cannot drain).
    run = BesideLoad(train=(1, 0), decode=(2, 1))
    for _ in range(1000):
        d = run.step()
    assert d.keys[run.decode].mode is duty.Mode.DUTY
    assert d.keys[run.train].mode is duty.Mode.BUDGET and not d.keys[run.train].beside
    # The same two on one device: paced by time beside it, asked to stop at
    # a launch, and given no probe or stop time (its waits are in its
    # launches; the time would be the neighbour's).
    run = BesideLoad(train=(1, 0), decode=(2, 0), probe_s=2e-6)
    train = run.train
    for _ in range(1000):
        d = run.step()
        assert d.keys[train].ask is not Ask.SYNC
    assert d.keys[train].mode is duty.Mode.DUTY and d.keys[train].beside
    assert d.keys[train].probe_share == 0.0 < d.keys[run.decode].probe_share
    assert d.keys[train].stop_share == 0.0
    # The paced group goes idle: within BESIDE_S and its rate's window the
    # loop is the budget's again, at once and for good (no see-saw stay).
    changes = []
    for _ in range(int((duty.BESIDE_S + duty.RATE_WALL_S) / 0.005)):
        d = run.step(decode_runs=False)
        changes += [c for c in d.mode_changes if c[0] == train]
    assert changes == [(train, duty.Mode.BUDGET)], changes
    assert not d.keys[train].beside


def test_a_paced_loop_that_stops_synchronizing_beside_another_says_why_it_is_still_paced():
    # A training loop that read its loss at first (paced by its own
    # synchronizes) and then stops reading it, next to a decode loop: it
    # stays paced by time, now beside the decode loop, and says so.
    run = BesideLoad(train=(1, 0), decode=(2, 0))
    said = []
    for i in range(2000):
        d = run.step(train_syncs=i < 600)
        said += [(c[1], d.keys[run.train].beside) for c in d.mode_changes if c[0] == run.train]
    assert said == [(duty.Mode.DUTY, False), (duty.Mode.DUTY, True)], said


def test_a_launch_bound_group_alone_on_its_device_is_given_back_its_stop_cost():
    share, _overlap, _ = simulate({(1, 0): 30, (2, 1): 70}, 20, waited=0.0)
    assert abs(share[(1, 0)] - allowed(30)) <= 3 and abs(share[(2, 1)] - allowed(70)) <= 3, share


def test_an_idle_neighbour_does_not_hold_a_group_back():
    share, _overlap, _ = simulate({(1, 0): 40, (2, 0): 40}, 10, idle={2})
    assert abs(share[(1, 0)] - 40) <= 3, share


def test_groups_on_different_devices_run_at_once():
    share, overlap, _ = simulate({(1, 0): 50, (2, 1): 50}, 10)
    assert overlap == 0.0
    assert all(abs(v - 50) <= 3 for v in share.values()), share


@settings(max_examples=40, deadline=None)
@given(a=st.integers(10, 90), b=st.integers(10, 90))
def test_each_of_two_groups_gets_at_least_its_cap_less_a_little_when_they_fit(a, b):
    # Caps that add to 100 or less fit the device; each runs at its cap.
    if a + b > 100:
        b = 100 - a
    share, _overlap, longest = simulate({(1, 0): a, (2, 0): b}, 12)
    assert share[(1, 0)] >= a - 4 and share[(2, 0)] >= b - 4, share
    assert longest <= duty.MAX_HOLD_S + 2 * DT
