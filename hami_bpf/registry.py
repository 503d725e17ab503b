"""The process registry: the slot table, what registration learned of each
process, and every change of membership (registration, the hold at cuInit,
exit, exec, compaction, the reaper's repairs and the kernel's usage taken
over where an event was lost).

It is the only writer of `proc_cfg` (a process's group, slot and device map
in BPF) and turns the slot table's actions into calls on each owner: a group
deleted is one call to SmControl, the region publisher and the probes.
"""
from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass, field
from typing import Callable

from . import abi, enforce
from .actions import ClearSlot, Compacted, CreateGroup, DeleteGroup, ReleaseProcess, WriteSlot
from .classify import ENVIRON_MAX, PROBLEMS_SHOWN, classify, proc_comm
from .events import (MemoryAllocated, MemoryFreed, ProcessExited, ProcessRegistered, ProcKey,
                     UsageObserved)
from .limits import EnvLimits, clipped
from .memory import Place
from .metrics import observe_exit_latency
from .slots import SlotTable


def alloc_key(e: abi.Event) -> int:
    """An allocation's key in the table: its pointer or handle, in the name
    space of its kind (device pointers, cuMemCreate handles and CUDA arrays
    are separate ones in one process)."""
    return e.ptr | (e.alloc_kind << 64)


@dataclass
class ProcInfo:
    """What the controller learned of a process at registration (not in the pure table)."""
    env: EnvLimits | None
    phys: list[int]
    ns_pid: int | None
    state: str = "running"
    labels: dict[str, str] = field(default_factory=dict)   # pod labels (containers.PodRef.labels)
    cvd: str | None = None     # its CUDA_VISIBLE_DEVICES (limits are per visible index)


class ProcessRegistry:
    def __init__(self, *, probes: Callable, devices: Callable, stopped: Callable,
                 group_by: Callable[[], str], env_limits: bool, pod_names,
                 limits, sm, memory: Callable, watch: Callable, regions, record, counters):
        self.table = SlotTable()
        self.info: dict[int, ProcInfo] = {}
        self.exit_latency_ns: collections.deque[int] = collections.deque(maxlen=10000)
        self.dirty = True              # something the snapshot shows changed
        self._probes = probes
        self._devices = devices
        self._stopped = stopped
        self._group_by = group_by
        self.env_limits = env_limits
        self.pod_names = pod_names
        self.limits = limits           # grouplimits.GroupLimits
        self.sm = sm
        self._memory = memory
        self._watch = watch
        self.regions = regions
        self._record = record
        self.counters = counters
        self._mismatch: dict[int, dict[int, int]] = {}   # pid -> kernel usage that disagreed

    def reset(self, first_group_index: int) -> None:
        """A fresh table whose new groups start above the kept maps' indices
        (adoption: a group index is never reused)."""
        self.table = SlotTable(first_group_index=first_group_index)

    def place(self, pid: int, device: int) -> Place | None:
        """Where `pid`'s memory on `device` is accounted (memory.MemoryEnforcer)."""
        view = self.table.process(pid)
        if view is None:
            return None
        return Place(view.group, view.group_index, self.table.limits(view.group).get(device))

    # -- registration ----------------------------------------------------------

    def register(self, pid: int, ts_ns: int, comm: str = "", existing: bool = False,
                 index: int | None = None) -> None:
        if pid == os.getpid():
            return    # the daemon maps libcuda to measure its probes; it is not a workload
        st = enforce.proc_start_time(pid)
        devices = self._devices()
        c = classify(pid, st is not None, group_by=self._group_by(), env_limits=self.env_limits,
                     uuid_to_index=lambda: devices.uuid_to_index, pod_names=self.pod_names)
        if c.environ_cut:
            self._record("config", "env_cut", pid=pid, limit=ENVIRON_MAX)
        for prob in c.problems[:PROBLEMS_SHOWN]:
            self._record("config", "env_ignored", pid=pid, variable=prob.name, value=prob.value,
                         reason=prob.reason)
        if len(c.problems) > PROBLEMS_SHOWN:
            self._record("config", "env_ignored_more", pid=pid, count=len(c.problems) - PROBLEMS_SHOWN)
        group = c.group
        key = ProcKey(pid, st if st is not None else 0)
        self.info[pid] = ProcInfo(c.env, c.phys, c.ns_pid, labels=c.labels, cvd=c.cvd)
        actions = self.table.apply(ProcessRegistered(key, group, comm or proc_comm(pid), ts_ns,
                                                     index=index))
        self.act(actions, new_pid=pid if not existing else None, existing=existing)
        view = self.table.process(pid)
        if view is None:
            return
        if existing:
            self._probes().ensure_proc(pid)
        self._record("register", "registered", pid=pid, comm=view.comm, group=group,
                     slot=view.slot)
        if c.failed:
            self.counters["classify_failures"] += 1
            self._record("error", "classify_failed", pid=pid, group=group,
                         classify_failed=list(c.failed), reasons=list(c.reasons))
        try:
            self.limits.apply(view.group, view.group_index, pid, c.cvd)
        except Exception as e:  # noqa: BLE001 - fall back to the policy alone, never to nothing
            self.counters["classify_failures"] += 1
            self._record("error", "limits_failed", pid=pid, group=group,
                         classify_failed=["limits"], error=f"{type(e).__name__}: {clipped(str(e))}")
            info = self.info.get(pid)
            if info is not None:
                info.env, info.cvd = None, None
            self.limits.apply(view.group, view.group_index, pid, None)

    def register_found(self, pid: int) -> None:
        """A user of a library discovery attached to (it may have called
        cuInit before the probes were there)."""
        self.register(pid, time.monotonic_ns(), existing=True)
        self.dirty = True

    def gated(self, pid: int, ts_ns: int, comm: str = "") -> bool:
        """A process held at cuInit until it is classified: register it and
        resume it, if this call is the one that claims its hold (its event
        and the tick's scan of gate_wait may both report it). True if it did."""
        if not self._probes().claim_gate(pid):
            return False
        stopped = self._stopped()
        try:
            if self.table.resolve(pid) is not None:
                # Held at cuInit, so BPF has no proc_cfg for it: a new image
                # whose exec event was lost (ring buffer full). Its old image
                # is gone.
                self.exec(pid, ts_ns)
            stopped.add(pid, enforce.proc_start_time(pid), "held at cuInit")
            try:
                self.register(pid, ts_ns, comm=comm)
            finally:
                stopped.remove(pid)
        finally:
            enforce.resume(pid)   # exactly once (see memory.MemoryEnforcer)
        return True

    def release_gated(self) -> None:
        """Every process the cuInit probe holds, whether or not its event got
        through the ring buffer (maps.h, gate_wait)."""
        for pid in self._probes().gate_waiting():
            if self.gated(pid, time.monotonic_ns()):
                self.counters["gate_scan_claims"] += 1
                self.dirty = True

    # -- memory events ------------------------------------------------------------

    def allocated(self, e: abi.Event) -> None:
        pid = e.tgid
        ptr = alloc_key(e)
        before = self.table.process(pid)
        first_use = before is not None and not before.used.get(e.device)
        self.table.apply(MemoryAllocated(pid, e.device, e.size, ptr, e.ts_ns))
        if first_use and self.limits.ctx_bytes:
            self.limits.sync(before.group, e.device)
        if e.flags & abi.F_DENIED:
            self._record("deny_ignored", "charged", pid=pid, group=before.group if before else None, device=e.device,
                         size=e.size)

    def alloc_failed(self, e: abi.Event) -> None:
        self.counters["alloc_failures"] += 1

    def freed(self, e: abi.Event) -> None:
        ptr = alloc_key(e)
        self.table.apply(MemoryFreed(e.tgid, ptr, e.ts_ns))

    # -- leaving ---------------------------------------------------------------

    def exit(self, pid: int, ts_ns: int) -> None:
        if self.table.resolve(pid) is None:
            return
        self.act(self.table.apply(ProcessExited(pid, None, ts_ns)))
        self._watch().release(pid)
        lat = max(0, time.monotonic_ns() - ts_ns)
        self.exit_latency_ns.append(lat)
        observe_exit_latency(self.counters, lat)

    def exec(self, pid: int, ts_ns: int) -> None:
        """The process replaced its image: the old image's memory died with it
        (BPF gave its bytes back already), so it leaves its group as at an
        exit. The new image is classified afresh, from its new environment, at
        its first libcuda call (held at cuInit like any new process)."""
        view = self.table.process(pid)
        if view is None:
            return
        self.counters["execs"] += 1
        self._record("exec", "replaced", pid=pid, comm=view.comm, group=view.group)
        self.act(self.table.apply(ProcessExited(pid, None, ts_ns)))
        self._watch().release(pid)

    def reap(self) -> None:
        """Repair lost exit events: a process whose /proc entry is gone or reused has exited."""
        for p in self.table.processes():
            if enforce.proc_start_time(p.key.pid) != p.key.start_time:
                self.counters["reaped"] += 1
                self.act(self.table.apply(ProcessExited(p.key.pid, p.key.start_time,
                                                        time.monotonic_ns())))
                self.dirty = True
        # Users of libraries found by discovery that are not registered (or
        # whose exit event was lost): gone or reused -> maybe detach.
        self._watch().housekeeping(time.monotonic())

    def sweep(self) -> None:
        """Allocation records in BPF of processes neither we nor BPF know."""
        probes = self._probes()
        probes.sweep({p.key.pid for p in self.table.processes()} | probes.bpf_procs())

    def reconcile(self) -> None:
        """The kernel's per-process counters (pmem) are authoritative: the
        table's sum of allocation events is corrected where it disagrees with
        them twice in a row with the same value (one disagreement may be an
        event still on its way; a lost one stays)."""
        kernel: dict[int, dict[int, int]] = {}
        for (pid, dev), b in self._probes().process_mem().items():
            if b:
                kernel.setdefault(pid, {})[dev] = b
        now: dict[int, dict[int, int]] = {}
        for p in self.table.processes():
            k = kernel.get(p.key.pid, {})
            if k == dict(p.used):
                continue
            if self._mismatch.get(p.key.pid) != k:
                now[p.key.pid] = k
                continue
            self.table.apply(UsageObserved(p.key.pid, k, p.key.start_time))
            self.counters["usage_corrections"] += 1
            self.dirty = True
            self._record("reconcile", "corrected", pid=p.key.pid, group=p.group,
                         before={str(d): b for d, b in p.used.items()},
                         after={str(d): b for d, b in k.items()})
        self._mismatch = now

    # -- the table's actions, applied ------------------------------------------------

    def act(self, actions, new_pid: int | None = None, existing: bool = False) -> None:
        after_release: list[tuple[str, tuple[int, ...]]] = []
        for a in actions:
            if isinstance(a, WriteSlot):
                self._write_slot(a, new_pid, existing)
            elif isinstance(a, ReleaseProcess):
                self.info.pop(a.key.pid, None)
                self.sm.release(a.group, a.key.pid)
                devs = set(a.released) if self.limits.ctx_bytes else set()
                devs.update(self.limits.forget_process(a.key.pid))
                if devs:
                    after_release.append((a.group, tuple(sorted(devs))))
                self._memory().forget(a.key.pid)
                if enforce.proc_start_time(a.key.pid) != a.key.start_time:
                    self._probes().delete_proc_cfg(a.key.pid)
            elif isinstance(a, DeleteGroup):
                self.delete_group(a.name, a.index)
            elif isinstance(a, Compacted):
                moves = [{"pid": k.pid, "from": f, "to": t} for k, f, t in a.moves]
                self.counters["compactions"] += 1
                self._record("compact", "compacted", group=a.group, removed=a.removed.pid, moves=moves)
            elif isinstance(a, (CreateGroup, ClearSlot)):
                pass
        for group, devs in after_release:
            for dev in devs:
                self.limits.sync(group, dev)

    def _write_slot(self, a: WriteSlot, new_pid: int | None, existing: bool) -> None:
        info = self.info.get(a.key.pid)
        first = a.key.pid == new_pid or (existing and a.key.pid in self.info)
        ok = self._probes().write_proc_cfg(a.key.pid, a.group_index, a.slot,
                                           info.phys if info else None, must_exist=not first)
        if not ok and not first:
            # The exit program already dropped it: its exit event is on the way.
            self.counters["slot_write_after_exit"] += 1

    def delete_group(self, name: str, index: int) -> None:
        """An empty group: one call to each owner of its state."""
        self._probes().delete_group(index)
        self.sm.forget_group(name, index)
        if self.regions:
            self.regions.gone(name)
        self._record("group", "deleted", group=name)
