"""The launch budget's check against the GPU (sm.guard): fail open."""
from __future__ import annotations

import math

from hypothesis import given, strategies as st

from hami_bpf.sm import guard
from hami_bpf.sm.guard import Guard, Reason


def run_window(g: Guard, *, cap: float, util: float | None, held: bool = True,
               shared: bool = False, start: float = 0.0, key=(1, 0)):
    """Tick a window's worth (50 ms ticks); the correction at its end."""
    out = run_paced(g, cap=cap, held=1.0 if held else 0.0, util=util, shared=shared,
                    start=start, key=key)
    return out[-1] if out else None


def run_paced(g: Guard, *, cap: float, held: float, util: float | None, windows: int = 1,
              shared: bool = False, start: float = 0.0, key=(1, 0)) -> list:
    """`windows` windows (50 ms ticks) of a group held `held` of its ticks
    (spread evenly) at `util`% busy: the corrections, in order."""
    out, t, i = [], start, 0
    while t <= start + windows * guard.WINDOW_S + 0.051:
        on = math.floor((i + 1) * held + 1e-9) > math.floor(i * held + 1e-9)
        c = g.observe(key, now=t, cap=cap, held=on, util=util, shared=shared)
        out += [c] if c else []
        t, i = t + 0.05, i + 1
    return out


def test_a_group_held_while_its_device_idles_is_loosened_at_once():
    c = run_window(Guard(), cap=50, util=2.0)
    assert c is not None and c.reason is Reason.HELD_WHILE_IDLE
    assert c.gain == guard.FAST_MAX        # 50 / 2 = 25, bounded
    assert c.source is guard.Source.DEVICE


def test_a_little_under_the_cap_is_raised_a_step():
    c = run_window(Guard(), cap=50, util=43.0)
    assert c is not None and c.reason is Reason.UNDER_CAP
    assert 1.0 < c.gain <= guard.TRIM_MAX


def test_over_the_cap_alone_is_lowered_but_not_next_to_others():
    g = Guard()
    # The first window reads NVML a second behind: the group still ran free.
    assert run_window(g, cap=50, util=70.0) is None
    c = run_window(g, cap=50, util=70.0, start=guard.WINDOW_S + 0.2)
    assert c is not None and c.reason is Reason.OVER_CAP and c.gain < 1.0
    g = Guard()
    run_window(g, cap=50, util=70.0, shared=True)
    assert run_window(g, cap=50, util=70.0, shared=True, start=guard.WINDOW_S + 0.2) is None


def test_the_first_window_after_the_budget_took_hold_is_not_lowered():
    # NVML reads a second behind: a loop whose budget just took hold at 25
    # reads as busy there as it ran free (48%). Raising there stays: a
    # starved group is no lag.
    assert run_window(Guard(), cap=25, util=48.0) is None
    c = run_window(Guard(), cap=50, util=2.0)
    assert c is not None and c.reason is Reason.HELD_WHILE_IDLE


def test_within_the_band_or_not_held_nothing_changes():
    assert run_window(Guard(), cap=50, util=52.0) is None
    assert run_window(Guard(), cap=50, util=5.0, held=False) is None


def test_the_target_is_the_caps_share_of_what_the_group_used_running_free():
    g = Guard()
    for i in range(10):
        g.reference((1, 0), 60.0, i * 0.5)  # a loop that kept the GPU 60% busy
    assert g.target((1, 0), 50) == 30.0
    assert Guard().target((1, 0), 50) == 50.0   # no reference: the whole device
    # 39% busy where 30% is allowed: not raised. Nor lowered: the reference
    # may come from another phase (a warm-up that kept the GPU 4% busy made a
    # decode loop 18% busy look over its cap of 50, and lowered it to 1%).
    assert run_window(g, cap=50, util=39.0) is None
    # Over the cap itself: lowered.
    c = run_window(g, cap=50, util=60.0, start=guard.WINDOW_S + 0.2)
    assert c is not None and c.reason is Reason.OVER_CAP and c.gain < 1.0


def test_a_reference_from_a_quiet_warm_up_never_lowers_a_group_under_its_cap():
    g = Guard()
    for i in range(10):
        g.reference((1, 0), 4.0, i * 0.5)   # learned while the model warmed up
    for k in range(20):
        c = run_window(g, cap=50, util=18.0, start=k * (guard.WINDOW_S + 0.1))
        assert c is None or c.gain >= 1.0, c


def test_with_no_reference_a_launch_bound_loop_is_judged_by_what_it_used_running():
    # Its budget learned in 0.9 s, before NVML caught up: no reference. A
    # loop 55% busy running free, paced to half its speed at cap 50, reads
    # 27% busy held half the time: paced right, not starved.
    assert run_paced(Guard(), cap=50, held=0.5, util=27.5, windows=3) == []
    # Paced to 30% of its speed, it is raised toward its cap, not past it.
    c, = run_paced(Guard(), cap=50, held=0.7, util=16.5)
    assert c.gain > 1.0 and math.isclose(c.target, 27.5)
    assert 0.3 * c.gain <= 0.5 + 1e-9
    # Held the whole window with the device idle: raised by a lot, as ever.
    c, = run_paced(Guard(), cap=50, held=1.0, util=1.0)
    assert c.reason is Reason.HELD_WHILE_IDLE and c.gain == guard.FAST_MAX


@given(cap=st.floats(10, 90), free=st.floats(guard.MIN_REF, 100), speed=st.floats(0.02, 1.0))
def test_a_launch_bound_loop_with_no_reference_is_raised_only_under_its_cap(cap, free, speed):
    # It runs at its free speed between holds: `speed` of it, `free`% busy
    # running. Never raised at or over its cap; raised well under it.
    out = run_paced(Guard(), cap=cap, held=1.0 - speed, util=free * speed, windows=2)
    if speed >= cap / 100:
        assert all(c.gain <= 1.0 for c in out)
    elif speed < cap / 100 - (guard.IDLE_PTS + 1) / free:
        assert out and all(c.gain > 1.0 for c in out)


def test_no_readings_no_correction():
    assert run_window(Guard(), cap=50, util=None) is None


@given(cap=st.floats(5, 95), util=st.floats(0, 100), shared=st.booleans())
def test_never_lowers_a_group_under_its_cap_and_never_raises_one_over_it(cap, util, shared):
    first = run_window(Guard(), cap=cap, util=util, shared=shared)
    assert first is None or first.gain > 1.0    # its first window is never lowered
    g = Guard()
    run_window(g, cap=cap, util=util, shared=shared, held=False)
    c = run_window(g, cap=cap, util=util, shared=shared, start=guard.WINDOW_S + 0.2)
    if c is None:
        return
    if c.gain < 1.0:
        assert util > cap and not shared
    else:
        assert util < c.target
    assert 1 / guard.LOWER_MAX <= c.gain <= guard.FAST_MAX   # one window: no streak


def test_idle_windows_in_a_row_compound_their_raises_up_to_a_bound():
    # A rate 10^4 too low (learned in another phase): x6, x36, then x64 a
    # window, where x6 a window took the whole run.
    g = Guard()
    step = guard.WINDOW_S + 0.1
    gains = [run_window(g, cap=30, util=1.0, start=k * step).gain for k in range(5)]
    assert gains == [guard.FAST_MAX] + [guard.STREAK_MAX] * 4
    g = Guard()
    gains = [run_window(g, cap=30, util=6.0, start=k * step).gain for k in range(4)]
    assert gains == [5.0, 25.0, guard.STREAK_MAX, guard.STREAK_MAX]
    # Windows that are not idle end the streak (the first may still hold an
    # idle reading): the next idle one starts over.
    run_window(g, cap=30, util=29.0, start=4 * step)
    assert run_window(g, cap=30, util=29.0, start=5 * step) is None
    assert run_window(g, cap=30, util=6.0, start=6 * step).gain <= guard.FAST_MAX


@given(utils=st.lists(st.floats(0, 100), min_size=1, max_size=30), cap=st.floats(5, 90))
def test_a_crawling_group_is_raised_by_a_lot_every_window(utils, cap):
    # Fail open: whatever came before, a window far under the cap while held
    # raises by at least FAST_MIN.
    g = Guard()
    t = 0.0
    for u in utils:
        run_window(g, cap=cap, util=u, start=t)
        t += guard.WINDOW_S + 0.1
    # Two windows: the first may still hold a reading from before.
    low = cap - guard.idle_pts(cap) - 1
    c1 = run_window(g, cap=cap, util=low, start=t)
    c2 = run_window(g, cap=cap, util=low, start=t + guard.WINDOW_S + 0.1)
    assert c2 is not None and c2.gain >= guard.FAST_MIN, (c1, c2)


def test_readings_of_the_first_second_are_not_the_groups():
    # NVML lags: a group that learned in 0.6 s read only what ran before it
    # (a neighbour's learning, 2% busy) and keeps no reference.
    g = Guard()
    for i in range(7):
        g.reference((1, 0), 2.0, 10.0 + i * 0.1)
    assert g.target((1, 0), 50) == 50.0
    for i in range(4):
        g.reference((1, 0), 90.0, 11.0 + i * 0.1)
    assert g.target((1, 0), 50) == 45.0


def test_a_group_that_learned_while_it_waited_is_raised_fast_when_starved():
    # Its reference read while it waited on a barrier (2% busy): held at
    # 0% busy, it is raised by the most a window allows, not a step.
    g = Guard()
    for i in range(30):
        g.reference((1, 0), 2.0, i * 0.5)
    c = run_window(g, cap=50, util=0.0, start=20.0)
    assert c is not None and c.reason is Reason.HELD_WHILE_IDLE and c.gain == guard.FAST_MAX


def free_windows(g: Guard, n: int, *, cap: float, util: float, launched: float,
                 full_rate: float, shared: bool = False, held: bool = False) -> list:
    """n windows (50 ms ticks) of a group launching `launched` units a
    second, its budget's full rate `full_rate`; each window's correction."""
    out, t, consumed = [], 0.0, 0.0
    for _ in range(n):
        c = None
        end = t + guard.WINDOW_S + 0.05
        while t < end:
            c = g.observe((1, 0), now=t, cap=cap, held=held, util=util, shared=shared,
                          consumed=int(consumed), full_rate=full_rate) or c
            t += 0.05
            consumed += launched * 0.05
        out.append(c)
    return out


def test_a_budget_that_no_longer_holds_its_group_over_its_cap_is_rebased_on_what_it_did():
    # A rate raised far past the group's pace holds it no more: 92% busy at
    # cap 50, launching 2e4 units/s where its full rate says 3.5e9.
    cs = free_windows(Guard(), 4, cap=50, util=92.0, launched=2e4, full_rate=3.5e9)
    # Not in the first window (NVML still reads it before its budget), and
    # a second such window in a row is the sign.
    assert cs[0] is None
    c = cs[1]
    assert c is not None and c.reason is Reason.RUNS_FREE and c.util == 92.0
    # Its full rate becomes what it did at 92%, scaled to the whole device.
    assert math.isclose(c.gain * 3.5e9, 2e4 * 100 / 92.0, rel_tol=0.06)
    # The window after a lowering still reads the group before it.
    assert cs[2] is None


def test_a_group_its_budget_does_not_hold_is_left_alone_under_its_cap_or_beside_others():
    assert free_windows(Guard(), 4, cap=50, util=54.0, launched=2e4, full_rate=3.5e9) == [None] * 4
    assert free_windows(Guard(), 4, cap=50, util=92.0, launched=2e4, full_rate=3.5e9,
                        shared=True) == [None] * 4
    # It launches more than its full rate allows at 92%: never raised here.
    assert free_windows(Guard(), 4, cap=50, util=92.0, launched=2e4, full_rate=1e4) == [None] * 4
    # Without what it launched, nothing to re-base on.
    assert free_windows(Guard(), 4, cap=50, util=92.0, launched=2e4, full_rate=None) == [None] * 4


@given(cap=st.floats(5, 95), util=st.floats(0, 100), launched=st.floats(1e3, 1e9),
       full_rate=st.floats(1, 1e10), shared=st.booleans())
def test_a_rebase_only_lowers_a_group_over_its_cap_to_its_caps_share_of_what_it_did(
        cap, util, launched, full_rate, shared):
    for c in free_windows(Guard(), 3, cap=cap, util=util, launched=launched,
                          full_rate=full_rate, shared=shared):
        if c is None:
            continue
        assert c.reason is Reason.RUNS_FREE and c.gain < 1.0
        assert util > cap + guard.TRIM_PTS and not shared
        # The rate its cap then allows: cap / util of what it launched.
        assert math.isclose(c.gain * full_rate * cap / 100, launched * cap / util, rel_tol=0.06)


def test_a_window_after_a_lowering_is_not_lowered_again():
    g = Guard()
    run_window(g, cap=50, util=70.0)
    step = guard.WINDOW_S + 0.2
    assert run_window(g, cap=50, util=70.0, start=step).reason is Reason.OVER_CAP
    # NVML reads a second behind: this window is of the group before.
    assert run_window(g, cap=50, util=70.0, start=2 * step) is None
    assert run_window(g, cap=50, util=70.0, start=3 * step).reason is Reason.OVER_CAP


def short_holds(g: Guard, *, cap: float, util: float, stops_per_s: int, windows: int = 2,
                key=(1, 0)) -> list:
    """Windows of 5 ms ticks in which the budget stops the group
    `stops_per_s` times a second for one tick each (held 0.5% a stop): the
    corrections, in order."""
    out, t, i, every = [], 0.0, 0, (200 // stops_per_s if stops_per_s else 0)
    while t <= windows * guard.WINDOW_S + 0.006:
        on = bool(every) and i % every == every - 1
        c = g.observe(key, now=t, cap=cap, held=on, util=util, shared=False,
                      hold_since=t if on else None)
        out += [c] if c else []
        t, i = t + 0.005, i + 1
    return out


def test_many_short_holds_of_a_group_whose_device_idles_loosen_it():
    """Held 5% of the time in 10 stops a second, the device at 35% where
    the cap allows 63: a launch-bound loop each stop slows for a while."""
    g = Guard()
    g.reference((1, 0), 64.0, 0.0)
    for t in (1.0, 1.1, 1.2):
        g.reference((1, 0), 64.0, t)
    c = short_holds(g, cap=99, util=35.0, stops_per_s=10)
    assert c and c[0].reason is Reason.HELD_WHILE_IDLE and c[0].gain > 1.5, c
    assert c[0].target > 60.0 and c[0].util == 35.0


def test_a_few_short_holds_say_nothing():
    g = Guard()
    for t in (0.0, 1.0, 1.1, 1.2):
        g.reference((1, 0), 64.0, t)
    assert short_holds(g, cap=99, util=35.0, stops_per_s=guard.MIN_STOPS - 1) == []


def test_a_hold_seen_over_several_ticks_is_one_stop():
    g = Guard()
    for t in (0.0, 1.0, 1.1, 1.2):
        g.reference((1, 0), 64.0, t)
    out = []
    for i in range(410):
        # one hold three 5 ms ticks long every 250 ms: 4 stops a second, 6% held
        t, on = i * 0.005, 20 <= i % 50 < 23
        c = g.observe((1, 0), now=t, cap=99, held=on, util=35.0, shared=False,
                      hold_since=(i // 50) * 0.25 + 0.1 if on else None)
        out += [c] if c else []
    assert out == []
