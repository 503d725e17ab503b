"""The slot table: a pure model of which process holds which slot of which group.

No I/O, no bcc, no clock reads; time only arrives inside events. `apply`
turns one event into the actions the daemon must perform on the BPF maps.

Why slots are kept the way they are: HAMi-core once compacted dead slots while
a process still cached its old slot index; the index stayed valid by pid but
fell outside [0, proc_num), so later updates went to an inactive slot and the
accounting was lost (TP=2 vLLM stall). Here a group's slots are a Python list
(nothing can exist past proc_num), each process record carries its own slot
number, and a compaction rewrites the mover's record and the list in the same
step, so there is no second copy of an index to go stale.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .actions import (
    Action,
    ClearSlot,
    Compacted,
    CreateGroup,
    DeleteGroup,
    ReleaseProcess,
    WriteSlot,
)
from .events import (
    GroupLimitSet,
    LaunchesCounted,
    MemoryAllocated,
    MemoryFreed,
    ProcessExited,
    ProcessRegistered,
    ProcKey,
    UsageObserved,
)

__all__ = ["SlotTable", "ProcView", "GroupView", "STAT_NAMES"]

U32_MAX = 2**32 - 1

# Counters always present in `stats`, so snapshots have a stable shape.
STAT_NAMES: tuple[str, ...] = (
    "registered",          # new processes placed in a slot
    "reregistered_stale",  # pid came back under a new start_time: old one exited unseen
    "stale_register",      # registration older than the live holder of the pid: dropped
    "duplicate_register",  # same key registered again (no-op, comm refreshed)
    "group_full",          # registration refused: group at max_slots
    "exited",
    "stale_exit",          # exit for a start_time that is not the live one
    "compactions",         # exits that moved a process
    "groups_created",
    "groups_deleted",
    "allocations",
    "frees",
    "duplicate_ptr",       # alloc of a ptr still live (free was lost): old one replaced
    "unknown_pid",
    "unknown_ptr",
    "invalid_event",       # negative size etc.
    "unknown_event",
    "limits_set",
    "usage_corrected",     # a process's usage taken from the kernel's counters (UsageObserved)
    "index_adopted",       # a new group took the index the BPF maps already use for it
)

_EMPTY: Mapping[int, Any] = MappingProxyType({})


@dataclass(frozen=True)
class ProcView:
    key: ProcKey
    comm: str
    group: str
    group_index: int
    slot: int
    used: Mapping[int, int]  # device -> bytes; devices with zero usage omitted
    launches: int | None     # None until a LaunchesCounted arrives
    registered_ts_ns: int
    allocations: int         # live ptrs


@dataclass(frozen=True)
class GroupView:
    name: str
    index: int
    slots: tuple[ProcKey, ...]   # slot order; proc_num == len(slots)
    used: Mapping[int, int]      # device -> bytes; zero entries omitted
    limits: Mapping[int, int | None]  # device -> bytes (None = explicitly unlimited)

    @property
    def proc_num(self) -> int:
        return len(self.slots)


class _Proc:
    """Mutable, table-private record. Holds its own slot so there is exactly one
    place the slot number lives besides the group's list position."""

    __slots__ = ("key", "comm", "group", "slot", "used", "ptrs", "unattributed", "launches",
                 "ts_ns")

    def __init__(self, key: ProcKey, comm: str, group: _Group, slot: int, ts_ns: int):
        self.key = key
        self.comm = comm
        self.group = group
        self.slot = slot
        self.used: dict[int, int] = {}
        self.ptrs: dict[int, tuple[int, int]] = {}  # ptr -> (device, size)
        # device -> bytes the kernel's counters hold that no known ptr explains
        # (UsageObserved): used == sum of ptrs + unattributed, per device.
        self.unattributed: dict[int, int] = {}
        self.launches: int | None = None
        self.ts_ns = ts_ns


class _Group:
    __slots__ = ("name", "index", "slots", "used")

    def __init__(self, name: str, index: int):
        self.name = name
        self.index = index
        self.slots: list[_Proc] = []
        self.used: dict[int, int] = {}


def _add(d: dict[int, int], device: int, delta: int) -> None:
    # Zero entries are dropped so "no usage" has a single representation.
    v = d.get(device, 0) + delta
    if v:
        d[device] = v
    else:
        d.pop(device, None)


class SlotTable:
    """Pure slot table. Feed events to `apply`; read with resolve/process/
    processes/groups; `check_invariants` is cheap enough for tests, O(n)."""

    def __init__(self, *, max_slots: int | None = None, first_group_index: int = 1):
        # first_group_index defaults to 1 so a zero-initialised BPF value never
        # looks like a real group.
        if max_slots is not None and max_slots < 1:
            raise ValueError("max_slots must be >= 1")
        if not 0 <= first_group_index <= U32_MAX:
            raise ValueError("first_group_index must fit in a u32")
        self._max_slots = max_slots
        self._next_index = first_group_index
        self._by_pid: dict[int, _Proc] = {}
        self._groups: dict[str, _Group] = {}
        # Limits outlive groups: they may arrive before the group exists, and
        # a group that empties and comes back keeps its configured limits.
        self._limits: dict[str, dict[int, int | None]] = {}
        self._stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._dispatch: dict[type, Callable[[Any], list[Action]]] = {
            ProcessRegistered: self._register,
            MemoryAllocated: self._alloc,
            MemoryFreed: self._free,
            UsageObserved: self._observed,
            LaunchesCounted: self._launches,
            ProcessExited: self._exit,
            GroupLimitSet: self._limit,
        }

    # ------------------------------------------------------------------ apply
    def apply(self, event: object) -> list[Action]:
        handler = self._dispatch.get(type(event))
        if handler is None:
            self._stats["unknown_event"] += 1
            return []
        return handler(event)

    def _register(self, ev: ProcessRegistered) -> list[Action]:
        key = ev.key
        actions: list[Action] = []
        live = self._by_pid.get(key.pid)
        if live is not None:
            if live.key == key:
                self._stats["duplicate_register"] += 1
                if ev.comm:
                    live.comm = ev.comm
                return actions
            if key.start_time < live.key.start_time:
                # A pid has one holder at a time; the newer holder is the live one.
                self._stats["stale_register"] += 1
                return actions
            self._stats["reregistered_stale"] += 1
            actions += self._remove(live, ev.ts_ns)

        group = self._groups.get(ev.group)
        if group is not None and self._max_slots is not None and len(group.slots) >= self._max_slots:
            self._stats["group_full"] += 1
            return actions
        if group is None:
            index = self._next_index
            if (ev.index is not None and 0 < ev.index <= U32_MAX
                    and ev.index not in self._indices()):
                index = ev.index
                self._stats["index_adopted"] += 1
            elif self._next_index > U32_MAX:
                raise OverflowError("group index space (u32) exhausted")
            group = _Group(ev.group, index)
            # Indices are never reused: a BPF entry of a deleted group must
            # never be read as a new group's.
            self._next_index = max(self._next_index, index + 1)
            self._groups[ev.group] = group
            self._stats["groups_created"] += 1
            actions.append(CreateGroup(group.name, group.index))

        proc = _Proc(key, ev.comm, group, len(group.slots), ev.ts_ns)
        group.slots.append(proc)
        self._by_pid[key.pid] = proc
        self._stats["registered"] += 1
        actions.append(WriteSlot(group.name, group.index, proc.slot, key))
        return actions

    def _exit(self, ev: ProcessExited) -> list[Action]:
        proc = self._by_pid.get(ev.pid)
        if proc is None:
            self._stats["unknown_pid"] += 1
            return []
        if ev.start_time is not None and ev.start_time != proc.key.start_time:
            self._stats["stale_exit"] += 1
            return []
        return self._remove(proc, ev.ts_ns)

    def _remove(self, proc: _Proc, ts_ns: int) -> list[Action]:
        group = proc.group
        slots = group.slots
        hole = proc.slot
        last = len(slots) - 1
        assert slots[hole] is proc, "slot table corrupted"

        released = MappingProxyType(dict(proc.used))
        for device, size in proc.used.items():
            _add(group.used, device, -size)
        actions: list[Action] = [ReleaseProcess(proc.key, group.name, group.index, released)]

        if hole == last:
            slots.pop()
            actions.append(ClearSlot(group.name, group.index, last))
        else:
            mover = slots.pop()
            # List position and record change together: no stale index anywhere.
            slots[hole] = mover
            mover.slot = hole
            actions.append(WriteSlot(group.name, group.index, hole, mover.key))
            actions.append(ClearSlot(group.name, group.index, last))
            actions.append(Compacted(group.name, group.index, proc.key, ((mover.key, last, hole),), ts_ns))
            self._stats["compactions"] += 1

        del self._by_pid[proc.key.pid]
        self._stats["exited"] += 1
        if not slots:
            del self._groups[group.name]
            self._stats["groups_deleted"] += 1
            actions.append(DeleteGroup(group.name, group.index))
        return actions

    def _alloc(self, ev: MemoryAllocated) -> list[Action]:
        proc = self._by_pid.get(ev.pid)
        if proc is None:
            self._stats["unknown_pid"] += 1
            return []
        if ev.size < 0 or ev.device < 0:
            self._stats["invalid_event"] += 1
            return []
        old = proc.ptrs.get(ev.ptr)
        if old is not None:
            # The free for this ptr was lost; the driver reused the address.
            self._stats["duplicate_ptr"] += 1
            self._charge(proc, old[0], -old[1])
        proc.ptrs[ev.ptr] = (ev.device, ev.size)
        self._charge(proc, ev.device, ev.size)
        self._stats["allocations"] += 1
        return []

    def _free(self, ev: MemoryFreed) -> list[Action]:
        proc = self._by_pid.get(ev.pid)
        if proc is None:
            self._stats["unknown_pid"] += 1
            return []
        rec = proc.ptrs.pop(ev.ptr, None)
        if rec is None:
            self._stats["unknown_ptr"] += 1
            return []
        self._charge(proc, rec[0], -rec[1])
        self._stats["frees"] += 1
        return []

    def _observed(self, ev: UsageObserved) -> list[Action]:
        proc = self._by_pid.get(ev.pid)
        if proc is None or (ev.start_time is not None and ev.start_time != proc.key.start_time):
            self._stats["unknown_pid"] += 1
            return []
        if any(d < 0 or b < 0 for d, b in ev.used.items()):
            self._stats["invalid_event"] += 1
            return []
        want = {d: b for d, b in ev.used.items() if b}
        if want == proc.used:
            return []
        changed = {d for d in set(want) | set(proc.used) if want.get(d, 0) != proc.used.get(d, 0)}
        for device in changed:
            self._charge(proc, device, want.get(device, 0) - proc.used.get(device, 0))
        # Which pointers make up the difference is unknown: the ones on a
        # device whose total changed go (a later free of one of them counts
        # as unknown; the kernel's counters already have it right), and the
        # device's bytes are unattributed.
        proc.ptrs = {p: r for p, r in proc.ptrs.items() if r[0] not in changed}
        for device in changed:
            if want.get(device):
                proc.unattributed[device] = want[device]
            else:
                proc.unattributed.pop(device, None)
        self._stats["usage_corrected"] += 1
        return []

    def _indices(self) -> set[int]:
        return {g.index for g in self._groups.values()}

    @staticmethod
    def _charge(proc: _Proc, device: int, delta: int) -> None:
        _add(proc.used, device, delta)
        _add(proc.group.used, device, delta)

    def _launches(self, ev: LaunchesCounted) -> list[Action]:
        proc = self._by_pid.get(ev.pid)
        if proc is None:
            self._stats["unknown_pid"] += 1
            return []
        proc.launches = ev.count
        return []

    def _limit(self, ev: GroupLimitSet) -> list[Action]:
        if ev.device < 0 or (ev.limit is not None and ev.limit < 0):
            self._stats["invalid_event"] += 1
            return []
        self._limits.setdefault(ev.group, {})[ev.device] = ev.limit
        self._stats["limits_set"] += 1
        return []

    # ------------------------------------------------------------------- read
    @property
    def stats(self) -> Mapping[str, int]:
        return MappingProxyType(self._stats)

    def __len__(self) -> int:
        return len(self._by_pid)

    def resolve(self, pid: int) -> tuple[str, int] | None:
        proc = self._by_pid.get(pid)
        return None if proc is None else (proc.group.name, proc.slot)

    def process(self, pid: int) -> ProcView | None:
        proc = self._by_pid.get(pid)
        return None if proc is None else self._view(proc)

    def processes(self) -> tuple[ProcView, ...]:
        """All live processes, ordered by (group index, slot)."""
        return tuple(
            self._view(p)
            for g in sorted(self._groups.values(), key=lambda g: g.index)
            for p in g.slots
        )

    def group(self, name: str) -> GroupView | None:
        g = self._groups.get(name)
        return None if g is None else self._gview(g)

    def groups(self) -> tuple[GroupView, ...]:
        """Live groups, ordered by index."""
        return tuple(self._gview(g) for g in sorted(self._groups.values(), key=lambda g: g.index))

    def limits(self, group: str) -> Mapping[int, int | None]:
        """Configured limits of a group, whether or not it exists yet."""
        lim = self._limits.get(group)
        return MappingProxyType(dict(lim)) if lim else _EMPTY

    @staticmethod
    def _view(p: _Proc) -> ProcView:
        return ProcView(
            key=p.key,
            comm=p.comm,
            group=p.group.name,
            group_index=p.group.index,
            slot=p.slot,
            used=MappingProxyType(dict(p.used)),
            launches=p.launches,
            registered_ts_ns=p.ts_ns,
            allocations=len(p.ptrs),
        )

    def _gview(self, g: _Group) -> GroupView:
        return GroupView(
            name=g.name,
            index=g.index,
            slots=tuple(p.key for p in g.slots),
            used=MappingProxyType(dict(g.used)),
            limits=self.limits(g.name),
        )

    # ------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Raise AssertionError naming the first broken invariant."""
        seen_keys: set[ProcKey] = set()
        seen_indices: set[int] = set()
        n_slotted = 0
        for name, g in self._groups.items():
            if g.name != name:
                raise AssertionError(f"group {name!r} stored under wrong name {g.name!r}")
            if g.index in seen_indices:
                raise AssertionError(f"group index {g.index} used twice")
            seen_indices.add(g.index)
            if not g.slots:
                raise AssertionError(f"group {name!r} is empty but still exists")
            if self._max_slots is not None and len(g.slots) > self._max_slots:
                raise AssertionError(f"group {name!r} exceeds max_slots")
            expect_used: dict[int, int] = {}
            for i, p in enumerate(g.slots):
                n_slotted += 1
                if p.key in seen_keys:
                    raise AssertionError(f"{p.key} holds more than one slot")
                seen_keys.add(p.key)
                if p.slot != i:
                    raise AssertionError(
                        f"{p.key} in {name!r} slot {i} believes it is in slot {p.slot} "
                        f"(proc_num={len(g.slots)})")
                if p.group is not g:
                    raise AssertionError(f"{p.key} in {name!r} points at group {p.group.name!r}")
                if self._by_pid.get(p.key.pid) is not p:
                    raise AssertionError(f"{p.key} in {name!r} slot {i} is not the live holder of its pid")
                per_ptr: dict[int, int] = dict(p.unattributed)
                for device, size in p.ptrs.values():
                    _add(per_ptr, device, size)
                if per_ptr != p.used:
                    raise AssertionError(f"{p.key} usage {p.used} != sum of its live ptrs and "
                                         f"unattributed bytes {per_ptr}")
                for device, size in p.used.items():
                    if size < 0:
                        raise AssertionError(f"{p.key} has negative usage on device {device}")
                    _add(expect_used, device, size)
            if expect_used != g.used:
                raise AssertionError(f"group {name!r} usage {g.used} != sum of its processes {expect_used}")
        if n_slotted != len(self._by_pid):
            raise AssertionError(f"{len(self._by_pid)} live pids but {n_slotted} occupied slots")
        for pid, p in self._by_pid.items():
            if p.key.pid != pid:
                raise AssertionError(f"pid {pid} maps to {p.key}")
            g = self._groups.get(p.group.name)
            if g is not p.group or not 0 <= p.slot < len(g.slots) or g.slots[p.slot] is not p:
                raise AssertionError(f"pid {pid} does not resolve to its own slot inside [0, proc_num)")
        if any(i >= self._next_index for i in seen_indices):
            raise AssertionError("group index ahead of the allocator")
