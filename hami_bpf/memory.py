"""Memory enforcement in user space: the answers to what the memory probes
stopped a process for.

* A denied allocation under stop-rewrite: the thread waits, stopped at the
  function's entry, until `fail_call` makes the call return
  CUDA_ERROR_OUT_OF_MEMORY. A process that retries over its limit is paced
  (heartbeat.DenyPacer): past a few answers a second its denials queue here,
  still stopped, and are answered when due.
* A memory-information query (cuMemGetInfo, cuDeviceTotalMem, NVML's memory
  info) under stop-write: the virtual figures are written into the caller's
  buffers, then it is resumed.

Admission itself lives in BPF (exact, atomic); this component owns the
per-process denial counts, the pacer and the queue of paced denials. Every
stopped process it is handed is resumed exactly once, on every path: a
second SIGCONT could cancel the stop of the process's next denial.
"""
from __future__ import annotations

import collections
import heapq
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, MutableMapping

from . import abi, enforce
from .heartbeat import DenyPacer
from .ptrace import PtraceError, read_mem, write_mem

log = logging.getLogger("hami_bpf")


@dataclass(frozen=True)
class Place:
    """Where a process's device memory is accounted: its group and limit."""
    group: str
    group_index: int
    limit: int | None        # bytes on the device in question; None = unlimited


class MemoryEnforcer:
    """`place(pid, device)`: the process's Place, None if it is not tracked.
    `group_used(group_index, device)`: bytes the kernel charged to the group.
    `context_reserve(group, device)`: bytes of the group's limit held there
    outside its allocations (contexts, memory no probed call charged).
    `stopped()`: the set of processes on record as stopped by us (enforce).
    `record(kind, what, **data)`: the event log. `counters`: the daemon's."""

    def __init__(self, *, place: Callable[[int, int], Place | None],
                 group_used: Callable[[int, int], int],
                 context_reserve: Callable[[str, int], int],
                 stopped: Callable[[], object], record: Callable[..., None],
                 counters: MutableMapping[str, int]) -> None:
        self._place = place
        self._group_used = group_used
        self._context_reserve = context_reserve
        self._stopped = stopped
        self._record = record
        self._counters = counters
        self._denied: collections.Counter[int] = collections.Counter()
        self._pacer = DenyPacer()
        # Paced denials: (due, seq, event), processes stopped until answered.
        self._queue: list[tuple[float, int, abi.Event]] = []
        self._due_of: dict[int, float] = {}    # pid -> due of its last paced denial
        self._seq = 0
        self._draining = False

    # -- what others ask -------------------------------------------------------

    def denied(self, pid: int) -> int:
        """Allocations of `pid` refused so far."""
        return self._denied.get(pid, 0)

    def forget(self, pid: int) -> None:
        """The process left the table."""
        self._denied.pop(pid, None)
        self._pacer.forget(pid)

    def next_due(self) -> float | None:
        """Monotonic time of the next paced denial's answer, None if none waits."""
        return self._queue[0][0] if self._queue else None

    # -- events ------------------------------------------------------------------

    def deny(self, e: abi.Event) -> None:
        """A DENY event: count it, and answer the stopped call (at once, or
        queued when the process retries too often)."""
        pid, act = e.tgid, e.aux
        what, group, limit = self._what(e)
        self._counters["denials"] += 1
        if act != abi.ACT_OBSERVE and act != abi.ACT_NONE_STALE:
            self._denied[pid] += 1
        if act == abi.ACT_STOP_REWRITE:
            now = time.monotonic()
            # A process that retries over its limit waits, stopped, before its
            # answer: its retries cost the loop little. Its later denials join
            # the queue behind it, so they are answered one after the other.
            delay = 0.0 if self._draining else self._pacer.delay(pid, now)
            if delay > 0 or pid in self._due_of:
                due = max(now + delay, self._due_of.get(pid, 0.0))
                self._due_of[pid] = due
                heapq.heappush(self._queue, (due, self._seq, e))
                self._seq += 1
                self._counters["denials_paced"] += 1
                return
            self._answer(e, what, group, limit)
        elif act == abi.ACT_KILL:
            self._record("deny", "killed", **what, action="kill")
        elif act == abi.ACT_RETURN_OOM:
            self._record("deny", "oom_in_kernel", **what, action="return-oom")
        else:
            self._counters["would_deny"] += 1
            why = "controller stale" if act == abi.ACT_NONE_STALE else "observe only"
            self._record("deny", "allowed", **what, reason=why,
                         action=abi.ACTION_NAMES.get(act, str(act)))

    def answer_due(self, now: float) -> None:
        """Answer the paced denials that are due (every one with now=inf)."""
        while self._queue and self._queue[0][0] <= now:
            _, _, e = heapq.heappop(self._queue)
            what, group, limit = self._what(e, paced=True)
            self._answer(e, what, group, limit)
            if not any(x[2].tgid == e.tgid for x in self._queue):
                self._due_of.pop(e.tgid, None)

    def drain(self) -> None:
        """Shutdown: from now on denials are answered at once, and every
        queued one is answered now (never resumed as it is: its call would
        run into the driver)."""
        self._draining = True
        self.answer_due(math.inf)

    def meminfo(self, e: abi.Event) -> None:
        """A memory-information query stopped at its return: write the group's
        figures (its limit as total) into the caller's buffers, resume it."""
        pid = e.tgid
        try:
            where = self._place(pid, e.device)
            if where is None or where.limit is None:
                enforce.resume(pid)
                return
            limit = where.limit
            # The kernel's charge, not the table's sum: exact even when an
            # event was lost.
            used = (self._group_used(where.group_index, e.device)
                    + self._context_reserve(where.group, e.device))
            if e.kind == abi.EV_MEMINFO:
                # Never report more free than the device really has.
                real_free = int.from_bytes(read_mem(pid, e.ptr, 8), "little")
                free = min(max(0, limit - used), real_free)
                enforce.write_meminfo(pid, e.ptr, e.aux, free, limit)
            elif e.kind == abi.EV_NVMLMEM:
                if e.aux == abi.NVML_MEM_V2:
                    total_at, free_at, used_at = (e.ptr + abi.NVML_MEM_V2_TOTAL,
                                                  e.ptr + abi.NVML_MEM_V2_FREE,
                                                  e.ptr + abi.NVML_MEM_V2_USED)
                else:
                    total_at, free_at, used_at = (e.ptr + abi.NVML_MEM_V1_TOTAL,
                                                  e.ptr + abi.NVML_MEM_V1_FREE,
                                                  e.ptr + abi.NVML_MEM_V1_USED)
                real_free = int.from_bytes(read_mem(pid, free_at, 8), "little")
                free = min(max(0, limit - used), real_free)
                write_mem(pid, used_at, min(used, limit).to_bytes(8, "little"))
                enforce.write_meminfo(pid, free_at, total_at, free, limit)
            else:
                enforce.write_meminfo(pid, 0, e.ptr, 0, limit)
            self._counters["meminfo_rewrites"] += 1
            return  # write_meminfo resumed it
        except (enforce.EnforceError, PtraceError, OSError) as err:
            self._record("error", "meminfo_failed", pid=pid, error=str(err))
        except BaseException:
            enforce.resume(pid)
            raise
        enforce.resume(pid)

    # -- inside ------------------------------------------------------------------

    def _what(self, e: abi.Event, paced: bool = False) -> tuple[dict, str, int | None]:
        """(the denial's payload, its group, its limit); ``paced``: answered late."""
        where = self._place(e.tgid, e.device)
        group = where.group if where else "?"
        limit = where.limit if where else None
        return dict(pid=e.tgid, group=group, device=e.device, size=e.size, limit=limit,
                    paced=paced), group, limit

    def _answer(self, e: abi.Event, what: dict, group: str, limit: int | None) -> None:
        """Make a call the probe stopped return CUDA_ERROR_OUT_OF_MEMORY."""
        pid = e.tgid
        try:
            took = enforce.fail_call(pid, e.tid, e.ptr, stopped=self._stopped())
            self._record("deny", "oom_rewritten", **what, action="stop-rewrite",
                         took_ms=round(took * 1e3, 3))
        except enforce.EnforceRefused as err:
            self._counters["enforce_refused"] += 1
            self._record("fallback", "let_through", **what, action="let-through",
                         reason=err.reason)
        except enforce.EnforceError as err:
            self._counters["enforce_errors"] += 1
            self._record("error", "stop_rewrite_failed", **what, error=str(err))
        except BaseException:
            enforce.resume(pid)
            raise
        finally:
            self._pacer.answered(pid, time.monotonic())
        # fail_call resumed the process on every path above. Never a second
        # SIGCONT: it could cancel the SIGSTOP of the process's next denial.
