"""hami_bpf.heartbeat: the controller's pulse and the pace of memory denials."""
from __future__ import annotations

import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from hami_bpf.heartbeat import DenyPacer, Heartbeat


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_it_beats_while_the_loop_makes_progress_however_long_a_step_takes():
    clock, beats = Clock(), []
    h = Heartbeat(lambda: beats.append(clock.t), stall_s=30, clock=clock)
    for _ in range(100):          # a burst of work: 25 s without a loop tick
        clock.t += 0.25
        assert h.tick()
    assert len(beats) == 100 and not h.stalled


def test_a_wedged_loop_stops_the_heartbeat_and_progress_resumes_it():
    clock, beats = Clock(), []
    h = Heartbeat(lambda: beats.append(clock.t), stall_s=30, clock=clock)
    clock.t += 31
    assert not h.tick() and h.stalled and beats == []
    h.progress()
    assert h.tick() and not h.stalled and beats == [clock.t]


def test_a_failing_beat_is_counted_and_retried():
    calls = []

    def beat():
        calls.append(1)
        if len(calls) == 1:
            raise OSError("map update failed")

    h = Heartbeat(beat)
    assert not h.tick() and h.errors == 1
    assert h.tick() and len(calls) == 2


def test_the_thread_beats_until_stopped_and_never_after():
    beats = []
    lock = threading.Lock()

    def beat():
        with lock:
            beats.append(time.monotonic())

    h = Heartbeat(beat, every_s=0.01)
    h.start()
    deadline = time.monotonic() + 30
    while len(beats) < 5 and time.monotonic() < deadline:
        h.progress()
        time.sleep(0.01)
    h.stop()
    with lock:
        n = len(beats)
    time.sleep(0.05)
    assert n >= 5 and len(beats) == n


def test_a_few_denials_a_second_are_answered_at_once():
    p = DenyPacer(free=8)
    for i in range(8):
        assert p.delay(1, 10.0 + i * 0.01) == 0.0
        p.answered(1, 10.0 + i * 0.01)
    assert p.delay(1, 10.1) > 0
    assert p.delay(2, 10.1) == 0.0            # per process
    assert p.delay(1, 11.2) == 0.0            # a second later the window is empty
    p.forget(1)
    assert len(p) == 0


@given(st.lists(st.floats(0, 0.999), min_size=1, max_size=60))
def test_the_wait_grows_with_the_retries_and_stays_bounded(offsets):
    p = DenyPacer(free=8, base_s=0.005, max_s=1.0)
    last = 0.0
    for t in sorted(offsets):
        d = p.delay(7, 50.0 + t)
        assert 0.0 <= d <= 1.0
        assert d >= last           # all in one window: more answers, never a shorter wait
        last = d
        p.answered(7, 50.0 + t)


def test_a_retry_loop_is_answered_a_bounded_number_of_times_per_second():
    """A process that retries at once after every answer: the pacer keeps it
    to a few dozen answers a second, not thousands."""
    p, t, answers = DenyPacer(), 0.0, 0
    while t < 10.0:
        t += p.delay(1, t) + 0.0007          # the answer itself takes 0.7 ms
        p.answered(1, t)
        answers += 1
    assert answers / 10.0 < 40
