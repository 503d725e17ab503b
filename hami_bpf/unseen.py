"""Device memory a process holds that no probed call charged.

Pure: readings in, changes out; no I/O.

Some device memory is taken by no call whose size a probe sees: a module's
static __device__ variables when it loads, a CUDA graph's memory nodes when
it runs, a driver entry point the probes do not know. Where the driver
reports each process's device memory (NVML's list of compute processes on a
bare-metal host; a virtual machine's lists none), a member of a group that
holds more than it was charged (its allocations, and the context reserve the
group's limits already count for it) has the difference, its unseen bytes,
counted against its group's limit (hami_bpf.grouplimits): admission in BPF
sees the limit less them, so the group cannot allocate past its limit
through memory the probes cannot size.

A reading and the charges it is compared with are not taken at one instant:
an allocation the driver has made may not have reached the table yet. So an
increase counts only once CONFIRM_READS readings in a row show at least it
(the least of them is taken); a decrease counts at once. Differences under
UNSEEN_MIN are the driver's rounding, not memory anyone can use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

UNSEEN_MIN = 16 << 20   # bytes: smaller differences are not counted
CONFIRM_READS = 2       # readings in a row that an increase needs
READ_S = 2.0            # seconds between readings (the daemon's job)


@dataclass(frozen=True)
class Change:
    """A process's unseen bytes on a device changed: what the driver said it
    holds, what was charged for it then, and the unseen bytes before and now."""
    pid: int
    device: int
    held: int
    charged: int
    before: int
    after: int


class UnseenMemory:
    """Per (pid, device): its unseen bytes in force, and increases waiting for
    their confirmation."""

    def __init__(self) -> None:
        self.unseen: dict[tuple[int, int], int] = {}
        self._rising: dict[tuple[int, int], list[int]] = {}

    def step(self, readings: Mapping[int, Mapping[int, int] | None],
             charged: Callable[[int, int], int | None], reserve: Callable[[int, int], int]) -> list:
        """`readings`: device -> {pid: bytes it holds} (None: not known there);
        `charged(pid, dev)`: bytes charged to a registered process there (None:
        not registered); `reserve(pid, dev)`: what its group's limit already
        counts for its context there. The changes, in reading order."""
        changes = []
        for dev, procs in readings.items():
            if procs is None:
                continue
            # a process the driver no longer lists there holds nothing there
            procs = {**{p: 0 for p, d in self.unseen if d == dev}, **procs}
            for pid, held in procs.items():
                c = charged(pid, dev)
                if c is None:
                    continue
                key = (pid, dev)
                extra = held - c - reserve(pid, dev)
                extra = extra if extra >= UNSEEN_MIN else 0
                old = self.unseen.get(key, 0)
                if extra > old:
                    seen = self._rising.setdefault(key, [])
                    seen.append(extra)
                    if len(seen) < CONFIRM_READS:
                        continue
                    extra = min(seen[-CONFIRM_READS:])
                self._rising.pop(key, None)
                if extra == old or (abs(extra - old) < UNSEEN_MIN and extra and old):
                    continue
                if extra:
                    self.unseen[key] = extra
                else:
                    self.unseen.pop(key, None)
                changes.append(Change(pid, dev, held, c, old, extra))
        return changes

    def bytes(self, pid: int, dev: int) -> int:
        return self.unseen.get((pid, dev), 0)

    def forget(self, pid: int) -> list[int]:
        """The process is gone: the devices where it had unseen bytes."""
        devs = [d for p, d in self.unseen if p == pid]
        for d in devs:
            del self.unseen[(pid, d)]
        for key in [k for k in self._rising if k[0] == pid]:
            del self._rising[key]
        return devs
