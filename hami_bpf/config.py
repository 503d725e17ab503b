"""Daemon configuration: one frozen value built by `hami-bpf run`.

The parsers here are shared by the CLI (which turns ValueError into a one-line
usage error) and by the daemon (which can trust a DaemonConfig it is given).
"""
from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass

from .sm.duty import HOST_RUN_S, HOST_STOP_SHARE, QUANTUM_S, TURN_RUN_S
from .sm.progress import SAMPLE_SHARE
from .throttle import TURN_PERIOD_S

DEFAULT_SOCKET = "/run/hami-bpf/hami-bpf.sock"
DEFAULT_STATE_DIR = "/run/hami-bpf"
DEFAULT_PIN_DIR = "/sys/fs/bpf/hami-bpf"
DEFAULT_SM_TURN_MS = round(TURN_PERIOD_S * 1000)
DEFAULT_SM_HOLD_MS = round(QUANTUM_S * 1000)
DEFAULT_SM_HOST_RUN_MS = round(HOST_RUN_S * 1000)
DEFAULT_SM_TURN_RUN_MS = round(TURN_RUN_S * 1000)
DEFAULT_SM_GIVEBACK_PCT = round(HOST_STOP_SHARE * 100)
DEFAULT_SM_SAMPLE_PCT = round(SAMPLE_SHARE * 100)

GROUP_BY_FIXED = ("cgroup", "pid")
OOM_ACTIONS = ("auto", "return-oom", "stop-rewrite", "kill", "observe")

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def unsafe_chain(path: str) -> str | None:
    """Why someone other than root could replace the file at ``path``, or
    None. Every directory from / down to it, along the path as given and as
    resolved (symbolic links followed), must be owned by root and writable by
    no one else. A sticky world-writable directory such as /tmp is refused
    too, as sudo and sshd refuse it: its other users can still create the
    names we would look up there. The file itself is checked by its opener."""
    dirs: list[str] = []
    for p in (os.path.realpath(path), os.path.abspath(path)):   # the real directory named first
        d = os.path.dirname(p)
        while d not in dirs:
            dirs.append(d)
            if d == os.path.dirname(d):
                break
            d = os.path.dirname(d)
    for d in dirs:
        try:
            st = os.stat(d)      # a linked component is judged where it leads (also checked)
        except OSError as e:
            return f"directory {d}: {e.strerror}"
        if st.st_uid != 0:
            return f"directory {d} is owned by uid {st.st_uid}, not root"
        if st.st_mode & 0o022:
            return (f"directory {d} is writable by group or others "
                    f"(mode {stat.S_IMODE(st.st_mode):o})")
    return None


def parse_group_by(value: str) -> str:
    """'cgroup' | 'pid' | 'env:NAME' -> normalized string; ValueError otherwise."""
    v = value.strip()
    if v in GROUP_BY_FIXED:
        return v
    if v.startswith("env:"):
        name = v[4:]
        if _ENV_NAME.match(name):
            return v
        raise ValueError(f"{value!r}: env:NAME needs an environment variable name "
                         "(letters, digits, underscore)")
    raise ValueError(f"{value!r} is not one of cgroup, pid, env:NAME")


def parse_host_port(value: str, allow_zero: bool = False) -> tuple[str, int]:
    """'HOST:PORT', ':PORT' (all interfaces) or '[v6]:PORT' -> (host, port)."""
    host, sep, port = value.rpartition(":")
    low = 0 if allow_zero else 1
    if not sep or not port.isdigit() or not low <= int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT (port 1-65535)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"{value!r}: write IPv6 addresses as [ADDR]:PORT")
    return host or "0.0.0.0", int(port)


# Where NVML does not answer (the demo, the stand-in libcuda): the stand-in's
# own defaults.
DEFAULT_FALLBACK_DEVICES = 2
DEFAULT_FALLBACK_TOTAL_MEM = 16 << 30
# Seconds an attached driver library nobody uses stays attached (a restarting
# container must not pay a detach and a re-attach).
DEFAULT_LIB_GRACE_S = 10.0


@dataclass(frozen=True)
class DaemonConfig:
    libcuda: tuple[str, ...] = ()        # explicit libcuda paths; () = discover
    group_by: str = "cgroup"             # cgroup | pid | env:NAME
    socket: str = DEFAULT_SOCKET
    count_launches: bool = False
    policy: str | None = None            # policy file path
    env_limits: bool = True              # honor CUDA_DEVICE_MEMORY_LIMIT & co. in processes' env
    oom_action: str = "auto"             # one of OOM_ACTIONS
    metrics_addr: str | None = None      # HOST:PORT for Prometheus, None = off
    socket_group: str | None = None      # chgrp the socket and make it 0660
    demo: bool | None = None             # None = auto: demo when no libcuda is found
    state_dir: str = DEFAULT_STATE_DIR
    verbose: bool = False
    context_bytes: int | None = None     # device memory a process's context holds; None = auto
    unseen_memory: bool = True           # count memory the driver reports and no probe charged
    sm_limits: bool = True               # enforce SM caps (throttle launches); off: caps are shown only
    hami_regions: str | None = None      # publish HAMi shared-region files under this dir; None = off
    sm_lend_idle: bool = False           # a capped group may use what higher/equal priority leave idle
    sm_turns: bool = True                # groups capped on one device take turns (throttle.turns)
    sm_turn_ms: int = DEFAULT_SM_TURN_MS  # the turns' period
    sm_hold_ms: int = DEFAULT_SM_HOLD_MS  # running time a synchronizing group owes before it is held
    sm_host_run_ms: int = DEFAULT_SM_HOST_RUN_MS  # a host-paced group runs this long between holds; 0: off
    sm_turn_run_ms: int = DEFAULT_SM_TURN_RUN_MS  # ... while it takes turns with a capped neighbour
    sm_giveback_pct: int = DEFAULT_SM_GIVEBACK_PCT  # a launch-bound group alone runs this % more; 0: off
    sm_sample_pct: int = DEFAULT_SM_SAMPLE_PCT  # running time spent free measuring speed; 0: off
    sm_learn_alone: bool = True          # a group learns its rate with its device's capped groups held
    open_gate: bool = True               # hold a process opening a libcuda until that file is probed
    pin_dir: str | None = DEFAULT_PIN_DIR  # bpffs directory the accounting maps are kept in; None = not kept
    fresh: bool = False                  # discard kept state instead of adopting it
    fallback_devices: int = DEFAULT_FALLBACK_DEVICES    # devices assumed where NVML does not answer
    fallback_total_mem: int = DEFAULT_FALLBACK_TOTAL_MEM  # ... and each one's memory
    sim_gpu: str | None = None           # the simulated GPU's file (stand-in libcuda): its utilization
    sim_proc_mem: str | None = None      # the stand-in libcuda's per-process memory table
    lib_grace_s: float = DEFAULT_LIB_GRACE_S  # an attached library nobody uses is detached after this

    def __post_init__(self) -> None:
        object.__setattr__(self, "libcuda", tuple(self.libcuda))
        parse_group_by(self.group_by)
        if self.oom_action not in OOM_ACTIONS:
            raise ValueError(f"oom_action {self.oom_action!r} is not one of {', '.join(OOM_ACTIONS)}")
        if self.metrics_addr is not None:
            parse_host_port(self.metrics_addr)
        if not 10 <= self.sm_hold_ms <= 500:
            raise ValueError(f"sm_hold_ms {self.sm_hold_ms} is not between 10 and 500")
        if not 0 <= self.sm_host_run_ms <= 1000:
            raise ValueError(f"sm_host_run_ms {self.sm_host_run_ms} is not between 0 and 1000")
        if not 0 <= self.sm_turn_run_ms <= 1000:
            raise ValueError(f"sm_turn_run_ms {self.sm_turn_run_ms} is not between 0 and 1000")
        if not 0 <= self.sm_giveback_pct <= 50:
            raise ValueError(f"sm_giveback_pct {self.sm_giveback_pct} is not between 0 and 50")
        if not 0 <= self.sm_sample_pct <= 25:
            raise ValueError(f"sm_sample_pct {self.sm_sample_pct} is not between 0 and 25")
        if not 20 <= self.sm_turn_ms <= 1000:
            raise ValueError(f"sm_turn_ms {self.sm_turn_ms} is not between 20 and 1000")
