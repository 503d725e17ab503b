"""A paced group's speed, measured against free samples (sm.progress), and
what the pacer does with it (sm.duty): directly, property-based, and over
recorded real workloads replayed with a host that runs slower when held."""
from __future__ import annotations

import collections
import dataclasses
import functools
import random
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from hami_bpf.sm import duty, progress, replay, workload
from hami_bpf.sm.controller import SmController
from hami_bpf.sm.progress import Phase, ProgressMeter

TICK = 0.01


class Loop:
    """A loop that launches `free_hz` a second when it runs free and
    `paced_hz` a second of running while paced, where paced means held
    `held_share` of every PERIOD (no hold while the meter samples)."""
    PERIOD = 0.2

    def __init__(self, paced_hz: float, free_hz: float, held_share: float = 0.5) -> None:
        self.paced_hz, self.free_hz, self.held_share = paced_hz, free_hz, held_share
        self.t = 0.0
        self.launches = 0.0
        self.held_s = 0.0
        self.free_s = 0.0       # time run free for the meter's samples

    def step(self, meter: ProgressMeter, measured: bool = True, **kw):
        self.t += TICK
        held = (not meter.sampling and measured
                and (self.t % self.PERIOD) < self.held_share * self.PERIOD)
        if held:
            self.held_s += TICK
        elif meter.sampling:
            self.launches += self.free_hz * TICK
            self.free_s += TICK
        else:
            self.launches += self.paced_hz * TICK
        return meter.step(self.t, int(self.launches), self.held_s, measured, held, **kw)

    def through_a_sample(self, meter: ProgressMeter) -> None:
        """Step until the meter has run a free sample and is confirming it."""
        while not meter.sampling:
            self.step(meter)
        while meter.sampling:
            self.step(meter)

    def run(self, meter: ProgressMeter, seconds: float, measured: bool = True) -> list:
        out = []
        for _ in range(round(seconds / TICK)):
            s = self.step(meter, measured)
            if s is not None:
                out.append(s)
        return out


# -- the meter ---------------------------------------------------------------------

def expected_speed(readings: list, prior: float) -> float:
    vals = readings[-progress.ESTIMATES:] + [prior] * progress.PRIOR_WEIGHT
    return min(max(sum(vals) / len(vals), progress.MIN_SPEED), progress.MAX_SPEED)


def test_the_speed_is_work_per_second_of_running_paced_against_free():
    m, loop = ProgressMeter(prior=0.85), Loop(paced_hz=8000, free_hz=10000)
    samples = loop.run(m, 12.0)
    assert samples, "no sample in 12 s"
    assert samples[0].ratio == pytest.approx(0.8, abs=0.02)
    assert samples[0].free_hz == pytest.approx(10000, rel=0.02)
    assert samples[0].paced_hz == pytest.approx(8000, rel=0.02)
    # the reading and the prior, one reading's worth
    assert m.speed == pytest.approx(expected_speed([s.ratio for s in samples], 0.85), abs=1e-9)
    assert m.dropped == 0
    while m.samples < progress.ESTIMATES + 2:
        loop.step(m)
    # readings that agree outvote the prior
    assert m.speed == pytest.approx(expected_speed([0.8] * progress.ESTIMATES, 0.85), abs=0.02)
    assert m.speed < 0.85


def test_a_loop_whose_rate_moves_by_a_fifth_around_a_sample_is_measured():
    # a launch-bound loop's own rate moves 10-30% from second to second:
    # a sample its paced rate moved around by less than SAME_PHASE counts
    m, loop = ProgressMeter(), Loop(paced_hz=9000, free_hz=10000)
    loop.through_a_sample(m)
    loop.paced_hz = 9000 * (1 + 0.8 * progress.SAME_PHASE)
    while m.samples + m.dropped == 0:
        loop.step(m)
    assert m.samples == 1 and m.dropped == 0


class NoisyLoop(Loop):
    """A Loop whose own rate, paced and free alike, moves each second by a
    factor drawn from [1 - amp, 1 + amp], as a launch-bound loop's does on
    the H200's VM."""

    def __init__(self, paced_hz: float, free_hz: float, amp: float, seed: int) -> None:
        super().__init__(paced_hz, free_hz)
        self.base = (paced_hz, free_hz)
        self.amp, self.rng, self.second = amp, random.Random(seed), -1

    def step(self, meter: ProgressMeter, measured: bool = True, **kw):
        if int(self.t) != self.second:
            self.second = int(self.t)
            f = 1 + self.rng.uniform(-self.amp, self.amp)
            self.paced_hz, self.free_hz = self.base[0] * f, self.base[1] * f
        return super().step(meter, measured, **kw)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), amp=st.floats(0.0, 0.2),
       speed=st.floats(progress.MIN_SPEED + 0.05, 1.0))
def test_a_loop_whose_own_rate_moves_each_second_is_measured_not_dropped(seed, amp, speed):
    # Its samples count (dropped, each would run free for nothing), and the
    # speed they give lies near what it does paced, with the first guess
    # as one reading.
    prior = 0.85
    m, loop = ProgressMeter(prior=prior), NoisyLoop(10000 * speed, 10000, amp, seed)
    loop.run(m, 120.0)
    assert m.samples >= 3 and m.dropped <= m.samples // 2, (m.samples, m.dropped)
    assert m.speed == pytest.approx(expected_speed([speed] * progress.ESTIMATES, prior),
                                    abs=0.1)


def test_a_new_phase_forgets_the_readings_and_is_sampled_soon():
    m, loop = ProgressMeter(prior=0.85), Loop(paced_hz=4000, free_hz=5000)
    while m.samples < 2:
        loop.step(m)
    assert m.speed == pytest.approx(expected_speed([0.8, 0.8], 0.85), abs=0.02)
    # a warm-up sampled, and now its timed loop, launching ten times as fast
    loop.paced_hz, loop.free_hz = 40000, 42000
    t0 = loop.t
    while m.phases == 0:
        loop.step(m)
    assert m.speed is None
    # within PHASE_CHECK_S of running (held half the time), and sampled
    # FIRST_RUN_S after that
    assert loop.t - t0 <= 2 * progress.PHASE_CHECK_S + 0.1
    t1 = loop.t
    while m.samples < 3:
        loop.step(m)
    assert loop.t - t1 <= 2 * progress.FIRST_RUN_S + progress.SAMPLE_S + 2 * (
        progress.FIRST_RUN_S + progress.PACED_SETTLE_S) + 0.1
    assert m.speed == pytest.approx(expected_speed([40000 / 42000], 0.85), abs=0.02)


def test_the_first_sample_comes_within_seconds_and_then_samples_take_their_share():
    m, loop = ProgressMeter(), Loop(paced_hz=9000, free_hz=10000)
    first = None
    while first is None and loop.t < 10:
        if loop.step(m) is not None:
            first = loop.t
    # FIRST_RUN_S of running, held half the time; the sample; as much running
    # after it, once settled
    due = 2 * progress.FIRST_RUN_S + progress.SAMPLE_S + 2 * (progress.FIRST_RUN_S
                                                              + progress.PACED_SETTLE_S)
    assert first is not None and first <= due + 0.1
    loop.free_s = 0.0
    start_held = loop.held_s
    loop.run(m, 600.0)
    ran = 600.0 - (loop.held_s - start_held)
    assert m.samples >= 5
    assert loop.free_s / ran == pytest.approx(progress.SAMPLE_SHARE, abs=0.03)


def test_a_loop_that_changes_phase_around_a_sample_is_not_measured():
    m, loop = ProgressMeter(), Loop(paced_hz=9000, free_hz=9000)
    loop.through_a_sample(m)
    loop.paced_hz = 4000        # after the sample, another phase
    assert loop.run(m, 6.0) == []
    assert m.dropped >= 1 and m.speed is None


def test_a_sample_held_by_another_rule_is_dropped():
    m, loop = ProgressMeter(), Loop(paced_hz=9000, free_hz=9000)
    while not m.sampling:
        loop.step(m)
    loop.t += TICK
    loop.held_s += TICK          # held: by the launch budget's turns, say
    m.step(loop.t, int(loop.launches), loop.held_s, True, True)
    assert m.phase is Phase.PACED and m.dropped == 1


def test_a_neighbour_ends_a_sample_and_the_measuring():
    m, loop = ProgressMeter(), Loop(paced_hz=9000, free_hz=9000)
    while not m.sampling:
        loop.step(m)
    loop.step(m, measured=False)
    assert m.phase is Phase.OFF and m.dropped == 1 and not m.sampling
    assert loop.run(m, 20.0, measured=False) == [] and m.phase is Phase.OFF


def test_a_loop_that_launches_rarely_is_never_measured():
    m, loop = ProgressMeter(), Loop(paced_hz=5, free_hz=5)
    assert loop.run(m, 60.0) == [] and m.speed is None and loop.free_s == 0.0


def test_a_share_of_zero_never_samples():
    m, loop = ProgressMeter(share=0.0), Loop(paced_hz=9000, free_hz=10000)
    assert loop.run(m, 60.0) == [] and loop.free_s == 0.0


def test_a_loop_that_does_more_paced_than_free_runs_its_caps_share():
    # a sample that reads over 1 counts as 1: never under its cap's share
    m, loop = ProgressMeter(), Loop(paced_hz=12000, free_hz=10000)
    seen = []
    while len(seen) < 3:
        s = loop.step(m)
        if s is not None:
            seen.append(s)
    assert [s.ratio for s in seen] == [pytest.approx(1.2, abs=0.03)] * 3
    assert [s.speed for s in seen] == [1.0, 1.0, 1.0] and m.speed == 1.0


def test_one_odd_sample_moves_the_speed_by_its_share_of_the_mean():
    m, loop = ProgressMeter(prior=0.8), Loop(paced_hz=8000, free_hz=10000)
    while m.samples < 2:
        loop.step(m)
    assert m.speed == pytest.approx(0.8, abs=0.02)
    loop.paced_hz = 9500            # one sample's worth of an odd moment
    while m.samples < 3:
        loop.step(m)
    weight = min(m.samples, progress.ESTIMATES) + progress.PRIOR_WEIGHT
    assert m.speed == pytest.approx(0.8 + (0.95 - 0.8) / weight, abs=0.02)


def test_readings_are_averaged_before_they_are_bounded(monkeypatch):
    # noise around a speed near 1 must not only ever pull it down
    monkeypatch.setattr(progress, "PRIOR_SPREAD", 0.0)
    m = ProgressMeter(prior=0.9)
    m._estimate(1.15, 9000.0)
    m._estimate(0.85, 9000.0)
    assert m.speed == pytest.approx((1.15 + 0.85 + 0.9) / 3)
    m._estimate(1.3, 9000.0)
    m._estimate(1.3, 9000.0)
    assert m.speed == progress.MAX_SPEED
    for _ in range(progress.ESTIMATES):
        m._estimate(0.3, 9000.0)
    assert m.speed == progress.MIN_SPEED


def test_noisy_readings_leave_the_speed_nearer_the_first_guess():
    # where the meter cannot tell, it errs open: readings that agree move
    # the speed all the way (the prior one reading's worth), readings as
    # far apart as a noisy loop's leave it near the first guess
    agree, noisy = ProgressMeter(prior=0.85), ProgressMeter(prior=0.85)
    for r in (1.0, 1.01, 0.99):
        agree._estimate(r, 9000.0)
    assert agree.speed == pytest.approx(expected_speed([1.0, 1.01, 0.99], 0.85), abs=1e-9)
    for r in (1.2, 0.85, 0.95):
        noisy._estimate(r, 9000.0)
    # as the same mean would with the prior one reading's worth: 0.9625
    assert noisy.speed < expected_speed([1.0] * 3, 0.85) - 0.03
    assert 0.85 < noisy.speed < 1.0


@settings(max_examples=40, deadline=None)
@given(paced=st.floats(20000, 100000), free=st.floats(20000, 100000),
       held=st.floats(0.1, 0.8))
def test_the_speed_stays_within_its_bounds_and_no_sample_runs_a_group_under_its_cap(
        paced, free, held):
    m, loop = ProgressMeter(), Loop(paced_hz=paced, free_hz=free, held_share=held)
    seen = []
    while m.samples + m.dropped < 2 and loop.t < 200:
        s = loop.step(m)
        if s is not None:
            seen.append(s)
            # fail open: a sample lets it run more, never less
            assert s.speed <= 1.0
    if m.speed is not None:
        assert progress.MIN_SPEED <= m.speed <= progress.MAX_SPEED
    for s in seen:
        if progress.MIN_RATIO <= paced / free <= progress.MAX_RATIO:
            assert s.ratio == pytest.approx(paced / free, rel=0.05)


# -- in the pacer and the controller ---------------------------------------------------

KEY = (0, 0)


def paced(p: duty.DutyPacer, cap: float, seconds: float):
    """A loop that loses nothing when held (a synchronize each TICK, 100
    launches each, none of its time inside them) paced by `p` at `cap`:
    (time, the pacer's decision, time held so far) after each step."""
    t, launches, syncs, held_since, held_s = 0.0, 0, 0, None, 0.0
    while t < seconds:
        t += TICK
        if held_since is None:
            launches += 100
            syncs += 1
        else:
            held_s += TICK
        d = p.step(duty.Observation(
            now=t, caps={KEY: cap}, use={KEY: duty.Use(launches, syncs, 0, launches, 0.0)},
            held={0: held_since} if held_since is not None else {}))
        yield t, d, held_s
        if 0 in d.release:
            held_since = None
        elif d.keys[KEY].ask is not duty.Ask.NONE and held_since is None:
            held_since = t


def test_a_sampling_group_is_not_held_and_repays_what_the_sample_ran_after_it():
    # A loop that loses nothing when held (`paced`): measured at speed 1,
    # it is held half the time at cap 50, its free samples included, once
    # what they ran over it is repaid.
    # (Nothing given back before it is measured: duty.HOST_STOP_SHARE's own tests.)
    p = duty.DutyPacer(host_stop_share=0.0)
    free_since, ran_free, asked_while_sampling = None, [], 0
    reserve_after_first = last_debt = owed_before = owed_before_first = 0.0
    for t, d, held_s in paced(p, 50.0, 240.0):
        k = d.keys[KEY]
        if k.sampling:
            if free_since is None:
                free_since, owed_before = t, max(last_debt, 0.0)
            asked_while_sampling += k.ask is not duty.Ask.NONE
        elif free_since is not None:
            ran_free.append(t - free_since)
            free_since = None
            if len(ran_free) == 1:
                reserve_after_first, owed_before_first = p.reserve(KEY), owed_before
        last_debt = k.debt
    assert len(ran_free) >= 4 and asked_while_sampling == 0
    assert ran_free[0] == pytest.approx(progress.SAMPLE_S, abs=2 * TICK)
    # what the sample ran owes as much as running paced would have, and
    # what it owed when it began is owed still
    assert reserve_after_first == pytest.approx(owed_before_first + progress.SAMPLE_S, abs=0.05)
    assert p.speed(KEY) == pytest.approx(1.0, abs=0.02)
    assert held_s / t == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("cap,length", [(50.0, progress.SAMPLE_S), (65.0, 0.6 / 0.35),
                                        (75.0, progress.SAMPLE_MAX_S)])
def test_a_sample_is_longer_where_its_cap_leaves_it_less_to_owe(cap, length):
    # What a sample runs over its cap's share is owed: 1.5 s up to cap 60, and
    # longer, to 2 s, as the cap rises, while it owes SAMPLE_OWES_S at most.
    assert progress.sample_s(cap) == pytest.approx(length)
    p = duty.DutyPacer(host_stop_share=0.0)
    free_since, ran_free = None, []
    for t, d, _held_s in paced(p, cap, 60.0):
        if d.keys[KEY].sampling:
            free_since = t if free_since is None else free_since
        elif free_since is not None:
            ran_free.append(t - free_since)
            free_since = None
    assert len(ran_free) >= 2
    assert all(r == pytest.approx(length, abs=2 * TICK) for r in ran_free)


@given(cap=st.floats(min_value=0.0, max_value=100.0))
def test_a_sample_owes_at_most_its_bound_unless_it_is_as_short_as_samples_are(cap):
    length = progress.sample_s(cap)
    assert progress.SAMPLE_S <= length <= progress.SAMPLE_MAX_S
    owed = length * (1.0 - min(cap, 99.0) / 100.0)
    assert owed <= progress.SAMPLE_OWES_S + 1e-9 or length == progress.SAMPLE_S
    assert length > progress.SAMPLE_SKIP_S     # something is measured


@pytest.mark.parametrize("cap", [10.0, 25.0, duty.SAMPLE_FROM_CAP, 50.0])
def test_caps_under_sample_from_cap_are_never_sampled_and_keep_the_first_guess(cap):
    # A launch-bound loop (no time inside synchronize calls): under
    # SAMPLE_FROM_CAP it never runs free, and runs cap / (1 - HOST_STOP_SHARE)
    # of the time; from there up it is sampled.
    p, sampled = duty.DutyPacer(), False
    for t, d, held_s in paced(p, cap, 60.0):
        sampled |= d.keys[KEY].sampling
    assert sampled == (cap >= duty.SAMPLE_FROM_CAP)
    if cap < duty.SAMPLE_FROM_CAP:
        assert p.speed(KEY) is None and p.reserve(KEY) == 0.0
        assert 1 - held_s / t == pytest.approx(cap / 100 / (1 - duty.HOST_STOP_SHARE), abs=0.02)
        # and the first guess is within 5 points for any speed it may have
        for speed in (progress.MIN_SPEED, progress.MAX_SPEED):
            assert abs(cap * (speed / (1 - duty.HOST_STOP_SHARE) - 1)) <= 5.0


def test_the_controller_says_what_a_sample_measured():
    from test_sm_controller import PLAIN, Load, events, groups, step
    c = SmController(dataclasses.replace(PLAIN, sample_share=progress.SAMPLE_SHARE), epoch=0.0)
    assert c.set_cap("a", 0, 50)
    gs, a = groups(a=1), Load(1)
    a.key = (1, 0)
    t, seen, counts = 100.0, [], collections.Counter()
    for _ in range(1500):
        t += 0.01
        a.run(t, cost=100, sync=True)
        d = step(c, t, gs, [a])
        seen += events(d, "speed")
        counts.update(d.counters)
    assert seen, "no sample measured in 15 s"
    e = seen[0]
    assert (e["group"], e["device"]) == ("a", 0)
    assert e["ratio"] == pytest.approx(1.0, abs=0.02)
    # the reading, and the first guess as one more
    assert e["speed"] == pytest.approx(expected_speed([e["ratio"]], 1 - duty.HOST_STOP_SHARE),
                                       abs=0.002)
    assert e["run_pct"] == pytest.approx(50.0 / e["speed"], abs=1.0)
    assert e["free_hz"] == pytest.approx(1000, rel=0.05)
    # the paced rate before the sample and after it, which agreed
    assert e["paced_hz"] == pytest.approx(e["after_hz"], rel=0.1)
    assert counts["sm_samples_measured"] == len(seen)
    # another phase: ten times the launches; its readings are forgotten, said once
    forgot = []
    for _ in range(300):
        t += 0.01
        a.run(t, cost=100, sync=True)
        a.launches += 90
        d = step(c, t, gs, [a])
        forgot += events(d, "speed_forgotten")
        counts.update(d.counters)
    assert len(forgot) == 1 and (forgot[0]["group"], forgot[0]["device"]) == ("a", 0)
    assert forgot[0]["paced_hz"] >= progress.NEW_PHASE * forgot[0]["was_hz"] * 0.99
    assert counts["sm_samples_forgotten"] == 1


# -- recorded loops, replayed with a host that runs slower when held ---------------------

TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"
REPEAT = 6          # the recorded timed loop (8 s) six times over: several samples
TOLERANCE_PTS = 5.0
FAIL_OPEN_S = 5


@functools.lru_cache(maxsize=None)
def _workload(name: str, repeat: int = REPEAT):
    rec = workload.repeat_loop(replay.load(TRACES / f"{name}.json.gz"), repeat)
    wl = replay.fit(rec)
    return rec, wl, replay.replay(wl)


@functools.lru_cache(maxsize=None)
def slowed(name: str, cap: int, speed: float | None, sample_share: float) -> replay.Report:
    rec, wl, base = _workload(name)
    cold = None if speed is None else replay.Cold(seconds=1.0, speed=speed)
    run = replay.replay_capped(wl, cap, horizon=wl.recorded_end * 100.0 / cap + 10.0, cold=cold,
                               pacer=duty.DutyPacer(sample_share=sample_share))
    return replay.compare(run, base, (rec.loop_start, rec.loop_end))


# (workload, what being held leaves of its speed, caps): the recorded decode
# loop as it was, and as slow as the H200's held decode loops ran (85%, and
# 75% where a cap leaves room for it); the train/eval loop, whose phases
# change every few seconds, as it was and at 85%; a sampled GPT-2 decode
# loop, which the pacer's constants were not set on, both ways
CASES = [("llm_decode", None, (25, 50, 75)), ("llm_decode", 0.85, (25, 50, 75)),
         ("llm_decode", 0.75, (25, 50)), ("phased", None, (25, 50, 75)),
         ("phased", 0.85, (25, 50, 75)), ("gpt2_decode", None, (25, 50, 75)),
         ("gpt2_decode", 0.85, (25, 50, 75))]


@pytest.mark.parametrize("name,speed,cap", [(n, s, c) for n, s, caps in CASES for c in caps])
def test_a_loop_slowed_by_its_holds_or_not_keeps_its_cap(name, speed, cap):
    if not (TRACES / f"{name}.json.gz").exists():
        pytest.skip(f"no recording {name}")
    rep = slowed(name, cap, speed, progress.SAMPLE_SHARE)
    print(rep.line())
    assert abs(100 * rep.loop_mean - cap) <= TOLERANCE_PTS, rep.line()
    assert rep.loop_below_longest_s <= FAIL_OPEN_S, rep.line()


# Loops the pacer's constants were not set on: an encoder serving batches
# (its GPU 35% busy: samples read over 1 there), a GPT-2 decode loop, a
# training loop fed by a DataLoader, and a server answering on three
# threads, each on its own stream (its GPU works on through a hold). Each
# keeps the fail-open floor, and where it misses its cap it errs open: never
# more than 5 points under.
UNSEEN = ("bert_infer", "gpt2_decode", "loader_train", "threaded_infer")


@pytest.mark.parametrize("name,speed,cap", [(n, s, c) for n in UNSEEN for s in (None, 0.85)
                                            for c in (25, 50, 75)])
def test_unseen_loops_keep_the_floor_and_err_open(name, speed, cap):
    if not (TRACES / f"{name}.json.gz").exists():
        pytest.skip(f"no recording {name}")
    rep = slowed(name, cap, speed, progress.SAMPLE_SHARE)
    print(rep.line())
    assert rep.loop_below_longest_s <= FAIL_OPEN_S, rep.line()
    assert 100 * rep.loop_mean >= cap - TOLERANCE_PTS, rep.line()


# A cap set on a running launch-bound loop, judged over its first half-minute
# from 5 s after it, as the GPU suite judges a run (bench/replay_sweep.py runs
# many more): the loop's own launch rate moves 10-30% from second to second,
# and readings must not be spent on that noise (each dropped sample runs free
# for nothing) nor lean on one high reading (it would run under the cap).
STRETCH_S = 30.0
STRETCHES = [(n, cap, offset, cost)
             for n in ("llm_decode", "bert_infer", "gpt2_decode", "loader_train")
             for cap in (50, 75) for offset in (7.0, 20.0) for cost in ("held", "cold")]
COSTS = {"held": replay.HELD_MEASURED, "cold": replay.COLD_MEASURED}


def _stretch(name: str, cap: int, offset: float, cost: str,
             seconds: float = STRETCH_S) -> replay.Report:
    rec, wl, base = _workload(name, 8)
    start = rec.loop_start + offset
    run = replay.replay_capped(wl, cap, horizon=start + seconds, cold=COSTS[cost],
                               start=start, pacer=duty.DutyPacer())
    return replay.compare(run, base, (start, start + seconds))


def _stretch_errors(seconds: float) -> list[float]:
    """Each of STRETCHES capped for `seconds`: its error against its cap
    (points), each one held to the fail-open floor."""
    if not all((TRACES / f"{n}.json.gz").exists() for n, *_ in STRETCHES):
        pytest.skip("recordings missing")
    errors = []
    for name, cap, offset, cost in STRETCHES:
        rep = _stretch(name, cap, offset, cost, seconds=seconds)
        assert rep.loop_below_longest_s <= FAIL_OPEN_S, (name, cap, offset, cost, rep.line())
        errors.append(100 * rep.loop_mean - cap)
    return errors


def test_a_cap_set_on_a_running_launch_bound_loop_settles_in_its_first_half_minute():
    errors = _stretch_errors(STRETCH_S)
    within = sum(abs(e) <= TOLERANCE_PTS for e in errors)
    # (a sample dropped at every 10% move of the loop's rate, and the median
    # of readings bounded first: 17 of 32 within, a mean of +4.8)
    assert within >= 0.65 * len(errors), sorted(round(e, 1) for e in errors)
    assert -1.0 <= sum(errors) / len(errors) <= 4.0, sorted(round(e, 1) for e in errors)


def test_a_short_cap_repays_most_of_its_samples_inside_it():
    # The same stretches, 15 s long (as bench/gpu/suite_ab.sh caps a
    # process): what a free sample runs over the cap's share is repaid over
    # the seconds after it, so a short sample leaves less of it unpaid when
    # the cap ends. (Samples of 2 s, measured over their last second: 9 of
    # 32 within, a mean of +6.9.)
    errors = _stretch_errors(15.0)
    within = sum(abs(e) <= TOLERANCE_PTS for e in errors)
    assert within >= 14, sorted(round(e, 1) for e in errors)
    assert 0.0 <= sum(errors) / len(errors) <= 6.0, sorted(round(e, 1) for e in errors)


@pytest.mark.parametrize("speed", (None, 0.75))
def test_without_samples_a_fixed_allowance_misses_the_cap_either_way(speed):
    # The same decode loop at cap 50 given back duty.HOST_STOP_SHARE
    # whatever its holds cost: over its cap when they cost nothing, under it
    # when they cost 25%. Measured, it keeps its cap in both (above).
    if not (TRACES / "llm_decode.json.gz").exists():
        pytest.skip("no recording llm_decode")
    fixed = slowed("llm_decode", 50, speed, 0.0)
    print(fixed.line())
    assert abs(100 * fixed.loop_mean - 50) > TOLERANCE_PTS, fixed.line()


def test_a_measured_speed_is_given_while_alone_and_said_when_a_neighbour_takes_it_away():
    p = duty.DutyPacer(host_stop_share=0.0)
    t, launches, syncs, held_since, sampling = 0.0, 0, 0, None, False
    given, measured, runs = [], [], []

    def tick(shared: bool) -> None:
        nonlocal t, launches, syncs, held_since, sampling
        t += TICK
        if held_since is None:
            launches += 100 if sampling else 80    # paced, it does 80% per second of running
            syncs += 1
        d = p.step(duty.Observation(
            now=t, caps={KEY: 50.0}, use={KEY: duty.Use(launches, syncs, 0, launches, 0.0)},
            held={0: held_since} if held_since is not None else {},
            shared=frozenset({KEY}) if shared else frozenset()))
        k = d.keys[KEY]
        sampling = k.sampling
        given.extend(share for _key, share in d.given_back)
        measured.extend(s for _key, s in d.measured)
        runs.append(k.stop_share)
        if 0 in d.release:
            held_since = None
        elif k.ask is not duty.Ask.NONE and held_since is None:
            held_since = t
    while not measured:
        tick(False)
    assert measured[0].ratio == pytest.approx(0.8, abs=0.03)
    # nothing given back before a sample: the prior is a speed of 1
    share = 1 - expected_speed([measured[0].ratio], 1.0)
    assert runs[-1] == pytest.approx(share, abs=1e-9) and share > 0.05 and given == []
    for _ in range(100):
        tick(True)      # another group launches on the device: its time, not ours
    assert given == [0.0] and runs[-1] == 0.0
    for _ in range(100):
        tick(False)
    assert len(given) == 2 and given[1] == pytest.approx(share, abs=1e-9)
