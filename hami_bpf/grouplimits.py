"""Each group's limits: memory per device in the slot table and in BPF
(`grp_lim`, written only here), SM caps and scheduling handed to SmControl.

A group's limit comes from the policy, lowered by what its members' own
environments ask (never raised). Admission in BPF sees the limit less the
context reserve of the members using the device and their unseen bytes
(hami_bpf.unseen: memory the driver says they hold that no probed call
charged); memory info reports the limit itself.
"""
from __future__ import annotations

from typing import Callable

from .events import GroupLimitSet
from .limits import effective_limits, effective_sched, physical_to_visible
from .unseen import READ_S, UnseenMemory

# What a PyTorch process's CUDA context, modules and handles held on an H200
# (driver 580) right after start-up: 554,500,096 bytes by NVML
# (docs/performance.md). No allocation probe sees it, so each process using a
# device reserves this much of its group's limit there.
DEFAULT_CONTEXT_BYTES = 528 << 20


class GroupLimits:
    UNSEEN_READ_S = READ_S       # how often check_unseen reads the driver's count

    def __init__(self, *, table: Callable, info: Callable, policy, sm, probes: Callable,
                 devices: Callable, env_limits: bool, record, counters=None,
                 count_unseen: bool = True):
        self._table = table          # the registry's slot table (it may be replaced at adoption)
        self._info = info            # pid -> registry.ProcInfo
        self.policy = policy         # policyfile.PolicyFile
        self.sm = sm
        self._probes = probes
        self._devices = devices
        self.env_limits = env_limits
        self._record = record
        self.ctx_bytes = 0           # context reserve per process per device (set at start)
        self.unseen = UnseenMemory()
        self.count_unseen = count_unseen     # off (--no-unseen-memory): the driver's count is not read
        self._counters = counters

    def apply(self, group: str, gidx: int, pid: int, cvd: str | None) -> None:
        """A member can lower its group's limit, never raise it above the policy."""
        table, devices, policy = self._table(), self._devices(), self.policy.current
        info = self._info(pid)
        prio, upol = effective_sched(policy, group,
                                     info.env if info and self.env_limits else None)
        changed = self.sm.set_sched(group, prio, upol)
        if changed:
            prio, upol = changed
            self._record("limit", "sched", group=group, priority=prio, utilization_policy=upol)
        current = table.limits(group)
        for dev in range(devices.count):
            vis = physical_to_visible(dev, cvd, devices.uuid_to_index) if cvd is not None else dev
            # A device the process cannot see by its environment still gets
            # the policy's limit: the environment it started with need not be
            # the one the driver reads (setenv before cuInit).
            env = info.env if info and self.env_limits and vis is not None else None
            mem, sm = effective_limits(policy, group, env, dev, visible_index=vis)
            self.sm.apply_cap(group, dev, sm)
            old = current.get(dev)
            new = mem if old is None else (old if mem is None else min(old, mem))
            if new != old:
                table.apply(GroupLimitSet(group, dev, new))
                self.sync(group, dev)
                self._record("limit", "memory", group=group, device=dev, limit=new)

    def recompute(self, group: str) -> None:
        """Work the group's limits out again from the policy and its members
        (a reloaded policy may raise them)."""
        table = self._table()
        g = table.group(group)
        if g is None:
            return
        old_limits = dict(table.limits(group))
        old_caps = self.sm.clear_group_caps(group)
        for dev in old_limits:
            table.apply(GroupLimitSet(group, dev, None))
        for key in g.slots:
            info = self._info(key.pid)
            self.apply(group, g.index, key.pid, info.cvd if info else None)
        limits = table.limits(group)
        for dev in set(old_limits) | set(limits):
            if limits.get(dev) != old_limits.get(dev):
                self.sync(group, dev)
                if limits.get(dev) is None:
                    self._record("limit", "memory", group=group, device=dev, limit=None)
        self.sm.caps_reread(group, g.index, old_caps)

    def recompute_all(self) -> None:
        for g in self._table().groups():
            self.recompute(g.name)

    def check_unseen(self) -> None:
        """What each member holds by the driver's count against what it was
        charged (hami_bpf.unseen); a change moves its group's admission limit."""
        devices = self._devices()
        if not self.count_unseen or devices is None or not devices.has_process_memory:
            return
        table = self._table()

        def charged(pid: int, dev: int) -> int | None:
            p = table.process(pid)
            return None if p is None else p.used.get(dev, 0)

        def reserve(pid: int, dev: int) -> int:
            p = table.process(pid)
            return self.ctx_bytes if p is not None and p.used.get(dev) else 0

        readings = {dev: devices.process_memory(dev) for dev in range(devices.count)}
        for ch in self.unseen.step(readings, charged, reserve):
            p = table.process(ch.pid)
            group = p.group if p is not None else None
            if group is not None:
                self.sync(group, ch.device)
            if self._counters is not None:
                self._counters["memory_unseen_changes"] += 1
            self._record("limit", "unseen", pid=ch.pid, group=group, device=ch.device,
                         held=ch.held, charged=ch.charged, unseen=ch.after)

    def forget_process(self, pid: int) -> list[int]:
        """A member left: the devices where its unseen bytes counted (to sync)."""
        return self.unseen.forget(pid)

    def unseen_bytes(self, group: str, dev: int) -> int:
        """Bytes the group's members hold on the device that no probed call charged."""
        g = self._table().group(group)
        return 0 if g is None else sum(self.unseen.bytes(k.pid, dev) for k in g.slots)

    def reserved(self, group: str, dev: int) -> int:
        """Bytes of the group's limit on the device held outside its allocations:
        its members' contexts and their unseen bytes."""
        return self.context_reserve(group, dev) + self.unseen_bytes(group, dev)

    def context_reserve(self, group: str, dev: int) -> int:
        """Bytes the group's contexts hold on the device: one per member using it."""
        if not self.ctx_bytes:
            return 0
        table = self._table()
        g = table.group(group)
        if g is None:
            return 0
        n = 0
        for key in g.slots:
            p = table.process(key.pid)
            if p is not None and p.used.get(dev):
                n += 1
        return n * self.ctx_bytes

    def sync(self, group: str, dev: int) -> None:
        """grp_lim: admission in BPF sees the limit less the group's context
        reserve and unseen bytes; memory info keeps reporting the limit itself
        as total."""
        g = self._table().group(group)
        if g is None:
            return
        limit = g.limits.get(dev)
        if limit is None:
            self._probes().set_group_limit(g.index, dev, None, None)
            return
        self._probes().set_group_limit(g.index, dev, max(0, limit - self.reserved(group, dev)),
                                       limit)
