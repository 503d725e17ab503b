"""Everything the daemon reads from /proc, in one place.

Each function takes a ``proc`` root (default: the module's ``PROC``, read at each
call, so a test can point every reader at a fake tree at once) so tests run on fake
trees, returns None (or an empty value) for a process that is gone, and reads
at most a fixed number of bytes: a workload controls its environment, its
name and, where cgroups are delegated to it, its cgroup path.  Writes through
``/proc/PID/mem`` stay with ptrace (:mod:`hami_bpf.ptrace`).

Cgroup path rule (:func:`cgroup_path`, used both for ``--group-by cgroup``
and for pod labels, so a group's name and its labels come from one
hierarchy):

* cgroup v2 only: the unified entry (``0::/path``), whatever it is.
* v1 and hybrid hosts: the candidates are the unified entry unless it is the
  root or systemd's ``init.scope``, then the non-root v1 paths, the
  ``memory`` controller's first, then ``pids``, ``cpu``/``cpuacct``,
  ``name=systemd`` and any other hierarchy, in file order.  The first
  candidate that names a container (a Kubernetes pod, or a runtime's 64-hex
  container ID) wins, else the first candidate, else the unified entry (or
  ``/``).  On a v1 host the unified line is ``0::/``, so one container's
  processes do not share the root's group with every other container.
"""
from __future__ import annotations

import os
import re
from typing import NamedTuple

__all__ = [
    "CGROUP_MAX", "CGROUP_PATH_MAX", "COMM_MAX", "ENVIRON_MAX", "MAPS_MAX", "STAT_MAX",
    "STATUS_MAX", "MapEntry", "cgroup_path", "comm", "environ", "fd_path", "fds",
    "fd_target", "maps", "maps_entries", "mounts", "names_container", "ns_pids",
    "parse_cgroup", "parse_environ", "parse_maps", "parse_stat", "pids", "read_bounded",
    "root_path", "start_time", "stat_fields", "state", "status_field", "task_exists",
    "tasks", "user_pc",
]

PROC = "/proc"

# Caps on bytes read.  The kernel's own output stays below each; a longer
# file is cut there (the cut is reported where it matters).
ENVIRON_MAX = 1 << 20      # the kernel allows a quarter of the stack limit, gigabytes
CGROUP_MAX = 64 << 10      # one line per hierarchy, each path at most PATH_MAX
CGROUP_PATH_MAX = 4096     # PATH_MAX: longer paths are not the kernel's and are ignored
COMM_MAX = 256             # TASK_COMM_LEN is 16; kernel threads show up to 64
STAT_MAX = 4096
STATUS_MAX = 1 << 20       # "Groups:" lists up to 65536 supplementary groups before NSpid
MAPS_MAX = 64 << 20        # a CUDA process maps ~1 MiB of lines; cut at a line end
SYSCALL_MAX = 256
MOUNTS_MAX = 4 << 20


def read_bounded(path: str, limit: int) -> tuple[bytes | None, bool]:
    """At most ``limit`` bytes of ``path`` (None if it cannot be read), and
    whether there was more."""
    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError:
        return None, False
    return raw[:limit], len(raw) > limit


def _read_lines(path: str, limit: int) -> bytes | None:
    """``path`` up to ``limit`` bytes, a cut file ending at its last whole line."""
    raw, cut = read_bounded(path, limit)
    if raw is not None and cut:
        raw = raw[: raw.rfind(b"\n") + 1]
    return raw


def _pid_dir(pid: int | str, proc: str, tid: int | None = None) -> str:
    return f"{proc}/{pid}" if tid is None else f"{proc}/{pid}/task/{tid}"


# --- processes and threads ----------------------------------------------------

def pids(proc: str | None = None) -> list[int]:
    """Every pid listed in ``proc`` (unsorted)."""
    proc = PROC if proc is None else proc
    try:
        return [int(d) for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return []


def tasks(pid: int, proc: str | None = None) -> list[int]:
    """Thread ids of ``pid``; empty if it is gone."""
    proc = PROC if proc is None else proc
    try:
        return [int(t) for t in os.listdir(f"{proc}/{pid}/task") if t.isdigit()]
    except OSError:
        return []


def task_exists(pid: int, tid: int, proc: str | None = None) -> bool:
    proc = PROC if proc is None else proc
    return os.path.exists(f"{proc}/{pid}/task/{tid}")


def thread_exists(tid: int, proc: str | None = None) -> bool:
    """Whether a thread of that id lives (/proc/TID resolves for any thread,
    though only leaders are listed)."""
    proc = PROC if proc is None else proc
    return os.path.exists(f"{proc}/{tid}")


def root_path(pid: int, path: str, proc: str | None = None) -> str:
    """``path`` as the process sees it, reached from here (its root directory)."""
    proc = PROC if proc is None else proc
    return f"{proc}/{pid}/root{path}"


# --- stat ---------------------------------------------------------------------

def parse_stat(raw: bytes) -> list[str]:
    """Fields of a stat line, numbered from 1 (index 0 is field 1: pid).  The
    name (field 2) may hold spaces and parentheses: it runs to the last ')'.
    ValueError if there are no parentheses."""
    text = raw.decode("utf-8", "replace")
    lpar, rpar = text.index("("), text.rindex(")")
    return [text[:lpar].strip(), text[lpar + 1:rpar]] + text[rpar + 1:].split()


def stat_fields(pid: int, tid: int | None = None, proc: str | None = None) -> list[str] | None:
    proc = PROC if proc is None else proc
    raw, _ = read_bounded(f"{_pid_dir(pid, proc, tid)}/stat", STAT_MAX)
    if raw is None:
        return None
    try:
        return parse_stat(raw)
    except ValueError:
        return None


def start_time(pid: int, proc: str | None = None) -> int | None:
    """Field 22 (starttime, clock ticks after boot); None if gone."""
    proc = PROC if proc is None else proc
    f = stat_fields(pid, proc=proc)
    try:
        return int(f[21]) if f else None
    except (ValueError, IndexError):
        return None


def state(pid: int, tid: int | None = None, proc: str | None = None) -> str | None:
    """Field 3 (state letter) of the process or one of its threads; None if gone."""
    proc = PROC if proc is None else proc
    f = stat_fields(pid, tid, proc)
    return f[2] if f and len(f) > 2 else None


def user_pc(pid: int, tid: int, proc: str | None = None) -> int | None:
    """The user pc of a task that is not in a system call (``syscall`` reads
    "-1 sp pc"); None otherwise."""
    proc = PROC if proc is None else proc
    raw, _ = read_bounded(f"{proc}/{pid}/task/{tid}/syscall", SYSCALL_MAX)
    parts = raw.split() if raw else []
    if len(parts) == 3 and parts[0] == b"-1":
        try:
            return int(parts[2], 16)
        except ValueError:
            return None
    return None


# --- comm, status, environ ----------------------------------------------------

def comm(pid: int, proc: str | None = None) -> str:
    """The process's name; "" if gone."""
    proc = PROC if proc is None else proc
    raw, _ = read_bounded(f"{proc}/{pid}/comm", COMM_MAX)
    return raw.decode(errors="replace").strip() if raw else ""


def status_field(pid: int, name: str, tid: int | None = None, proc: str | None = None) -> str | None:
    """The value of ``name:`` in ``status`` (stripped); None if gone or absent."""
    proc = PROC if proc is None else proc
    raw = _read_lines(f"{_pid_dir(pid, proc, tid)}/status", STATUS_MAX)
    if raw is None:
        return None
    prefix = name.encode() + b":"
    for line in raw.splitlines():
        if line.startswith(prefix):
            return line[len(prefix):].decode(errors="replace").strip()
    return None


def ns_pids(pid: int, proc: str | None = None) -> tuple[int, int] | None:
    """``(pid as proc sees it, pid in the process's own namespace)`` from
    ``NSpid``; equal for a process in the reader's namespace.  None if gone.
    Kernels without ``NSpid`` (before 4.1) give ``(pid, pid)``."""
    proc = PROC if proc is None else proc
    raw = _read_lines(f"{proc}/{pid}/status", STATUS_MAX)
    if raw is None:
        return None
    for line in raw.splitlines():
        if line.startswith(b"NSpid:"):
            nums = [int(x) for x in line.split()[1:] if x.isdigit()]
            if nums:
                return nums[0], nums[-1]
    return pid, pid


def parse_environ(raw: bytes, truncated: bool = False) -> dict[str, str]:
    """NUL-separated NAME=value items, decoded leniently (any bytes in, text
    out). With ``truncated`` the last item is dropped: it may be cut short."""
    items = raw.split(b"\0")
    if truncated and items:
        items.pop()
    env = {}
    for item in items:
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env


def environ(pid: int, proc: str | None = None, limit: int = ENVIRON_MAX) -> tuple[dict[str, str], bool]:
    """(environment of ``pid``, whether it was cut at ``limit`` bytes); empty if gone."""
    proc = PROC if proc is None else proc
    raw, cut = read_bounded(f"{proc}/{pid}/environ", limit)
    return parse_environ(raw or b"", cut), cut


# --- cgroup -------------------------------------------------------------------

# A path component that names a container: a runtime's 64-hex ID, bare or as
# a systemd scope (docker-, cri-containerd-, crio-, libpod-), or a Kubernetes
# pod (cgroupfs "pod<uid>", systemd "kubepods-...-pod<uid>.slice").
_CONTAINER_COMPONENT = re.compile(
    r"(?:^|-)[0-9a-f]{64}(?:\.scope)?$"
    r"|^pod[0-9a-fA-F][0-9a-fA-F_-]{15,63}$"
    r"|^kubepods(?:-[a-z]+)?-pod[0-9a-fA-F][0-9a-fA-F_-]{15,63}\.slice$")


def names_container(path: str) -> bool:
    """Whether some component of a cgroup path names a container or a pod."""
    return any(_CONTAINER_COMPONENT.search(p) for p in path.split("/") if p)


def _v1_rank(controllers: str) -> int:
    names = set(controllers.split(","))
    if "memory" in names:
        return 0
    if "pids" in names:
        return 1
    if "cpu" in names or "cpuacct" in names:
        return 2
    if "name=systemd" in names:
        return 3
    return 4


def _rootish(path: str) -> bool:
    return path == "/" or path.rstrip("/").rsplit("/", 1)[-1] == "init.scope"


def parse_cgroup(raw: bytes) -> str:
    """The cgroup path a ``/proc/PID/cgroup`` text names, by the rule in the
    module's docstring.  Never raises; at most CGROUP_PATH_MAX characters."""
    unified = None
    v1: list[tuple[int, int, str]] = []      # (rank, file order, path)
    for n, line in enumerate(raw[:CGROUP_MAX].decode(errors="replace").splitlines()):
        hid, sep1, rest = line.partition(":")
        controllers, sep2, path = rest.partition(":")
        if not (sep1 and sep2):
            continue
        path = path or "/"
        if len(path) > CGROUP_PATH_MAX:
            continue
        if hid == "0" and not controllers:
            if unified is None:
                unified = path
        elif path != "/":
            v1.append((_v1_rank(controllers), n, path))
    candidates = [] if unified is None or _rootish(unified) else [unified]
    candidates += [p for _r, _n, p in sorted(v1)]
    for p in candidates:
        if names_container(p):
            return p
    if candidates:
        return candidates[0]
    return unified or "/"


def cgroup_path(pid: int, proc: str | None = None) -> str | None:
    """The cgroup path of ``pid`` by :func:`parse_cgroup`; None if gone."""
    proc = PROC if proc is None else proc
    raw = _read_lines(f"{proc}/{pid}/cgroup", CGROUP_MAX)
    return None if raw is None else parse_cgroup(raw)


# --- maps ---------------------------------------------------------------------

class MapEntry(NamedTuple):
    start: int
    end: int
    perms: str
    offset: int
    dev: int          # os.makedev(major, minor)
    inode: int
    path: str         # without " (deleted)"
    deleted: bool


def maps_entries(text: str) -> list[MapEntry]:
    """Lines of a maps file that name a path; malformed lines are skipped."""
    out = []
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        addrs, perms, off, dev, inode, path = parts
        deleted = path.endswith(" (deleted)")
        if deleted:
            path = path[: -len(" (deleted)")]
        try:
            major, minor = (int(x, 16) for x in dev.split(":"))
            start, end = (int(x, 16) for x in addrs.split("-"))
            out.append(MapEntry(start, end, perms, int(off, 16), os.makedev(major, minor),
                                int(inode), path, deleted))
        except ValueError:
            continue
    return out


def parse_maps(text: str) -> list[tuple[int, int, int, int, str, str, bool]]:
    """File mappings of a maps text -> ``(start, end, dev, inode, perms, path,
    deleted)``, ``dev`` as ``os.makedev``."""
    return [(e.start, e.end, e.dev, e.inode, e.perms, e.path, e.deleted)
            for e in maps_entries(text) if e.path.startswith("/") and e.inode != 0]


def maps(pid: int, proc: str | None = None) -> bytes | None:
    """``/proc/PID/maps`` (whole lines, at most MAPS_MAX bytes); None if gone."""
    proc = PROC if proc is None else proc
    return _read_lines(f"{proc}/{pid}/maps", MAPS_MAX)


# --- descriptors and mounts ---------------------------------------------------

def fds(pid: int | str = "self", proc: str | None = None) -> list[int]:
    """Open descriptors of ``pid`` (default: this process)."""
    proc = PROC if proc is None else proc
    try:
        return [int(n) for n in os.listdir(f"{proc}/{pid}/fd") if n.isdigit()]
    except OSError:
        return []


def fd_target(fd: int, pid: int | str = "self", proc: str | None = None) -> str | None:
    proc = PROC if proc is None else proc
    try:
        return os.readlink(f"{proc}/{pid}/fd/{fd}")
    except OSError:
        return None


def fd_path(fd: int, pid: int | None = None, proc: str | None = None) -> str:
    """A path that opens the file behind descriptor ``fd`` of ``pid`` (default:
    this process, by number, so the path stays valid for other readers)."""
    proc = PROC if proc is None else proc
    return f"{proc}/{os.getpid() if pid is None else pid}/fd/{fd}"


def mounts(proc: str | None = None) -> list[tuple[str, str]]:
    """(mount point, filesystem type) of each mount this process sees."""
    proc = PROC if proc is None else proc
    raw = _read_lines(f"{proc}/self/mounts", MOUNTS_MAX)
    out = []
    for line in (raw or b"").decode(errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 3:
            out.append((parts[1].replace("\\040", " "), parts[2]))
    return out


def mem_path(pid: int, proc: str | None = None) -> str:
    """The file through which ``pid``'s memory is read and written (ptrace.py)."""
    proc = PROC if proc is None else proc
    return f"{proc}/{pid}/mem"
