"""The kernel's side before hami.bpf.c loads: tracefs and bpffs mounted, the
directory the kept maps are pinned in (and their layout's fingerprint), and
which BPF features this kernel allows (tiny programs loaded through bcc, the
one other place bcc is imported; probes.py loads the real programs).
"""
from __future__ import annotations

import ctypes as ct
import os
import stat
import subprocess
from dataclasses import dataclass, field

from . import abi, procfs

BPFFS = "/sys/fs/bpf"
DEFAULT_PIN_DIR = f"{BPFFS}/hami-bpf"
MAX_ALLOCS = 262144    # maps.h's defaults, part of the kept layout
MAX_GROUPS = 4096


class ProbeError(RuntimeError):
    """Loading or attaching failed; the message says what was being done."""


def ensure_tracefs() -> None:
    if os.path.isdir("/sys/kernel/tracing/events"):
        return
    try:
        subprocess.run(["mount", "-t", "tracefs", "nodev", "/sys/kernel/tracing"],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        raise ProbeError(f"mounting tracefs at /sys/kernel/tracing: {err.strip()}") from e


def ensure_bpffs(root: str = BPFFS) -> None:
    """bpffs at ``root`` (where pinned maps live); mounted if absent."""
    if _is_bpffs(root):
        return
    try:
        os.makedirs(root, exist_ok=True)
        subprocess.run(["mount", "-t", "bpf", "bpf", root], check=True, capture_output=True,
                       text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        err = getattr(e, "stderr", "") or str(e)
        raise ProbeError(f"mounting bpffs at {root}: {err.strip()}") from e


def _is_bpffs(path: str) -> bool:
    """Whether ``path`` is on a bpf filesystem (the longest mount point above it)."""
    best, fstype = "", ""
    real = os.path.realpath(path)
    for mnt, kind in procfs.mounts():
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, kind
    return fstype == "bpf"


# The maps hami.bpf.c keeps across restarts (HAMI_KEPT_HASH in maps.h), with
# the structures of their keys and values: what the layout's fingerprint covers.
KEPT_MAPS = {
    "procs": ("u32", "Proc"), "proc_cfg": ("u32", "ProcCfg"), "pmem": ("PKey", "u64"),
    "grp_mem": ("GKey", "GMem"), "grp_lim": ("GKey", "GLim"), "allocs": ("AKey", "Alloc"),
    "inflight": ("u32", "Call"), "ctx_dev": ("CKey", "s32"), "nvml_dev": ("CKey", "s32"),
    "cur_ctx": ("u32", "TCtx"),
}


def layout_fingerprint(max_procs: int) -> str:
    """A name for the kept maps' layout: ABI version, sizes and every field's
    name, offset and size. A daemon adopts pinned maps only under its own
    fingerprint, so a layout change is never read through the wrong struct."""
    import hashlib

    def describe(t: str) -> str:
        if not hasattr(abi, t):
            return t
        cls = getattr(abi, t)
        return t + "{" + ",".join(f"{n}@{getattr(cls, n).offset}:{getattr(cls, n).size}"
                                  for n, *_ in cls._fields_) + f"}}{ct.sizeof(cls)}"
    text = ";".join(f"{m}:{describe(k)}->{describe(v)}" for m, (k, v) in sorted(KEPT_MAPS.items()))
    text += f";procs={max_procs};allocs={MAX_ALLOCS};groups={MAX_GROUPS}"
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return f"abi{abi.ABI_VERSION}-{digest}"


class PinRefused(ProbeError):
    """Kept state this daemon must not use: another layout's, or a directory
    others could write."""


def prepare_pin_dir(pin_dir: str, fingerprint: str, fresh: bool) -> tuple[str, bool]:
    """The directory this daemon pins its kept maps in (``pin_dir``/``fingerprint``)
    and whether it holds a predecessor's maps to adopt. State of another layout
    is refused (adopting it would read every entry through the wrong struct)
    unless ``fresh`` discards it; ``fresh`` discards ours too."""
    import shutil
    if any(c in pin_dir for c in "\"\\ \n") or not os.path.isabs(pin_dir):
        raise PinRefused(f"--bpf-pin-dir {pin_dir!r}: an absolute path without quotes, "
                         "backslashes or spaces")
    parent = os.path.dirname(pin_dir.rstrip("/")) or "/"
    if not _is_bpffs(parent) and not _is_bpffs(pin_dir):
        if os.path.realpath(parent).startswith(BPFFS):
            ensure_bpffs(BPFFS)
        else:
            raise ProbeError(f"--bpf-pin-dir {pin_dir}: not on a bpf filesystem")
    try:
        os.makedirs(pin_dir, mode=0o700, exist_ok=True)
        st = os.lstat(pin_dir)
    except OSError as e:
        raise ProbeError(f"creating the pin directory {pin_dir}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        raise PinRefused(f"pin directory {pin_dir}: not a directory owned by root and closed "
                         "to others: refused")
    here = os.path.join(pin_dir, fingerprint)
    others = sorted(d for d in os.listdir(pin_dir) if d != fingerprint)
    if fresh:
        for d in others + [fingerprint]:
            shutil.rmtree(os.path.join(pin_dir, d), ignore_errors=True)
        others = []
    if others:
        raise PinRefused(
            f"{pin_dir} holds the state of another daemon version (layout {', '.join(others)}; "
            f"this one is {fingerprint}): refusing to adopt it. Run the version that wrote it, "
            "or start this one with --fresh, which discards the accounting of running "
            "processes")
    adopted = os.path.isdir(here) and bool(os.listdir(here))
    os.makedirs(here, mode=0o700, exist_ok=True)
    return here, adopted


OPEN_TRACEPOINTS = ("syscalls/sys_enter_openat", "syscalls/sys_exit_openat",
                    "syscalls/sys_enter_mmap")


def open_gate_missing(tracefs: str = "/sys/kernel/tracing") -> str | None:
    """Why the open gate cannot run here (None: it can): it needs the
    openat and mmap syscall tracepoints (CONFIG_FTRACE_SYSCALLS)."""
    for tp in OPEN_TRACEPOINTS:
        if not os.path.isdir(f"{tracefs}/events/{tp}"):
            return f"no tracepoint {tp} (kernel built without CONFIG_FTRACE_SYSCALLS?)"
    return None


def _bcc():
    try:
        import bcc  # noqa: F401
        from bcc import BPF
    except ImportError as e:
        raise ProbeError(
            "importing bcc: %s (install the distribution's python3-bpfcc; "
            "the PyPI package named 'bcc' is unrelated)" % e) from e
    return BPF


# --- start-up feature probes --------------------------------------------------

_FEATURE_SOURCES = {
    "ringbuf": r"""
BPF_RINGBUF_OUTPUT(rb, 1);
int probe(struct pt_regs *ctx) { u64 v = 1; rb.ringbuf_output(&v, sizeof(v), 0); return 0; }
""",
    "send_signal": r"""
int probe(struct pt_regs *ctx) { if (ctx->ax == 12345) bpf_send_signal(19); return 0; }
""",
    "probe_write_user": r"""
int probe(struct pt_regs *ctx) { u64 v = 0; if (ctx->ax == 12345) bpf_probe_write_user((void *)ctx->di, &v, sizeof(v)); return 0; }
""",
    "reg_write": r"""
int probe(struct pt_regs *ctx) { if (ctx->ax == 12345) ctx->ax = 2; return 0; }
""",
    "atomics": r"""
BPF_ARRAY(a, u64, 1);
int probe(struct pt_regs *ctx) { int k = 0; u64 *v = a.lookup(&k); if (v) __sync_val_compare_and_swap(v, 0, 1); return 0; }
""",
}


@dataclass(frozen=True)
class Features:
    ringbuf: bool
    send_signal: bool
    probe_write_user: bool
    reg_write: bool
    atomics: bool
    errors: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("ringbuf", "send_signal", "probe_write_user",
                                              "reg_write", "atomics")} | {"errors": dict(self.errors)}


def _load_quietly(BPF, text: str) -> tuple[bool, str]:
    """Compile and load one tiny program; the verifier's refusal is the answer."""
    # The verifier log goes to fd 2 from C: silence it, keep the first line.
    r, w = os.pipe()
    saved = os.dup(2)
    os.dup2(w, 2)
    os.close(w)
    ok, err = True, ""
    try:
        b = BPF(text="#include <uapi/linux/ptrace.h>\n" + text)
        b.load_func("probe", BPF.KPROBE)
        b.cleanup()
    except Exception as e:  # bcc raises bare Exception
        ok, err = False, str(e)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.set_blocking(r, False)
        try:
            out = os.read(r, 65536).decode(errors="replace")
        except BlockingIOError:
            out = ""
        os.close(r)
    if not ok:
        lines = [ln for ln in out.splitlines() if ln and not ln.startswith((";", " ")) and "insns" not in ln]
        detail = next((ln for ln in lines if "invalid" in ln or "cannot" in ln or "unknown" in ln), "")
        err = detail or (lines[-1] if lines else err)
    return ok, err


def probe_features() -> Features:
    """Which BPF features this kernel allows a uprobe program, by loading tiny programs."""
    BPF = _bcc()
    ensure_tracefs()
    res, errors = {}, {}
    for name, src in _FEATURE_SOURCES.items():
        ok, err = _load_quietly(BPF, src)
        res[name] = ok
        if not ok:
            errors[name] = err
    return Features(errors=errors, **res)
