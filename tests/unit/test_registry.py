"""The process registry driven directly, over a fake /proc and fake owners
(tests/unit/fakes.py): registration, exit and compaction, the group deleted
with one call to each owner, exec, the hold at cuInit and a limits failure."""
from __future__ import annotations

import os
import signal

import pytest

from fakes import FakeLimits, FakeMemory, FakeProbes, FakeProc, FakeRegions, FakeSm, FakeWatch, event
from hami_bpf import abi, enforce
from hami_bpf.counters import Counters
from hami_bpf.devices import Devices
from hami_bpf.eventlog import EventLog
from hami_bpf.classify import PROBLEMS_SHOWN
from hami_bpf.registry import ProcessRegistry


class World:
    def __init__(self, tmp_path, ctx_bytes=0):
        self.log = EventLog()
        self.counters = Counters()
        self.probes = FakeProbes()
        self.sm, self.limits = FakeSm(), FakeLimits(ctx_bytes)
        self.memory, self.watch, self.regions = FakeMemory(), FakeWatch(), FakeRegions()
        self.stopped = enforce.StoppedSet(str(tmp_path / "state"))
        self.devices = Devices(2, True)
        self.reg = ProcessRegistry(
            probes=lambda: self.probes, devices=lambda: self.devices,
            stopped=lambda: self.stopped, group_by=lambda: "env:G", env_limits=True,
            pod_names=None, limits=self.limits, sm=self.sm, memory=lambda: self.memory,
            watch=lambda: self.watch, regions=self.regions, record=self.log.record,
            counters=self.counters)

    def events(self, kind):
        return [(e.what, dict(e.data)) for e in self.log if e.kind == kind]


@pytest.fixture
def proc(tmp_path, monkeypatch):
    return FakeProc(tmp_path / "proc").install(monkeypatch)


@pytest.fixture
def w(tmp_path, proc):
    return World(tmp_path)


def slots(w, group):
    g = w.reg.table.group(group)
    return [k.pid for k in g.slots] if g else None


def test_registration_puts_the_process_in_its_groups_next_slot(w, proc):
    a = proc.spawn(11, {"G": "train"})
    b = proc.spawn(12, {"G": "train", "CUDA_VISIBLE_DEVICES": "1"})
    c = proc.spawn(13, {"G": "other"})
    for p in (a, b, c):
        w.reg.register(p, 0)
    g, o = w.reg.table.group("train"), w.reg.table.group("other")
    assert slots(w, "train") == [a, b] and slots(w, "other") == [c]
    assert g.index != o.index
    assert w.probes.proc_cfg == {a: (g.index, 0), b: (g.index, 1), c: (o.index, 0)}
    # The device map written with the slot: CUDA_VISIBLE_DEVICES=1 puts
    # physical device 1 first.
    assert w.probes.phys[b][0] == 1 and w.probes.phys[a][:2] == [0, 1]
    assert w.events("register") == [
        ("registered", {"pid": a, "comm": "python", "group": "train", "slot": 0}),
        ("registered", {"pid": b, "comm": "python", "group": "train", "slot": 1}),
        ("registered", {"pid": c, "comm": "python", "group": "other", "slot": 0})]
    assert w.limits.applied == [("train", g.index, a, None), ("train", g.index, b, "1"),
                                ("other", o.index, c, None)]
    assert w.reg.info[b].cvd == "1" and w.reg.info[a].ns_pid == 7


def test_the_daemon_itself_is_never_registered(w, proc):
    w.reg.register(os.getpid(), 0)
    assert len(w.reg.table) == 0 and not w.probes.proc_cfg and not w.events("register")


def test_an_exit_compacts_the_slots_without_a_gap_and_rewrites_the_moved_one(w, proc):
    pids = [proc.spawn(p, {"G": "g"}) for p in (21, 22, 23, 24)]
    for p in pids:
        w.reg.register(p, 0)
    gi = w.reg.table.group("g").index
    proc.exit(22)
    w.reg.exit(22, 0)
    assert slots(w, "g") == [21, 24, 23]
    assert w.probes.proc_cfg == {21: (gi, 0), 24: (gi, 1), 23: (gi, 2)}
    assert w.events("compact") == [("compacted", {"group": "g", "removed": 22,
                                                  "moves": ({"pid": 24, "from": 3, "to": 1},)})]
    assert w.counters["compactions"] == 1
    assert w.sm.released == [("g", 22)] and w.memory.forgotten == [22]
    assert w.watch.released == [22]
    assert len(w.reg.exit_latency_ns) == 1
    assert 22 not in w.reg.info and not w.events("group")


def test_the_last_slots_exit_moves_nothing(w, proc):
    for p in (31, 32):
        w.reg.register(proc.spawn(p, {"G": "g"}), 0)
    proc.exit(32)
    w.reg.exit(32, 0)
    assert slots(w, "g") == [31]
    assert not w.events("compact") and w.counters["compactions"] == 0
    assert w.probes.proc_cfg[31][1] == 0


def test_the_last_members_exit_deletes_the_group_with_one_call_to_each_owner(w, proc):
    p = proc.spawn(41, {"G": "solo"})
    w.reg.register(p, 0)
    gi = w.reg.table.group("solo").index
    proc.exit(p)
    w.reg.exit(p, 0)
    assert w.reg.table.group("solo") is None
    assert w.probes.deleted_groups == [gi]
    assert w.sm.forgotten == [("solo", gi)]
    assert w.regions.gone_groups == ["solo"]
    assert w.events("group") == [("deleted", {"group": "solo"})]
    assert p not in w.probes.proc_cfg      # gone from /proc: its map entry too


def test_an_exit_of_an_unknown_pid_changes_nothing(w, proc):
    w.reg.register(proc.spawn(51, {"G": "g"}), 0)
    w.reg.exit(999, 0)
    assert slots(w, "g") == [51] and not w.watch.released and not w.reg.exit_latency_ns


def test_exec_releases_the_process_from_its_group(w, proc):
    a = proc.spawn(61, {"G": "g"}, comm="trainer")
    b = proc.spawn(62, {"G": "g"})
    w.reg.register(a, 0)
    w.reg.register(b, 0)
    w.reg.exec(a, 0)
    assert w.reg.table.process(a) is None and slots(w, "g") == [b]
    assert w.events("exec") == [("replaced", {"pid": a, "comm": "trainer", "group": "g"})]
    assert w.counters["execs"] == 1
    assert w.sm.released == [("g", a)] and w.watch.released == [a] and a not in w.reg.info
    w.reg.exec(a, 0)                  # not registered any more: nothing to release
    assert w.counters["execs"] == 1 and len(w.events("exec")) == 1


def test_a_moved_slot_whose_process_already_left_bpf_is_counted_not_written(w, proc):
    for p in (71, 72, 73):
        w.reg.register(proc.spawn(p, {"G": "g"}), 0)
    del w.probes.proc_cfg[73]          # BPF's exit program dropped it; its event is on the way
    proc.exit(71)
    w.reg.exit(71, 0)
    assert slots(w, "g") == [73, 72]
    assert 73 not in w.probes.proc_cfg
    assert w.counters["slot_write_after_exit"] == 1


def test_released_memory_resyncs_the_groups_limits_where_contexts_are_charged(tmp_path, proc):
    w = World(tmp_path, ctx_bytes=300 << 20)
    a, b = proc.spawn(81, {"G": "g"}), proc.spawn(82, {"G": "g"})
    w.reg.register(a, 0)
    w.reg.register(b, 0)
    w.reg.allocated(event(abi.EV_ALLOC, a, device=1, size=4096, ptr=0x1000))
    assert w.limits.synced == [("g", 1)]      # a's first use of device 1
    w.limits.synced.clear()
    proc.exit(a)
    w.reg.exit(a, 0)
    assert w.limits.synced == [("g", 1)]


def test_a_member_with_unseen_bytes_that_leaves_resyncs_those_devices(tmp_path, proc):
    w = World(tmp_path)                 # no context reserve: only the unseen bytes move
    a = proc.spawn(83, {"G": "g"})
    w.reg.register(a, 0)
    w.reg.allocated(event(abi.EV_ALLOC, a, device=0, size=4096, ptr=0x1000))
    w.limits.unseen_devices[a] = [1]
    w.limits.synced.clear()
    proc.exit(a)
    w.reg.exit(a, 0)
    assert w.limits.synced == [("g", 1)]
    assert a not in w.limits.unseen_devices


def test_a_failure_applying_a_members_limits_falls_back_to_the_policy(w, proc):
    p = proc.spawn(91, {"G": "g", "CUDA_VISIBLE_DEVICES": "0"})
    w.limits.fail = ValueError("bad limit")
    w.reg.register(p, 0)
    gi = w.reg.table.group("g").index
    assert w.limits.applied == [("g", gi, p, "0"), ("g", gi, p, None)]
    (what, d), = w.events("error")
    assert what == "limits_failed"
    assert (d["pid"], d["group"], d["classify_failed"]) == (p, "g", ("limits",))
    assert d["error"].startswith("ValueError")
    assert w.counters["classify_failures"] == 1
    assert w.reg.info[p].env is None and w.reg.info[p].cvd is None
    assert w.reg.table.process(p) is not None     # still tracked


def test_a_hold_at_cuinit_is_claimed_once_registered_and_resumed_once(w, proc):
    p = proc.spawn(101, {"G": "g"})
    proc.set_state(p, "T")
    w.probes.gate_wait.add(p)
    assert w.reg.gated(p, 0) is True
    assert w.reg.gated(p, 0) is False           # the tick's scan finds it claimed
    w.reg.release_gated()
    assert w.reg.table.process(p) is not None and p in w.probes.proc_cfg
    assert proc.signals == [(p, signal.SIGCONT)]
    assert p not in w.stopped
    assert w.counters["gate_scan_claims"] == 0


def test_the_scan_of_held_processes_claims_those_whose_event_was_lost(w, proc):
    p = proc.spawn(111, {"G": "g"})
    proc.set_state(p, "T")
    w.probes.gate_wait.add(p)
    w.reg.dirty = False
    w.reg.release_gated()
    assert w.reg.table.process(p) is not None and proc.signals == [(p, signal.SIGCONT)]
    assert w.counters["gate_scan_claims"] == 1 and w.reg.dirty


def test_a_held_pid_still_in_the_table_is_a_new_image_the_old_one_leaves_first(w, proc):
    p = proc.spawn(121, {"G": "g"})
    w.reg.register(p, 0)
    w.probes.gate_wait.add(p)          # its exec event was lost
    assert w.reg.gated(p, 0)
    assert [what for what, _ in w.events("exec")] == ["replaced"]
    assert [d["slot"] for _, d in w.events("register")] == [0, 0]
    assert slots(w, "g") == [p]


def test_the_reaper_releases_a_process_whose_pid_was_reused(w, proc):
    p = proc.spawn(131, {"G": "g"})
    w.reg.register(p, 0)
    proc.exit(p)
    proc.spawn(p, {"G": "g"})          # same pid, later start time
    w.reg.reap()
    assert w.reg.table.process(p) is None and w.counters["reaped"] == 1
    assert w.watch.housekept == 1


def test_malformed_variables_are_events_with_their_fields_the_rest_counted(w, proc):
    env = {"G": "train", "CUDA_DEVICE_MEMORY_LIMIT": "12x"}
    env.update({f"CUDA_DEVICE_SM_LIMIT_{i}": "150" for i in range(PROBLEMS_SHOWN + 2)})
    p = proc.spawn(21, env)
    w.reg.register(p, 0)
    got = w.events("config")
    ignored = [d for what, d in got if what == "env_ignored"]
    assert len(ignored) == PROBLEMS_SHOWN
    assert any((d["variable"], d["value"]) == ("CUDA_DEVICE_MEMORY_LIMIT", "12x") for d in ignored)
    assert all(d["pid"] == p and d["reason"] for d in ignored)
    assert ("env_ignored_more", {"pid": p, "count": 3}) in got
    assert slots(w, "train") == [p]       # still registered, in its group


def test_an_environment_cut_at_its_bound_is_said_once(w, proc, monkeypatch):
    from hami_bpf import classify
    monkeypatch.setattr(classify, "read_environ", lambda pid: ({"G": "train"}, True))
    p = proc.spawn(22, {"G": "train"})
    w.reg.register(p, 0)
    assert w.events("config") == [("env_cut", {"pid": p, "limit": classify.ENVIRON_MAX})]
