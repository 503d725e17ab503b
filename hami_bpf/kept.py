"""Accounting that outlives the daemon.

The maps that hold usage, allocations, limits and group membership are pinned
in bpffs (maps.h, HAMI_KEPT_HASH), so a restarted or upgraded daemon finds
them where its predecessor left them. This module decides what a new daemon
makes of them; the daemon applies the decision.

  * ``wait_for_predecessor``: the previous daemon's probes must be gone before
    ours attach, or each call would be counted by both (its exit, or the child
    that closes its probes, can outlive its lock by seconds).
  * ``plan``: pure. What the maps say about each process, against what /proc
    says is alive: processes to adopt (with the group index their bytes are
    charged to), processes that exited while no daemon ran (their bytes go
    back to their groups), and reservations of calls whose return no probe
    saw (given back).

What the maps cannot know: calls made while no daemon's probes were attached
(between the predecessor's last probe and ours). Those allocations are not
counted, and their frees are ignored.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from . import procfs

PREDECESSOR_WAIT_S = 120.0   # its probes close in ~0.1 s each (6.18): 370 took 34 s
OWNER_FILE = "daemon.json"
# A process's start time (clock ticks) is coarser than the probes' clock:
# an entry made within this much before the start we compute is still its.
START_SLACK_NS = 20_000_000
GROUP_NONE = 0xFFFFFFFF


@dataclass(frozen=True)
class KeptProc:
    """What the kept maps hold for one process."""
    pid: int
    charged: int | None     # group index its bytes are charged to (procs); None: not yet
    assigned: int | None    # group index the controller gave it (proc_cfg)
    image_ns: int | None    # procs.image: when its entry was made (CLOCK_MONOTONIC); 0/None unknown
    used: Mapping[int, int] = field(default_factory=dict)   # device -> bytes (pmem)


@dataclass(frozen=True)
class Reservation:
    """Bytes an allocation's entry charged to a group; its return was never seen."""
    tid: int
    group: int
    device: int
    size: int


@dataclass(frozen=True)
class Adoption:
    live: tuple[KeptProc, ...]
    dead: tuple[KeptProc, ...]
    reservations: tuple[Reservation, ...]
    stale_calls: tuple[int, ...]      # in-flight entries without a reservation (tids)
    indices: frozenset[int]           # every group index the maps mention

    @property
    def bytes_adopted(self) -> int:
        return sum(sum(p.used.values()) for p in self.live)

    @property
    def bytes_released(self) -> int:
        return sum(sum(p.used.values()) for p in self.dead if p.charged is not None)


def plan(procs: Mapping[int, tuple[int, int]], assigned: Mapping[int, int],
         pmem: Mapping[tuple[int, int], int], calls: Mapping[int, tuple[int, int, int, bool]],
         group_keys: Iterable[int], start_ns: Callable[[int], int | None]) -> Adoption:
    """``procs``: pid -> (charged group or GROUP_NONE, image ns); ``assigned``:
    pid -> group index (proc_cfg); ``pmem``: (pid, device) -> bytes; ``calls``:
    tid -> (group, device, size, reserved) of in-flight entries; ``group_keys``:
    group indices of grp_mem/grp_lim entries; ``start_ns(pid)``: when the live
    process of that pid started (CLOCK_MONOTONIC ns), None if there is none.
    A pid whose entry is older than its live process's start belongs to a
    process that exited unseen (the pid was reused): dead."""
    used: dict[int, dict[int, int]] = {}
    for (pid, dev), b in pmem.items():
        if b:
            used.setdefault(pid, {})[dev] = b
    live, dead = [], []
    for pid in sorted(set(procs) | set(assigned) | set(used)):
        charged, image = procs.get(pid, (GROUP_NONE, 0))
        rec = KeptProc(pid, None if charged == GROUP_NONE else charged,
                       assigned.get(pid), image or None, used.get(pid, {}))
        start = start_ns(pid)
        if start is None or (image and image < start - START_SLACK_NS):
            dead.append(rec)
        else:
            live.append(rec)
    reservations, stale = [], []
    for tid, (group, dev, size, reserved) in sorted(calls.items()):
        if reserved and group != GROUP_NONE and size:
            reservations.append(Reservation(tid, group, dev, size))
        else:
            stale.append(tid)
    indices = set(group_keys)
    for p in live + dead:
        indices.update(i for i in (p.charged, p.assigned) if i is not None)
    indices.update(r.group for r in reservations)
    return Adoption(tuple(live), tuple(dead), tuple(reservations), tuple(stale),
                    frozenset(indices))


# --- /proc and the state directory ---------------------------------------------

def _live_stat(pid: int) -> list[str] | None:
    """stat fields of a process that has not exited (a zombie has closed its
    files: its probes are gone)."""
    f = procfs.stat_fields(pid)
    if not f or len(f) < 22 or f[2] in ("Z", "X"):
        return None
    return f


def start_ns(pid: int) -> int | None:
    """When ``pid``'s live process started, on CLOCK_MONOTONIC (the probes'
    clock); None if there is none or it is a zombie."""
    f = _live_stat(pid)
    if f is None:
        return None
    boot_ns = int(f[21]) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")
    # /proc counts from boot including suspend; the probes' clock does not.
    suspended = time.clock_gettime_ns(time.CLOCK_BOOTTIME) - time.monotonic_ns()
    return boot_ns - suspended


def _alive(pid: int, start: int | None) -> bool:
    f = _live_stat(pid)
    return f is not None and (start is None or int(f[21]) == start)


def _start_ticks(pid: int) -> int | None:
    return procfs.start_time(pid)


def write_owner(state_dir: str, closer: int | None = None) -> None:
    """Record this daemon (and the child that closes its probes) for the next one."""
    from . import __version__
    me = os.getpid()
    rec = {"pid": me, "start": _start_ticks(me), "version": __version__}
    if closer:
        rec.update(closer=closer, closer_start=_start_ticks(closer))
    path = os.path.join(state_dir, OWNER_FILE)
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(tmp, path)


def predecessors(state_dir: str) -> list[tuple[int, int | None]]:
    """(pid, start ticks) of the previous daemon and its probe closer, as it left them."""
    try:
        with open(os.path.join(state_dir, OWNER_FILE)) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return []
    out = []
    for k, s in (("pid", "start"), ("closer", "closer_start")):
        pid, st = rec.get(k), rec.get(s)
        if isinstance(pid, int) and pid > 0 and pid != os.getpid():
            out.append((pid, st if isinstance(st, int) else None))
    return out


def predecessor_version(state_dir: str) -> str | None:
    """The version of the daemon that last recorded itself here (None: unknown)."""
    try:
        with open(os.path.join(state_dir, OWNER_FILE)) as f:
            v = json.load(f).get("version")
    except (OSError, ValueError, AttributeError):
        return None
    return v[:64] if isinstance(v, str) else None


def wait_for_predecessor(state_dir: str, timeout: float = PREDECESSOR_WAIT_S,
                         said: Callable[[list[int]], None] | None = None) -> list[int]:
    """Wait until the previous daemon's processes (and so their probes) are
    gone. Returns the pids still there after ``timeout``. ``said``: given the
    pids waited for, once, when there are any."""
    waiting = [(p, s) for p, s in predecessors(state_dir) if _alive(p, s)]
    if waiting and said:
        said([p for p, _ in waiting])
    deadline = time.monotonic() + timeout
    while waiting and time.monotonic() < deadline:
        time.sleep(0.05)
        waiting = [(p, s) for p, s in waiting if _alive(p, s)]
    return [p for p, _ in waiting]
