"""--hami-regions (regionpub.RegionPublisher) driven directly from hand-made
snapshots: the HAMi region file of each group, its name, its contents, the
once-a-second cadence, removal, and errors recorded without raising."""
from __future__ import annotations

import os

import pytest

from hami_bpf import hami_region as hr
from hami_bpf.eventlog import EventLog
from hami_bpf.regionpub import RegionError, RegionPublisher
from hami_bpf.snapshot import (SCHEMA_VERSION, DeviceInfo, DeviceUsage, GroupInfo, ProcessInfo,
                               SlotInfo, Snapshot)

GiB = 1 << 30


def snapshot(*groups):
    """groups: (name, index, [(pid, {device: used}, labels)], {device: limit})."""
    procs, infos = [], []
    for name, index, members, limits in groups:
        for slot, (pid, used, labels) in enumerate(members):
            procs.append(ProcessInfo(pid, 1000 + pid, "python", name, slot,
                                     {d: DeviceUsage(u, limits.get(d)) for d, u in used.items()},
                                     None, ns_pid=pid % 100, labels=labels))
        infos.append(GroupInfo(name, index, len(members),
                               tuple(SlotInfo(i, m[0], 1000 + m[0]) for i, m in enumerate(members)),
                               {d: DeviceUsage(0, v) for d, v in limits.items()}))
    devs = (DeviceInfo(0, "gpu", None, None, None, False, uuid="GPU-zero"),
            DeviceInfo(1, "gpu", None, None, None, False, uuid=None))
    return Snapshot(SCHEMA_VERSION, 0.0, False, {}, devs, tuple(procs), tuple(infos), {})


class World:
    def __init__(self, root):
        self.log = EventLog()
        self.exists = set()
        self.phys: dict[int, list[int]] = {}
        self.caps: dict[str, dict[int, int]] = {}
        self.ctx = 0
        self.pub = RegionPublisher(str(root), record=self.log.record,
                                   group_exists=lambda g: g in self.exists,
                                   phys=lambda pid: self.phys.get(pid), ndev=lambda: 2,
                                   sm_caps=lambda g: self.caps.get(g, {}),
                                   ctx_bytes=lambda: self.ctx)

    def errors(self):
        return [(e.what, dict(e.data)) for e in self.log if e.kind == "error"]


@pytest.fixture
def root(tmp_path):
    return tmp_path / "regions"


@pytest.fixture
def w(root):
    return World(root)


def read(path):
    with open(path, "rb") as f:
        return hr.decode_region(f.read())


def test_a_groups_region_holds_its_members_limits_and_devices(w, root):
    w.exists = {"train"}
    w.caps = {"train": {1: 30}}
    w.ctx = 300 << 20
    snap = snapshot(("train", 1, [(101, {0: GiB}, {}), (102, {1: 2 * GiB}, {})],
                     {0: 4 * GiB, 1: 8 * GiB}))
    assert w.pub.publish(snap, 10.0) is True
    r = read(root / "train" / "hami-bpf.cache")
    assert r.uuids == ("GPU-zero", "hami-bpf-dev1")
    assert r.limits == (4 * GiB, 8 * GiB) and r.sm_limits == (0, 30)
    assert [(p.pid, p.host_pid) for p in r.procs] == [(1, 101), (2, 102)]   # slot order, ns pids
    assert r.procs[0].used == {0: GiB} and r.procs[1].used == {1: 2 * GiB}
    assert r.procs[0].context == {0: 300 << 20}
    assert not w.errors()


def test_the_first_members_device_map_orders_the_regions_devices(w, root):
    w.exists = {"g"}
    w.phys = {101: [1]}                # CUDA_VISIBLE_DEVICES=1
    w.pub.publish(snapshot(("g", 1, [(101, {1: GiB}, {})], {1: 4 * GiB})), 0.0)
    r = read(root / "g" / "hami-bpf.cache")
    assert r.uuids == ("hami-bpf-dev1",) and r.limits == (4 * GiB,)
    assert r.procs[0].used == {0: GiB}


def test_a_pods_container_gets_hamis_directory_name(w, root):
    w.exists = {"pod"}
    w.pub.publish(snapshot(("pod", 1, [(101, {0: 1}, {"pod_uid": "u-1", "container": "main"})],
                            {})), 0.0)
    assert (root / "u-1_main" / "hami-bpf.cache").is_file()


def test_a_group_name_unfit_for_a_directory_is_sanitized_and_kept_distinct(w, root):
    w.exists = {"a/b", "a_b", ".."}
    w.pub.publish(snapshot(("a/b", 1, [(101, {}, {})], {}), ("a_b", 2, [(102, {}, {})], {}),
                           ("..", 3, [(103, {}, {})], {})), 0.0)
    names = sorted(os.listdir(root))
    assert "a_b" in names and len(names) == 3
    assert all(n not in (".", "..") and "/" not in n for n in names)
    for n in names:
        assert (root / n / "hami-bpf.cache").is_file()


def test_at_most_once_a_second_and_unchanged_regions_are_not_rewritten(w, root, monkeypatch):
    writes = []
    real = hr.publish_region
    monkeypatch.setattr(hr, "publish_region", lambda f, r: (writes.append(f), real(f, r)))
    w.exists = {"g"}
    snap = snapshot(("g", 1, [(101, {0: GiB}, {})], {}))
    assert w.pub.publish(snap, 10.0) is True and len(writes) == 1
    bigger = snapshot(("g", 1, [(101, {0: 2 * GiB}, {})], {}))
    assert w.pub.publish(bigger, 10.5) is False and len(writes) == 1   # not due: call again
    assert w.pub.publish(bigger, 11.0) is True and len(writes) == 2
    assert read(root / "g" / "hami-bpf.cache").procs[0].used == {0: 2 * GiB}
    assert w.pub.publish(bigger, 12.0) is True and len(writes) == 2    # unchanged
    os.unlink(root / "g" / "hami-bpf.cache")                           # removed under us
    assert w.pub.publish(bigger, 13.0) is True and len(writes) == 3


def test_a_group_gone_from_the_snapshot_or_deleted_loses_its_file(w, root):
    w.exists = {"a", "b"}
    w.pub.publish(snapshot(("a", 1, [(101, {}, {})], {}), ("b", 2, [(102, {}, {})], {})), 0.0)
    assert sorted(os.listdir(root)) == ["a", "b"]
    w.pub.gone("a")
    assert sorted(os.listdir(root)) == ["b"]
    w.pub.publish(snapshot(), 5.0)
    assert os.listdir(root) == []
    w.pub.gone("never-published")      # nothing to remove: no error
    assert not w.errors()


def test_a_group_deleted_since_the_snapshot_is_not_published(w, root):
    w.exists = set()
    w.pub.publish(snapshot(("late", 1, [(101, {}, {})], {})), 0.0)
    assert os.listdir(root) == []


def test_a_write_failure_is_recorded_once_with_its_path_and_never_raised(w, root):
    w.exists = {"g"}
    f = root / "g" / "hami-bpf.cache"
    f.mkdir(parents=True)              # something that is not a region file
    snap = snapshot(("g", 1, [(101, {0: 1}, {})], {}))
    assert w.pub.publish(snap, 0.0) is True
    assert w.pub.publish(snap, 1.0) is True
    ((what, data),) = w.errors()
    assert what == "region_failed" and data["path"] == str(f) and data["error"]
    f.rmdir()
    w.pub.publish(snap, 2.0)
    assert read(f).procs[0].host_pid == 101
    f.unlink()
    f.mkdir()                          # failing again after it worked: said again
    w.pub.publish(snapshot(("g", 1, [(101, {0: 2}, {})], {})), 3.0)
    assert len(w.errors()) == 2


def test_an_unsafe_directory_is_refused_at_start_and_reported_later(w, root):
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(RegionError):
        w.pub.publish(snapshot(), 0.0)
    os.chmod(root, 0o755)
    w.exists = {"g"}
    snap = snapshot(("g", 1, [(101, {}, {})], {}))
    assert w.pub.publish(snap, 1.0) is True and (root / "g").is_dir()
    os.chmod(root, 0o777)              # opened to others while running: stop, say so, go on
    os.unlink(root / "g" / "hami-bpf.cache")
    assert w.pub.publish(snap, 5.0) is True
    assert not (root / "g" / "hami-bpf.cache").exists()
    ((what, data),) = w.errors()
    assert what == "region_failed" and data["path"] == str(root)
    os.chmod(root, 0o755)
