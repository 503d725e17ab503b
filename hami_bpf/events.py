"""Controller-level input events: what the BPF probes and /proc scans observed.

Events are past-tense facts. BPF only knows the tgid, so everything after
registration is keyed by pid; the slot table resolves pid -> live ProcKey.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ProcKey",
    "ProcessRegistered",
    "MemoryAllocated",
    "MemoryFreed",
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
class GroupLimitSet:
    group: str
    device: int
    limit: int | None  # bytes; None = unlimited. May precede the group's creation.


Event = (
    ProcessRegistered
    | MemoryAllocated
    | MemoryFreed
    | LaunchesCounted
    | ProcessExited
    | GroupLimitSet
)
