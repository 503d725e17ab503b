"""Host checks for hami-bpf: pure data, rendered by the CLI (`hami-bpf doctor`).

``collect()`` returns ``{name: {"ok": bool, "value": ..., "detail": str}}``
plus, when ``hami_bpf.probes.probe_features()`` exists, ``"features"`` with
whatever it returns (or ``{"error": "..."}``).  Nothing here needs root, and
nothing raises: a check that cannot run reports ``ok: False`` and why.
"""
from __future__ import annotations

import importlib
import os
import platform
from pathlib import Path
from typing import Any, Callable

from . import procfs

__all__ = ["CHECKS", "collect"]


def _check(ok: bool, value: Any, detail: str) -> dict[str, Any]:
    return {"ok": bool(ok), "value": value, "detail": detail}


def check_kernel() -> dict[str, Any]:
    rel = platform.release()
    return _check(True, rel, f"{platform.system()} {rel} ({platform.machine()})")


def check_btf() -> dict[str, Any]:
    p = Path("/sys/kernel/btf/vmlinux")
    if p.exists():
        return _check(True, str(p), "kernel BTF present")
    return _check(False, None, "no /sys/kernel/btf/vmlinux (CONFIG_DEBUG_INFO_BTF off); "
                  "bcc still works with kernel headers")


def check_uprobes() -> dict[str, Any]:
    p = Path("/sys/bus/event_source/devices/uprobe")
    if p.exists():
        return _check(True, str(p), "uprobe perf event source present")
    return _check(False, None, "no uprobe event source (CONFIG_UPROBE_EVENTS off?): "
                  "hami-bpf cannot observe libcuda")


def _mounts() -> list[tuple[str, str]]:
    return procfs.mounts()


def check_tracefs() -> dict[str, Any]:
    points = [mp for mp, fs in _mounts() if fs == "tracefs"]
    if points:
        return _check(True, points[0], f"tracefs mounted at {', '.join(points)}")
    return _check(False, None, "tracefs not mounted: "
                  "`mount -t tracefs nodev /sys/kernel/tracing` (make install does it)")


def check_bpffs() -> dict[str, Any]:
    """Where the daemon keeps its accounting across restarts (--bpf-pin-dir)."""
    from hami_bpf.config import DEFAULT_PIN_DIR
    points = [mp for mp, fs in _mounts() if fs == "bpf"]
    if "/sys/fs/bpf" in points:
        kept = os.path.isdir(DEFAULT_PIN_DIR) and sorted(os.listdir(DEFAULT_PIN_DIR))
        return _check(True, "/sys/fs/bpf", "bpffs mounted: accounting kept across restarts in "
                      f"{DEFAULT_PIN_DIR}" + (f" (holds {', '.join(kept)})" if kept else ""))
    return _check(True, None, "bpffs not mounted at /sys/fs/bpf: the daemon mounts it at "
                  "start-up; where it cannot, a restart starts the accounting from zero")


def check_open_gate() -> dict[str, Any]:
    """Whether a process opening a private libcuda can be held until it is probed."""
    from hami_bpf.probes import open_gate_missing
    why = open_gate_missing()
    if why is None:
        return _check(True, "openat tracepoints", "a process that opens a libcuda file is held "
                      "until that file is probed")
    return _check(True, None, f"{why}: private libcuda copies are found by scanning /proc "
                  "(about every second; calls before that are not seen)")


def check_lockdown() -> dict[str, Any]:
    p = Path("/sys/kernel/security/lockdown")
    try:
        text = p.read_text().strip()
    except OSError:
        return _check(True, "unknown/none", f"{p} absent: no lockdown LSM, or securityfs unmounted")
    # the active mode is shown in brackets: "none [integrity] confidentiality"
    mode = text
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            mode = word[1:-1]
    if mode == "none":
        return _check(True, mode, "no lockdown")
    if mode == "integrity":
        return _check(True, mode, "integrity: bpf_probe_write_user is refused; "
                      "enforcement uses stop-and-rewrite through ptrace and /proc/PID/mem")
    return _check(False, mode, f"{mode}: BPF reads of kernel memory are refused; "
                  "probes may fail to load")


def check_kernel_headers() -> dict[str, Any]:
    build = Path("/lib/modules") / platform.release() / "build"
    if not build.exists():
        return _check(False, None, f"{build} missing: bcc cannot compile BPF programs "
                      "(run `make install`, which installs headers and links them)")
    target = str(build.resolve())
    release = None
    for rel in ("include/config/kernel.release",):
        try:
            release = (build / rel).read_text().strip()
        except OSError:
            pass
    if release and release != platform.release():
        detail = (f"headers of {release} for kernel {platform.release()}: bcc compiles with "
                  "them; hami-bpf's BPF reads no kernel struct fields, so the mismatch is harmless")
    else:
        detail = f"{build} -> {target}"
    return _check(True, target, detail)


def check_bcc() -> dict[str, Any]:
    try:
        bcc = importlib.import_module("bcc")
    except Exception as e:  # ImportError, or libbcc failing to load
        return _check(False, None, f"cannot import bcc ({type(e).__name__}: {e}); "
                      "install the distribution's python3-bpfcc (the PyPI `bcc` is unrelated)")
    version = getattr(bcc, "__version__", None) or "unknown"
    return _check(True, version, f"bcc {version} from {Path(bcc.__file__).parent}")


def check_libcuda() -> dict[str, Any]:
    try:
        from .libcuda import find_libcuda
        found = [str(p) for p in find_libcuda(None)]
    except Exception as e:
        return _check(False, [], f"search failed: {e}")
    if found:
        return _check(True, found, ", ".join(found))
    return _check(False, [], "no libcuda.so.1 found: `hami-bpf run` uses the simulated "
                  "stand-in libcuda (demo)")


def check_nvml() -> dict[str, Any]:
    try:
        import pynvml  # from nvidia-ml-py
    except Exception as e:
        return _check(False, None, f"pynvml not importable: {e}")
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return _check(False, None, f"NVML init failed: {e}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        try:
            drv = pynvml.nvmlSystemGetDriverVersion()
            drv = drv.decode() if isinstance(drv, bytes) else drv
        except Exception:
            drv = "unknown"
        why = "no device"
        if count:
            from .devices import process_samples
            why = process_samples(pynvml, 0)[1]
        per_process = why is None
        reads = ("per-process utilization: the SM guard reads each group's own part"
                 if per_process else
                 f"no per-process utilization ({why}): the SM guard reads the device's")
        return _check(True, {"devices": count, "driver": drv, "process_utilization": per_process},
                      f"{count} device(s), driver {drv}; {reads}")
    except Exception as e:
        return _check(False, None, f"NVML query failed: {e}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def check_root() -> dict[str, Any]:
    euid = os.geteuid()
    if euid == 0:
        return _check(True, euid, "running as root")
    return _check(False, euid, "not root: loading BPF programs and enforcement need root")


CHECKS: dict[str, Callable[[], dict[str, Any]]] = {
    "kernel": check_kernel,
    "btf": check_btf,
    "uprobes": check_uprobes,
    "tracefs": check_tracefs,
    "bpffs": check_bpffs,
    "open_gate": check_open_gate,
    "lockdown": check_lockdown,
    "kernel_headers": check_kernel_headers,
    "bcc": check_bcc,
    "libcuda": check_libcuda,
    "nvml": check_nvml,
    "root": check_root,
}


def collect() -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name, fn in CHECKS.items():
        try:
            result[name] = fn()
        except Exception as e:  # a check must never take the report down
            result[name] = _check(False, None, f"check failed: {type(e).__name__}: {e}")
    try:
        probes = importlib.import_module("hami_bpf.probes")
    except ImportError:
        probes = None
    except Exception as e:
        result["features"] = {"error": f"importing hami_bpf.probes failed: {e}"}
        probes = None
    if probes is not None and callable(getattr(probes, "probe_features", None)):
        try:
            feats = probes.probe_features()
            result["features"] = feats.as_dict() if hasattr(feats, "as_dict") else feats
            from hami_bpf.startup import choose_mechanisms, sm_mechanism
            oom, meminfo = choose_mechanisms(feats)
            result["mechanisms"] = {"oom": oom, "meminfo": meminfo, "sm": sm_mechanism(feats)}
        except Exception as e:
            result["features"] = {"error": f"{type(e).__name__}: {e}"}
    return result
