"""The controller's composition root: the components wired together, the
loop (poll -> route -> each job when due -> snapshot) and shutdown.

One thread runs the loop and owns every component's data, the BPF maps and
every ptrace operation (a tracee belongs to the thread that seized it).
Signal handlers only set a flag. The server and metrics threads read the
latest immutable Snapshot, swapped in by reference. docs/architecture.md
names the component that handles each event kind.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

from . import abi, containers, enforce, kept, signals
from .counters import Counters
from .eventlog import EventLog
from .grouplimits import DEFAULT_CONTEXT_BYTES, GroupLimits
from .heartbeat import Heartbeat
from .libwatch import LibraryWatcher
from .memory import MemoryEnforcer
from .policyfile import DaemonError, PolicyFile
from .regionpub import RegionError, RegionPublisher
from .registry import ProcessRegistry
from .smcontrol import SmControl
from .snapshot import Snapshot
from .startup import MAX_PROCS, Startup
from .view import build_snapshot

log = logging.getLogger("hami_bpf")

POLL_MS = 100
# Jobs of the loop besides polling: (name, seconds between runs).
PERIODIC = (("reap", 1.0),         # lost exit events repaired from /proc
            ("reconcile", 1.0),    # the table's usage checked against the kernel's counters
            ("sweep", 10.0),       # allocation records of processes that are gone
            ("unseen", GroupLimits.UNSEEN_READ_S),   # memory the driver counts, no probe charged
            ("refresh", 0.1))      # the views' counters and SM state (maps, NVML: not every turn)


class Daemon:
    def __init__(self, cfg):
        self.cfg = cfg
        self.counters = Counters()    # only names declared in counters.py
        self.mechanisms: dict[str, str] = {}
        self.log = EventLog()
        self.record = self.log.record
        # Set at start: until then the components see None.
        self.probes = self.devices = self.stopped = self.heart = None
        self.server = self.metrics = self.demo = self.fake = None
        self.simulated = False
        self.oom_action = abi.ACT_OBSERVE
        self.group_by = cfg.group_by
        # Set from signal handlers, so plain flags: a handler must take no lock
        # (threading.Event.set() does; a second SIGINT arriving while the first
        # handler held it deadlocked the daemon before its shutdown).
        self._stopping = False
        self._stop_signal: int | None = None     # the signal that asked us to stop
        self._snap = Snapshot.empty()
        common = dict(record=self.record, counters=self.counters)
        probes, devices, stopped = (lambda: self.probes), (lambda: self.devices), (lambda: self.stopped)
        self.startup = Startup(cfg, mechanisms=self.mechanisms, **common)
        self.policy = PolicyFile(cfg.policy, applied=self._policy_applied, **common)
        # SM caps: every piece of SM state and every hold (smcontrol).
        self.sm = SmControl(cfg, probes=probes, table=lambda: self.registry.table,
                            devices=devices, stopped=stopped, libs=lambda: self.watch.libs,
                            mechanisms=lambda: self.mechanisms, **common)
        self.limits = GroupLimits(table=lambda: self.registry.table,
                                  info=lambda pid: self.registry.info.get(pid),
                                  policy=self.policy, sm=self.sm, probes=probes, devices=devices,
                                  env_limits=cfg.env_limits, count_unseen=cfg.unseen_memory, **common)
        self.memory = MemoryEnforcer(place=lambda pid, dev: self.registry.place(pid, dev),
                                     group_used=lambda gi, dev: self.probes.group_used(gi, dev),
                                     context_reserve=self.limits.reserved,
                                     stopped=stopped, **common)
        self.regions = RegionPublisher(
            cfg.hami_regions, record=self.record,
            group_exists=lambda name: self.registry.table.group(name) is not None,
            phys=lambda pid: self.registry.info[pid].phys if pid in self.registry.info else None,
            ndev=lambda: self.devices.count if self.devices else 0,
            sm_caps=self.sm.caps, ctx_bytes=lambda: self.limits.ctx_bytes) if cfg.hami_regions else None
        host = os.environ.get("HAMI_BPF_HOST_ROOT") or "/"
        self.registry = ProcessRegistry(
            probes=probes, devices=devices, stopped=stopped, group_by=lambda: self.group_by,
            env_limits=cfg.env_limits,
            pod_names=containers.PodNames(host if os.path.isdir(host) else "/"),
            limits=self.limits, sm=self.sm, memory=lambda: self.memory, watch=lambda: self.watch,
            regions=self.regions, **common)
        table = lambda: self.registry.table   # noqa: E731
        self.watch = LibraryWatcher(
            probes=probes, register=self.registry.register_found,
            is_registered=lambda pid: table().resolve(pid) is not None,
            registered=lambda: [p.key.pid for p in table().processes()],
            stop_rewrite=lambda: self.oom_action == abi.ACT_STOP_REWRITE,
            grace_s=cfg.lib_grace_s, **common)
        # Each event kind from BPF and the one component that handles it.
        r = self.registry
        self.routes = {
            abi.EV_EXIT: lambda e: r.exit(e.tgid, e.ts_ns),
            abi.EV_EXEC: lambda e: r.exec(e.tgid, e.ts_ns),
            abi.EV_LIBOPEN: self.watch.opened,
            abi.EV_ALLOC: r.allocated, abi.EV_FREE: r.freed, abi.EV_ALLOC_FAIL: r.alloc_failed,
            abi.EV_DENY: self.memory.deny, abi.EV_MEMINFO: self.memory.meminfo,
            abi.EV_TOTALMEM: self.memory.meminfo, abi.EV_NVMLMEM: self.memory.meminfo,
            abi.EV_THROTTLE: self.sm.on_hold,
        }   # EV_INIT: registry.gated where BPF held it (_route), else a first event

    def snapshot(self) -> Snapshot:
        return self._snap

    def _policy_applied(self) -> None:
        self.limits.recompute_all()
        self.sm.sync_launch_probes()
        self.registry.dirty = True

    # -- start-up ------------------------------------------------------------

    def start(self) -> None:
        from . import probes
        cfg, s = self.cfg, self.startup
        s.raise_priority()
        self.watch.libs, self.fake = s.choose_libs()
        if self.fake is not None:
            self.simulated = self.log.verbose = True
            if cfg.demo is not False and self.group_by == "cgroup":
                # The demo's processes share our cgroup; its groups are HAMi-style regions.
                self.group_by = "env:CUDA_DEVICE_MEMORY_SHARED_CACHE"
                log.info("demo: grouping by %s", self.group_by)
        s.lock_libs(self.watch.libs)
        self.policy.load()
        feats, self.oom_action, reg_write, pwu = s.features()
        self.devices = s.discover_devices(self.simulated)
        self.limits.ctx_bytes = cfg.context_bytes if cfg.context_bytes is not None else (
            0 if self.simulated or not self.devices.nvml else DEFAULT_CONTEXT_BYTES)
        self.mechanisms["context_reserve"] = f"{self.limits.ctx_bytes} bytes per process per device"
        self.stopped = s.stopped_set(self.watch.libs)
        pin = s.prepare_kept_state()
        try:
            gate_missing = ("--no-open-gate" if not cfg.open_gate else
                            probes.open_gate_missing() if feats.send_signal else
                            "this kernel refuses bpf_send_signal")
            self.probes = probes.Probes(reg_write=reg_write, probe_write_user=pwu,
                                        max_procs=MAX_PROCS, pin_dir=pin,
                                        open_gate=gate_missing is None)
        except probes.ProbeError as e:
            raise DaemonError(str(e)) from None
        if cfg.pin_dir:
            s.wait_for_predecessor()   # compiling took that long off the wait
        s.config_flags(self.probes, feats=feats, gate_missing=gate_missing,
                       gate_init=bool(cfg.env_limits or self.policy.current),
                       oom_action=self.oom_action)
        self.heart = Heartbeat(self.probes.heartbeat)
        self.heart.start()
        self.probes.open_events(self._on_event)
        if s.adopting:
            s.adopt(self.probes, self.registry)   # before our probes attach: the maps stay still
        s.attach(self.probes, self.watch.libs, self.watch, self.oom_action)
        self.sm.probe_cost_s = s.measure_probe_cost(self.probes, self.watch.libs)
        self.watch.pin_configured()
        self.watch.discover(register=False)   # scan_existing registers their users
        s.recover_bpf_stops(self.watch.libs, self.watch, self.stopped)
        s.scan_existing(self.watch.libs, self.watch, self.registry)
        try:
            self._rebuild_snapshot()
        except RegionError as e:
            raise DaemonError(str(e)) from None
        self.server, self.metrics = s.serve(self.snapshot, self.log.since)
        if self.simulated and cfg.demo is not False:
            from .demo import start_demo_workload
            self.demo = start_demo_workload(self.fake)
        log.info("ready: %s; oom=%s meminfo=%s; socket %s", ", ".join(map(str, self.watch.libs)),
                 self.mechanisms["oom"], self.mechanisms["meminfo"], cfg.socket)

    # -- the loop ------------------------------------------------------------

    def loop(self) -> None:
        r = self.registry
        jobs = {"reap": r.reap, "reconcile": r.reconcile, "sweep": r.sweep, "unseen": self.limits.check_unseen,
                "refresh": lambda: (self.cfg.count_launches or self.sm.active) and self._rebuild_snapshot()}
        due = {name: time.monotonic() + every for name, every in PERIODIC}
        while not self._stopping:
            self.heart.progress()
            # While a group is held, tick fast: the hold should end as soon as
            # the budget allows, or the held time itself lowers the share.
            self.probes.poll(self._poll_ms())
            r.release_gated()
            now = time.monotonic()
            if self.sm.active:
                self.sm.tick(now)
            for name, every in PERIODIC:
                if now >= due[name]:
                    jobs[name]()
                    due[name] = now + every
            self.memory.answer_due(now)   # paced denials whose time has come
            self.policy.due()
            if r.dirty:
                self._rebuild_snapshot()

    def _poll_ms(self) -> int:
        due_at = self.memory.next_due()
        if due_at is not None:
            return max(1, min(POLL_MS, math.ceil((due_at - time.monotonic()) * 1000)))
        wait = self.sm.wait_s(time.monotonic())
        return POLL_MS if wait is None else max(1, math.ceil(wait * 1000))

    def _on_event(self, e: abi.Event) -> None:
        self.heart.progress()
        try:
            self._route(e)
        except Exception:
            log.exception("handling event kind %d of pid %d", e.kind, e.tgid)
            self.counters["handler_errors"] += 1
            # The handlers of stopping events resume exactly once themselves;
            # only a failure before that leaves it to us. A hold at cuInit is
            # resumed by whoever claimed it (registry.gated), or by the next scan.
            if e.flags & abi.F_STOPPED and e.kind != abi.EV_INIT:
                enforce.resume(e.tgid)

    def _route(self, e: abi.Event) -> None:
        r = self.registry
        r.dirty = True
        self.counters["events"] += 1
        if e.kind == abi.EV_INIT and e.flags & abi.F_STOPPED:
            r.gated(e.tgid, e.ts_ns, e.comm.decode(errors="replace"))
            return
        if e.kind not in (abi.EV_EXIT, abi.EV_EXEC, abi.EV_LIBOPEN) and r.table.resolve(e.tgid) is None:
            r.register(e.tgid, e.ts_ns, comm=e.comm.decode(errors="replace"))
        handler = self.routes.get(e.kind)
        if handler is not None:
            handler(e)

    def _rebuild_snapshot(self) -> None:
        self.registry.dirty = False
        self._snap = build_snapshot(registry=self.registry, sm=self.sm, memory=self.memory,
                                    probes=self.probes, devices=self.devices,
                                    mechanisms=self.mechanisms, simulated=self.simulated,
                                    counters=self.counters)
        if self.regions and self.regions.publish(self._snap, time.monotonic()) is False:
            self.registry.dirty = True   # not due yet: come back, the change must not be lost

    # -- stopping --------------------------------------------------------------

    def stop(self, signum: int | None = None) -> None:
        """A fatal signal: the loop ends at its next turn (safe in a signal
        handler: plain assignments, no lock)."""
        if self._stop_signal is None:
            self._stop_signal = signum
        self._stopping = True

    def shutdown(self) -> None:
        """Every exit path: nobody may be left stopped, every probe detached."""
        if self.heart is not None:
            self.heart.stop()
        if self.probes:
            try:
                self.probes.stop_heartbeat()   # the BPF side stops nobody from now on
                self.probes.consume()          # resume what it stopped meanwhile
                self.registry.release_gated()
            except Exception as e:
                log.warning("draining events at shutdown: %s", e)
        self.memory.drain()               # paced denials answered, later ones at once
        if self.stopped:
            for pid in self.stopped.resume_all():
                log.info("resumed pid %d at shutdown", pid)
        if self.demo:
            self.demo.stop()
        for part in (self.server, self.metrics):
            if part:
                part.close()
        if self.probes:
            self.probes.close()
            if self.cfg.pin_dir and self.stopped is not None:
                try:   # the next daemon waits for the child that closes our probes
                    kept.write_owner(self.cfg.state_dir, closer=self.probes.closer_pid)
                except OSError as e:
                    log.warning("recording the probes' closer in %s: %s", self.cfg.state_dir, e)
        self.watch.close()                # after the probes: they detach through its fds


def run(cfg) -> int:
    """Run the daemon until a fatal signal; returns the exit status."""
    logging.basicConfig(level=logging.DEBUG if cfg.verbose else logging.INFO,
                        format="hami-bpf: %(message)s", stream=sys.stderr)
    d = Daemon(cfg)
    old = signals.install(d.stop, d.policy.request)
    try:
        d.start()
        d.loop()
    finally:
        d.shutdown()
        signals.ignore(old)
    status, said = signals.exit_status(d._stop_signal)
    log.info("%s", said)
    return status
