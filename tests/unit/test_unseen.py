"""hami_bpf.unseen: device memory the driver counts and no probed call charged."""
from hypothesis import given, settings
from hypothesis import strategies as st

from hami_bpf.unseen import CONFIRM_READS, UNSEEN_MIN, UnseenMemory

MiB = 1 << 20


def step(u, held, charged, reserve=0, dev=0):
    return u.step({dev: held}, lambda pid, d: charged.get(pid), lambda pid, d: reserve)


def test_an_increase_counts_once_two_readings_show_it_and_the_lesser_is_taken():
    u = UnseenMemory()
    assert step(u, {7: 100 * MiB}, {7: 20 * MiB}) == []          # one reading: not yet
    assert u.bytes(7, 0) == 0
    (ch,) = step(u, {7: 90 * MiB}, {7: 20 * MiB})
    assert (ch.pid, ch.device, ch.before, ch.after, ch.held, ch.charged) == \
        (7, 0, 0, 70 * MiB, 90 * MiB, 20 * MiB)
    assert u.bytes(7, 0) == 70 * MiB
    assert CONFIRM_READS == 2


def test_a_decrease_counts_at_once_and_a_process_no_longer_listed_holds_nothing():
    u = UnseenMemory()
    for _ in range(2):
        step(u, {7: 100 * MiB}, {7: 0})
    (ch,) = step(u, {7: 40 * MiB}, {7: 0})
    assert ch.after == 40 * MiB
    (ch,) = step(u, {}, {7: 0})
    assert (ch.before, ch.after) == (40 * MiB, 0) and u.bytes(7, 0) == 0


def test_charges_and_the_context_reserve_are_not_unseen_nor_is_rounding():
    u = UnseenMemory()
    for _ in range(3):
        assert step(u, {7: 564 * MiB}, {7: 36 * MiB}, reserve=528 * MiB) == []
        assert step(u, {7: 36 * MiB + UNSEEN_MIN - 1}, {7: 36 * MiB}) == []
    assert u.unseen == {}


def test_only_registered_processes_count_and_a_process_that_left_is_forgotten():
    u = UnseenMemory()
    readings = {0: {7: 100 * MiB, 8: 100 * MiB}, 1: {7: 50 * MiB}}
    for _ in range(2):
        u.step(readings, lambda pid, d: 0 if pid == 7 else None, lambda pid, d: 0)
    assert u.unseen == {(7, 0): 100 * MiB, (7, 1): 50 * MiB}
    assert sorted(u.forget(7)) == [0, 1] and u.unseen == {}


def test_an_unknown_device_changes_nothing():
    u = UnseenMemory()
    for _ in range(2):
        step(u, {7: 100 * MiB}, {7: 0})
    assert u.step({0: None}, lambda p, d: 0, lambda p, d: 0) == []
    assert u.bytes(7, 0) == 100 * MiB


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 400), st.integers(0, 200), st.booleans()),
                min_size=1, max_size=30))
def test_unseen_bytes_never_exceed_what_the_readings_show_beyond_the_charges(seq):
    """Whatever the readings, a process's unseen bytes are at most what the
    latest reading shows beyond its charges (plus the rounding allowance),
    never more than any reading showed, and nothing once the latest shows
    nothing: a group's limit is never lowered for memory no reading saw."""
    u = UnseenMemory()
    extras = []
    for held_mib, charged_mib, listed in seq:
        held, charged = held_mib * MiB, charged_mib * MiB
        step(u, {7: held} if listed else {}, {7: charged})
        extra = max(0, (held if listed else 0) - charged)
        extras.append(extra if extra >= UNSEEN_MIN else 0)
        got = u.bytes(7, 0)
        assert got >= 0
        if extras[-1] == 0:
            assert got == 0
        assert got <= extras[-1] + UNSEEN_MIN and got <= max(extras)
