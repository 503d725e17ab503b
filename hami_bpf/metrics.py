"""Prometheus exporter that renders the latest Snapshot at scrape time.

Building the series from the snapshot on every scrape (instead of updating
long-lived Gauges) means a process that exited simply stops appearing, with no
label bookkeeping.

Per-process memory series reuse the metric names of HAMi's vGPU monitor
(hami_vgpu_memory_used_bytes / hami_vgpu_memory_limit_bytes) and its label
names for the same things: "vdevice_index" for the device ordinal the process
sees, and "namespace", "pod", "container" when the snapshot knows them. Our
own labels are "group" and "pid". Device metrics use HAMi's host names
(hami_host_gpu_memory_used_bytes, hami_host_gpu_utilization_ratio) and labels.
Everything else is hami_bpf_*. The table of all series is in docs/cli.md.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Callable, Iterator

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                   HistogramMetricFamily, Metric)
from prometheus_client.registry import Collector, CollectorRegistry

from .config import parse_host_port
from .snapshot import (COUNTER_COMPACTIONS, COUNTER_DENIALS, COUNTER_EVENTS,
                       COUNTER_RINGBUF_DROPS, Snapshot)

log = logging.getLogger(__name__)

K8S_LABELS = ("namespace", "pod", "container")

# snapshot.counters key -> (metric, help, scale). Absent keys are not exported
# (a counter we do not have is not invented as 0).
_COUNTERS = (
    ("hami_bpf_denials_total", COUNTER_DENIALS, "Allocations refused because of a limit.", 1),
    ("hami_bpf_compactions_total", COUNTER_COMPACTIONS,
     "Slot table compactions (one per exited process).", 1),
    ("hami_bpf_ringbuf_drops_total", COUNTER_RINGBUF_DROPS,
     "Events lost because the BPF ring buffer was full.", 1),
    ("hami_bpf_events_total", COUNTER_EVENTS, "Events received from the BPF programs.", 1),
    ("hami_bpf_throttle_episodes_total", "throttle_episodes",
     "Times a process was held back to keep its group under its SM cap "
     "(and, while its group learns, for a few ms after a synchronize).", 1),
    ("hami_bpf_throttle_seconds_total", "throttle_ms",
     "Time processes spent held back by SM caps, in seconds.", 1e-3),
    ("hami_bpf_sm_holds_cut_short_total", "holds_cut_short",
     "SM holds ended by their time bound with the group's debt or budget unpaid "
     "(the controller erred open).", 1),
    ("hami_bpf_memory_unseen_changes_total", "memory_unseen_changes",
     "Changes of the device memory a process holds by the driver's count that no probed "
     "call charged, which counts against its group's limit (NVML's per-process list).", 1),
    ("hami_bpf_reaped_total", "reaped",
     "Exited processes found by the /proc reaper because their exit event was lost.", 1),
)

# SM controller counters with a label: (metric, snapshot.counters key prefix,
# help, label); the rest of the key is the label's value.
_SM_LABELLED = (
    ("hami_bpf_sm_corrections", "sm_corrections_",
     "Launch-budget rates corrected against the device's utilization, by reason "
     "(held_while_idle: the group was held while its device idled; under_cap: held a little under its cap; over_cap: held over its cap alone on its device; runs_free: over its cap alone and no longer held, its rate re-based on what it launched; turns_idle: groups taking turns left their device idle, and the turns ended; learn_idle: a group waited with nothing in flight while it learned its rate, and learning started over; free_sample: a free sample of a group its budget held found its rate faster than its budget's, or no longer as fast as an earlier sample's, and set it).", "reason"),
    ("hami_bpf_sm_mode_changes", "sm_mode_",
     "Capped groups moved between pacing by time at their synchronizes (duty) and "
     "the launch budget (budget).", "mode"),
    ("hami_bpf_sm_slice_changes", "sm_slices_",
     "Groups paced by time that began to be held in longer slices because their launching "
     "thread sets their pace (host), or in the usual ones again (gpu).", "slices"),
    ("hami_bpf_sm_giveback_changes", "sm_giveback_",
     "Groups paced by time that began to run a share of their running time more because "
     "they are launch-bound and being held slows them (on), or stopped (off).", "state"),
    ("hami_bpf_sm_overlap_changes", "sm_overlap_",
     "Launch-bound groups paced by time that began to run beside launch-bound groups only, "
     "without taking turns with them (on), or stopped (off).", "state"),
    ("hami_bpf_sm_speed_samples", "sm_samples_",
     "Free samples of groups paced by time, run to measure their work per second of running "
     "against free (measured), or interrupted before they measured anything (dropped); "
     "and groups' readings forgotten because their loop changed phase (forgotten).",
     "outcome"),
)

# Probe and handler failures: snapshot.counters key -> value of the `kind` label
# of hami_bpf_probe_errors_total.
PROBE_ERROR_KINDS = {
    "handler_errors": "handler",            # the controller failed to handle an event
    "sm_errors": "sm",                      # SM pacing failed a tick (holds released)
    "enforce_errors": "enforce",            # stop-and-rewrite failed
    "enforce_refused": "enforce_refused",   # stop-and-rewrite refused, call let through
    "allocs_map_full": "allocs_map_full",   # BPF maps full: an allocation was not recorded
    "inflight_map_full": "inflight_map_full",
    "procs_map_full": "procs_map_full",
    "ctx_map_full": "ctx_map_full",
}

# Exit-to-compaction latency (process death -> slot table compacted), in the
# daemon's counters as a cumulative histogram:
#   exit_latency_count, exit_latency_sum_ns, exit_latency_le_<NS> (observations <= NS)
EXIT_LATENCY_BUCKETS_NS = tuple(int(x * 1e6) for x in (
    0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500))
EXIT_LATENCY_COUNT = "exit_latency_count"
EXIT_LATENCY_SUM = "exit_latency_sum_ns"
EXIT_LATENCY_BUCKET = "exit_latency_le_{}"


def observe_exit_latency(counters, latency_ns: int) -> None:
    """Add one exit-to-compaction latency to a collections.Counter of snapshot
    counters (for the daemon; the exporter turns them into a histogram)."""
    latency_ns = max(0, int(latency_ns))
    counters[EXIT_LATENCY_COUNT] += 1
    counters[EXIT_LATENCY_SUM] += latency_ns
    for b in EXIT_LATENCY_BUCKETS_NS:
        if latency_ns <= b:
            counters[EXIT_LATENCY_BUCKET.format(b)] += 1


def _exit_latency(counters) -> HistogramMetricFamily | None:
    if EXIT_LATENCY_COUNT not in counters:
        return None
    h = HistogramMetricFamily(
        "hami_bpf_exit_compaction_latency_seconds",
        "Time from a process's death (exit tracepoint) to its slot being compacted.")
    buckets = [(repr(b / 1e9), counters.get(EXIT_LATENCY_BUCKET.format(b), 0))
               for b in EXIT_LATENCY_BUCKETS_NS]
    buckets.append(("+Inf", counters[EXIT_LATENCY_COUNT]))
    h.add_metric([], buckets, counters.get(EXIT_LATENCY_SUM, 0) / 1e9)
    return h


def node_name() -> str:
    """HAMi's `node` label: $NODE_NAME (set by Kubernetes manifests), else the host name."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


class MetricsError(Exception):
    """The exporter could not start; str() is one line."""


class SnapshotCollector(Collector):
    def __init__(self, get_snapshot: Callable[[], Snapshot]) -> None:
        self._get_snapshot = get_snapshot
        self._node = node_name()

    def collect(self) -> Iterator[Metric]:
        try:
            snap = self._get_snapshot()
        except Exception:
            # A scrape with missing series is better than a 500 that hides
            # the process metrics too.
            log.exception("metrics: cannot get snapshot")
            return
        yield from self._devices(snap)
        yield from self._processes(snap)
        yield from self._groups(snap)
        yield from self._counters(snap)

    def _devices(self, snap: Snapshot) -> Iterator[Metric]:
        """HAMi's host metrics, with its labels (device_uuid empty when unknown,
        device_type "NVIDIA-<name>" as HAMi writes it)."""
        mem = GaugeMetricFamily("hami_host_gpu_memory_used_bytes",
                                "Device memory in use on the GPU (all processes), in bytes.",
                                labels=["node", "device_index", "device_uuid", "device_type"])
        util = GaugeMetricFamily("hami_host_gpu_utilization_ratio",
                                 "GPU core utilization, percent (0-100).",
                                 labels=["node", "device_index", "device_uuid", "device_type"])
        total = GaugeMetricFamily("hami_bpf_device_memory_total_bytes",
                                  "Device memory of the GPU, in bytes.",
                                  labels=["device_index", "device_uuid", "simulated"])
        for d in snap.devices:
            labels = [self._node, str(d.index), d.uuid or "",
                      d.name if d.simulated else f"NVIDIA-{d.name or 'unknown'}"]
            if d.used_bytes is not None:
                mem.add_metric(labels, float(d.used_bytes))
            if d.utilization is not None:
                util.add_metric(labels, float(d.utilization))
            if d.total_bytes is not None:
                total.add_metric([str(d.index), d.uuid or "", str(d.simulated).lower()],
                                 float(d.total_bytes))
        yield mem
        yield util
        yield total

    def _processes(self, snap: Snapshot) -> Iterator[Metric]:
        uuids = {d.index: d.uuid for d in snap.devices if d.uuid}
        used = Metric("hami_vgpu_memory_used_bytes",
                      "Device memory a process has allocated on one device, in bytes.", "gauge")
        limit = Metric("hami_vgpu_memory_limit_bytes",
                       "Device memory limit that applies to the process on one device, in bytes "
                       "(absent when unlimited).", "gauge")
        share = Metric("hami_container_device_utilization_ratio",
                       "Achieved SM share of the process, percent of the device (absent when "
                       "not measured).", "gauge")
        denied = Metric("hami_bpf_process_denials", "Allocations of the process refused.",
                        "counter")
        state = Metric("hami_bpf_process_state",
                       "1 for the process's state: running, throttled (held to its group's SM "
                       "cap) or stopped (by hami-bpf).", "gauge")
        for p in snap.processes:
            base = {"group": p.group, "pid": str(p.pid)}
            # Only labels we know: an empty label would read as "known to be empty".
            base.update({k: p.labels[k] for k in K8S_LABELS if p.labels.get(k)})
            for dev, u in p.devices.items():
                # vdevice_index is the ordinal the process sees (as in HAMi);
                # device_uuid names the physical device when NVML told us.
                labels = {**base, "vdevice_index": str(p.visible_index(dev))}
                if dev in uuids:
                    labels["device_uuid"] = uuids[dev]
                used.add_sample(used.name, labels, float(u.used_bytes))
                if u.limit_bytes is not None:
                    limit.add_sample(limit.name, labels, float(u.limit_bytes))
            if p.sm_share is not None:
                share.add_sample(share.name, base, float(p.sm_share))
            denied.add_sample(denied.name + "_total", base, float(p.denied))
            state.add_sample(state.name, {**base, "state": p.state}, 1.0)
        yield used
        yield limit
        yield share
        yield denied
        yield state

        procs = GaugeMetricFamily("hami_bpf_processes", "CUDA processes being tracked.")
        procs.add_metric([], len(snap.processes))
        yield procs

    def _groups(self, snap: Snapshot) -> Iterator[Metric]:
        slots = GaugeMetricFamily("hami_bpf_group_slots", "Slots in use in a group's slot table.",
                                  labels=["group"])
        sm = GaugeMetricFamily("hami_bpf_group_sm_limit_percent",
                               "The group's SM cap, percent (absent when uncapped).",
                               labels=["group"])
        denied = CounterMetricFamily("hami_bpf_group_denials",
                                     "Allocations of the group's processes refused in the kernel.",
                                     labels=["group"])
        for g in snap.groups:
            slots.add_metric([g.id], g.proc_num)
            if g.sm_limit is not None:
                sm.add_metric([g.id], g.sm_limit)
            denied.add_metric([g.id], g.denied)
        yield slots
        yield sm
        yield denied

    def _counters(self, snap: Snapshot) -> Iterator[Metric]:
        c = snap.counters
        for name, key, doc, scale in _COUNTERS:
            if key in c:
                m = CounterMetricFamily(name, doc)
                m.add_metric([], c[key] * scale)
                yield m
        kinds = [(kind, c[key]) for key, kind in PROBE_ERROR_KINDS.items() if key in c]
        if kinds:
            m = CounterMetricFamily("hami_bpf_probe_errors",
                                    "Failures in the probes or their handling, by kind.",
                                    labels=["kind"])
            for kind, v in kinds:
                m.add_metric([kind], v)
            yield m
        for name, prefix, doc, label in _SM_LABELLED:
            vals = [(k[len(prefix):], v) for k, v in c.items() if k.startswith(prefix)]
            if vals:
                m = CounterMetricFamily(name, doc, labels=[label])
                for lv, v in sorted(vals):
                    m.add_metric([lv], v)
                yield m
        h = _exit_latency(c)
        if h is not None:
            yield h


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
