"""The pure SM-budget controller, driven with synthetic time and consumption."""
from hypothesis import given, settings, strategies as st

from hami_bpf.throttle import LEARN_S, TRIM_MAX, TRIM_MIN, Budget, shares, tick


def run(b, rate_fn, seconds, dt=0.05, util_fn=None, start=0.0, consumed=0):
    """Simulate a workload that launches at rate_fn(allowed) cost units/s."""
    t = start
    granted = tick(b, now=t, consumed=consumed)
    while t < start + seconds:
        t += dt
        want = rate_fn() * dt
        consumed += int(min(want, max(0, granted - consumed)) if not b.learning else want)
        granted = tick(b, now=t, consumed=consumed, util=util_fn(b) if util_fn else None)
    return consumed, granted


def test_learns_full_rate_then_caps_at_the_share():
    b = Budget(cap=30)
    # queue filling: a burst in the first 0.2 s that learning must ignore
    burst = iter([10_000_000] * 4)
    run(b, lambda: next(burst, 100_000), LEARN_S + 0.2)
    assert not b.learning
    assert abs(b.full_rate - 100_000) / 100_000 < 0.05
    assert abs(b.rate - 30_000) / 30_000 < 0.06


def test_open_loop_throughput_is_cap_times_full_rate():
    b = Budget(cap=50)
    run(b, lambda: 200_000, LEARN_S + 0.1)
    c0 = b.last_consumed
    c1, _ = run(b, lambda: 200_000, 4.0, start=b.last_t, consumed=c0)
    achieved = (c1 - c0) / 4.0
    assert abs(achieved / 200_000 - 0.5) < 0.03


def test_feedback_is_bounded_when_utilization_stays_high():
    # A drained queue keeps the GPU 100% busy for a while: the trim must not
    # run away (an unbounded integrator starved graph replays on the H200).
    b = Budget(cap=25)
    run(b, lambda: 50_000, LEARN_S + 0.1, util_fn=lambda b: 100.0)
    run(b, lambda: 50_000, 10.0, start=b.last_t, consumed=b.last_consumed,
        util_fn=lambda b: 100.0)
    assert b.trim >= TRIM_MIN
    assert b.rate >= TRIM_MIN * 0.25 * b.full_rate * 0.99


@settings(max_examples=200, deadline=None)
@given(cap=st.integers(1, 99), util=st.floats(0, 100))
def test_trim_stays_in_bounds(cap, util):
    b = Budget(cap=cap)
    run(b, lambda: 10_000, LEARN_S + 0.1, util_fn=lambda b: 60.0)
    run(b, lambda: 10_000, 3.0, start=b.last_t, consumed=b.last_consumed, util_fn=lambda b: util)
    assert TRIM_MIN <= b.trim <= TRIM_MAX


def test_idle_group_cannot_bank_a_long_burst():
    b = Budget(cap=50)
    run(b, lambda: 100_000, LEARN_S + 0.1)
    c = b.last_consumed
    _, granted = run(b, lambda: 0, 5.0, start=b.last_t, consumed=c)
    assert granted - c <= b.rate * 0.05 + 1


def test_shares_split_utilization_by_launch_cost():
    assert shares(80.0, {"a": 3.0, "b": 1.0}) == {"a": 60.0, "b": 20.0}
    assert shares(None, {"a": 1.0}) == {"a": None}
