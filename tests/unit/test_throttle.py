"""The pure SM-budget controller, driven with synthetic time and consumption."""
import pytest
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


def simulate_queued_gpu(cap, seconds=8.0, gpu_rate=1000.0, queue_s=1.1, sync_every=0.25, dt=0.01):
    """A host that launches as fast as the launch queue allows (queue_s of GPU
    work) and synchronizes every sync_every seconds of enqueueing, like
    bench/gpu/sm_workload.py; the GPU drains at gpu_rate. Returns the GPU's
    completion rate over the last 3 s."""
    b = Budget(cap=cap)
    t, launched, done = 0.0, 0.0, 0.0
    granted = tick(b, now=t, consumed=0)
    phase_start, syncing, sync_target = 0.0, False, 0.0
    completed_mark = None
    done_at = []
    while t < seconds:
        t += dt
        done = min(launched, done + gpu_rate * dt)
        done_at.append((t, done))
        if syncing:
            if done >= sync_target:
                syncing, phase_start = False, t
                completed_mark = sync_target
        else:
            room_queue = max(0.0, done + gpu_rate * queue_s - launched)
            room_budget = max(0.0, granted - launched)
            launched += min(room_queue, room_budget, gpu_rate * 50 * dt)
            if t - phase_start >= sync_every:
                syncing, sync_target = True, launched
        granted = tick(b, now=t, consumed=int(launched),
                       completed=None if completed_mark is None else int(completed_mark))
    t0, d0 = next((tt, d) for tt, d in done_at if tt >= seconds - 3.0)
    return (done - d0) / (t - t0) / gpu_rate, b


@pytest.mark.parametrize("cap", [25, 50, 75])
def test_caps_a_deep_launch_queue_by_its_completions(cap):
    achieved, b = simulate_queued_gpu(cap)
    assert b.by_completion
    assert abs(achieved * 100 - cap) <= 5, (achieved, b)


def test_a_tiny_rate_still_grants_over_time():
    # Rounding each tick's grant to an integer once granted nothing at a few
    # units per second, and a held TP=2 job never resumed (H200 x2).
    b = Budget(cap=10)
    run(b, lambda: 40, LEARN_S + 0.5)
    assert not b.learning and b.rate < 5
    over = b.granted + 3                 # a launch overshot the budget: held
    t = b.last_t
    for _ in range(200):                 # 10 s of 50 ms ticks, nothing launched
        t += 0.05
        granted = tick(b, now=t, consumed=over)
    assert granted > over
