import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hami_bpf.metrics import MetricsError, make_registry, start_metrics_server
from hami_bpf.snapshot import Snapshot, example_snapshot


def scrape(url):
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_scrape_matches_snapshot():
    current = [example_snapshot()]
    srv = start_metrics_server("127.0.0.1:0", lambda: current[0])
    try:
        url = "http://127.0.0.1:%d/metrics" % srv.address[1]
        got = scrape(url)
        snap = current[0]
        for p in snap.processes:
            for dev, u in p.devices.items():
                labels = {"group": p.group, "pid": str(p.pid), "vdevice_index": str(dev),
                          **{k: v for k, v in p.labels.items()
                             if k in ("namespace", "pod", "container")}}
                key = tuple(sorted(labels.items()))
                assert got[("hami_vgpu_memory_used_bytes", key)] == u.used_bytes
                if u.limit_bytes is None:
                    assert ("hami_vgpu_memory_limit_bytes", key) not in got
                else:
                    assert got[("hami_vgpu_memory_limit_bytes", key)] == u.limit_bytes
        assert got[("hami_bpf_processes", ())] == 3
        assert got[("hami_bpf_group_slots", (("group", "pod-a"),))] == 2
        assert got[("hami_bpf_group_slots", (("group", "pod-b"),))] == 1
        assert got[("hami_bpf_denials_total", ())] == 3
        assert got[("hami_bpf_compactions_total", ())] == 1
        assert got[("hami_bpf_ringbuf_drops_total", ())] == 0
        assert got[("hami_bpf_events_total", ())] == 42
        # HAMi's pod labels appear only when known.
        assert ("hami_vgpu_memory_used_bytes",
                (("group", "pod-b"), ("pid", "2001"), ("vdevice_index", "1"))) in got

        # Series of exited processes vanish on the next scrape.
        current[0] = Snapshot.empty()
        got = scrape(url)
        assert not any(name.startswith("hami_vgpu") for name, _ in got)
        assert got[("hami_bpf_processes", ())] == 0
        assert ("hami_bpf_denials_total", ()) not in got  # unknown counters are not invented
    finally:
        srv.close()


def test_snapshot_failure_gives_empty_scrape():
    def boom():
        raise RuntimeError("x")

    from prometheus_client import generate_latest
    assert generate_latest(make_registry(boom)) == b""


def test_bad_addr():
    with pytest.raises(MetricsError, match="HOST:PORT"):
        start_metrics_server("nope", example_snapshot)
