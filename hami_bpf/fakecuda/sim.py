"""Reading the stand-in libcuda's simulated GPU (FAKECUDA_GPU_SIM) from outside.

The daemon has no NVML without a GPU; with HAMI_BPF_SIM_GPU naming the same
shared file the workloads use, it reads device utilization from the simulated
timeline instead, so the SM controller's NVML path runs in tests and benches.
Layout: struct gpu_sim in libcuda.c (busy_until[64], busy_ns[64], ...).
"""
from __future__ import annotations

import mmap
import os
import struct
import time

from .. import procfs

MAX_DEVICES = 64
_HEAD = struct.Struct(f"<{MAX_DEVICES}Q{MAX_DEVICES}Q")


def _map_shared(path: str, size: int) -> mmap.mmap:
    """A file the stand-in driver shares, mapped for reading: created (0600,
    no symlink followed) and grown to `size` where the workloads have not yet."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


class SimGpu:
    def __init__(self, path: str):
        self._m = _map_shared(path, _HEAD.size)
        self._last: dict[int, tuple[float, float]] = {}

    def busy_s(self, dev: int, now_ns: int) -> float:
        """Device-busy seconds done by `now_ns` (CLOCK_MONOTONIC)."""
        vals = _HEAD.unpack_from(self._m, 0)
        until, busy = vals[dev], vals[MAX_DEVICES + dev]
        return (busy - max(0, until - now_ns)) / 1e9

    def utilization(self, count: int) -> dict[int, float | None]:
        """Percent busy per device since the previous call (None the first time)."""
        now_ns = time.monotonic_ns()
        now = now_ns / 1e9
        out: dict[int, float | None] = {}
        for d in range(count):
            b = self.busy_s(d, now_ns)
            prev = self._last.get(d)
            self._last[d] = (now, b)
            out[d] = (None if prev is None or now <= prev[0]
                      else max(0.0, min(100.0, 100.0 * (b - prev[1]) / (now - prev[0]))))
        return out


# The stand-in's per-process memory table (FAKECUDA_PROC_MEM): struct pm_slot
# {u32 pid, pad; u64 used[PM_DEVS]} x PM_SLOTS, in libcuda.c.
PM_SLOTS, PM_DEVS = 256, 8
_PM_SLOT = struct.Struct(f"<II{PM_DEVS}Q")


class ProcMem:
    """Each process's device memory as the stand-in driver publishes it: what
    NVML's per-process list reports on a bare-metal host."""

    def __init__(self, path: str):
        self._m = _map_shared(path, PM_SLOTS * _PM_SLOT.size)

    def processes(self, dev: int) -> dict[int, int]:
        """pid -> bytes it holds on `dev`, for live processes holding any."""
        out: dict[int, int] = {}
        if not 0 <= dev < PM_DEVS:
            return out
        for i in range(PM_SLOTS):
            pid, _, *used = _PM_SLOT.unpack_from(self._m, i * _PM_SLOT.size)
            if pid and used[dev] and procfs.start_time(pid) is not None:
                out[pid] = used[dev]
        return out
