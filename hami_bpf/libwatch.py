"""The driver libraries hami-bpf probes, and the processes that use them.

The configured libcuda files are probed from the start (pinned). Others, a
container's own driver library (CUDA forward compatibility in an image, a
private copy), are found in /proc/PID/maps by a bounded scan, or by the open
gate when a process maps a file opened under a libcuda name; each is
attached through a descriptor held open (bcc detaches by re-reading the
file at the path it attached with, and a container's /proc/PID/root/... path
goes with the container), and detached self.grace_s after its last user is
gone. One lock file per library keeps two daemons off the same file.

Owns: the libraries (paths, descriptors, locks, users, idle and refused
ones), the entry-prologue checks stop-rewrite needs per library. Takes its
collaborators as arguments: the probes, the event log, the daemon's
counters, registration.
"""
from __future__ import annotations

import errno
import logging
import os
import stat as stat_
import time
from pathlib import Path
from typing import Callable, Iterable, MutableMapping

from . import abi, containers, enforce, procfs
from .config import DEFAULT_LIB_GRACE_S, unsafe_chain

log = logging.getLogger("hami_bpf")

LIB_SCAN_DUTY = 0.05       # share of one core the /proc scan may use
LIB_VERIFY_S = 5.0         # an opener of a driver library not mapping it by then is no user
LIB_RETRY_S = 30.0         # a library we could not attach to is tried again after this


class LockError(Exception):
    """A library's lock file or its directory is not safe to use."""


# One lock per probed library file, here: a directory only root can write
# (created 0700; its parent is the default state and socket directory).
LOCK_DIR = "/run/hami-bpf/locks"


def lock_dir() -> str:
    """LOCK_DIR, made if missing, after checking that it and every directory
    above it are real directories only root can write (LockError if not)."""
    for d, mode in ((os.path.dirname(LOCK_DIR), 0o755), (LOCK_DIR, 0o700)):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
        except OSError as e:
            raise LockError(f"making lock directory {d}: {e.strerror}") from None
        st = os.lstat(d)
        if not stat_.S_ISDIR(st.st_mode):
            raise LockError(f"lock directory {d} is not a directory (a symbolic link?): refused")
    bad = unsafe_chain(os.path.join(LOCK_DIR, "x"))
    if bad:
        raise LockError(f"lock directory {LOCK_DIR}: {bad}: refused")
    return LOCK_DIR


def pids_mapping(lib: Path) -> list[int]:
    """Processes that already have this libcuda mapped (dev:inode match)."""
    try:
        st = lib.stat()
    except OSError:
        return []
    want = f" {st.st_ino} "
    out = []
    for pid in procfs.pids():
        raw = procfs.maps(pid)
        if raw and want.encode() in raw and str(lib.name).encode() in raw:
            out.append(pid)
    return out


def lock_file(st: os.stat_result) -> tuple[int | None, str]:
    """The library's lock (by dev:inode), or None if another daemon holds
    it. The locks live in a directory only root can write (LOCK_DIR): in a
    world-writable one anybody could take a lock's name first and keep
    the daemon from starting. Raises LockError for a lock that is not
    our plain file (a link, say)."""
    import fcntl
    lockdir = lock_dir()
    path = f"{lockdir}/{st.st_dev}-{st.st_ino}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise LockError(f"opening lock {path}: {e.strerror}"
                        + (" (a symbolic link: refused)" if e.errno == errno.ELOOP else ""))
    lst = os.fstat(fd)
    if not stat_.S_ISREG(lst.st_mode) or lst.st_uid != 0:
        os.close(fd)
        raise LockError(f"lock {path} is not a regular file owned by root: refused")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None, path
    return fd, path



class LibraryWatcher:
    """`probes()`: the loaded programs. `record(kind, what, **data)`: the
    event log. `register(pid)`: register a user found with cuInit behind it.
    `is_registered(pid)`, `registered()`: the process table's view.
    `stop_rewrite()`: whether denials stop and rewrite (entries are checked
    for it). `grace_s`: how long an unused library stays attached."""

    def __init__(self, *, probes: Callable[[], object], record: Callable[..., None],
                 counters: MutableMapping[str, int], register: Callable[[int], None],
                 is_registered: Callable[[int], bool], registered: Callable[[], Iterable[int]],
                 stop_rewrite: Callable[[], bool], grace_s: float = DEFAULT_LIB_GRACE_S) -> None:
        self._probes = probes
        self._record = record
        self._counters = counters
        self._register = register
        self._is_registered = is_registered
        self._registered = registered
        self._stop_rewrite = stop_rewrite
        self.grace_s = grace_s
        self.libs: list[Path] = []            # every library probed now, by the path probed
        # libcuda files per (dev, inode): the configured ones pinned, others
        # attached at their first user seen, through a descriptor we hold
        # (fds: key -> (fd, "/proc/<our pid>/fd/N")), detached after their
        # last user exits.
        self.track = containers.LibTracker()
        self.fds: dict[tuple[int, int], tuple[int, str]] = {}
        self.entry_ok: dict[str, dict[str, tuple[bool, str]]] = {}
        self._idle: dict = {}          # key -> (since, ref): last user gone
        self._detaching: set = set()   # keys whose probes are being detached
        self._locks: dict[tuple[int, int], int] = {}
        self._keys: dict[str, tuple[int, int]] = {}       # fd path -> key
        self._users: dict[int, int] = {}                   # tracked pid -> start time
        self._refused: dict[tuple[int, int], float] = {}   # key -> retry after (monotonic)
        self._pinned_files: set[tuple[int, int]] = set()   # os.stat keys of the configured libs
        self._not_driver: set[tuple[int, int]] = set()
        # (pid, library) the open gate saw opened -> when to check it is mapped
        self._verify: dict[tuple[int, tuple[int, int]], float] = {}
        self.next_scan = 0.0
        self._scanned = False          # the first scan (at start) reads every process

    def pin_configured(self) -> None:
        """The configured libraries, probed for the daemon's whole life."""
        for lib in list(self.libs):
            st = lib.stat()
            self._pinned_files.add((st.st_dev, st.st_ino))
            self.track.pin(containers.LibRef(st.st_dev, st.st_ino, str(lib), str(lib), 0))

    def housekeeping(self, now: float) -> None:
        """Each reaper pass: users that never mapped what they opened, or are
        gone, released; idle libraries detached; the scan when it is due."""
        self._verify_users(now)
        for pid, st in list(self._users.items()):
            if enforce.proc_start_time(pid) != st:
                self.release(pid)
        self._detach_idle(time.monotonic())
        if time.monotonic() >= self.next_scan:
            self.discover()

    def close(self) -> None:
        """After the probes: they detach through these descriptors."""
        for fd, _path in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def pids_of(self, lib: Path) -> list[int]:
        """Processes mapping ``lib``: for a library attached through a held
        descriptor (its path names our fd, not the file) the pids discovery
        found mapping its (dev, inode); for a configured one, a scan."""
        key = self._keys.get(str(lib))
        return sorted(self.track.users(key)) if key else pids_mapping(lib)

    def discover(self, register: bool = True) -> None:
        """Attach to libcuda files that processes map and nobody probes yet: a
        container's own driver library (e.g. CUDA forward compatibility in the
        image) is another file than the node's, seen only in /proc/PID/maps.

        Cost: one read of /proc/PID/maps per process not registered and not
        known to map a libcuda already (so never the GPU workloads' large maps,
        nor their mmap locks), every reaper pass; a pass that takes long
        pushes the next one out so that discovery uses at most LIB_SCAN_DUTY
        of one core. A process that maps a library it was not mapping when
        last read is found at the next pass (~1 s): its calls before that
        are not seen.

        The first scan reads registered processes too: at a start they are
        the ones adopted from a previous daemon's kept maps (a restart or a
        rollout), whose own driver library nobody probes yet."""
        t0 = time.monotonic()
        skip = set(self._users) | (set(self._registered()) if self._scanned else set())
        self._scanned = True
        skip.add(os.getpid())
        found = []
        scanned = containers.scan_libcuda(skip=skip)
        # Only the scan counts against LIB_SCAN_DUTY (attaching takes longer, once).
        self.next_scan = t0 + (time.monotonic() - t0) / LIB_SCAN_DUTY
        for pid, refs in sorted(scanned.items()):
            st = enforce.proc_start_time(pid)
            if st is None:
                continue
            for ref in refs:
                if not self.track.tracked(ref.key) and (
                        ref.deleted or t0 < self._refused.get(ref.key, 0.0)):
                    continue
                if self.track.add(pid, ref):
                    self._attach(ref)
                if self.track.tracked(ref.key):   # not if its attach failed
                    self._users[pid] = st
                    found.append((pid, ref.key))
        if register:
            # A process may have called cuInit before we attached: register
            # every user of a library we probe through a held descriptor.
            for pid, key in found:
                if key in self.fds and not self._is_registered(pid):
                    self._register(pid)

    def opened(self, e: abi.Event) -> None:
        """The open gate stopped a process that opened a file named like the
        driver library: probe that file (if it is a driver library nobody
        probes yet) before the process can map it, then resume it, exactly
        once. The configured library and ones probed already cost a stat."""
        from . import libcuda
        pid = e.tgid
        self._counters["lib_opens"] += 1
        try:
            ref = containers.opened_lib(pid, int(e.aux))
            if ref is None or ref.key in self._pinned_files or ref.key in self._not_driver:
                return
            if not self.track.tracked(ref.key):
                try:
                    driver = "cuMemAlloc_v2" in libcuda.cuda_symbols(ref.host_path)
                except (libcuda.LibcudaError, OSError):
                    driver = False     # not an ELF, or gone: nothing to probe
                if not driver:
                    self._not_driver.add(ref.key)
                    return
                self._counters["lib_opens_probed"] += 1
            st = enforce.proc_start_time(pid)
            if self.track.add(pid, ref):
                self._attach(ref)
            if self.track.tracked(ref.key) and st is not None:
                self._users[pid] = st
                # An open is not a mapping (a tool reading the file): a
                # process that has not mapped it soon after is no user of it.
                self._verify[(pid, ref.key)] = time.monotonic() + LIB_VERIFY_S
        except Exception as err:  # noqa: BLE001 - the process must be resumed whatever happened
            self._counters["handler_errors"] += 1
            self._record("error", "lib_probe_failed", pid=pid,
                         error=f"{type(err).__name__}: {err}")
        finally:
            enforce.resume(pid)

    def _attach(self, ref: containers.LibRef) -> bool:
        """Attach the probes to ``ref`` through a descriptor we hold open: bcc
        detaches by re-reading the ELF at the path it attached with, and the
        container's /proc/PID/root/... disappears with the container."""
        from . import libcuda, probes
        if ref.key in self._idle:          # a new user within the grace time
            del self._idle[ref.key]
            return True
        deadline = time.monotonic() + 30
        while ref.key in self._detaching and time.monotonic() < deadline:
            time.sleep(0.05)   # rare: old probes still fire; attaching now would count twice
        try:
            fd = os.open(ref.host_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            return self._refuse(ref, f"opening {ref.host_path}: {e.strerror}")
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) in self._pinned_files:
            # A configured library that maps shows under another dev (btrfs,
            # overlayfs): probed already; a second attach would count twice.
            os.close(fd)
            self.track.pin(ref)
            return False
        try:
            lock, lock_path = lock_file(st)
        except LockError as e:
            os.close(fd)
            return self._refuse(ref, str(e), kind="config")
        if lock is None:
            os.close(fd)
            return self._refuse(ref, f"another hami-bpf daemon is attached to it (lock "
                                         f"{lock_path} is held)", kind="config")
        path = procfs.fd_path(fd)
        try:
            syms = libcuda.cuda_symbols(path)
            a = self._probes().attach_core(path, syms)
            if self._probes().launch_probes_attached() > 0:
                self._probes().attach_launch(path, syms)
            offs = libcuda.symbol_file_offsets(path, probes.ALLOC_SYMBOLS)
        except (probes.ProbeError, libcuda.LibcudaError, OSError, ValueError) as e:
            def _close(fd=fd, lock=lock):
                os.close(fd)
                os.close(lock)
            self._probes().detach_core(path, then=_close)
            return self._refuse(ref, str(e))
        self.entry_ok[path] = {s: enforce.prologue_ok(path, o, s) for s, o in offs.items()}
        if self._stop_rewrite():
            for s, (ok, why) in self.entry_ok[path].items():
                if not ok:
                    self._record("fallback", "stop_rewrite_refused", symbol=s, lib=str(ref),
                                 reason=why)
        self.fds[ref.key] = (fd, path)
        self._locks[ref.key] = lock
        self._keys[path] = ref.key
        self.libs.append(Path(path))
        self._record("probes", "attached", pid=ref.pid, lib=ref.path, lib_ref=str(ref),
                     probes=len(a.core), through=path)
        return True

    def _refuse(self, ref: containers.LibRef, why: str, kind: str = "error") -> bool:
        self.track.forget(ref.key)
        self._refused[ref.key] = time.monotonic() + LIB_RETRY_S
        self._record(kind, "not_attached", pid=ref.pid, lib=ref.path, lib_ref=str(ref),
                     reason=why)
        return False

    def _verify_users(self, now: float) -> None:
        """Users the open gate recorded are users only if they map the file."""
        for (pid, key), due in list(self._verify.items()):
            if now < due:
                continue
            del self._verify[(pid, key)]
            if key in {r.key for r in containers.mapped_libcuda(pid)}:
                continue
            lib = self.track.remove_user(pid, key)
            if lib is not None and key in self.fds:
                self._idle[key] = (now, lib)
            if not self.track.keys_of(pid):
                self._users.pop(pid, None)

    def release(self, pid: int) -> None:
        """``pid`` exited: a library it was the last user of goes idle; it is
        detached after self.grace_s unless a new user comes (a restarting
        container must not pay seconds of detach and re-attach)."""
        self._users.pop(pid, None)
        for ref in self.track.remove_pid(pid):
            if ref.key in self.fds:
                self._idle[ref.key] = (time.monotonic(), ref)

    def _detach_idle(self, now: float) -> None:
        for key, (since, ref) in list(self._idle.items()):
            if now - since >= self.grace_s:
                del self._idle[key]
                self._detach(ref)

    def _detach(self, ref) -> None:
        fd, path = self.fds.pop(ref.key, (None, None))
        if fd is not None:
            self.libs = [lib for lib in self.libs if str(lib) != path]
            self.entry_ok.pop(path, None)
            self._keys.pop(path, None)
            lock = self._locks.pop(ref.key, None)
            if lock is not None:
                # Now: a new user of the same file may come before the detach
                # ends, and our own lock would refuse our re-attach.
                os.close(lock)
            # In the background, with the fd (which names the library) kept
            # open until the last detach has re-read it. Until then the old
            # probes still fire: a re-attach to the same file waits (_attach).
            self._detaching.add(ref.key)

            def _done(fd=fd, key=ref.key):
                os.close(fd)
                self._detaching.discard(key)
            self._probes().detach_core(path, then=_done)
            self._record("probes", "detaching", lib=ref.path, lib_ref=str(ref),
                         idle_s=self.grace_s)

