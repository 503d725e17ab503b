"""A budget-paced group's full rate checked in free samples (sm.resample):
raised where the group runs faster than it learned, never under that, the
sample repaid; and the controller carrying it out."""
from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from hami_bpf.sm import resample
from hami_bpf.sm.resample import Resampler
from hami_bpf.throttle import UNLIMITED, Budget
from test_sm_controller import DEV, Load, controller, events, groups, learn, step

KEY = (1, 0)
TICK = 0.05


def paced(r: Resampler, *, rate_in_sample, full_rate: float = 1000.0,
          held_share: float = 0.5, alone=lambda t: True, until: float = 30.0,
          host_bound: bool = False):
    """Tick a group held `held_share` of each second that launches at
    `rate_in_sample` (units/s, or a function of the time) whenever it runs
    free, its full rate changed by each sample's gain; (ticks run free,
    results)."""
    t, consumed, free_ticks, results = 0.0, 0, 0, []
    free = False
    speed = rate_in_sample if callable(rate_in_sample) else (lambda _t: rate_in_sample)
    while t < until:
        t = round(t + TICK, 6)
        if free:
            consumed += int(speed(t) * TICK)
        held = not free and (t % 1.0) < held_share
        free, res = r.step(KEY, now=t, consumed=consumed, held=held, alone=alone(t),
                           full_rate=full_rate, host_bound=host_bound)
        free_ticks += free
        if res is not None:
            results.append((t, res))
            full_rate *= res.gain
    return free_ticks, results


def test_a_group_its_budget_holds_runs_free_for_a_sample_every_so_often():
    free_ticks, results = paced(Resampler(), rate_in_sample=1000.0, until=25.0)
    # Two samples in 25 s of pacing, each SAMPLE_S long.
    assert len(results) == 2
    assert abs(free_ticks * TICK - 2 * resample.SAMPLE_S) <= 2 * TICK
    t0 = results[0][0]
    assert resample.SAMPLE_EVERY_S <= t0 <= resample.SAMPLE_EVERY_S + resample.SAMPLE_S + 2 * TICK


def test_a_group_its_launcher_paces_is_first_sampled_soon_after_it_learned():
    """Its CPU may have sped up since it learned: the first sample comes
    FIRST_HOST_S in, the next SAMPLE_EVERY_S after that one."""
    _free, results = paced(Resampler(), rate_in_sample=2000.0, until=16.0, host_bound=True)
    (t0, res0), (t1, _res1) = results
    assert resample.FIRST_HOST_S <= t0 <= resample.FIRST_HOST_S + resample.SAMPLE_S + 2 * TICK
    assert abs(res0.gain - 2.0) < 0.05
    assert t1 - t0 >= resample.SAMPLE_EVERY_S
    _free, results = paced(Resampler(), rate_in_sample=2000.0, until=9.0)
    assert results == []        # one the GPU paces: not before SAMPLE_EVERY_S


def test_a_host_bound_loop_read_slower_than_its_rate_is_sampled_again_soon():
    """A sample in a slow spell of its CPU (80% of the learned rate) says
    nothing of the fast spell after it: the next comes FIRST_HOST_S after,
    and raises the rate the loop now runs at. One its GPU paces waits out
    SAMPLE_EVERY_S whatever a sample read."""
    speed = lambda t: 800.0 if t < 5.0 else 2000.0    # noqa: E731
    _free, results = paced(Resampler(), rate_in_sample=speed, until=10.0, host_bound=True)
    (t0, res0), (t1, res1) = results
    assert res0.gain == 1.0 and res0.free_rate < 0.9 * res0.full_rate
    assert t1 - t0 <= resample.FIRST_HOST_S + resample.SAMPLE_S + 2 * TICK
    assert abs(res1.gain - 2.0) < 0.05
    _free, results = paced(Resampler(), rate_in_sample=lambda t: 800.0 if t < 12 else 2000.0,
                           until=21.0)
    (t0, _res0), = results
    assert t0 >= resample.SAMPLE_EVERY_S
    # Read at its rate, a host-bound loop waits SAMPLE_EVERY_S too.
    _free, results = paced(Resampler(), rate_in_sample=1000.0, until=14.0, host_bound=True)
    (t0, res0), = results
    assert res0.gain == 1.0 and t0 <= resample.FIRST_HOST_S + resample.SAMPLE_S + 2 * TICK


def test_a_sample_faster_than_the_learned_rate_raises_it_by_that_much():
    _free, results = paced(Resampler(), rate_in_sample=2000.0, until=12.0)
    (_t, res), = results
    assert res.changed and abs(res.gain - 2.0) < 0.05
    assert abs(res.free_rate - 2000.0) < 100.0 and res.full_rate == 1000.0


def test_a_sample_never_takes_the_rate_under_the_budgets_and_raises_it_a_bounded_factor():
    _free, results = paced(Resampler(), rate_in_sample=300.0, until=12.0)
    assert [res.gain for _t, res in results] == [1.0]
    _free, results = paced(Resampler(), rate_in_sample=1050.0, until=12.0)
    assert [res.changed for _t, res in results] == [False]    # within DEADBAND: kept
    _free, results = paced(Resampler(), rate_in_sample=50_000.0, until=12.0)
    assert [res.gain for _t, res in results] == [resample.GAIN_MAX]


def test_a_loop_that_slows_again_has_a_samples_raise_undone_down_to_its_budgets_rate():
    # Twice as fast for its first sample, then back at its learned speed, then
    # slower still: raised x2, back to x1, and there it stays.
    _free, results = paced(Resampler(), until=34.0,
                           rate_in_sample=lambda t: 2000.0 if t < 12 else (1000.0 if t < 23
                                                                          else 400.0))
    gains = [round(res.gain, 2) for _t, res in results]
    assert gains == [2.0, 0.5, 1.0]
    # A reading within DEADBAND of the raised rate keeps it.
    _free, results = paced(Resampler(), until=23.0,
                           rate_in_sample=lambda t: 2000.0 if t < 12 else 1900.0)
    assert [round(res.gain, 2) for _t, res in results] == [2.0, 1.0]


def test_no_sample_where_the_budget_barely_holds_or_beside_another_group():
    assert paced(Resampler(), rate_in_sample=2000.0, held_share=0.0) == (0, [])
    assert paced(Resampler(), rate_in_sample=2000.0, alone=lambda t: False) == (0, [])
    # A neighbour arriving during the sample ends it unmeasured.
    free_ticks, results = paced(Resampler(), rate_in_sample=2000.0, until=12.0,
                                alone=lambda t: not 10.5 <= t <= 11.0)
    assert results == [] and 0 < free_ticks * TICK < resample.SAMPLE_S


def test_the_guard_waits_out_a_sample_and_its_repaying():
    r = Resampler()
    paced(r, rate_in_sample=2000.0, until=10.4)
    assert r.sampling(KEY) and not r.guarded(KEY, 10.4)
    r.quiet(KEY, 20.0)
    r.forget(KEY)
    assert r.guarded(KEY, 10.4)


def test_a_settled_sample_is_repaid_by_its_budget_up_to_a_bound():
    b = Budget(cap=25.0, rate=250.0, full_rate=1000.0, credit=10_000.0, granted=10_000)
    # It launched 1,000 units past its credit, at twice its learned rate:
    # two seconds of the raised rate owed.
    owed = resample.settle(b, resample.Result(2000.0, 1000.0, 2.0), consumed=11_000)
    assert b.full_rate == 2000.0 and b.rate == 500.0
    assert b.credit == 10_000.0 and b.granted == 10_000 and owed == 2.0
    b = Budget(cap=25.0, rate=250.0, full_rate=1000.0, credit=0.0, granted=0)
    owed = resample.settle(b, resample.Result(900.0, 1000.0, 1.0), consumed=10_000)
    assert owed == resample.REPAY_MAX_S and b.full_rate == 1000.0
    assert b.credit == 10_000 - 250.0 * resample.REPAY_MAX_S


@settings(max_examples=60, deadline=None)
@given(rates=st.lists(st.floats(0.0, 1e5), min_size=1, max_size=6), held=st.floats(0.0, 1.0))
def test_samples_keep_the_rate_between_the_budgets_and_a_bounded_multiple(rates, held):
    """Whatever the loop's speed from one sample to the next, the full rate
    the samples leave is never under the budget's own (1000) nor over
    GAIN_MAX times it, and a sample that changes it sets it to what it saw
    (within those bounds)."""
    _free, results = paced(Resampler(), held_share=held, until=11.0 * len(rates) + 1,
                           rate_in_sample=lambda t: rates[min(int(t // 11), len(rates) - 1)])
    full = 1000.0
    for _t, res in results:
        full *= res.gain
        assert 1000.0 - 1e-6 <= full <= 1000.0 * resample.GAIN_MAX + 1e-6
        if res.changed:
            assert abs(full - min(max(res.free_rate, 1000.0), 4000.0)) <= 1e-6 * full


def test_the_controller_raises_a_budget_its_group_outran_and_holds_it_to_repay():
    """A loop that learned its rate while its CPU ran slow, then runs twice
    as fast: its budget held it at half its cap until a free sample."""
    c, gs, a = controller({"a": 25}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    b = c.budgets[a.key]
    learned = b.full_rate
    held_since, resampled, counters, free_grants = None, [], collections.Counter(), 0
    start, mark, held_at, sampled_at = t, None, [], None
    for n in range(int(19.0 / TICK)):
        t += TICK
        if mark is None and t - start >= 15.0:
            mark = (t, a.consumed)
        if held_since is None:
            a.run(t, cost=2000, sync=n % 4 == 0)      # twice what it learned at
        d = step(c, t, gs, [a], held={"a": held_since} if held_since is not None else {},
                 util={DEV: 30.0})
        if events(d, "resampled"):
            sampled_at = t
        resampled += events(d, "resampled")
        counters.update(d.counters)
        granted = d.grants[a.key].granted
        free_grants += granted >= a.consumed + UNLIMITED // 2
        if "a" in d.release:
            held_since = None
        if held_since is None and a.consumed >= granted:
            held_since = t
        held_at.append((t, held_since is not None))
    (ev,) = resampled
    assert ev["group"] == "a" and ev["device"] == DEV
    assert abs(ev["gain"] - 2.0) < 0.1 and ev["full_rate"] == round(learned, 1)
    assert counters["sm_corrections_free_sample"] == 1
    assert abs(b.full_rate - 2 * learned) < 0.1 * learned
    assert free_grants >= resample.SAMPLE_S / TICK - 1
    # The sample's work is owed: the group was held right after it.
    assert 0 < ev["owed_s"] <= resample.REPAY_MAX_S
    repaying = [h for tt, h in held_at if sampled_at < tt <= sampled_at + ev["owed_s"]]
    assert sum(repaying) >= 0.8 * len(repaying), repaying
    # Repaid, it does its cap's share of what it now runs at (2 x learned).
    done = (a.consumed - mark[1]) / (t - mark[0])
    assert abs(done - 0.25 * 2 * learned) <= 0.1 * 0.25 * 2 * learned, (done, learned)


def test_the_controller_samples_a_host_bound_budget_soon_after_it_learned():
    c, gs, a = controller({"a": 50}), groups(a=1), Load(1)
    t, _d = learn(c, gs, a, 100.0)
    b = c.budgets[a.key]
    b.probe_share = 0.05        # learned "host-bound: +5% for the probe"
    learned_at, held_since, sampled_at = t, None, None
    for n in range(int(8.0 / TICK)):
        t += TICK
        if held_since is None:
            a.run(t, cost=2000, sync=n % 4 == 0)
        d = step(c, t, gs, [a], held={"a": held_since} if held_since is not None else {},
                 util={DEV: 30.0})
        if events(d, "resampled") and sampled_at is None:
            sampled_at = t
        granted = d.grants[a.key].granted
        if "a" in d.release:
            held_since = None
        if held_since is None and a.consumed >= granted:
            held_since = t
    assert sampled_at is not None
    assert sampled_at - learned_at <= resample.FIRST_HOST_S + resample.SAMPLE_S + 0.5
