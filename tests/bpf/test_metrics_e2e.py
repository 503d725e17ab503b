"""Prometheus metrics of a real daemon (`run --metrics-addr`) against what
`ps --json` says at the same moment, with real uprobes on stand-in libcuda
processes. One daemon per module.
"""
from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import Daemon, Tracked, converge, finish_daemon, gname, wait_for, wait_registered

pytestmark = pytest.mark.bpf

MiB = 1 << 20


def free_port() -> int:
    # `run --metrics-addr` wants a real port (1-65535), so pick a free one.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Scraper:
    def __init__(self, port: int):
        self.url = f"http://127.0.0.1:{port}/metrics"

    def text(self) -> str:
        return urllib.request.urlopen(self.url, timeout=5).read().decode()

    def samples(self) -> list:
        return [s for fam in text_string_to_metric_families(self.text()) for s in fam.samples]


@pytest.fixture(scope="module")
def mdaemon(fakecuda):
    port = free_port()
    d = Daemon(fakecuda, extra=["--metrics-addr", f"127.0.0.1:{port}"]).start()
    d.scraper = Scraper(port)
    yield d
    finish_daemon(d)


def used_from_ps(ps: dict, pids: set[int]) -> dict[tuple[int, int], int]:
    return {(p["pid"], int(dev)): u["used_bytes"] for p in ps["processes"] if p["pid"] in pids
            for dev, u in p["devices"].items()}


def used_from_scrape(samples, pids: set[int]) -> dict[tuple[int, int], int]:
    return {(int(s.labels["pid"]), int(s.labels["vdevice_index"])): int(s.value) for s in samples
            if s.name == "hami_vgpu_memory_used_bytes" and int(s.labels["pid"]) in pids}


def same_moment(d: Daemon):
    """(ps doc, scrape samples) taken while the snapshot did not change:
    ps, scrape, ps again, until both ps documents agree."""
    box = {}

    def check():
        ps1 = d.cli_json("ps")
        samples = d.scraper.samples()
        ps2 = d.cli_json("ps")
        box.update(ps=ps2, samples=samples)
        return None if ps1 == ps2 else "the snapshot changed between ps and the scrape"

    wait_for(check, 10, interval=0.05, what="a quiet moment")
    return box["ps"], box["samples"]


def test_scrape_matches_ps_and_dead_series_disappear(mdaemon, fakecuda):
    g = gname("met")
    limit = 256 * MiB
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "256m"}
    with Tracked.spawn(fakecuda, g, env=env) as a, Tracked.spawn(fakecuda, g, env=env) as b:
        wait_registered(mdaemon, [a, b])
        a.alloc("alloc 40M", 0)
        a.ok("device 1")
        a.alloc("alloc 7M", 1)
        b.alloc("alloc 1048577", 0)
        converge(mdaemon, [a, b])
        pids = {a.pid, b.pid}

        ps, samples = same_moment(mdaemon)
        want = used_from_ps(ps, pids)
        assert want[(a.pid, 0)] == 40 * MiB and want[(b.pid, 0)] == 1048577
        assert used_from_scrape(samples, pids) == want

        by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
        for p in ps["processes"]:
            if p["pid"] not in pids:
                continue
            for dev, u in p["devices"].items():
                key = (("group", g), ("pid", str(p["pid"])), ("vdevice_index", dev))
                assert by[("hami_vgpu_memory_limit_bytes", key)] == u["limit_bytes"] == limit
            assert by[("hami_bpf_process_state", (("group", g), ("pid", str(p["pid"])),
                                                  ("state", p["state"])))] == 1
        grp = next(x for x in mdaemon.snapshot()["groups"] if x["id"] == g)
        assert by[("hami_bpf_group_slots", (("group", g),))] == grp["proc_num"] == 2

        # A denial shows in the process's and the daemon's denial counters.
        before = by.get(("hami_bpf_denials_total", ()), 0)
        b.alloc("alloc 300M", 0, expect_rc=2)
        converge(mdaemon, [a, b])
        ps, samples = same_moment(mdaemon)
        by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
        denied_b = next(p["denied"] for p in ps["processes"] if p["pid"] == b.pid)
        assert denied_b == 1
        assert by[("hami_bpf_process_denials_total", (("group", g), ("pid", str(b.pid))))] == 1
        assert by[("hami_bpf_denials_total", ())] >= before + 1

        # a exits: its series disappear, b's stay; the compaction is counted.
        compactions = by.get(("hami_bpf_compactions_total", ()), 0)
        a.proc.send("exit 0")
        a.proc.wait(5)
        a.mark_dead()
        converge(mdaemon, [b])
        ps, samples = same_moment(mdaemon)
        assert a.pid not in {p["pid"] for p in ps["processes"]}
        assert not [s for s in samples if s.labels.get("pid") == str(a.pid)]
        assert used_from_scrape(samples, pids) == used_from_ps(ps, pids) == {(b.pid, 0): 1048577}
        by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
        assert by[("hami_bpf_compactions_total", ())] == compactions + 1
        assert by[("hami_bpf_group_slots", (("group", g),))] == 1

    # The last member left: the group's series go too.
    wait_for(lambda: [s for s in mdaemon.scraper.samples() if s.labels.get("group") == g],
             5, what=f"no series of group {g}")


def test_scrape_has_hami_device_and_hami_bpf_counters(mdaemon):
    samples = mdaemon.scraper.samples()
    names = {s.name for s in samples}
    snap = mdaemon.snapshot()
    for name in ("hami_bpf_processes", "hami_bpf_events_total", "hami_bpf_ringbuf_drops_total"):
        assert name in names, name
    c = snap["counters"]
    by = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    # BPF-side counters come straight from the maps, so they only grow between
    # the snapshot and the scrape.
    assert by[("hami_bpf_ringbuf_drops_total", ())] >= c["ringbuf_drops"]
    kinds = {s.labels["kind"] for s in samples if s.name == "hami_bpf_probe_errors_total"}
    assert kinds >= {"allocs_map_full", "procs_map_full"}, kinds
    text = mdaemon.scraper.text()
    assert "# TYPE hami_vgpu_memory_used_bytes gauge" in text


def test_exit_latency_histogram(mdaemon, fakecuda):
    g = gname("lat")
    with Tracked.spawn(fakecuda, g) as a:
        wait_registered(mdaemon, [a])
        a.proc.send("exit 0")
        a.proc.wait(5)
        a.mark_dead()
        converge(mdaemon, [a])
    counters = mdaemon.snapshot()["counters"]
    assert counters.get("exit_latency_count", 0) >= 1, counters
    samples = mdaemon.scraper.samples()
    count = next(s.value for s in samples
                 if s.name == "hami_bpf_exit_compaction_latency_seconds_count")
    assert count >= 1
    buckets = [s for s in samples if s.name == "hami_bpf_exit_compaction_latency_seconds_bucket"]
    inf = next(s.value for s in buckets if s.labels["le"] == "+Inf")
    assert inf == count
    values = [s.value for s in buckets]
    assert values == sorted(values)  # cumulative
