"""The snapshot (view.build_snapshot) built from a slot table and fake owners:
each process's and group's fields come from the owner that knows them, and
what is unknown stays None (text such as "N/A" is made where it is shown)."""
from __future__ import annotations

import json

from fakes import FakeMemory, FakeProbes, FakeSm
from hami_bpf.devices import Devices
from hami_bpf.events import GroupLimitSet, MemoryAllocated, ProcessRegistered, ProcKey
from hami_bpf.registry import ProcInfo
from hami_bpf.slots import SlotTable
from hami_bpf.snapshot import Snapshot
from hami_bpf.view import build_snapshot

GiB = 1 << 30


class Registry:
    def __init__(self):
        self.table = SlotTable()
        self.info: dict[int, ProcInfo] = {}

    def add(self, pid, group, start=500, comm="python", info=None):
        self.table.apply(ProcessRegistered(ProcKey(pid, start), group, comm, 0))
        if info is not None:
            self.info[pid] = info

    def alloc(self, pid, device, size, ptr):
        self.table.apply(MemoryAllocated(pid, device, size, ptr))


def build(reg, sm=None, memory=None, probes=None, devices=Devices(2, True), counters=None):
    return build_snapshot(registry=reg, sm=sm or FakeSm(), memory=memory or FakeMemory(),
                          probes=probes, devices=devices, mechanisms={"oom": "observe"},
                          simulated=True, counters=counters or {})


def world():
    reg = Registry()
    reg.add(11, "train", info=ProcInfo(None, [1, 0], 7, labels={"pod": "p-0"}))
    reg.add(12, "train", comm="worker", info=ProcInfo(None, [0, 1], None))
    reg.add(21, "infer")               # nothing learned of it at registration
    reg.table.apply(GroupLimitSet("train", 0, 4 * GiB))
    reg.table.apply(GroupLimitSet("train", 1, None))
    reg.table.apply(GroupLimitSet("infer", 1, 2 * GiB))
    reg.alloc(11, 0, GiB, 0x1000)
    reg.alloc(12, 0, 2 * GiB, 0x2000)
    reg.alloc(12, 1, 3 * GiB, 0x3000)
    return reg


def test_each_process_shows_its_usage_limits_and_what_registration_learned():
    reg = world()
    memory = FakeMemory()
    memory.denials = {12: 3}
    sm = FakeSm()
    sm.throttled = {"train": {12}}
    sm.shares = {reg.table.group("train").index: 24.5}
    snap = build(reg, sm=sm, memory=memory)
    a, b, c = snap.process(11), snap.process(12), snap.process(21)
    assert (a.pid, a.start_time, a.comm, a.group, a.slot) == (11, 500, "python", "train", 0)
    assert (b.comm, b.slot) == ("worker", 1)
    assert {d: (u.used_bytes, u.limit_bytes) for d, u in b.devices.items()} == {
        0: (2 * GiB, 4 * GiB), 1: (3 * GiB, None)}
    assert a.state == "running" and b.state == "throttled"
    assert a.sm_share == b.sm_share == 24.5 and c.sm_share is None
    assert (a.denied, b.denied) == (0, 3)
    # CUDA_VISIBLE_DEVICES=1,0: physical 1 is the process's 0 and the other way round.
    assert dict(a.visible_devices) == {1: 0, 0: 1} and dict(b.visible_devices) == {}
    assert a.ns_pid == 7 and dict(a.labels) == {"pod": "p-0"}
    assert (c.ns_pid, dict(c.labels), dict(c.visible_devices)) == (None, {}, {})


def test_each_group_shows_its_slots_totals_limits_and_denials():
    reg = world()
    probes = FakeProbes()
    gi = reg.table.group("train").index
    probes.gmem = {(gi, 0): (3 * GiB, 2), (gi, 1): (3 * GiB, 1),
                   (reg.table.group("infer").index, 1): (0, 0)}
    sm = FakeSm()
    sm.sm_caps = {"train": {0: 30}}
    snap = build(reg, sm=sm, probes=probes)
    g, h = snap.group("train"), snap.group("infer")
    assert (g.id, g.index, g.proc_num) == ("train", gi, 2)
    assert [(s.index, s.pid, s.start_time) for s in g.slots] == [(0, 11, 500), (1, 12, 500)]
    assert {d: (u.used_bytes, u.limit_bytes) for d, u in g.devices.items()} == {
        0: (3 * GiB, 4 * GiB), 1: (3 * GiB, None)}
    assert g.denied == 3 and h.denied == 0
    assert g.sm_limit == 30 and h.sm_limit is None
    # A device limited but unused is shown; one neither used nor limited is not.
    assert {d: (u.used_bytes, u.limit_bytes) for d, u in h.devices.items()} == {1: (0, 2 * GiB)}


def test_launches_are_counted_only_while_the_launch_probes_are_attached():
    reg = world()
    probes = FakeProbes()
    probes.launch_counts = {11: 40}
    snap = build(reg, probes=probes)
    assert all(p.launches is None for p in snap.processes)
    assert snap.counters["launch_probes"] == 0
    probes.launch_probes = 3
    snap = build(reg, probes=probes)
    assert (snap.process(11).launches, snap.process(12).launches) == (40, 0)
    assert snap.counters["launch_probes"] == 3


def test_counters_merge_the_tables_the_daemons_and_the_probes():
    reg = world()
    probes = FakeProbes()
    probes.stat_values = {"ringbuf_drops": 5}
    snap = build(reg, probes=probes, counters={"denials": 4})
    c = snap.counters
    assert c["registered"] == 3 and c["denials"] == 4 and c["ringbuf_drops"] == 5
    assert snap.mechanisms["oom"] == "observe" and snap.simulated


def test_without_probes_or_devices_the_snapshot_is_still_whole():
    reg = world()
    snap = build(reg, probes=None, devices=None)
    assert snap.devices == () and snap.counters["launch_probes"] == 0
    assert snap.group("train").denied == 0
    # Without a device count no device map is shown.
    assert dict(snap.process(11).visible_devices) == {}


def test_a_device_whose_values_are_unknown_shows_none_not_text():
    reg = world()
    snap = build(reg, devices=Devices(2, False))      # no NVML, not simulated
    assert [(d.index, d.total_bytes, d.used_bytes, d.utilization) for d in snap.devices] == [
        (0, None, None, None), (1, None, None, None)]
    js = json.loads(json.dumps(snap.to_json()))
    assert all(d["total_bytes"] is None and d["utilization"] is None for d in js["devices"])
    assert Snapshot.from_json(js).devices == snap.devices
    sim = build(reg, devices=Devices(2, True, total_mem=8 * GiB))
    assert [d.total_bytes for d in sim.devices] == [8 * GiB, 8 * GiB]
    # A process without a limit on a device: None, also through JSON.
    assert js["processes"][1]["devices"]["1"]["limit_bytes"] is None


def test_a_device_nvml_could_not_read_has_no_name_in_data_and_na_in_text():
    from cli.render import NA, render_devices, render_top_devices, to_text
    from hami_bpf.snapshot import DeviceInfo
    d = DeviceInfo(0, None, None, None, None, False)
    assert DeviceInfo.from_json(json.loads(json.dumps(d.to_json()))) == d
    for view in (render_devices([d]), render_top_devices([d])):
        row = next(line for line in to_text(view).splitlines() if line.strip().startswith("0"))
        assert NA in row and "None" not in row
