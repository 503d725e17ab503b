"""ctypes mirror of bpf_programs/hami.h, the ABI between BPF and Python.

Mirrored once, here. tests/bpf/test_abi.py checks every size and offset against
bcc's own view of the compiled structs; tests/unit/test_abi_constants.py checks
every constant against the header.
"""
from __future__ import annotations

import ctypes as ct
from pathlib import Path

ABI_VERSION = 4

BPF_DIR = Path(__file__).resolve().parent.parent / "bpf_programs"


def bpf_dir() -> Path:
    """The folder holding hami.bpf.c, also when installed as package data."""
    try:
        from importlib.resources import files

        p = Path(str(files("hami_bpf.bpf_programs")))
        if (p / "hami.bpf.c").exists():
            return p
    except Exception:  # pragma: no cover - only when the package is half-installed
        pass
    return BPF_DIR


# Event kinds.
EV_INIT = 1
EV_ALLOC = 2
EV_ALLOC_FAIL = 3
EV_FREE = 4
EV_DENY = 5
EV_EXIT = 6
EV_MEMINFO = 7
EV_TOTALMEM = 8
EV_THROTTLE = 10
EV_NVMLMEM = 11
EV_EXEC = 12
EV_LIBOPEN = 13

KIND_PTR = 0
KIND_HANDLE = 1
KIND_ARRAY = 2

F_STOPPED = 1 << 0
F_RESERVED = 1 << 1
F_NOGROUP = 1 << 2
F_AT_SYNC = 1 << 3
F_DENIED = 1 << 4

ACT_OBSERVE = 0
ACT_STOP_REWRITE = 1
ACT_KILL = 2
ACT_RETURN_OOM = 3
ACT_NONE_STALE = 4

CFG_ENFORCE_MEM = 1 << 0
CFG_VIRT_MEMINFO = 1 << 1
CFG_GATE_INIT = 1 << 2
CFG_GATE_LIBS = 1 << 3

SIGKILL = 9    # x86-64 numbers: what the probes pass to bpf_send_signal
SIGSTOP = 19

CUDA_SUCCESS = 0
NVML_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2

# nvmlMemory_t / nvmlMemory_v2_t: version (EV_NVMLMEM's aux) and byte offsets.
NVML_MEM_V1 = 1
NVML_MEM_V2 = 2
NVML_MEM_V1_TOTAL = 0
NVML_MEM_V1_FREE = 8
NVML_MEM_V1_USED = 16
NVML_MEM_V2_TOTAL = 8
NVML_MEM_V2_FREE = 24
NVML_MEM_V2_USED = 32

GROUP_NONE = 0xFFFFFFFF
UNLIMITED = 0xFFFFFFFFFFFFFFFF
CTX_DEPTH = 8
MAX_DEVS = 16

STAT_RB_DROPS = 0
STAT_ALLOCS_FULL = 1
STAT_INFLIGHT_FULL = 2
STAT_PROCS_FULL = 3
STAT_DENIALS = 4
STAT_STOPS = 5
STAT_STALE_SKIPS = 6
STAT_CTX_FULL = 7
STAT_THROTTLES = 8
STAT_RET_FALLBACKS = 9
STAT_DENY_IGNORED = 10
STAT_MAX = 11

STAT_NAMES = {
    STAT_RB_DROPS: "ringbuf_drops",
    STAT_ALLOCS_FULL: "allocs_map_full",
    STAT_INFLIGHT_FULL: "inflight_map_full",
    STAT_PROCS_FULL: "procs_map_full",
    STAT_DENIALS: "bpf_denials",
    STAT_STOPS: "bpf_stops",
    STAT_STALE_SKIPS: "stale_heartbeat_skips",
    STAT_CTX_FULL: "ctx_map_full",
    STAT_THROTTLES: "bpf_throttles",
    STAT_RET_FALLBACKS: "return_oom_fallbacks",
    STAT_DENY_IGNORED: "denials_ignored",
}

ACTION_NAMES = {
    ACT_OBSERVE: "observe",
    ACT_STOP_REWRITE: "stop-rewrite",
    ACT_KILL: "kill",
    ACT_RETURN_OOM: "return-oom",
    ACT_NONE_STALE: "allowed-controller-stale",
}


class Event(ct.Structure):
    _fields_ = [
        ("kind", ct.c_uint32),
        ("tgid", ct.c_uint32),
        ("tid", ct.c_uint32),
        ("device", ct.c_int32),
        ("rc", ct.c_int32),
        ("flags", ct.c_uint32),
        ("group", ct.c_uint32),
        ("alloc_kind", ct.c_uint32),
        ("ts_ns", ct.c_uint64),
        ("size", ct.c_uint64),
        ("ptr", ct.c_uint64),
        ("aux", ct.c_uint64),
        ("comm", ct.c_char * 16),
    ]


class Proc(ct.Structure):
    _fields_ = [("charged", ct.c_uint64), ("last_dev", ct.c_int32), ("pad", ct.c_uint32),
                ("image", ct.c_uint64)]


class ProcCfg(ct.Structure):
    _fields_ = [("group", ct.c_uint32), ("slot", ct.c_uint32), ("phys", ct.c_uint8 * MAX_DEVS)]


class PKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("device", ct.c_int32)]


class GKey(ct.Structure):
    _fields_ = [("group", ct.c_uint32), ("device", ct.c_int32)]


class GMem(ct.Structure):
    _fields_ = [("used", ct.c_uint64), ("denied", ct.c_uint64)]


class GLim(ct.Structure):
    _fields_ = [("limit", ct.c_uint64), ("total", ct.c_uint64)]


class AKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("kind", ct.c_uint32), ("ptr", ct.c_uint64)]


class Alloc(ct.Structure):
    _fields_ = [("size", ct.c_uint64), ("device", ct.c_int32), ("pad", ct.c_uint32),
                ("image", ct.c_uint64)]


class Call(ct.Structure):
    _fields_ = [
        ("out", ct.c_uint64),
        ("size", ct.c_uint64),
        ("aux", ct.c_uint64),
        ("aux2", ct.c_uint64),
        ("fn", ct.c_uint32),
        ("flags", ct.c_uint32),
        ("group", ct.c_uint32),
        ("device", ct.c_int32),
    ]


class CKey(ct.Structure):
    _fields_ = [("tgid", ct.c_uint32), ("pad", ct.c_uint32), ("ctx", ct.c_uint64)]


class TCtx(ct.Structure):
    _fields_ = [
        ("ctx", ct.c_uint64 * CTX_DEPTH),
        ("dev", ct.c_int32 * CTX_DEPTH),
        ("depth", ct.c_uint32),
        ("pad", ct.c_uint32),
    ]


class Config(ct.Structure):
    _fields_ = [
        ("heartbeat_ns", ct.c_uint64),
        ("stale_ns", ct.c_uint64),
        ("flags", ct.c_uint32),
        ("oom_action", ct.c_uint32),
        ("graph_cost", ct.c_uint64),
        ("controller", ct.c_uint32),
        ("pad", ct.c_uint32),
    ]


class SmGrant(ct.Structure):
    _fields_ = [("granted", ct.c_uint64), ("limited", ct.c_uint32), ("checkpoint", ct.c_uint32),
                ("hold_at_sync", ct.c_uint64)]


class SmUse(ct.Structure):
    _fields_ = [("consumed", ct.c_uint64), ("launches", ct.c_uint64), ("completed", ct.c_uint64),
                ("sync_ns", ct.c_uint64), ("completed_ns", ct.c_uint64),
                ("checkpoint_ns", ct.c_uint64), ("syncs", ct.c_uint64)]


class SyncAt(ct.Structure):
    _fields_ = [("consumed", ct.c_uint64), ("ts", ct.c_uint64), ("gk", GKey)]


# C struct name -> mirror, for the layout test.
STRUCTS = {
    "hami_event": Event,
    "hami_proc": Proc,
    "hami_pcfg": ProcCfg,
    "hami_pkey": PKey,
    "hami_gkey": GKey,
    "hami_gmem": GMem,
    "hami_glim": GLim,
    "hami_akey": AKey,
    "hami_alloc": Alloc,
    "hami_call": Call,
    "hami_ckey": CKey,
    "hami_tctx": TCtx,
    "hami_config": Config,
    "hami_smgrant": SmGrant,
    "hami_smuse": SmUse,
    "hami_syncat": SyncAt,
}


def decode(data: int | bytes, size: int | None = None) -> Event:
    """Copy one ring-buffer record (a pointer from bcc, or bytes) into an Event."""
    if isinstance(data, (bytes, bytearray)):
        return Event.from_buffer_copy(bytes(data[: ct.sizeof(Event)]))
    return Event.from_buffer_copy(ct.string_at(data, ct.sizeof(Event)))
