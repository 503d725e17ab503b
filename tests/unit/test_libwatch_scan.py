"""The library watcher's scans: which processes' maps are read."""
from __future__ import annotations

from hami_bpf import containers, libwatch


def _watcher(registered: list[int]) -> libwatch.LibraryWatcher:
    return libwatch.LibraryWatcher(
        probes=lambda: None, record=lambda *a, **k: None, counters={},
        register=lambda pid: None, is_registered=lambda pid: pid in registered,
        registered=lambda: list(registered), stop_rewrite=lambda: False)


def test_first_scan_reads_registered_processes_later_scans_skip_them(monkeypatch):
    """At a start the registered processes are those adopted from the kept
    maps (a restart, a rollout): their own driver library is probed by nobody
    yet, so the first scan must read their maps; later scans skip them."""
    skips: list[set[int]] = []

    def scan(proc="/proc", skip=()):
        skips.append(set(skip))
        return {}

    monkeypatch.setattr(containers, "scan_libcuda", scan)
    w = _watcher([4242])
    w.discover(register=False)
    w.discover()
    assert 4242 not in skips[0]
    assert 4242 in skips[1]
