"""hami_bpf.hami_region: HAMi's shared-region layout, round trip and offsets."""
from __future__ import annotations

import struct

import pytest

from hami_bpf import hami_region as H

U0 = "GPU-11111111-2222-3333-4444-555555555555"
U1 = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


def test_layout_constants():
    # the sizes HAMi's monitor and HAMi-core agree on for version 1
    assert H.OFF_DEVICE_NUM == 56
    assert H.OFF_PROCS == 1856
    assert H.SLOT_SIZE == 1960
    assert H.OFF_PROC_NUM == 2008896
    assert H.REGION_SIZE == 2008952


def test_round_trip():
    r = H.Region((U0, U1), (8 << 30, 4 << 30), (50, 100),
                 (H.RegionProc(1, 4242, {0: 3 << 20, 1: 1 << 20}, {0: 5 << 20}, {0: 37}),
                  H.RegionProc(7, 4250, {1: 9 << 20})),
                 priority=0, last_kernel_time=1_700_000_000, owner_pid=99)
    img = H.encode_region(r)
    assert len(img) == H.REGION_SIZE
    assert H.decode_region(img) == r
    assert r.total(0) == (3 << 20) + (5 << 20)


def test_fields_where_the_monitor_reads_them():
    r = H.Region((U0,), (1 << 30,), (), (H.RegionProc(1, 500, {0: 12345}),))
    img = H.encode_region(r)
    magic, major, _minor = struct.unpack_from("<iii", img, 0)
    assert (magic, major) == (19920718, 1)
    assert struct.unpack_from("<Q", img, 56)[0] == 1
    assert img[64:64 + len(U0)] == U0.encode() and img[64 + len(U0)] == 0
    assert struct.unpack_from("<Q", img, 1600)[0] == 1 << 30
    slot = 1856
    assert struct.unpack_from("<ii", img, slot) == (1, 500)
    # device 0 usage record: context, module, data, offset, total
    assert struct.unpack_from("<5Q", img, slot + 8) == (0, 0, 12345, 0, 12345)
    assert struct.unpack_from("<i", img, slot + 1928)[0] == 1   # running
    assert struct.unpack_from("<Q", img, slot + 1936)[0] % 2 == 0
    assert struct.unpack_from("<i", img, 2008896)[0] == 1


def test_decode_rejects_foreign_files():
    with pytest.raises(H.RegionError):
        H.decode_region(b"\0" * 100)
    with pytest.raises(H.RegionError, match="magic"):
        H.decode_region(b"\0" * H.REGION_SIZE)
    img = bytearray(H.encode_region(H.Region((U0,))))
    struct.pack_into("<I", img, 4, 2)
    with pytest.raises(H.RegionError, match="version"):
        H.decode_region(bytes(img))


def test_limits_of_the_layout():
    with pytest.raises(H.RegionError):
        H.encode_region(H.Region(tuple(U0 for _ in range(17))))
    with pytest.raises(H.RegionError):
        H.encode_region(H.Region((U0,), procs=(H.RegionProc(1, 1, {16: 1}),)))


def test_from_snapshot_maps_physical_to_container_devices():
    snap = {
        "groups": [{"id": "g", "index": 0, "proc_num": 2,
                    "slots": [{"index": 0, "pid": 900, "start_time": 1},
                              {"index": 1, "pid": 901, "start_time": 2}],
                    "devices": {"3": {"used_bytes": 30, "limit_bytes": 1000},
                                "1": {"used_bytes": 5, "limit_bytes": 500}}}],
        "processes": [
            {"pid": 900, "ns_pid": 1, "group": "g", "slot": 0,
             "devices": {"3": {"used_bytes": 10, "limit_bytes": 1000}}},
            {"pid": 901, "ns_pid": None, "group": "g", "slot": 1,
             "devices": {"3": {"used_bytes": 20, "limit_bytes": 1000},
                         "1": {"used_bytes": 5, "limit_bytes": 500}}}],
    }
    # the container sees physical 3 as its device 0 and physical 1 as device 1
    r = H.region_from_snapshot(snap, "g", (U0, U1), visible=[3, 1])
    assert r.limits == (1000, 500)
    assert [(p.pid, p.host_pid) for p in r.procs] == [(1, 900), (901, 901)]
    assert r.procs[1].used == {0: 20, 1: 5}
    assert (r.total(0), r.total(1)) == (30, 5)
    assert H.decode_region(H.encode_region(r)) == r
    with pytest.raises(H.RegionError):
        H.region_from_snapshot(snap, "nope", (U0,))


def test_publish_in_place_keeps_the_monitors_fields(tmp_path):
    path = tmp_path / "x.cache"
    H.publish_region(path, H.Region((U0,), procs=(H.RegionProc(1, 2, {0: 10}),)))
    ino = path.stat().st_ino
    # the monitor sets the utilisation switch and the recent-kernel counter
    with open(path, "r+b") as f:
        f.seek(H.OFF_UTIL_SWITCH)
        f.write(struct.pack("<ii", 1, 7))
    H.publish_region(path, H.Region((U0,), procs=(H.RegionProc(1, 2, {0: 99}),), priority=0))
    data = path.read_bytes()
    assert path.stat().st_ino == ino                     # same file, never replaced
    assert struct.unpack_from("<ii", data, H.OFF_UTIL_SWITCH) == (1, 7)
    r = H.decode_region(data)
    assert r.procs[0].used == {0: 99} and r.priority == 0
    assert H.region_dir_name("uid-1", "main") == "uid-1_main"
