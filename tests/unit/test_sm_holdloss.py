"""The hold-loss meter (hami_bpf.sm.holdloss) on its own: free stretches,
samples, the share given back, and the samples it refuses to take."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hami_bpf.sm import holdloss
from hami_bpf.sm.holdloss import FREE_S, FREE_SETTLE_S, LOSS_FIRST_S, HoldLoss, Phase

DT = 0.01


class Loop:
    """A group paced at 50% in 0.2 s slices (held, then running), launching
    `held_rate` per second of running while paced and `free_rate` while the
    meter lets it run free."""

    def __init__(self, held_rate: float, free_rate: float):
        self.held_rate, self.free_rate = held_rate, free_rate
        self.t = self.run_s = self.launches = 0.0
        self.meter = HoldLoss(0.0, 0, 0.0)

    def go(self, seconds: float, *, idle: bool = False, hold_in_stretch: bool = False,
           stretch_s: float = FREE_S) -> list:
        samples = []
        for _ in range(round(seconds / DT)):
            self.t += DT
            free = self.meter.free
            held = not free and int(self.t / 0.2) % 2 == 1
            if free and hold_in_stretch and self.t - self.meter.since > FREE_SETTLE_S:
                held = True
            if not held and not idle:
                self.run_s += DT
                self.launches += DT * (self.free_rate if free else self.held_rate)
            will_hold = not held and int((self.t + DT) / 0.2) % 2 == 1
            s = self.meter.step(self.t, int(self.launches), self.run_s, active=not idle,
                                held=held, will_hold=will_hold, stretch_s=stretch_s)
            if s is not None:
                samples.append(s)
        return samples


@given(free=st.floats(5_000, 100_000), loss=st.floats(-0.4, 0.45))
@settings(max_examples=30, deadline=None)
def test_a_sample_is_what_the_paced_rate_lacks_of_the_free_one(free, loss):
    lp = Loop(free * (1 - loss), free)
    samples = lp.go(20.0)
    assert len(samples) >= 3
    for s in samples:
        assert s.loss == pytest.approx(loss, abs=0.01)
    share = lp.meter.share(0.25)
    assert 0.0 <= share <= 0.25
    assert share == pytest.approx(min(max(loss - holdloss.NOISE, 0.0), 0.25), abs=0.01)


def test_the_first_stretch_comes_after_a_second_of_pacing_and_lasts_free_s():
    lp = Loop(8000, 10000)
    lp.go(LOSS_FIRST_S - 0.05)
    assert not lp.meter.free
    lp.go(0.5)
    assert lp.meter.free
    start = lp.meter.since
    while lp.meter.free:
        lp.go(DT)
    assert lp.t - start == pytest.approx(FREE_S, abs=2 * DT)


def test_the_median_resists_one_odd_sample():
    lp = Loop(8000, 10000)
    lp.go(12.0)
    lp.meter.samples.append(holdloss.Sample(5000, 10000, 0.45))
    assert lp.meter.share(0.5) == pytest.approx(0.2 - holdloss.NOISE, abs=0.01)


def test_a_phase_change_between_the_rates_is_not_a_sample():
    lp = Loop(3000, 10000)          # 70% "loss": a warm-up against a steady state
    assert lp.go(20.0) == [] and lp.meter.share(0.25) == 0.0


def test_an_idle_group_is_not_measured():
    lp = Loop(8000, 10000)
    assert lp.go(20.0, idle=True) == [] and not lp.meter.free


def test_a_hold_in_a_free_stretch_drops_it():
    lp = Loop(8000, 10000)
    assert lp.go(20.0, hold_in_stretch=True) == []
    assert lp.meter.phase is Phase.PACED or lp.meter.free


def test_no_stretch_shorter_than_min_free_s():
    lp = Loop(8000, 10000)
    assert lp.go(20.0, stretch_s=holdloss.MIN_FREE_S - 0.01) == [] and not lp.meter.free


def test_counters_that_start_over_start_the_count_over():
    lp = Loop(8000, 10000)
    lp.go(0.9)
    lp.launches = 0.0
    assert lp.go(0.2) == [] and lp.meter.mark[0] <= 200
