"""Thin ctypes layer over ptrace(2), waitpid(2) and process_vm_readv/writev(2).

x86_64 Linux only (``Regs`` is ``struct user_regs_struct`` of x86_64).  No
third-party packages.  Every failure is a :class:`PtraceError`, an ``OSError``
whose message names the operation and the target, e.g.
``"PTRACE_SEIZE tid 1234: Operation not permitted"``.

ptrace binds a tracee to the *OS thread* that attached it: call ``seize``,
``interrupt``, ``wait_stop``, ``get_regs``, ``set_regs`` and ``detach`` for
one tracee from the same Python thread (``hami_bpf.enforce.fail_call`` does the
whole sequence inside one call).
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from typing import NamedTuple

from . import procfs

__all__ = [
    "PtraceError",
    "Regs",
    "Stop",
    "seize",
    "interrupt",
    "wait_stop",
    "get_regs",
    "set_regs",
    "detach",
    "read_mem",
    "write_mem",
    "PTRACE_EVENT_STOP",
]

# <sys/ptrace.h>, <linux/ptrace.h>
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_DETACH = 17
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_EVENT_STOP = 128

# <linux/wait.h>
WNOHANG = 1
__WALL = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)

_ptrace = _libc.ptrace
_ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
_ptrace.restype = ctypes.c_long


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_vm_args = [
    ctypes.c_int,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.POINTER(_IOVec),
    ctypes.c_ulong,
    ctypes.c_ulong,
]
_process_vm_readv = _libc.process_vm_readv
_process_vm_readv.argtypes = _vm_args
_process_vm_readv.restype = ctypes.c_ssize_t
_process_vm_writev = _libc.process_vm_writev
_process_vm_writev.argtypes = _vm_args
_process_vm_writev.restype = ctypes.c_ssize_t


class PtraceError(OSError):
    """An OSError naming the operation and the target (``op``, ``target``)."""

    def __init__(self, err: int, op: str, target: str, detail: str | None = None):
        self.op = op
        self.target = target
        msg = f"{op} {target}: {detail or os.strerror(err)}"
        super().__init__(err, msg)

    def __str__(self) -> str:  # OSError would print "[Errno N] ..."
        return self.strerror


_REG_NAMES = (
    "r15 r14 r13 r12 rbp rbx r11 r10 r9 r8 rax rcx rdx rsi rdi orig_rax "
    "rip cs eflags rsp ss fs_base gs_base ds es fs gs"
).split()


class Regs(ctypes.Structure):
    """x86_64 ``struct user_regs_struct`` (27 unsigned longs)."""

    _fields_ = [(name, ctypes.c_ulong) for name in _REG_NAMES]

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in _REG_NAMES}

    def __repr__(self) -> str:
        r = self.as_dict()
        keys = ("rip", "rsp", "rbp", "rax", "orig_rax", "rdi", "rsi")
        return "Regs(" + ", ".join(f"{k}={r[k]:#x}" for k in keys) + ")"


assert ctypes.sizeof(Regs) == 27 * 8


class Stop(NamedTuple):
    """A waitpid stop report: raw ``status``, stop signal ``sig``, ptrace ``event``."""

    status: int
    sig: int
    event: int

    @property
    def is_event_stop(self) -> bool:
        """PTRACE_EVENT_STOP: group-stop or PTRACE_INTERRUPT trap of a seized tracee."""
        return self.event == PTRACE_EVENT_STOP

    @property
    def is_signal_delivery(self) -> bool:
        """A signal-delivery-stop: ``sig`` is about to be delivered (re-inject it on detach)."""
        return self.event == 0


def _call(op: str, tid: int, request: int, addr=None, data=None) -> int:
    ctypes.set_errno(0)
    res = _ptrace(request, tid, addr, data)
    if res == -1:
        err = ctypes.get_errno()
        if err:
            raise PtraceError(err, op, f"tid {tid}")
    return res


def seize(tid: int) -> None:
    """PTRACE_SEIZE ``tid`` (no options: if we die, the kernel detaches it)."""
    _call("PTRACE_SEIZE", tid, PTRACE_SEIZE, None, None)


def interrupt(tid: int) -> None:
    """PTRACE_INTERRUPT a seized ``tid``."""
    _call("PTRACE_INTERRUPT", tid, PTRACE_INTERRUPT, None, None)


def wait_stop(tid: int, timeout: float = 1.0) -> Stop:
    """Wait (``__WALL``) until the tracee ``tid`` reports a stop; return it.

    Any ptrace stop is returned: a PTRACE_EVENT_STOP (group-stop or
    interrupt, e.g. status 0x80137f) or a signal-delivery-stop.  Raises
    PtraceError (ESRCH) if the thread exited, (ETIMEDOUT) after ``timeout``.
    """
    deadline = time.monotonic() + timeout
    nap = 0.00002
    while True:
        try:
            wpid, status = os.waitpid(tid, WNOHANG | __WALL)
        except ChildProcessError as e:
            raise PtraceError(e.errno or errno.ECHILD, "waitpid", f"tid {tid}") from None
        if wpid == tid:
            if os.WIFSTOPPED(status):
                return Stop(status, (status >> 8) & 0xFF, (status >> 16) & 0xFFFF)
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                raise PtraceError(
                    errno.ESRCH, "waitpid", f"tid {tid}", f"thread exited (status {status:#x})"
                )
            continue  # WIFCONTINUED or something else: keep waiting
        if time.monotonic() >= deadline:
            raise PtraceError(
                errno.ETIMEDOUT, "waitpid", f"tid {tid}", f"no stop reported within {timeout}s"
            )
        time.sleep(nap)
        nap = min(nap * 2, 0.001)


def get_regs(tid: int) -> Regs:
    """PTRACE_GETREGS of a ptrace-stopped ``tid``."""
    regs = Regs()
    _call("PTRACE_GETREGS", tid, PTRACE_GETREGS, None, ctypes.addressof(regs))
    return regs


def set_regs(tid: int, regs: Regs) -> None:
    """PTRACE_SETREGS of a ptrace-stopped ``tid``."""
    _call("PTRACE_SETREGS", tid, PTRACE_SETREGS, None, ctypes.addressof(regs))


def detach(tid: int, sig: int = 0) -> None:
    """PTRACE_DETACH ``tid``, delivering ``sig`` (0: none) as it goes."""
    _call("PTRACE_DETACH", tid, PTRACE_DETACH, None, sig)


def read_mem(pid: int, addr: int, n: int) -> bytes:
    """Read ``n`` bytes at ``addr`` of process ``pid`` (process_vm_readv, else /proc/PID/mem)."""
    if n <= 0:
        return b""
    buf = ctypes.create_string_buffer(n)
    local = _IOVec(ctypes.cast(buf, ctypes.c_void_p), n)
    remote = _IOVec(addr, n)
    got = _process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if got == n:
        return buf.raw
    err = ctypes.get_errno() if got < 0 else errno.EIO
    if err == errno.ESRCH:
        raise PtraceError(err, "process_vm_readv", f"pid {pid}")
    try:
        with open(procfs.mem_path(pid), "rb", buffering=0) as f:
            f.seek(addr)
            data = f.read(n)
    except OSError as e:
        raise PtraceError(
            e.errno or err,
            "read_mem",
            f"pid {pid}",
            f"{n} bytes at {addr:#x}: process_vm_readv: {os.strerror(err)}; "
            f"{procfs.mem_path(pid)}: {e.strerror}",
        ) from None
    if len(data) != n:
        raise PtraceError(
            errno.EIO, "read_mem", f"pid {pid}", f"short read at {addr:#x}: {len(data)}/{n}"
        )
    return data


def write_mem(pid: int, addr: int, data: bytes) -> None:
    """Write ``data`` at ``addr`` of process ``pid`` (process_vm_writev, else /proc/PID/mem).

    process_vm_writev honours page protections; /proc/PID/mem (allowed under
    lockdown=integrity) also writes read-only pages.
    """
    n = len(data)
    if n == 0:
        return
    buf = ctypes.create_string_buffer(bytes(data), n)
    local = _IOVec(ctypes.cast(buf, ctypes.c_void_p), n)
    remote = _IOVec(addr, n)
    put = _process_vm_writev(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    if put == n:
        return
    err = ctypes.get_errno() if put < 0 else errno.EIO
    if err == errno.ESRCH:
        raise PtraceError(err, "process_vm_writev", f"pid {pid}")
    try:
        with open(procfs.mem_path(pid), "r+b", buffering=0) as f:
            f.seek(addr)
            written = f.write(bytes(data))
    except OSError as e:
        raise PtraceError(
            e.errno or err,
            "write_mem",
            f"pid {pid}",
            f"{n} bytes at {addr:#x}: process_vm_writev: {os.strerror(err)}; "
            f"{procfs.mem_path(pid)}: {e.strerror}",
        ) from None
    if written != n:
        raise PtraceError(
            errno.EIO, "write_mem", f"pid {pid}", f"short write at {addr:#x}: {written}/{n}"
        )
