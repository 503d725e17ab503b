"""The controller's components wired as the daemon wires them, driven by
events as BPF would send them, over a fake /proc and fake maps: registration,
exit and compaction, the reaper, denials, the hold at cuInit and SM holds,
without root, bcc or real processes (tests/unit/fakes.py)."""
from __future__ import annotations

import signal

import pytest

from fakes import FakeProbes, FakeProc, event
from hami_bpf import abi, enforce
from hami_bpf.config import DaemonConfig
from hami_bpf.daemon import Daemon
from hami_bpf.devices import Devices
from hami_bpf.limits import MEM_ENV, load_policy

GiB = 1 << 30
POLICY = '[default]\nmemory = "4Gi"\n'


@pytest.fixture
def proc(tmp_path, monkeypatch):
    return FakeProc(tmp_path / "proc").install(monkeypatch)


@pytest.fixture
def daemon(tmp_path):
    d = Daemon(DaemonConfig(group_by="env:G", state_dir=str(tmp_path / "state")))
    d.probes = FakeProbes()
    d.devices = Devices(2, True)
    d.stopped = enforce.StoppedSet(str(tmp_path / "state"))
    d.policy.current = load_policy(POLICY, "policy.toml")
    return d


def records(d, kind):
    return [e.data for e in d.log if e.kind == kind]


def alloc(d, pid, size, ptr, device=0):
    d._route(event(abi.EV_ALLOC, pid, device=device, size=size, ptr=ptr))


def test_a_first_event_registers_the_process_with_its_group_slot_and_limits(daemon, proc):
    d = daemon
    a = proc.spawn(101, {"G": "train", MEM_ENV: "2Gi"})
    b = proc.spawn(102, {"G": "train"})
    alloc(d, a, 1 << 20, 0x1000)
    alloc(d, b, 1 << 20, 0x2000)
    g = d.registry.table.group("train")
    assert [k.pid for k in g.slots] == [a, b]
    assert d.probes.proc_cfg == {a: (g.index, 0), b: (g.index, 1)}
    # The policy's 4 GiB, lowered by a member's own 2 GiB (never raised).
    assert d.probes.limits == {(g.index, 0): 2 * GiB, (g.index, 1): 2 * GiB}
    regs = records(d, "register")
    assert [(r["pid"], r["group"], r["slot"]) for r in regs] == [(a, "train", 0), (b, "train", 1)]
    assert d.registry.info[a].ns_pid == 7
    assert d.registry.table.process(a).used == {0: 1 << 20}


def test_an_exit_compacts_the_group_and_rewrites_the_moved_slot(daemon, proc):
    d = daemon
    pids = [proc.spawn(p, {"G": "g"}) for p in (201, 202, 203)]
    for i, p in enumerate(pids):
        alloc(d, p, 4096, 0x1000 * (i + 1))
    gi = d.registry.table.group("g").index
    proc.exit(202)
    d._route(event(abi.EV_EXIT, 202))
    assert d.probes.proc_cfg == {201: (gi, 0), 203: (gi, 1)}
    (c,) = records(d, "compact")
    assert c["group"] == "g" and c["removed"] == 202
    assert [dict(m) for m in c["moves"]] == [{"pid": 203, "from": 2, "to": 1}]
    assert d.counters["compactions"] == 1
    assert len(d.registry.exit_latency_ns) == 1


def test_the_last_exit_deletes_the_group_from_every_owner(daemon, proc):
    d = daemon
    p = proc.spawn(301, {"G": "solo"})
    alloc(d, p, 4096, 0x1000)
    gi = d.registry.table.group("solo").index
    proc.exit(p)
    d._route(event(abi.EV_EXIT, p))
    assert d.registry.table.group("solo") is None
    assert d.probes.deleted_groups == [gi] and not d.probes.limits
    assert records(d, "group") == [{"group": "solo"}]
    assert p not in d.registry.info


def test_the_reaper_repairs_a_lost_exit_event(daemon, proc):
    d = daemon
    p = proc.spawn(401, {"G": "g"})
    q = proc.spawn(402, {"G": "g"})
    alloc(d, p, 4096, 0x1000)
    alloc(d, q, 4096, 0x2000)
    proc.exit(p)                       # its exit event never came
    d.registry.reap()
    assert d.registry.table.process(p) is None and d.registry.table.process(q) is not None
    assert d.counters["reaped"] == 1
    assert p not in d.probes.proc_cfg   # gone from /proc: its map entry too


def test_a_denial_in_the_kernel_is_recorded_with_its_fields(daemon, proc):
    d = daemon
    p = proc.spawn(501, {"G": "g"})
    alloc(d, p, GiB, 0x1000)
    d._route(event(abi.EV_DENY, p, device=0, size=8 * GiB, aux=abi.ACT_RETURN_OOM))
    (r,) = records(d, "deny")
    assert (r["pid"], r["group"], r["device"], r["size"], r["action"]) == (
        p, "g", 0, 8 * GiB, "return-oom")
    assert r["limit"] == 4 * GiB
    assert d.counters["denials"] == 1 and d.memory.denied(p) == 1
    d._rebuild_snapshot()
    (shown,) = d.snapshot().processes
    assert shown.denied == 1 and shown.devices[0].limit_bytes == 4 * GiB


def test_a_hold_at_cuinit_is_registered_and_resumed_once(daemon, proc):
    d = daemon
    p = proc.spawn(601, {"G": "g"})
    proc.set_state(p, "T")             # the cuInit probe stopped it
    d.probes.gate_wait.add(p)
    d._route(event(abi.EV_INIT, p, abi.F_STOPPED))
    d.registry.release_gated()         # the tick's scan finds nothing more to claim
    assert d.registry.table.process(p) is not None and p in d.probes.proc_cfg
    assert proc.signals == [(p, signal.SIGCONT)]
    assert p not in d.stopped


def test_an_sm_hold_stops_the_peers_and_resumes_each_exactly_once(daemon, proc):
    d = daemon
    pids = [proc.spawn(p, {"G": "tp"}) for p in (701, 702, 703)]
    for i, p in enumerate(pids):
        alloc(d, p, 4096, 0x1000 * (i + 1))
    d.sm.sm_caps["tp"] = {0: 30}
    proc.set_state(701, "T")           # BPF stopped the launcher itself
    d._route(event(abi.EV_THROTTLE, 701))
    assert proc.signals == [(702, signal.SIGSTOP), (703, signal.SIGSTOP)]
    assert all(p in d.stopped for p in pids)
    d.sm.fail_open(RuntimeError("injected"))
    conts = sorted(p for p, s in proc.signals if s == signal.SIGCONT)
    assert conts == pids and not any(p in d.stopped for p in pids)
    assert records(d, "error")[-1]["error"] == "RuntimeError"


def test_a_group_that_waits_while_it_learns_starts_over_and_says_so(daemon, proc):
    d = daemon
    p = proc.spawn(751, {"G": "pre"})
    alloc(d, p, 4096, 0x1000)
    d.sm.sm_caps["pre"] = {0: 30}
    gi = d.registry.table.group("pre").index
    t, consumed = 100.0, 0
    for _ in range(6):                  # warm-up: launches that all complete
        t += 0.05
        consumed += 10_000
        d.probes.sm_uses[(gi, 0)] = (consumed, consumed // 100, consumed, 0, int(t * 1e9), 1)
        d.sm.tick(t)
    assert not [e for e in d.log if e.what == "learn_restarted"]
    for _ in range(20):                 # a 1 s wait with nothing in flight
        t += 0.05
        d.sm.tick(t)
    (r,) = records(d, "throttle")
    assert r["group"] == "pre" and r["device"] == 0 and r["sm_correction"] == "learn_idle"
    assert d.counters["sm_corrections_learn_idle"] == 1
    assert d.sm.budgets[(gi, 0)].learning


def test_lost_allocation_events_are_corrected_from_the_kernel(daemon, proc):
    d = daemon
    p = proc.spawn(801, {"G": "g"})
    alloc(d, p, 4096, 0x1000)
    d.probes.pmem = {(p, 0): 4096, (p, 1): GiB}    # an event for device 1 was lost
    d.registry.reconcile()
    assert d.registry.table.process(p).used == {0: 4096}   # once may be an event on its way
    d.registry.reconcile()
    assert d.registry.table.process(p).used == {0: 4096, 1: GiB}
    (r,) = records(d, "reconcile")
    assert dict(r["after"]) == {"0": 4096, "1": GiB}
