"""`top`'s pure parts: frames rendered to text, the key state machine,
launches/s from successive snapshots; `events` formatting and reconnection;
the exporter's hami_bpf_* series from a snapshot."""
from __future__ import annotations

import collections
import dataclasses
import os
import shutil
import tempfile

import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hami_bpf.cli.main import main
from hami_bpf.cli.render import (SORTS, LaunchRates, TopView, event_parts, format_event,
                                 next_view, render_top, to_text, usage_bar)
from hami_bpf.metrics import (EXIT_LATENCY_BUCKETS_NS, make_registry, observe_exit_latency)
from hami_bpf.server import SnapshotServer
from hami_bpf.snapshot import (DeviceInfo, DeviceUsage, EventRecord, GroupInfo, ProcessInfo,
                               SlotInfo, Snapshot, example_snapshot)

MiB = 1 << 20


def frame(snap=None, view=None, rates=None, status=None, width=160) -> str:
    return to_text(render_top(snap or example_snapshot(), view, rates, status), width=width)


def rows(text: str, group: str) -> list[list[str]]:
    """Cells of the rows in a group's panel (split on 2+ spaces)."""
    import re
    out, inside = [], False
    for line in text.splitlines():
        if line.startswith("╭─") and f"group {group} " in line:
            inside = True
        elif inside and line.startswith("╰"):
            break
        elif inside and re.match(r"^│\s+\d+\s+\d+\s", line):
            out.append(re.split(r"\s{2,}", line.strip("│ ")))
    return out


def snap_with(processes, groups=None, taken_at=1000.0, **kw) -> Snapshot:
    if groups is None:
        by = collections.defaultdict(list)
        for p in processes:
            by[p.group].append(p)
        groups = [GroupInfo(g, i, len(ps), tuple(SlotInfo(p.slot, p.pid, p.start_time)
                                                 for p in sorted(ps, key=lambda p: p.slot)),
                            {}) for i, (g, ps) in enumerate(by.items())]
    return Snapshot(1, taken_at, False, kw.get("mechanisms", {}), kw.get("devices", ()),
                    tuple(processes), tuple(groups), kw.get("counters", {}))


def proc(pid, group="g", slot=0, used=0, launches=None, start=1, **kw) -> ProcessInfo:
    return ProcessInfo(pid, start, f"p{pid}", group, slot,
                       {0: DeviceUsage(used, 1024 * MiB)} if used else {}, launches, **kw)


# --------------------------------------------------------------- rendering

def test_frame_has_header_devices_mechanisms_counters_and_panels():
    text = frame()
    head = text.splitlines()[0]
    assert "hami-bpf top" in head and "SIMULATED" in head
    assert "sort: memory" in head and "filter: all" in head and "view: per-process" in head
    assert "Simulated GPU (simulated)" in text and "2.0 GiB / 16.0 GiB" in text and "35%" in text
    assert "mechanisms: memory=uprobe  enforce=return-oom" in text
    assert "counters: events 42  denials 3  compactions 1  ringbuf_drops 0" in text
    assert "group pod-a  slots 2  SM cap 50% achieved N/A  denied 3" in text
    assert "group pod-b  slots 1  SM cap N/A" in text
    a = rows(text, "pod-a")
    assert [r[1] for r in a] == ["1240", "1234"]         # by memory: 1.25 GiB, then 512 MiB
    assert a[0][:4] == ["1", "1240", "trainer", "0,1"]
    assert "1.2 GiB / unlimited" in a[0][4]               # one device unlimited -> unlimited
    assert "512.0 MiB / 2.0 GiB" in a[1][4] and "███" in a[1][4]
    assert a[0][-2:] == ["throttled", "3"] and a[1][-2:] == ["running", "0"]
    assert a[1][5] == "N/A"     # launches/s needs two snapshots


def test_state_labels():
    p = proc(5, state="stopped")
    text = frame(snap_with([p]))
    assert "stopped-by-us" in text


def test_status_line_and_empty():
    text = frame(snap_with([]), status="reconnecting… (cannot connect)")
    assert text.splitlines()[1] == "reconnecting… (cannot connect)"
    assert "no CUDA processes tracked" in text
    text = frame(snap_with([]), TopView(group="gone"))
    assert "group 'gone': no processes" in text


def test_sm_share_and_cap():
    g = GroupInfo("g", 0, 2, (SlotInfo(0, 1, 1), SlotInfo(1, 2, 1)), {}, sm_limit=30)
    ps = [proc(1, slot=0, sm_share=12.4), proc(2, slot=1, sm_share=10.0)]
    text = frame(snap_with(ps, [g]))
    assert "SM cap 30% achieved 22%" in text
    assert [r[6] for r in rows(text, "g")] == ["12%", "10%"]


def test_sorts_filter_and_per_device_view():
    ps = [proc(30, slot=0, used=10 * MiB, launches=5), proc(10, slot=1, used=50 * MiB, launches=0),
          proc(20, slot=2, used=20 * MiB, launches=100),
          proc(40, group="h", slot=0, used=1 * MiB)]
    s1 = snap_with(ps)
    s2 = snap_with([dataclasses.replace(p, launches=(p.launches or 0) * 3 if p.launches
                                        is not None else None) for p in ps], taken_at=1002.0)
    rates = LaunchRates()
    rates.update(s1)
    rates.update(s2)
    pids = lambda v: [int(r[1]) for r in rows(frame(s2, v, rates), "g")]  # noqa: E731
    assert pids(TopView("memory")) == [10, 20, 30]
    assert pids(TopView("launches")) == [20, 30, 10]       # 100/s, 5/s, 0/s
    assert pids(TopView("pid")) == [10, 20, 30]
    text = frame(s2, TopView(group="h"), rates)
    assert "group h " in text and "group g " not in text
    assert [r[5] for r in rows(frame(s2, TopView("launches"), rates), "g")] == ["100", "5.0",
                                                                                "0.0"]

    two = ProcessInfo(7, 1, "two", "d", 0, {0: DeviceUsage(MiB, None),
                                              1: DeviceUsage(3 * MiB, 8 * MiB)}, None)
    text = frame(snap_with([two]), TopView(per_device=True))
    lines = [ln for ln in text.splitlines() if "MiB /" in ln and ln.startswith("│")]
    assert len(lines) == 2
    assert " 7 " in lines[0] and "1.0 MiB / unlimited" in lines[0]
    assert " 7 " not in lines[1] and "3.0 MiB / 8.0 MiB" in lines[1]
    text = frame(snap_with([two]), TopView(per_device=False))
    assert "4.0 MiB / unlimited" in text and "0,1" in text


def test_usage_bar():
    assert usage_bar(None, 10).plain == "N/A"
    assert usage_bar(5 * MiB, 10 * MiB, width=10).plain == "█████░░░░░ 5.0 MiB / 10.0 MiB"
    assert usage_bar(20 * MiB, 10 * MiB, width=4).plain.startswith("████ ")    # capped at full
    assert usage_bar(MiB, None, width=3).plain == "╌╌╌ 1.0 MiB / unlimited"


def test_frame_fits_narrow_terminal():
    # rich never raises on a narrow screen; every line fits the width
    for line in frame(width=80).splitlines():
        assert len(line) <= 80


# -------------------------------------------------------- key state machine

def test_keys():
    v = TopView()
    seen = []
    for _ in range(len(SORTS)):
        v = next_view(v, "s", [])
        seen.append(v.sort)
    assert seen == ["launches", "pid", "memory"]
    groups = ["a", "b"]
    v = TopView()
    order = []
    for _ in range(3):
        v = next_view(v, "f", groups)
        order.append(v.group)
    assert order == ["a", "b", None]
    # a filtered group that disappeared: the next f starts over at the first group
    assert next_view(TopView(group="gone"), "f", groups).group == "a"
    assert next_view(TopView(group="b"), "f", []).group is None
    assert next_view(TopView(), "d", groups).per_device is True
    assert next_view(TopView(per_device=True), "d", groups).per_device is False
    assert next_view(TopView(), "q", groups) is None
    assert next_view(TopView(), "Q", groups) is None
    assert next_view(TopView(sort="pid"), "x", groups) == TopView(sort="pid")


# ------------------------------------------------------------- launches/s

def test_launch_rates_over_a_window():
    r = LaunchRates(window=1.0)
    p = lambda n, t, start=1: snap_with([proc(1, launches=n, start=start)], taken_at=t)  # noqa
    assert r.update(p(0, 100.0)) == {(1, 1): None}       # one sample: unknown
    assert r.update(p(25, 100.25)) == {(1, 1): 100.0}
    assert r.update(p(25, 100.25)) == {(1, 1): 100.0}    # same snapshot again: unchanged
    r.update(p(50, 100.5))
    r.update(p(75, 100.75))
    assert r.update(p(100, 101.0))[(1, 1)] == pytest.approx(100.0)
    # the window slides: only the last second counts
    assert r.update(p(100, 101.5))[(1, 1)] == pytest.approx(50.0)   # (100-50)/1.0
    # a count that went down (daemon restarted) is unknown, not negative
    assert r.update(p(3, 102.0))[(1, 1)] is None
    # a new process with the same pid (other start time) starts fresh
    assert r.update(p(10, 102.25, start=2)) == {(1, 2): None}
    r.reset()
    assert r.update(p(10, 103.0)) == {(1, 1): None}


def test_launch_rates_uncounted_processes_are_left_out():
    r = LaunchRates()
    r.update(snap_with([proc(1)], taken_at=1.0))
    assert r.update(snap_with([proc(1)], taken_at=2.0)) == {}


# ----------------------------------------------------------------- events

def test_event_format():
    e = EventRecord(1_700_000_000.25, "compact", "compacted",
                    {"group": "g", "removed": 5, "moves": [{"pid": 9, "from": 2, "to": 0}]}, seq=3)
    ts, kind, msg = event_parts(e)
    assert ts.endswith(".250") and len(ts) == 12
    assert kind == "compact "
    assert format_event(e) == f"{ts}  compact   group 'g': pid 5 left; pid 9 slot 2->0"


def test_events_follow_survives_restart(monkeypatch):
    d = tempfile.mkdtemp(prefix="hb", dir="/tmp")
    path = os.path.join(d, "s.sock")
    first = [EventRecord(100.0 + i, "group", "deleted", {"group": f"old {i}"}, seq=i + 1)
             for i in range(2)]
    second = [EventRecord(100.0, "group", "deleted", {"group": "old 0"}, seq=1),  # a replay is not printed
              EventRecord(200.0, "state", "fresh", {"pin_dir": "new 1"}, seq=2)]
    box = {"events": first}
    srv = [SnapshotServer(path, example_snapshot,
                          lambda since: [e for e in box["events"] if e.seq > since])]
    srv[0].start()
    import time
    calls = []

    def fake_sleep(s):
        calls.append(s)
        if len(calls) == 1:          # the daemon goes away
            srv[0].close()
        elif len(calls) == 3:        # ... and a new one starts, numbering from 1 again
            box["events"] = second
            srv[0] = SnapshotServer(path, example_snapshot,
                                    lambda since: [e for e in box["events"] if e.seq > since])
            srv[0].start()
        elif len(calls) == 5:
            raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", fake_sleep)
    try:
        r = CliRunner().invoke(main, ["events", "--follow", "--socket", path, "--interval", "0.1"])
    finally:
        srv[0].close()
        shutil.rmtree(d, ignore_errors=True)
    assert r.exit_code == 0, r.output
    out = r.stdout.splitlines()
    assert [ln[24:] for ln in out] == ["group 'old 0' is empty: deleted",
                                       "group 'old 1' is empty: deleted",
                                       "--fresh: kept state under new 1 discarded"]
    assert "reconnecting" in r.stderr and "reconnected" in r.stderr


# ---------------------------------------------------------------- metrics

def scrape(snap):
    text = generate_latest(make_registry(lambda: snap)).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_metrics_hami_bpf_series():
    c = collections.Counter({"denials": 4, "compactions": 2, "ringbuf_drops": 1, "events": 9,
                             "throttle_episodes": 3, "throttle_ms": 1500, "handler_errors": 1,
                             "allocs_map_full": 0})
    for ns in (50_000, 3_000_000, 3_000_000, 7_000_000_000):
        observe_exit_latency(c, ns)
    base = example_snapshot()
    p = dataclasses.replace(base.processes[0], sm_share=42.0, visible_devices={0: 3})
    devs = (dataclasses.replace(base.devices[0], uuid="GPU-abc"),) + base.devices[1:]
    snap = dataclasses.replace(base, processes=(p,) + base.processes[1:], devices=devs,
                               counters=c)
    got = scrape(snap)
    assert got[("hami_bpf_denials_total", ())] == 4
    assert got[("hami_bpf_throttle_episodes_total", ())] == 3
    assert got[("hami_bpf_throttle_seconds_total", ())] == 1.5
    assert got[("hami_bpf_probe_errors_total", (("kind", "handler"),))] == 1
    assert got[("hami_bpf_probe_errors_total", (("kind", "allocs_map_full"),))] == 0
    h = "hami_bpf_exit_compaction_latency_seconds"
    assert got[(h + "_count", ())] == 4
    assert got[(h + "_sum", ())] == pytest.approx(7.00605)
    assert got[(h + "_bucket", (("le", "0.0001"),))] == 1
    assert got[(h + "_bucket", (("le", "0.005"),))] == 3
    assert got[(h + "_bucket", (("le", "2.5"),))] == 3
    assert got[(h + "_bucket", (("le", "+Inf"),))] == 4
    assert len(EXIT_LATENCY_BUCKETS_NS) + 1 == sum(1 for k in got if k[0] == h + "_bucket")
    # HAMi's labels: the ordinal the process sees, the physical device's uuid
    k8s = (("container", "main"), ("group", "pod-a"), ("namespace", "default"), ("pid", "1234"),
           ("pod", "train-0"))
    assert got[("hami_vgpu_memory_used_bytes",
                tuple(sorted(k8s + (("vdevice_index", "3"), ("device_uuid", "GPU-abc")))))] \
        == 512 * MiB
    assert got[("hami_container_device_utilization_ratio", k8s)] == 42.0
    assert got[("hami_bpf_process_state", (("group", "pod-a"), ("pid", "1240"),
                                           ("state", "throttled")))] == 1
    assert got[("hami_bpf_process_denials_total", (("group", "pod-a"), ("pid", "1240")))] == 3
    assert got[("hami_bpf_group_sm_limit_percent", (("group", "pod-a"),))] == 50
    assert ("hami_bpf_group_sm_limit_percent", (("group", "pod-b"),)) not in got
    assert got[("hami_bpf_group_denials_total", (("group", "pod-a"),))] == 3
    host = [k for k in got if k[0] == "hami_host_gpu_memory_used_bytes"]
    assert len(host) == 1 and dict(host[0][1])["device_uuid"] == "GPU-abc"
    assert got[host[0]] == 2 << 30


def test_metrics_without_processes_have_no_process_series():
    got = scrape(Snapshot.empty())
    assert not [k for k in got if "pid" in dict(k[1])]
    assert ("hami_bpf_exit_compaction_latency_seconds_count", ()) not in got


def test_snapshot_new_fields_round_trip():
    p = ProcessInfo(1, 2, "c", "g", 0, {0: DeviceUsage(1, None)}, None, sm_share=12.5,
                    visible_devices={2: 0})
    d = DeviceInfo(0, "x", None, None, None, False, uuid="GPU-1")
    s = Snapshot(1, 1.0, False, {}, (d,), (p,), (), {})
    back = Snapshot.from_json(s.to_json())
    assert back.processes[0].sm_share == 12.5 and back.processes[0].visible_index(2) == 0
    assert back.processes[0].visible_index(5) == 5
    assert back.devices[0].uuid == "GPU-1"
    # documents without the fields (older daemons) still parse
    doc = s.to_json()
    del doc["processes"][0]["sm_share"], doc["processes"][0]["visible_devices"]
    del doc["devices"][0]["uuid"]
    old = Snapshot.from_json(doc)
    assert old.processes[0].sm_share is None and old.devices[0].uuid is None
