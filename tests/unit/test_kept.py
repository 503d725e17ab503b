"""hami_bpf.kept: what a restarted daemon makes of the maps its predecessor kept."""
from __future__ import annotations

import os
import subprocess
import time

from hypothesis import given
from hypothesis import strategies as st

from hami_bpf import kept
from hami_bpf.kept import GROUP_NONE, Reservation

NOW = 10_000_000_000


def starts(**by_pid):
    table = {int(k[1:]): v for k, v in by_pid.items()}
    return lambda pid: table.get(pid)


def test_live_processes_are_adopted_with_their_bytes_and_group():
    a = kept.plan(procs={10: (3, NOW - 5), 11: (GROUP_NONE, NOW - 4)},
                  assigned={10: 3, 11: 4},
                  pmem={(10, 0): 100, (10, 1): 0, (11, 0): 7},
                  calls={}, group_keys=[3], start_ns=starts(p10=NOW - 9, p11=NOW - 9))
    assert [(p.pid, p.charged, p.assigned, dict(p.used)) for p in a.live] == [
        (10, 3, 3, {0: 100}), (11, None, 4, {0: 7})]
    assert a.dead == () and a.bytes_adopted == 107 and a.indices == {3, 4}


def test_exited_and_reused_pids_are_dead():
    a = kept.plan(procs={10: (3, NOW - 5), 12: (5, NOW - 10**9)},
                  assigned={10: 3, 12: 5},
                  pmem={(10, 0): 100, (12, 1): 9},
                  calls={}, group_keys=[],
                  # 10 is gone; 12 is another process that started after the entry
                  start_ns=starts(p12=NOW))
    assert [p.pid for p in a.dead] == [10, 12] and a.live == ()
    assert a.bytes_released == 109


def test_an_entry_made_at_start_up_has_no_image_and_follows_the_pid():
    a = kept.plan(procs={10: (GROUP_NONE, 0)}, assigned={}, pmem={}, calls={},
                  group_keys=[], start_ns=starts(p10=NOW))
    assert [p.pid for p in a.live] == [10]


def test_the_start_time_coarseness_is_tolerated():
    a = kept.plan(procs={10: (1, NOW - kept.START_SLACK_NS // 2)}, assigned={10: 1}, pmem={},
                  calls={}, group_keys=[], start_ns=starts(p10=NOW))
    assert [p.pid for p in a.live] == [10]


def test_reservations_of_unseen_returns_are_given_back():
    a = kept.plan(procs={}, assigned={}, pmem={},
                  calls={7: (3, 0, 4096, True), 8: (GROUP_NONE, 0, 4096, True), 9: (3, 0, 0, False)},
                  group_keys=[], start_ns=starts())
    assert a.reservations == (Reservation(7, 3, 0, 4096),)
    assert a.stale_calls == (8, 9)
    assert 3 in a.indices


@given(st.dictionaries(st.integers(1, 50), st.tuples(st.sampled_from([1, 2, GROUP_NONE]),
                                                     st.integers(0, NOW))),
       st.dictionaries(st.integers(1, 50), st.integers(1, 3)),
       st.dictionaries(st.tuples(st.integers(1, 50), st.integers(0, 3)), st.integers(0, 1 << 40)),
       st.dictionaries(st.integers(1, 50), st.integers(0, NOW) | st.none()))
def test_every_process_is_live_or_dead_and_every_byte_is_kept_or_released(procs, assigned,
                                                                          pmem, alive):
    a = kept.plan(procs, assigned, pmem, {}, [], lambda pid: alive.get(pid))
    pids = [p.pid for p in a.live] + [p.pid for p in a.dead]
    assert sorted(pids) == sorted(set(procs) | set(assigned) | {p for (p, _), b in pmem.items() if b})
    total = sum(b for b in pmem.values())
    assert a.bytes_adopted + sum(sum(p.used.values()) for p in a.dead) == total
    for p in a.live:
        assert alive.get(p.pid) is not None


def test_the_previous_daemon_is_waited_for_until_it_is_gone(tmp_path):
    child = subprocess.Popen(["sleep", "0.5"])
    try:
        rec = {"pid": child.pid, "start": kept._start_ticks(child.pid)}
        (tmp_path / kept.OWNER_FILE).write_text(__import__("json").dumps(rec))
        said = []
        t0 = time.monotonic()
        # a reaped child is gone; an unreaped one is a zombie: gone as well
        assert kept.wait_for_predecessor(str(tmp_path), timeout=30, said=said.append) == []
        assert time.monotonic() - t0 >= 0.3
        assert said == [[child.pid]]
    finally:
        child.wait()


def test_a_pid_reused_by_another_process_is_not_waited_for(tmp_path):
    (tmp_path / kept.OWNER_FILE).write_text(
        __import__("json").dumps({"pid": 1, "start": kept._start_ticks(1) + 1}))
    assert kept.wait_for_predecessor(str(tmp_path), timeout=5) == []


def test_a_live_predecessor_is_reported_after_the_timeout(tmp_path):
    child = subprocess.Popen(["sleep", "30"])
    try:
        kept_dir = str(tmp_path)
        (tmp_path / kept.OWNER_FILE).write_text(__import__("json").dumps(
            {"pid": child.pid, "start": kept._start_ticks(child.pid)}))
        assert kept.wait_for_predecessor(kept_dir, timeout=0.2) == [child.pid]
    finally:
        child.kill()
        child.wait()


def test_owner_record_round_trips(tmp_path):
    kept.write_owner(str(tmp_path), closer=os.getppid())
    assert kept.predecessors(str(tmp_path)) == [(os.getppid(), kept._start_ticks(os.getppid()))]
    assert os.stat(tmp_path / kept.OWNER_FILE).st_mode & 0o777 == 0o600


def test_start_ns_is_on_the_probes_clock():
    s = kept.start_ns(os.getpid())
    assert s is not None and s <= time.monotonic_ns()
    assert kept.start_ns(2**22 + 12345) is None
