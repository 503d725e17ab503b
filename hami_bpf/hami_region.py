"""HAMi's per-container shared-region file, written from hami-bpf's accounting.

HAMi's node monitor (``vGPUmonitor``) scans ``/usr/local/vgpu/containers/``.
Each entry is a directory named ``<pod uid>_<container name>`` that holds one
``*.cache`` file. HAMi-core maps that file into every process of the
container. The monitor maps it too, and turns it into the per-container
metrics and the usage feedback that HAMi's dashboards and scheduler read. If
hami-bpf writes its own accounting in the same layout, those consumers keep
working without the preload.

The layout, in our own words (x86-64, little-endian, natural C alignment;
version 1 as HAMi's monitor recognises it -- the monitor checks the magic
number and ``major == 1``):

header (offset 0)
    32-bit magic 19920718 (marks the region initialised), 32-bit major and
    minor version, a 32-bit "SM limiter initialised" flag, a 64-bit owner
    pid, then a 32-byte POSIX semaphore (the lock HAMi-core's processes share;
    unused here, zero).
device table (offset 56)
    64-bit device count; 16 UUID strings of 96 bytes each (NUL-padded, in the
    container's device order); 16 memory limits in bytes (0: none); 16 SM
    limits in percent.
process slots (offset 1856)
    1024 slots of 1960 bytes. Each slot holds:
    - the pid inside the container and the host pid (32-bit each);
    - per device (16): a usage record of eight 64-bit words, which are context
      bytes, module bytes, data bytes, an offset, the total, and 3 spare;
    - per device: a 64-bit "memory seen by NVML" figure;
    - per device: a utilisation record of six 64-bit words (decoder, encoder,
      SM, and 3 spare);
    - a 32-bit status (1 running, 2 swapped out), padded to 8 bytes;
    - a 64-bit sequence counter (odd while a writer is inside the slot);
    - 2 spare words.
    Only the first ``proc_num`` slots are live.
trailer (offset 2008896)
    32-bit proc_num, utilisation switch, recent-kernel counter and priority;
    64-bit time of the last kernel launch (seconds); a second 32-byte
    semaphore. Total size: 2,008,952 bytes.

The monitor writes two fields itself: the utilisation switch and the
recent-kernel counter, for its SM-limiting feedback. :func:`publish_region`
therefore writes the file in place and never touches those two fields. It
also never replaces the file: the monitor keeps its mapping of the first file
it saw in a directory.

Device indices in the region are the *container's*, in the order of its
``CUDA_VISIBLE_DEVICES``. hami-bpf accounts per physical device, so the
caller passes the visible-to-physical map.
"""
from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

__all__ = [
    "MAGIC", "MAX_DEVICES", "MAX_PROCS", "REGION_SIZE", "Region", "RegionProc",
    "decode_region", "encode_region", "publish_region", "region_from_snapshot",
    "region_dir_name",
]

MAGIC = 19920718
MAX_DEVICES = 16
MAX_PROCS = 1024
UUID_LEN = 96
SEM_LEN = 32

# offsets worked out from the layout described above
_HDR = struct.Struct("<iIIiQ")                 # magic, major, minor, sm_init, owner_pid
OFF_DEVICE_NUM = _HDR.size + SEM_LEN          # 56
OFF_UUIDS = OFF_DEVICE_NUM + 8                 # 64
OFF_LIMIT = OFF_UUIDS + MAX_DEVICES * UUID_LEN  # 1600
OFF_SM_LIMIT = OFF_LIMIT + 8 * MAX_DEVICES      # 1728
OFF_PROCS = OFF_SM_LIMIT + 8 * MAX_DEVICES      # 1856

_MEM_WORDS = 8     # context, module, data, offset, total, 3 spare
_UTIL_WORDS = 6    # dec, enc, sm, 3 spare
SLOT_OFF_USED = 8
SLOT_OFF_MONITOR = SLOT_OFF_USED + MAX_DEVICES * _MEM_WORDS * 8        # 1032
SLOT_OFF_UTIL = SLOT_OFF_MONITOR + MAX_DEVICES * 8                     # 1160
SLOT_OFF_STATUS = SLOT_OFF_UTIL + MAX_DEVICES * _UTIL_WORDS * 8        # 1928
SLOT_OFF_SEQ = SLOT_OFF_STATUS + 8                                     # 1936
SLOT_SIZE = SLOT_OFF_SEQ + 8 + 2 * 8                                   # 1960

OFF_PROC_NUM = OFF_PROCS + MAX_PROCS * SLOT_SIZE                       # 2008896
OFF_UTIL_SWITCH = OFF_PROC_NUM + 4
OFF_RECENT_KERNEL = OFF_PROC_NUM + 8
OFF_PRIORITY = OFF_PROC_NUM + 12
OFF_LAST_KERNEL = OFF_PROC_NUM + 16
REGION_SIZE = OFF_LAST_KERNEL + 8 + SEM_LEN                            # 2008952

MAJOR, MINOR = 1, 1


@dataclass(frozen=True)
class RegionProc:
    """One process as HAMi-core would record it.

    ``used``, ``context``: bytes per container device index."""

    pid: int                 # inside the container
    host_pid: int
    used: Mapping[int, int] = field(default_factory=dict)
    context: Mapping[int, int] = field(default_factory=dict)
    sm_util: Mapping[int, int] = field(default_factory=dict)
    status: int = 1


@dataclass(frozen=True)
class Region:
    uuids: tuple[str, ...]               # container device order
    limits: tuple[int, ...] = ()         # bytes; 0 or missing: none
    sm_limits: tuple[int, ...] = ()      # percent
    procs: tuple[RegionProc, ...] = ()
    priority: int = 1
    last_kernel_time: int = 0
    owner_pid: int = 0
    major: int = MAJOR
    minor: int = MINOR

    def total(self, dev: int) -> int:
        """What HAMi's monitor reports as the container's usage on ``dev``."""
        return sum(p.used.get(dev, 0) + p.context.get(dev, 0) for p in self.procs)


class RegionError(ValueError):
    pass


def _u64(buf: bytearray, off: int, v: int) -> None:
    struct.pack_into("<Q", buf, off, max(0, int(v)) & 0xFFFFFFFFFFFFFFFF)


def encode_region(r: Region) -> bytes:
    """The whole file image for ``r``."""
    if len(r.uuids) > MAX_DEVICES:
        raise RegionError(f"{len(r.uuids)} devices, the layout holds {MAX_DEVICES}")
    if len(r.procs) > MAX_PROCS:
        raise RegionError(f"{len(r.procs)} processes, the layout holds {MAX_PROCS}")
    buf = bytearray(REGION_SIZE)
    _HDR.pack_into(buf, 0, MAGIC, r.major, r.minor, 0, r.owner_pid)
    _u64(buf, OFF_DEVICE_NUM, len(r.uuids))
    for i, u in enumerate(r.uuids):
        raw = u.encode()[: UUID_LEN - 1]
        buf[OFF_UUIDS + i * UUID_LEN: OFF_UUIDS + i * UUID_LEN + len(raw)] = raw
    for i, v in enumerate(r.limits[:MAX_DEVICES]):
        _u64(buf, OFF_LIMIT + 8 * i, v or 0)
    for i, v in enumerate(r.sm_limits[:MAX_DEVICES]):
        _u64(buf, OFF_SM_LIMIT + 8 * i, v or 0)
    for n, p in enumerate(r.procs):
        base = OFF_PROCS + n * SLOT_SIZE
        struct.pack_into("<ii", buf, base, p.pid, p.host_pid)
        for dev in set(p.used) | set(p.context):
            if not 0 <= dev < MAX_DEVICES:
                raise RegionError(f"pid {p.host_pid}: device {dev} out of range")
            rec = base + SLOT_OFF_USED + dev * _MEM_WORDS * 8
            data, ctx = p.used.get(dev, 0), p.context.get(dev, 0)
            _u64(buf, rec, ctx)
            _u64(buf, rec + 16, data)
            _u64(buf, rec + 32, data + ctx)
        for dev, pct in p.sm_util.items():
            _u64(buf, base + SLOT_OFF_UTIL + dev * _UTIL_WORDS * 8 + 16, pct)
        struct.pack_into("<i", buf, base + SLOT_OFF_STATUS, p.status)
        # sequence counter stays 0: even, i.e. "no writer inside"
    struct.pack_into("<iiii", buf, OFF_PROC_NUM, len(r.procs), 0, 0, r.priority)
    _u64(buf, OFF_LAST_KERNEL, r.last_kernel_time)
    return bytes(buf)


def decode_region(data: bytes) -> Region:
    """Parse a region image (ours or HAMi-core's, version 1)."""
    if len(data) < REGION_SIZE:
        raise RegionError(f"{len(data)} bytes, a version-1 region has {REGION_SIZE}")
    magic, major, minor, _sm, owner = _HDR.unpack_from(data, 0)
    if magic != MAGIC:
        raise RegionError(f"magic {magic}, expected {MAGIC}")
    if major != 1:
        raise RegionError(f"version {major}.{minor}, only 1.x is known")
    (ndev,) = struct.unpack_from("<Q", data, OFF_DEVICE_NUM)
    if ndev > MAX_DEVICES:
        raise RegionError(f"device count {ndev} > {MAX_DEVICES}")
    uuids = tuple(data[OFF_UUIDS + i * UUID_LEN: OFF_UUIDS + (i + 1) * UUID_LEN]
                  .split(b"\0", 1)[0].decode(errors="replace") for i in range(ndev))
    limits = struct.unpack_from(f"<{ndev}Q", data, OFF_LIMIT)
    sm = struct.unpack_from(f"<{ndev}Q", data, OFF_SM_LIMIT)
    proc_num, _switch, _recent, priority = struct.unpack_from("<iiii", data, OFF_PROC_NUM)
    if not 0 <= proc_num <= MAX_PROCS:
        raise RegionError(f"proc_num {proc_num} out of range")
    (last,) = struct.unpack_from("<Q", data, OFF_LAST_KERNEL)
    procs = []
    for n in range(proc_num):
        base = OFF_PROCS + n * SLOT_SIZE
        pid, host_pid = struct.unpack_from("<ii", data, base)
        used, ctx, util = {}, {}, {}
        for dev in range(MAX_DEVICES):
            rec = base + SLOT_OFF_USED + dev * _MEM_WORDS * 8
            c, _mod, d = struct.unpack_from("<QQQ", data, rec)
            if d:
                used[dev] = d
            if c:
                ctx[dev] = c
            (s,) = struct.unpack_from("<Q", data, base + SLOT_OFF_UTIL + dev * _UTIL_WORDS * 8 + 16)
            if s:
                util[dev] = s
        (status,) = struct.unpack_from("<i", data, base + SLOT_OFF_STATUS)
        procs.append(RegionProc(pid, host_pid, used, ctx, util, status))
    return Region(uuids, tuple(limits), tuple(sm), tuple(procs), priority, last, owner,
                  major, minor)


def region_dir_name(pod_uid: str, container_name: str) -> str:
    """The directory HAMi's monitor expects under ``.../vgpu/containers/``."""
    return f"{pod_uid}_{container_name}"


def region_from_snapshot(snap: Mapping, group: str, uuids: Sequence[str],
                         visible: Sequence[int] | None = None, *,
                         context_bytes: int = 0, sm_limits: Sequence[int] = ()) -> Region:
    """A group of a hami-bpf snapshot (the ``snapshot`` socket reply, or
    ``ps --json`` merged with ``slots --json``) as a region.

    ``visible[i]`` is the physical device of container device ``i`` (default:
    the identity over ``uuids``). Processes are listed in slot order, so that
    the region's slot ``n`` is hami-bpf's slot ``n``."""
    visible = list(visible) if visible is not None else list(range(len(uuids)))
    to_vis = {phys: i for i, phys in enumerate(visible)}
    g = next((x for x in snap.get("groups", []) if x["id"] == group), None)
    if g is None:
        raise RegionError(f"no group {group!r} in the snapshot")
    by_pid = {p["pid"]: p for p in snap.get("processes", [])}
    limits = [0] * len(visible)
    for dev, u in (g.get("devices") or {}).items():
        i = to_vis.get(int(dev))
        if i is not None and u.get("limit_bytes"):
            limits[i] = int(u["limit_bytes"])
    procs = []
    for s in sorted(g.get("slots", []), key=lambda s: s["index"]):
        p = by_pid.get(s["pid"])
        if p is None:
            continue
        used, ctx = {}, {}
        for dev, u in (p.get("devices") or {}).items():
            i = to_vis.get(int(dev))
            if i is None:
                continue
            used[i] = int(u.get("used_bytes") or 0)
            if context_bytes:
                ctx[i] = context_bytes
        ns = p.get("ns_pid")
        procs.append(RegionProc(ns if ns is not None else p["pid"], p["pid"], used, ctx))
    sm = (list(sm_limits) + [0] * len(uuids))[:len(uuids)]
    return Region(tuple(uuids), tuple(limits), tuple(sm), tuple(procs))


def publish_region(path: str | os.PathLike, r: Region) -> None:
    """Write ``r`` into ``path`` in place (created 0644 if missing).

    The two fields HAMi's monitor writes (utilisation switch, recent kernel)
    are preserved once the file exists. Readers can see a torn image for the
    duration of the write, as they can with HAMi-core's own writers. Each slot's
    sequence counter is left even."""
    img = encode_region(r)
    # The directory may be shared with a container (HAMi mounts it there):
    # never follow a link planted in it, never write through a hard link, and
    # leave the file ours and 0644 at most.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                 0o644)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise RegionError(f"{path}: not a plain file with one link; not writing it")
        if st.st_mode & 0o133:
            os.fchmod(fd, st.st_mode & 0o644)
        if st.st_uid != os.geteuid():
            os.fchown(fd, os.geteuid(), os.getegid())
        size = st.st_size
        if size < REGION_SIZE:
            os.pwrite(fd, img, 0)
            return
        os.pwrite(fd, img[:OFF_UTIL_SWITCH], 0)
        os.pwrite(fd, img[OFF_PRIORITY:], OFF_PRIORITY)
    finally:
        os.close(fd)
