"""Prometheus exporter that renders the latest Snapshot at scrape time.

Building the series from the snapshot on every scrape (instead of updating
long-lived Gauges) means a process that exited simply stops appearing, with no
label bookkeeping.

Per-process memory series reuse the metric names of HAMi's vGPU monitor
(hami_vgpu_memory_used_bytes / hami_vgpu_memory_limit_bytes) and its label
names for the same things: "vdevice_index" for the device ordinal the process
sees, and "namespace", "pod", "container" when the snapshot knows them. Our
own labels are "group" and "pid".
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .config import parse_host_port
from .snapshot import (COUNTER_COMPACTIONS, COUNTER_DENIALS, COUNTER_EVENTS,
                       COUNTER_RINGBUF_DROPS, Snapshot)

log = logging.getLogger(__name__)

K8S_LABELS = ("namespace", "pod", "container")

_COUNTERS = (
    ("hami_bpf_denials_total", COUNTER_DENIALS, "Allocations refused because of a limit."),
    ("hami_bpf_compactions_total", COUNTER_COMPACTIONS, "Slot table compactions."),
    ("hami_bpf_ringbuf_drops_total", COUNTER_RINGBUF_DROPS,
     "Events lost because the BPF ring buffer was full."),
    ("hami_bpf_events_total", COUNTER_EVENTS, "Events received from the BPF programs."),
)


class MetricsError(Exception):
    """The exporter could not start; str() is one line."""


class SnapshotCollector(Collector):
    def __init__(self, get_snapshot: Callable[[], Snapshot]) -> None:
        self._get_snapshot = get_snapshot

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._get_snapshot()
        except Exception:
            # A scrape with missing series is better than a 500 that hides
            # the process metrics too.
            log.exception("metrics: cannot get snapshot")
            return
        used = Metric("hami_vgpu_memory_used_bytes",
                      "Device memory a process has allocated on one device, in bytes.", "gauge")
        limit = Metric("hami_vgpu_memory_limit_bytes",
                       "Device memory limit that applies to the process on one device, in bytes "
                       "(absent when unlimited).", "gauge")
        for p in snap.processes:
            base = {"group": p.group, "pid": str(p.pid)}
            # Only labels we know: an empty label would read as "known to be empty".
            base.update({k: p.labels[k] for k in K8S_LABELS if p.labels.get(k)})
            for dev, u in p.devices.items():
                labels = {**base, "vdevice_index": str(dev)}
                used.add_sample(used.name, labels, float(u.used_bytes))
                if u.limit_bytes is not None:
                    limit.add_sample(limit.name, labels, float(u.limit_bytes))
        yield used
        yield limit

        procs = GaugeMetricFamily("hami_bpf_processes", "CUDA processes being tracked.")
        procs.add_metric([], len(snap.processes))
        yield procs

        slots = GaugeMetricFamily("hami_bpf_group_slots", "Slots in use in a group's slot table.",
                                  labels=["group"])
        for g in snap.groups:
            slots.add_metric([g.id], g.proc_num)
        yield slots

        for name, key, doc in _COUNTERS:
            if key in snap.counters:
                c = CounterMetricFamily(name, doc)
                c.add_metric([], snap.counters[key])
                yield c


class MetricsServer:
    """Handle on the running exporter; close() stops it."""

    def __init__(self, httpd, thread: threading.Thread, registry: CollectorRegistry) -> None:
        self._httpd = httpd
        self._thread = thread
        self.registry = registry
        self.address = httpd.server_address[:2]  # (host, port); port is real even for ":0"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2)


def make_registry(get_snapshot: Callable[[], Snapshot]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(get_snapshot))
    return registry


def start_metrics_server(addr: str, get_snapshot: Callable[[], Snapshot]) -> MetricsServer:
    """Serve /metrics on HOST:PORT in a daemon thread (PORT 0 picks a free one)."""
    from prometheus_client import start_http_server

    try:
        host, port = parse_host_port(addr, allow_zero=True)
    except ValueError as e:
        raise MetricsError(f"--metrics-addr {e}") from None
    registry = make_registry(get_snapshot)
    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsError(f"cannot listen on {addr}: {e.strerror or e}") from None
    return MetricsServer(httpd, thread, registry)
