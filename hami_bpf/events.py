"""Controller-level input events: what the BPF probes and /proc scans observed.

Events are past-tense facts. BPF only knows the tgid, so everything after
registration is keyed by pid; the slot table resolves pid -> live ProcKey.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ProcKey",
    "ProcessRegistered",
    "MemoryAllocated",
    "MemoryFreed",
    "UsageObserved",
    "LaunchesCounted",
    "ProcessExited",
    "GroupLimitSet",
    "Event",
]


@dataclass(frozen=True, order=True)
class ProcKey:
    """Identity of a process. Pids are reused, so the pid alone is not enough:
    start_time is field 22 of /proc/PID/stat (clock ticks since boot)."""

    pid: int
    start_time: int


@dataclass(frozen=True)
class ProcessRegistered:
    key: ProcKey
    group: str
    comm: str = ""
    ts_ns: int = 0
    # The group's index in the BPF maps when the group is new here but not to
    # them (a restarted daemon adopting its predecessor's maps); ignored when
    # the group exists or the index is taken.
    index: int | None = None


@dataclass(frozen=True)
class MemoryAllocated:
    pid: int
    device: int
    size: int
    # Device pointer, or (for cuMemCreate) handle | (1 << 64) so handles never
    # collide with pointers; unique per live allocation within a process.
    ptr: int
    ts_ns: int = 0


@dataclass(frozen=True)
class MemoryFreed:
    pid: int
    ptr: int  # size and device come from the table's own record of ptr
    ts_ns: int = 0


@dataclass(frozen=True)
class LaunchesCounted:
    pid: int
    count: int  # cumulative for the process, not a delta: a lost event costs nothing


@dataclass(frozen=True)
class ProcessExited:
    pid: int
    start_time: int | None = None  # None: whichever live process holds pid
    ts_ns: int = 0


@dataclass(frozen=True)
class UsageObserved:
    """What the BPF side holds for a process (pmem): device -> bytes, every
    device it holds anything on. The kernel's counters are authoritative; the
    table takes them where its own sum of allocation events disagrees (an
    event lost to a full ring buffer, or a predecessor's allocations)."""
    pid: int
    used: Mapping[int, int]
    start_time: int | None = None  # None: whichever live process holds pid


@dataclass(frozen=True)
class GroupLimitSet:
    group: str
    device: int
    limit: int | None  # bytes; None = unlimited. May precede the group's creation.


Event = (
    ProcessRegistered
    | MemoryAllocated
    | MemoryFreed
    | UsageObserved
    | LaunchesCounted
    | ProcessExited
    | GroupLimitSet
)
