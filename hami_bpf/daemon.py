"""The controller: poll -> decode -> apply -> act -> snapshot.

One thread runs the loop and owns the slot table, the BPF maps and every
ptrace operation (a tracee belongs to the thread that seized it). Signal
handlers only set a flag. The server and metrics threads read the latest
immutable Snapshot, swapped in by reference.
"""
from __future__ import annotations

import collections
import logging
import math
import os
import signal
import stat as stat_
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, abi, containers, enforce, kept, procfs
from .heartbeat import Heartbeat
from .libwatch import LibraryWatcher, LockError, lock_file
from .memory import MemoryEnforcer, Place
from .actions import ClearSlot, Compacted, CreateGroup, DeleteGroup, ReleaseProcess, WriteSlot
from .config import DaemonConfig, unsafe_chain
from .devices import Devices, Fallback
from .events import (GroupLimitSet, MemoryAllocated, MemoryFreed, ProcessExited,
                     UsageObserved,
                     ProcessRegistered, ProcKey)
from .limits import (HAMI_DEFAULT_PRIORITY, EnvLimits, PolicyError, clipped, effective_limits,
                     effective_sched, load_policy, parse_env_limits, physical_to_visible,
                     visible_entries, visible_to_physical)
from .metrics import observe_exit_latency
from .slots import SlotTable
from .sm import duty, guard
from .throttle import (BUSY_S, LEARN_ALONE_S, TURN_CALIBRATE_S, UNLIMITED, Budget,
                       Completions, Turn, completion_rate, correct_rate, gpu_bound, held_to_cap, learn_alone,
                       neighbours, next_edge, scale_rate, tick as budget_tick, turn_gains, turns)
from .snapshot import (SCHEMA_VERSION, DeviceUsage, EventRecord, GroupInfo, ProcessInfo,
                       SlotInfo, Snapshot)

log = logging.getLogger("hami_bpf")

POLL_MS = 100
THROTTLE_TICK_S = 0.05
UNPACED_S = 2.0     # a neighbour that launched this recently and has no pace yet: wait
HELD_TICK_S = 0.005
DUTY_TICK_S = 0.01         # duty pacing asks for holds this promptly
CONTROL_NICE = -10         # the daemon's CPU priority (_raise_priority)
MAX_HOLD_S = 0.25          # no group is held longer than this, budget or not
RESUME_MARGIN_S = 0.02
THROTTLED_SHOWN_S = 1.0   # a group held back within this long shows as throttled
GRAPH_COST = 4096          # cost units per cuGraphLaunch (feedback corrects it where NVML is)
HEARTBEAT_STALE_NS = 2_000_000_000
REAP_EVERY_S = 1.0
RECONCILE_EVERY_S = 1.0    # the table's usage checked against the kernel's counters
MAX_PROCS = 4096           # procs map size (maps.h), part of the kept layout
SWEEP_EVERY_S = 10.0
EVENT_LOG_LEN = 2000
HANDLE_BIT = 1 << 64
# What a PyTorch process's CUDA context, modules and handles held on an H200
# (driver 580) right after start-up: 554,500,096 bytes by NVML
# (docs/performance.md). No allocation probe sees it, so each process using a
# device reserves this much of its group's limit there.
DEFAULT_CONTEXT_BYTES = 528 << 20   # cuMemCreate handles and device pointers are separate name spaces


class DaemonError(RuntimeError):
    """A start-up failure the CLI prints as one line (exit 2)."""


# --- /proc (read through procfs) ---------------------------------------------

# Longest group name kept as is; a longer one (an env:NAME value, say) is cut
# and made unique again by a hash of the whole.
GROUP_NAME_MAX = 1024
LABEL_MAX = 253            # a Kubernetes name's limit
PROBLEMS_SHOWN = 8         # malformed variables recorded per process
# Bytes of /proc/PID/environ read: the variables that matter come from the
# container spec, a few KiB. Past this the environment is cut and the cut is
# reported.
ENVIRON_MAX = procfs.ENVIRON_MAX
parse_environ = procfs.parse_environ


def read_environ(pid: int) -> tuple[dict[str, str], bool]:
    """(environment of ``pid``, whether it was cut at ENVIRON_MAX bytes)."""
    return procfs.environ(pid, limit=ENVIRON_MAX)


def proc_environ(pid: int) -> dict[str, str]:
    return read_environ(pid)[0]


def bounded_name(name: str, limit: int = GROUP_NAME_MAX) -> str:
    """``name`` if it is at most ``limit`` characters, else a prefix and a
    hash of the whole: still one name per distinct input."""
    if len(name) <= limit:
        return name
    import hashlib
    digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:16]
    return f"{name[:limit - 20]}...{digest}"


def proc_cgroup(pid: int) -> str | None:
    """The cgroup path ``--group-by cgroup`` groups by (see
    :func:`hami_bpf.procfs.parse_cgroup` for v1 and hybrid hosts)."""
    return procfs.cgroup_path(pid)


def proc_comm(pid: int) -> str:
    return procfs.comm(pid)


def ns_pid(pid: int) -> int | None:
    """The pid as the process's own pid namespace sees it (NSpid's last field)."""
    v = procfs.status_field(pid, "NSpid")
    parts = v.split() if v else []
    return int(parts[-1]) if parts else None


def group_of(pid: int, group_by: str, env: dict[str, str] | None,
             cgroup: str | None = None) -> str:
    """The group of ``pid``. ``cgroup``, when given, is its already read
    cgroup path (so its group and its pod labels come from one reading)."""
    if group_by == "pid":
        return str(pid)
    if group_by.startswith("env:"):
        name = group_by[4:]
        e = env if env is not None else proc_environ(pid)
        return bounded_name(e.get(name) or f"{name}(unset)")
    return bounded_name(cgroup or proc_cgroup(pid) or "(exited)")


def _stopped_tasks(pid: int) -> list[int]:
    return [t for t in procfs.tasks(pid) if procfs.state(pid, t) == "T"]


def _user_pc(pid: int, tid: int) -> int | None:
    """The user pc of a task that is not in a system call ("-1 sp pc")."""
    return procfs.user_pc(pid, tid)


def find_libnvml(libcuda_path: Path) -> Path | None:
    """libnvidia-ml.so.1 beside the probed libcuda (the driver installs them
    together; a container's compat libcuda comes without one), else ld.so's."""
    beside = Path(libcuda_path).parent / "libnvidia-ml.so.1"
    if beside.exists():
        return beside.resolve()
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if line.strip().startswith("libnvidia-ml.so.1 ") and "=>" in line:
            return Path(line.split("=>")[1].strip()).resolve()
    return None


# --- mechanisms -------------------------------------------------------------------

def choose_mechanisms(feats, oom_action: str = "auto") -> tuple[str, str]:
    """(OOM action, memory-info mechanism): the best the kernel's features allow."""
    want = oom_action
    if want == "auto":
        want = ("return-oom" if feats.reg_write else
                "stop-rewrite" if feats.send_signal else "observe")
    meminfo = ("probe-write-user" if feats.probe_write_user else
               "stop-write" if feats.send_signal else "off")
    return want, meminfo


def sm_mechanism(feats) -> str:
    """How SM caps are enforced on this kernel (doctor's report)."""
    if not feats.send_signal:
        return "off: the kernel refuses bpf_send_signal, nothing can hold a launch"
    return ("launch uprobes charge a per-group budget, bpf_send_signal(SIGSTOP) holds "
            "the group when spent; attached with the first cap")


# --- the controller ------------------------------------------------------------

@dataclass
class ProcInfo:
    """What the controller learned of a process at registration (not in the pure table)."""
    env: EnvLimits | None
    phys: list[int]
    ns_pid: int | None
    state: str = "running"
    labels: dict[str, str] = field(default_factory=dict)   # pod labels (containers.PodRef.labels)
    cvd: str | None = None     # its CUDA_VISIBLE_DEVICES (limits are per visible index)


UNCLASSIFIED = "(unclassified)"   # the group of a process whose group could not be read


@dataclass
class Classified:
    """What registration read of a process (Daemon._classify)."""
    group: str
    env: EnvLimits | None = None
    cvd: str | None = None
    phys: list[int] = field(default_factory=lambda: list(range(abi.MAX_DEVS)))
    labels: dict[str, str] = field(default_factory=dict)
    ns_pid: int | None = None
    problems: list[str] = field(default_factory=list)    # malformed values, ignored
    failed: list[str] = field(default_factory=list)      # steps that raised: inputs not used
    reasons: list[str] = field(default_factory=list)


class Daemon:
    def __init__(self, cfg: DaemonConfig):
        self.cfg = cfg
        self.table = SlotTable()
        self.info: dict[int, ProcInfo] = {}
        # SM limiting: caps per group and physical device (percent), budgets per
        # (group index, device), and the pids we hold stopped per throttled group.
        self.sm_caps: dict[str, dict[int, int]] = {}
        self.budgets: dict[tuple[int, int], Budget] = {}
        # (priority, utilization policy) per group: the lowest priority and
        # the strictest policy any member asked for (limits.effective_sched).
        self.sched: dict[str, tuple[int, str]] = {}
        self._last_busy: dict[tuple[int, int], float] = {}   # (group index, device) -> last launch seen
        self._first_busy: dict[tuple[int, int], float] = {}  # ... -> when its launches were first seen
        self._budget_logged: dict[tuple[int, int], float] = {}
        self.lending: set[tuple[int, int]] = set()           # (group index, device) above its cap now
        # Slots of the groups taking turns on a device (throttle.turns), by
        # (group index, device); counted from the daemon's start.
        self.turns: dict[tuple[int, int], Turn] = {}
        self._turn_epoch = time.monotonic()
        self._turns_read: float | None = None   # when turn_gains() last read the devices
        self._turns_util: dict[int, float | None] = {}  # ... and what it read
        # Per device, the group learning there alone and the capped groups it
        # holds meanwhile (throttle.learn_alone): (learner key, held keys).
        self.alone: dict[int, tuple[tuple[int, int] | None, frozenset]] = {}
        self._alone_said: dict[int, tuple[tuple[int, int], frozenset]] = {}  # ... as events told it
        self.throttled: dict[str, set[int]] = {}
        self.throttle_since: dict[str, float] = {}
        self._prev_use: dict[tuple[int, int], tuple[float, int]] = {}
        # Every (group, device)'s completions while some budget learns, for
        # splitting a shared device by what each group got done.
        self._done: dict[tuple[int, int], Completions] = {}
        self.last_throttled: dict[str, float] = {}
        self._sm_unenforced: set[str] = set()
        self.sm_share: dict[tuple[int, int], float | None] = {}
        # Groups that synchronize often are paced by time (sm.duty), the
        # rest by the launch budget (self.budgets).
        self.duty = duty.DutyPacer(quantum_s=cfg.sm_hold_ms / 1000,
                                    max_hold_s=max(duty.MAX_HOLD_S, 2 * cfg.sm_hold_ms / 1000))
        self.guard = guard.Guard()        # the launch budget checked against the GPU
        self._duty_next: float | None = None
        self.events_log: collections.deque[EventRecord] = collections.deque(maxlen=EVENT_LOG_LEN)
        self._seq = 0
        self._log_lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.exit_latency_ns: collections.deque[int] = collections.deque(maxlen=10000)
        self.mechanisms: dict[str, str] = {}
        self._previous_version: str | None = None   # of the daemon whose kept state we adopt
        self.simulated = False
        self.policy = None
        # Set from signal handlers, so plain flags: a handler must take no lock
        # (threading.Event.set() does; a second SIGINT arriving while the first
        # handler held it deadlocked the daemon before its shutdown).
        self._stopping = False
        self._stop_signal: int | None = None     # the signal that asked us to stop
        self._reload_asked = False
        self._reload_job: threading.Thread | None = None    # reading --policy again
        self._reload_result = None        # (Policy, None) or (None, DaemonError) from it
        self._reload_again = False        # SIGHUP while it read: read once more
        self._snap = Snapshot.empty()
        self._adopting = False
        # Files named like the driver library that export no driver API.
        self.heart: Heartbeat | None = None
        self.memory = MemoryEnforcer(place=self._place,
                                     group_used=lambda gi, dev: self.probes.group_used(gi, dev),
                                     context_reserve=self._context_reserve,
                                     stopped=lambda: self.stopped,
                                     record=self.record, counters=self.counters)
        self._mismatch: dict[int, dict[int, int]] = {}   # pid -> kernel usage that disagreed
        self._dirty = True
        self.probes = None
        self.server = None
        self.metrics = None
        self.demo = None
        self.stopped: enforce.StoppedSet | None = None
        self.oom_action = abi.ACT_OBSERVE
        self.group_by = cfg.group_by
        self.watch = LibraryWatcher(
            probes=lambda: self.probes, record=self.record, counters=self.counters,
            register=self._register_found, is_registered=lambda pid: self.table.resolve(pid) is not None,
            registered=lambda: [p.key.pid for p in self.table.processes()],
            stop_rewrite=lambda: self.oom_action == abi.ACT_STOP_REWRITE, grace_s=cfg.lib_grace_s)
        host = os.environ.get("HAMI_BPF_HOST_ROOT") or "/"
        self.pod_names = containers.PodNames(host if os.path.isdir(host) else "/")

    # -- events log ----------------------------------------------------------

    def record(self, kind: str, message: str, **data) -> None:
        with self._log_lock:
            self._seq += 1
            self.events_log.append(EventRecord(time.time(), kind, message, data, self._seq))
        lvl = (logging.WARNING if kind in ("config", "error", "deny_ignored") else
               logging.INFO if (self.simulated or kind in ("deny", "fallback", "recover")) else logging.DEBUG)
        log.log(lvl, "%s", message)

    def events_since(self, since: int) -> list[EventRecord]:
        with self._log_lock:
            return [e for e in self.events_log if e.seq > since]

    @property
    def libs(self) -> list[Path]:
        """Every library probed now (libwatch.LibraryWatcher owns the list)."""
        return self.watch.libs

    @libs.setter
    def libs(self, value: list[Path]) -> None:
        self.watch.libs = list(value)

    def _register_found(self, pid: int) -> None:
        """A user of a library discovery attached to (it may have called
        cuInit before the probes were there)."""
        self._register(pid, time.monotonic_ns(), existing=True)
        self._dirty = True

    def snapshot(self) -> Snapshot:
        return self._snap

    # -- start-up ------------------------------------------------------------

    def _choose_libs(self) -> None:
        from . import libcuda
        cfg = self.cfg
        if cfg.libcuda:
            for p in cfg.libcuda:
                try:
                    libcuda.validate_libcuda(p)
                except (libcuda.LibcudaError, OSError) as e:
                    raise DaemonError(str(e)) from None
            self.libs = [Path(p).resolve() for p in cfg.libcuda]
        elif cfg.demo is not True:
            self.libs = [p for p in libcuda.find_libcuda(None)]
        if cfg.demo or (cfg.demo is None and not self.libs):
            from . import demo, fakecuda
            fake = fakecuda.build(None)
            self.fake = fake
            self.libs = [Path(fake.libcuda)]
            self.simulated = True
            print(demo.SIMULATED_BANNER, file=sys.stderr, flush=True)
            if cfg.demo is not False and self.group_by == "cgroup":
                # The demo's processes share our cgroup; its groups are HAMi-style regions.
                self.group_by = "env:CUDA_DEVICE_MEMORY_SHARED_CACHE"
                log.info("demo: grouping by %s", self.group_by)

    def _choose_mechanisms(self) -> tuple[bool, bool]:
        from . import probes
        try:
            feats = probes.probe_features()
        except probes.ProbeError as e:
            raise DaemonError(str(e)) from None
        self.features = feats
        want, meminfo = choose_mechanisms(feats, self.cfg.oom_action)
        if want == "return-oom" and not feats.reg_write:
            raise DaemonError("--oom-action return-oom: this kernel refuses uprobe register writes "
                              f"({feats.errors.get('reg_write', 'refused')})")
        if want in ("stop-rewrite", "kill") and not feats.send_signal:
            raise DaemonError(f"--oom-action {want}: this kernel refuses bpf_send_signal "
                              f"({feats.errors.get('send_signal', 'refused')})")
        self.oom_action = {"return-oom": abi.ACT_RETURN_OOM, "stop-rewrite": abi.ACT_STOP_REWRITE,
                           "kill": abi.ACT_KILL, "observe": abi.ACT_OBSERVE}[want]
        self.mechanisms = {
            "daemon": f"hami-bpf {__version__}",
            "oom": want,
            "meminfo": meminfo,
            "exit": "tracepoint sched_process_exit",
            "events": "ringbuf" if feats.ringbuf else "none",
            "launch": "counting uprobes" if self.cfg.count_launches else "off",
        }
        return feats.reg_write and want == "return-oom", feats.probe_write_user

    def _load_policy(self) -> None:
        if self.cfg.policy:
            self.policy = self._read_policy(self.cfg.policy)

    @staticmethod
    def _read_policy(p: str):
        """The checked and parsed policy file (DaemonError naming what is wrong)."""
        # Whoever can write the file, or any directory above it, can raise
        # their own limit: only root may.
        bad = unsafe_chain(p)
        if bad:
            raise DaemonError(f"--policy {p}: {bad}; a workload must not be able to replace "
                              "the policy")
        try:
            fd = os.open(os.path.realpath(p), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            raise DaemonError(f"--policy {p}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat_.S_ISREG(st.st_mode):
                raise DaemonError(f"--policy {p}: not a regular file")
            if st.st_uid != 0 or st.st_mode & 0o022:
                raise DaemonError(f"--policy {p}: must be owned by root and not writable by "
                                  f"group or others (owner uid {st.st_uid}, mode "
                                  f"{st.st_mode & 0o777:o}); a workload must not be able to "
                                  "raise its own limit")
            try:
                text = f.read().decode()
            except (OSError, UnicodeDecodeError) as e:
                raise DaemonError(f"--policy {p}: {e}") from None
        try:
            return load_policy(text, p)
        except PolicyError as e:
            raise DaemonError(str(e)) from None

    def start(self) -> None:
        from . import libcuda, probes
        cfg = self.cfg
        self._raise_priority()
        self._choose_libs()
        self._lock_libs()
        self._load_policy()
        reg_write, pwu = self._choose_mechanisms()
        self.devices = Devices.discover(self.simulated, Fallback(cfg.fallback_devices, cfg.fallback_total_mem,
                                                                   cfg.sim_gpu))
        self.ctx_bytes = cfg.context_bytes if cfg.context_bytes is not None else (
            0 if self.simulated or not self.devices.nvml else DEFAULT_CONTEXT_BYTES)
        self.mechanisms["context_reserve"] = f"{self.ctx_bytes} bytes per process per device"
        os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
        # A previous run that crashed may have left processes stopped.
        for pid, what in enforce.StoppedSet.recover(cfg.state_dir).items():
            self.record("recover", f"pid {pid} left stopped by a previous run: {what}", pid=pid)
        self.stopped = enforce.StoppedSet(cfg.state_dir)
        self.stopped.on_error = self._state_write_failed
        pin = self._prepare_kept_state()
        try:
            gate_missing = ("--no-open-gate" if not cfg.open_gate else
                            probes.open_gate_missing() if self.features.send_signal else
                            "this kernel refuses bpf_send_signal")
            self.probes = probes.Probes(reg_write=reg_write, probe_write_user=pwu,
                                        max_procs=MAX_PROCS, pin_dir=pin,
                                        open_gate=gate_missing is None)
        except probes.ProbeError as e:
            raise DaemonError(str(e)) from None
        if cfg.pin_dir:
            self._wait_for_predecessor()   # compiling took that long off the wait
        flags = abi.CFG_ENFORCE_MEM
        if self.mechanisms["meminfo"] != "off":
            flags |= abi.CFG_VIRT_MEMINFO
        # Limits can come from a new process's environment or the policy: hold
        # it at cuInit until its group and limits are in the maps (~1 ms once).
        if (cfg.env_limits or self.policy) and self.features.send_signal:
            flags |= abi.CFG_GATE_INIT
            self.mechanisms["admission"] = "gated at cuInit"
        else:
            self.mechanisms["admission"] = "from first classified call"
        # A driver library a process opens (a private copy included) is
        # probed before the process can map it.
        if gate_missing is None and not self.probes.open_gate:
            gate_missing = f"the kernel refused its programs: {self.probes.open_gate_error}"
            self.record("fallback", f"the open gate: {gate_missing}; private libcuda copies are "
                        "found by scanning /proc")
        if gate_missing is None:
            flags |= abi.CFG_GATE_LIBS
            self.mechanisms["private_libs"] = "held at open until probed"
        else:
            self.mechanisms["private_libs"] = (f"found by scanning /proc (about every second; "
                                               f"{gate_missing})")
        self.probes.set_config(flags=flags, oom_action=self.oom_action, stale_ns=HEARTBEAT_STALE_NS)
        self.probes.set_graph_cost(GRAPH_COST)
        self.heart = Heartbeat(self.probes.heartbeat)
        self.heart.start()
        self.probes.open_events(self._on_event)
        if self._adopting:
            self._adopt()     # before our probes attach: nothing changes the maps meanwhile
        self.watch.entry_ok = {}
        for lib in self.libs:
            syms = libcuda.cuda_symbols(lib)
            try:
                a = self.probes.attach_core(str(lib), syms)
            except probes.ProbeError as e:
                raise DaemonError(str(e)) from None
            for sym, why in a.skipped.items():
                log.info("%s: skipping %s: %s", lib, sym, why)
            if cfg.count_launches:
                self.probes.attach_launch(str(lib), syms)
            offs = libcuda.symbol_file_offsets(lib, probes.ALLOC_SYMBOLS)
            self.watch.entry_ok[str(lib)] = {s: enforce.prologue_ok(str(lib), o, s) for s, o in offs.items()}
            if self.oom_action == abi.ACT_STOP_REWRITE:
                for s, (ok, why) in self.watch.entry_ok[str(lib)].items():
                    if not ok:
                        self.record("fallback", f"stop-rewrite refused for {s}: {why}; a denied "
                                    "call there is let through and counted", symbol=s)
            nvml = find_libnvml(lib)
            if nvml is not None:
                got = self.probes.attach_nvml(str(nvml), libcuda.read_symbols(nvml))
                if got:
                    log.info("attached %d probes to %s (nvidia-smi-style memory queries)",
                             len(got), nvml)
            log.info("attached %d probes to %s%s", len(a.core), lib,
                     f" (+{len(a.launch)} launch probes)" if a.launch else "")
        self.probe_cost_s = 0.0
        if cfg.sm_limits and self.libs:
            # Measured before any process is registered: the daemon maps
            # libcuda for it and must not count itself as a CUDA process.
            lib = str(self.libs[0])
            try:
                self.probe_cost_s = self.probes.measure_launch_probe_cost(lib)
                self.mechanisms["launch_probe_cost"] = (
                    f"{self.probe_cost_s * 1e6:.2f} us per launch (measured on {lib})")
            except Exception as e:  # noqa: BLE001 - the controller works without it
                self.mechanisms["launch_probe_cost"] = f"unknown ({e})"
                self.record("fallback", f"measuring the launch probe's cost on {lib}: {e}; "
                            "host-bound launchers will run a little under their caps")
        self.watch.pin_configured()
        self.watch.discover(register=False)   # _scan_existing registers their users
        self._recover_bpf_stops()
        self._scan_existing()
        from .server import ServerError, SnapshotServer
        self._rebuild_snapshot()
        self.server = SnapshotServer(cfg.socket, self.snapshot, self.events_since, cfg.socket_group)
        try:
            self.server.start()
        except (ServerError, OSError) as e:
            raise DaemonError(f"serving {cfg.socket}: {e}") from None
        if cfg.metrics_addr:
            from .metrics import MetricsError, start_metrics_server
            try:
                self.metrics = start_metrics_server(cfg.metrics_addr, self.snapshot)
            except (MetricsError, OSError) as e:
                raise DaemonError(f"serving metrics on {cfg.metrics_addr}: {e}") from None
        if self.simulated and cfg.demo is not False:
            from .demo import start_demo_workload
            self.demo = start_demo_workload(self.fake)
        log.info("ready: %s; oom=%s meminfo=%s; socket %s", ", ".join(map(str, self.libs)),
                 self.mechanisms["oom"], self.mechanisms["meminfo"], cfg.socket)

    def _state_write_failed(self, what: str, err: int | None) -> None:
        """The stopped-process record cannot be written (a full or read-only
        state directory): said once; limits and stops go on as before."""
        self.counters["state_write_errors"] += 1
        self.record("error", f"state directory: {what}; stopped processes are recorded in "
                    "memory only until writing works again (limits still apply)",
                    path=self.cfg.state_dir, errno=err, state_write_failed=True)

    def _prepare_kept_state(self) -> str | None:
        """Where the kept maps are pinned (None: in this process only), once the
        previous daemon's probes are gone. Sets _adopting when there is state
        to take over."""
        from . import probes
        cfg = self.cfg
        self._adopting = False
        if not cfg.pin_dir:
            self.mechanisms["state"] = "in this process only (--no-keep-state)"
            return None
        fp = probes.layout_fingerprint(MAX_PROCS)
        try:
            path, self._adopting = probes.prepare_pin_dir(cfg.pin_dir, fp, cfg.fresh)
        except probes.PinRefused as e:
            raise DaemonError(str(e)) from None
        except probes.ProbeError as e:
            self.mechanisms["state"] = f"in this process only ({e})"
            self.record("fallback", f"keeping the accounting across restarts: {e}; a restart "
                        "will start from zero", pin_dir=cfg.pin_dir)
            return None
        self.mechanisms["state"] = f"kept in {path}"
        if cfg.fresh:
            self.record("state", f"--fresh: kept state under {cfg.pin_dir} discarded",
                        pin_dir=cfg.pin_dir)
        return path

    def _wait_for_predecessor(self) -> None:
        """The previous daemon's probes must be gone before ours attach and
        before its maps are read: both would count every call otherwise."""
        cfg = self.cfg
        self._previous_version = kept.predecessor_version(cfg.state_dir)
        left = kept.wait_for_predecessor(cfg.state_dir,
                                         said=lambda m: self.record("state", m))
        if left:
            raise DaemonError(f"the previous daemon (pid {', '.join(map(str, left))}) still has its "
                              f"probes attached after {kept.PREDECESSOR_WAIT_S:.0f} s: adopting its "
                              "maps beside them would count every call twice")
        try:
            kept.write_owner(cfg.state_dir)
        except OSError as e:
            self._state_write_failed(f"recording this daemon in {cfg.state_dir}: {e.strerror}",
                                     e.errno)

    def _adopt(self) -> None:
        """Take over the maps a previous daemon kept: what exited while no
        daemon ran goes back to its group, reservations of calls whose return
        no probe saw are given back, and every living process is registered
        in the group index its bytes are charged to (kept.plan)."""
        st = self.probes.kept_state()
        a = kept.plan(st["procs"], st["assigned"], st["pmem"], st["calls"], st["group_keys"],
                      kept.start_ns)
        for p in a.dead:
            self.probes.forget_process(p.pid, p.charged, p.used)
        for r in a.reservations:
            self.probes.give_back(r.tid, r.group, r.device, r.size)
        for tid in a.stale_calls:
            self.probes.give_back(tid, None, 0, 0)
        threads = self.probes.forget_threads(procfs.thread_exists)
        # A group index is never reused: entries of one no process is in any
        # more are deleted below, but not before a new group could take it.
        self.table = SlotTable(first_group_index=max(a.indices, default=0) + 1)
        moved = 0
        for p in a.live:
            old = p.charged if p.charged is not None else p.assigned
            self._register(p.pid, time.monotonic_ns(), existing=True, index=old)
            view = self.table.process(p.pid)
            if view is None:        # gone meanwhile: as if it exited unseen
                self.probes.forget_process(p.pid, p.charged, p.used)
                continue
            if p.charged is not None and p.charged != view.group_index:
                self.probes.move_charge(p.pid, p.charged, view.group_index, p.used)
                moved += 1
            if p.used:
                self.table.apply(UsageObserved(p.pid, p.used, view.key.start_time))
        for idx in a.indices - {g.index for g in self.table.groups()}:
            self.probes.delete_group(idx)
        self.counters["adopted_processes"] += len(a.live)
        self.counters["adopted_exited"] += len(a.dead)
        self.record("adopt", f"adopted {len(a.live)} processes holding {a.bytes_adopted} bytes "
                    f"from the kept maps; {len(a.dead)} exited meanwhile ({a.bytes_released} "
                    f"bytes back to their groups), {len(a.reservations)} reservations given back, "
                    f"{moved} moved to another group", adopted=len(a.live),
                    adopted_bytes=a.bytes_adopted, exited=len(a.dead),
                    released_bytes=a.bytes_released, reservations=len(a.reservations),
                    moved=moved, threads_forgotten=threads, version=__version__,
                    previous_version=self._previous_version)

    def _reconcile(self) -> None:
        """The kernel's per-process counters (pmem) are authoritative: the
        table's sum of allocation events is corrected where it disagrees with
        them twice in a row with the same value (one disagreement may be an
        event still on its way; a lost one stays)."""
        kernel: dict[int, dict[int, int]] = {}
        for (pid, dev), b in self.probes.process_mem().items():
            if b:
                kernel.setdefault(pid, {})[dev] = b
        now: dict[int, dict[int, int]] = {}
        for p in self.table.processes():
            k = kernel.get(p.key.pid, {})
            if k == dict(p.used):
                continue
            if self._mismatch.get(p.key.pid) != k:
                now[p.key.pid] = k
                continue
            self.table.apply(UsageObserved(p.key.pid, k, p.key.start_time))
            self.counters["usage_corrections"] += 1
            self._dirty = True
            self.record("reconcile", f"pid {p.key.pid}: usage {dict(p.used)} corrected to {k} "
                        "from the kernel's counters (an allocation or free event was lost)",
                        pid=p.key.pid, group=p.group,
                        before={str(d): b for d, b in p.used.items()},
                        after={str(d): b for d, b in k.items()})
        self._mismatch = now

    def _lock_libs(self) -> None:
        """One controller per library: two would both stop, rewrite and resume
        the same processes. The lock dies with the process, SIGKILL included."""
        self._locks = []
        for lib in self.libs:
            try:
                fd, path = lock_file(lib.stat())
            except LockError as e:
                raise DaemonError(str(e)) from None
            if fd is None:
                raise DaemonError(f"another hami-bpf daemon is attached to {lib} "
                                  f"(lock {path} is held)") from None
            self._locks.append(fd)

    def _recover_bpf_stops(self) -> None:
        """Finish what a previous controller left: processes its probes stopped
        before it could act (it was SIGKILLed). Such a thread sits exactly one
        byte past a probed entry (the emulated push %rbp), which is where no
        one else's stop can leave it; /proc/PID/task/TID/syscall shows its pc
        without ptrace. A denied allocation is failed now; a hold at cuInit is
        released. Other stopped processes are not ours: left alone."""
        from . import libcuda, probes
        for lib in self.libs:
            offs = libcuda.symbol_file_offsets(lib, probes.ALLOC_SYMBOLS + probes.LAUNCH_SYMBOLS
                                               + ("cuInit",))
            for pid in self.watch.pids_of(lib):
                if pid == os.getpid():
                    continue
                entries = {}
                for sym, off in offs.items():
                    addr = enforce.entry_address(pid, str(lib), off)
                    if addr is not None:
                        entries[addr] = sym
                for tid in _stopped_tasks(pid):
                    pc = _user_pc(pid, tid)
                    sym = entries.get(pc - 1) if pc else None
                    if sym is None:
                        continue
                    if sym == "cuInit" or sym in probes.LAUNCH_PROBES:
                        enforce.resume(pid)
                        self.record("recover", f"pid {pid}: released from a hold at {sym} left by "
                                    "a previous run", pid=pid, symbol=sym)
                        continue
                    try:
                        enforce.fail_call(pid, tid, pc - 1, stopped=self.stopped)
                        self.record("recover", f"pid {pid}: {sym} denied by a previous run: "
                                    "returned CUDA_ERROR_OUT_OF_MEMORY", pid=pid, symbol=sym)
                    except enforce.EnforceError as e:
                        self.record("error", f"pid {pid}: finishing a denial left by a previous "
                                    f"run: {e}", pid=pid)

    def _scan_existing(self) -> None:
        for lib in self.libs:
            for pid in self.watch.pids_of(lib):
                if pid != os.getpid() and self.table.resolve(pid) is None:
                    self._register(pid, time.monotonic_ns(), existing=True)

    # -- libcuda files that containers bring ---------------------------------------

    # -- the loop ------------------------------------------------------------

    def loop(self) -> None:
        last_reap = last_sweep = last_reconcile = time.monotonic()
        while not self._stopping:
            self.heart.progress()
            # While a group is held, tick fast: the hold should end as soon as
            # the budget allows, or the held time itself lowers the share.
            self.probes.poll(self._poll_ms())
            self._release_gated()
            now = time.monotonic()
            if self.sm_caps:
                try:
                    self._throttle_tick(now)
                except Exception as e:   # noqa: BLE001 - SM pacing must never take the daemon down
                    self._sm_failed(e)
            if now - last_reap >= REAP_EVERY_S:
                self._reap()
                last_reap = now
            self.memory.answer_due(now)
            if now - last_reconcile >= RECONCILE_EVERY_S:
                self._reconcile()
                last_reconcile = now
            if now - last_sweep >= SWEEP_EVERY_S:
                live = {p.key.pid for p in self.table.processes()} | self.probes.bpf_procs()
                self.probes.sweep(live)
                last_sweep = now
            if self._reload_asked:
                self._reload_asked = False   # one asked meanwhile reads the same file
                self.reload_policy()
            if self._dirty or self.cfg.count_launches or self.sm_caps:
                self._rebuild_snapshot()

    def _raise_priority(self) -> None:
        """Holds end when the loop gets the CPU: on a node whose CPUs the
        workloads keep busy, a loop at their priority would stretch every
        hold (a group at cap 25 ran at under 1% next to two busy VMs). The
        loop sleeps in poll() between ticks, so a higher priority costs
        others nothing while it waits."""
        try:
            os.setpriority(os.PRIO_PROCESS, 0, CONTROL_NICE)
            self.mechanisms["control_priority"] = f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
        except OSError as e:
            self.mechanisms["control_priority"] = f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"
            self.record("config", f"could not raise the daemon's CPU priority to nice "
                        f"{CONTROL_NICE} ({e}): holds may outlast their time on a busy node",
                        nice=CONTROL_NICE)

    def _sm_failed(self, e: Exception) -> None:
        """SM pacing failed this tick: fail open. Every group it holds runs
        again; memory limits are untouched (they live in BPF)."""
        self.counters["sm_errors"] += 1
        log.exception("SM pacing failed; holds released")
        for group in list(self.throttled):
            self._resume_group(group)
        self.record("error", f"SM pacing failed ({type(e).__name__}: {e}); every hold released",
                    error=type(e).__name__)

    def _poll_ms(self) -> int:
        due_at = self.memory.next_due()
        if due_at is not None:
            due = due_at - time.monotonic()
            return max(1, min(POLL_MS, math.ceil(due * 1000)))
        if not self.sm_caps:
            return POLL_MS
        wait = HELD_TICK_S if self.throttled else THROTTLE_TICK_S
        if self._duty_next is not None:
            wait = min(wait, DUTY_TICK_S)
        # Turns begin and end on time: a tick at every slot's edges.
        now = time.monotonic()
        edge = next_edge(self.turns.values(), now) if self.turns else None
        if edge is not None:
            wait = min(wait, edge - now)
        return max(1, math.ceil(wait * 1000))

    def stop(self, signum: int | None = None) -> None:
        """A fatal signal: the loop ends at its next turn (safe in a signal
        handler: plain assignments, no lock)."""
        if self._stop_signal is None:
            self._stop_signal = signum
        self._stopping = True

    def request_reload(self) -> None:
        """SIGHUP: the loop re-reads --policy at its next turn."""
        self._reload_asked = True

    def reload_policy(self) -> None:
        """Re-read --policy (same ownership and syntax checks as at start) and
        work every group's limits out again from it and its members'
        environments: a policy can now raise a limit as well as lower it,
        members still only lower. A file that fails a check changes nothing.

        Reading and parsing run on a thread (a file of many rules takes
        seconds): the loop goes on handling events, under the previous policy,
        until the thread has a result, which it asks the loop to apply (the
        loop calls this again)."""
        if not self.cfg.policy:
            self.record("config", "SIGHUP: no --policy to reload")
            return
        job = self._reload_job
        if job is not None and job.is_alive():
            self._reload_again = True     # read the file again once this one is in
            return
        if job is None:
            self._reload_again = False
            path = self.cfg.policy

            def read():
                try:
                    self._reload_result = (self._read_policy(path), None)
                except DaemonError as e:
                    self._reload_result = (None, e)
                except Exception as e:  # noqa: BLE001 - reported by the loop
                    self._reload_result = (None, DaemonError(f"--policy {path}: {e}"))
                self._reload_asked = True     # the loop applies it at its next turn
            self._reload_result = None
            self._reload_job = threading.Thread(target=read, name="hami-policy", daemon=True)
            self._reload_job.start()
            return
        self._reload_job = None
        new, err = self._reload_result or (None, DaemonError("--policy: not read"))
        self._reload_result = None
        if err is not None:
            self.record("error", f"reloading policy: {err}; the previous policy stays in force")
        else:
            self.policy = new
            self.counters["policy_reloads"] += 1
            for g in self.table.groups():
                self._recompute_limits(g.name)
            self._sync_launch_probes()
            self.record("config", f"policy {self.cfg.policy} reloaded", policy=str(self.cfg.policy))
            self._dirty = True
        if self._reload_again:
            self.reload_policy()

    def _recompute_limits(self, group: str) -> None:
        g = self.table.group(group)
        if g is None:
            return
        old_limits = dict(self.table.limits(group))
        old_caps = self.sm_caps.pop(group, {})
        self.sched.pop(group, None)
        for dev in old_limits:
            self.table.apply(GroupLimitSet(group, dev, None))
        for key in g.slots:
            info = self.info.get(key.pid)
            self._apply_limits(group, g.index, key.pid, info.cvd if info else None)
        limits = self.table.limits(group)
        for dev in set(old_limits) | set(limits):
            if limits.get(dev) != old_limits.get(dev):
                self._sync_bpf_limit(group, dev)
                if limits.get(dev) is None:
                    self.record("limit", f"group {group!r} device {dev}: no memory limit",
                                group=group, device=dev, limit=None)
        caps = self.sm_caps.get(group, {})
        for dev in set(old_caps) - set(caps):
            # Count only from now on; a learned budget would be stale anyway.
            self._forget_budget((g.index, dev))
            self.probes.delete_sm_grant(g.index, dev)
            self.record("limit", f"group {group!r} device {dev}: no SM cap", group=group,
                        device=dev, sm=None)
        if group in self.throttled and not caps:
            self._resume_group(group)

    def shutdown(self) -> None:
        """Every exit path: nobody may be left stopped, every probe detached."""
        if self.heart is not None:
            self.heart.stop()
        if self.probes:
            try:
                self.probes.stop_heartbeat()   # the BPF side stops nobody from now on
                self.probes.consume()          # resume what it stopped meanwhile
                self._release_gated()
            except Exception as e:
                log.warning("draining events at shutdown: %s", e)
        self.memory.drain()               # paced denials answered, later ones at once
        if self.stopped:
            for pid in self.stopped.resume_all():
                log.info("resumed pid %d at shutdown", pid)
        if self.demo:
            self.demo.stop()
        if self.server:
            self.server.close()
        if self.metrics:
            self.metrics.close()
        if self.probes:
            self.probes.close()
            if self.cfg.pin_dir and self.stopped is not None:
                try:   # the next daemon waits for the child that closes our probes
                    kept.write_owner(self.cfg.state_dir, closer=self.probes.closer_pid)
                except OSError as e:
                    log.warning("recording the probes' closer in %s: %s", self.cfg.state_dir, e)
        self.watch.close()                # after the probes: they detach through its fds

    # -- events from BPF -------------------------------------------------------

    def _on_event(self, e: abi.Event) -> None:
        self.heart.progress()
        try:
            self._handle(e)
        except Exception:
            log.exception("handling event kind %d of pid %d", e.kind, e.tgid)
            self.counters["handler_errors"] += 1
            # The handlers of stopping events resume exactly once themselves;
            # only a failure before that leaves it to us. A hold at cuInit is
            # resumed by whoever claimed it (_gated), or by the next scan.
            if e.flags & abi.F_STOPPED and e.kind != abi.EV_INIT:
                enforce.resume(e.tgid)

    def _handle(self, e: abi.Event) -> None:
        self._dirty = True
        self.counters["events"] += 1
        pid = e.tgid
        if e.kind == abi.EV_EXIT:
            self._exit(pid, e.ts_ns)
            return
        if e.kind == abi.EV_EXEC:
            self._exec(pid, e.ts_ns)
            return
        if e.kind == abi.EV_LIBOPEN:
            self.watch.opened(e)
            return
        if e.kind == abi.EV_INIT and e.flags & abi.F_STOPPED:
            self._gated(pid, e.ts_ns, e.comm.decode(errors="replace"))
            return
        if self.table.resolve(pid) is None:
            self._register(pid, e.ts_ns, comm=e.comm.decode(errors="replace"))
        if e.kind == abi.EV_ALLOC:
            ptr = e.ptr | (HANDLE_BIT if e.alloc_kind == abi.KIND_HANDLE else 0)
            before = self.table.process(pid)
            first_use = before is not None and not before.used.get(e.device)
            self.table.apply(MemoryAllocated(pid, e.device, e.size, ptr, e.ts_ns))
            if first_use and self.ctx_bytes:
                self._sync_bpf_limit(before.group, e.device)
            if e.flags & abi.F_DENIED:
                self.record("deny_ignored", f"pid {pid}: a refused allocation of {e.size} bytes on "
                            f"device {e.device} returned success (resumed before its answer, or "
                            "the kernel did not take the refusal); charged to its group",
                            pid=pid, group=before.group if before else None, device=e.device,
                            size=e.size)
        elif e.kind == abi.EV_FREE:
            ptr = e.ptr | (HANDLE_BIT if e.alloc_kind == abi.KIND_HANDLE else 0)
            self.table.apply(MemoryFreed(pid, ptr, e.ts_ns))
        elif e.kind == abi.EV_ALLOC_FAIL:
            self.counters["alloc_failures"] += 1
        elif e.kind == abi.EV_DENY:
            self.memory.deny(e)
        elif e.kind in (abi.EV_MEMINFO, abi.EV_TOTALMEM, abi.EV_NVMLMEM):
            self.memory.meminfo(e)
        elif e.kind == abi.EV_THROTTLE:
            self._throttle(e)

    def _gated(self, pid: int, ts_ns: int, comm: str = "") -> bool:
        """A process held at cuInit until it is classified: register it and
        resume it, if this call is the one that claims its hold (its event
        and the tick's scan of gate_wait may both report it). True if it did."""
        if not self.probes.claim_gate(pid):
            return False
        try:
            if self.table.resolve(pid) is not None:
                # Held at cuInit, so BPF has no proc_cfg for it: a new image
                # whose exec event was lost (ring buffer full). Its old image
                # is gone.
                self._exec(pid, ts_ns)
            self.stopped.add(pid, enforce.proc_start_time(pid), "held at cuInit")
            try:
                self._register(pid, ts_ns, comm=comm)
            finally:
                self.stopped.remove(pid)
        finally:
            enforce.resume(pid)   # exactly once (see memory.MemoryEnforcer)
        return True

    def _release_gated(self) -> None:
        """Every process the cuInit probe holds, whether or not its event got
        through the ring buffer (maps.h, gate_wait)."""
        for pid in self.probes.gate_waiting():
            if self._gated(pid, time.monotonic_ns()):
                self.counters["gate_scan_claims"] += 1
                self._dirty = True

    def _classify(self, pid: int, alive: bool) -> "Classified":
        """Group, limits and device map of ``pid`` from its /proc entries. Each
        step that fails (whatever the workload put there) is named in
        ``failed`` and its input is not used: no environment limits, every
        device visible, the fallback group. So the process is still tracked,
        and with no more than its group's policy allows."""
        c = Classified(group="(exited)" if not alive else UNCLASSIFIED)
        if not alive:
            return c

        def step(what, fn):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - a workload's input must not untrack it
                c.failed.append(what)
                c.reasons.append(f"{what}: {type(e).__name__}: {clipped(str(e))}")
                return None

        got = step("environment", lambda: read_environ(pid))
        env, cut = got if got is not None else ({}, False)
        if cut:
            c.problems.append(f"environment longer than {ENVIRON_MAX} bytes: read up to there")
        if self.cfg.env_limits and env and "environment" not in c.failed:
            parsed = step("limits", lambda: parse_env_limits(env))
            if parsed is not None:
                c.env, problems = parsed
                c.problems += problems
        cvd = env.get("CUDA_VISIBLE_DEVICES") if "environment" not in c.failed else None
        if cvd is not None:
            def visible():
                norm = ",".join(visible_entries(cvd))
                return norm, [visible_to_physical(i, norm, self.devices.uuid_to_index)
                              for i in range(abi.MAX_DEVS)]
            got = step("devices", visible)
            if got is not None:
                c.cvd, mapped = got
                c.phys = [i if p is None else p for i, p in enumerate(mapped)]
        # One reading of the cgroup file names the group and gives the pod labels.
        cg = step("cgroup", lambda: proc_cgroup(pid))
        group = step("group", lambda: group_of(pid, self.group_by, env, cg))
        if group is not None:
            c.group = group
        pod = step("pod", lambda: containers.describe(pid, names=self.pod_names, env=env,
                                                      cgroup=cg).pod)
        if pod is not None:
            c.labels = {clipped(str(k), LABEL_MAX): clipped(str(v), LABEL_MAX)
                        for k, v in pod.labels().items()}
        c.ns_pid = step("pid namespace", lambda: ns_pid(pid))
        if c.failed and ("environment" in c.failed or "limits" in c.failed):
            c.env = None
        return c

    def _register(self, pid: int, ts_ns: int, comm: str = "", existing: bool = False,
                  index: int | None = None) -> None:
        if pid == os.getpid():
            return    # the daemon maps libcuda to measure its probes; it is not a workload
        st = enforce.proc_start_time(pid)
        c = self._classify(pid, st is not None)
        shown = c.problems[:PROBLEMS_SHOWN]
        if len(c.problems) > len(shown):
            shown.append(f"{len(c.problems) - len(shown)} more malformed variables")
        for msg in shown:
            self.record("config", f"pid {pid}: {msg} (ignored)", pid=pid)
        group = c.group
        key = ProcKey(pid, st if st is not None else 0)
        self.info[pid] = ProcInfo(c.env, c.phys, c.ns_pid, labels=c.labels, cvd=c.cvd)
        actions = self.table.apply(ProcessRegistered(key, group, comm or proc_comm(pid), ts_ns,
                                                     index=index))
        self._act(actions, new_pid=pid if not existing else None, existing=existing)
        view = self.table.process(pid)
        if view is None:
            return
        if existing:
            self.probes.ensure_proc(pid)
        self.record("register", f"pid {pid} ({view.comm}) registered in group {group!r} slot {view.slot}",
                    pid=pid, group=group, slot=view.slot)
        if c.failed:
            self.counters["classify_failures"] += 1
            self.record("error", f"pid {pid}: classifying it failed ({'; '.join(c.reasons)}); "
                        f"tracked in group {group!r} with the policy's limits only",
                        pid=pid, group=group, classify_failed=list(c.failed))
        try:
            self._apply_limits(view.group, view.group_index, pid, c.cvd)
        except Exception as e:  # noqa: BLE001 - fall back to the policy alone, never to nothing
            self.counters["classify_failures"] += 1
            self.record("error", f"pid {pid}: applying its limits failed ({type(e).__name__}: "
                        f"{clipped(str(e))}); the policy's limits apply", pid=pid, group=group,
                        classify_failed=["limits"])
            info = self.info.get(pid)
            if info is not None:
                info.env, info.cvd = None, None
            self._apply_limits(view.group, view.group_index, pid, None)

    def _apply_limits(self, group: str, gidx: int, pid: int, cvd: str | None) -> None:
        """A member can lower its group's limit, never raise it above the policy."""
        info = self.info.get(pid)
        prio, upol = effective_sched(self.policy, group,
                                     info.env if info and self.cfg.env_limits else None)
        old_sched = self.sched.get(group)
        if old_sched is not None:
            prio, upol = max(prio, old_sched[0]), ("force" if "force" in (upol, old_sched[1]) else upol)
        if (prio, upol) != old_sched:
            self.sched[group] = (prio, upol)
            if old_sched is not None or prio != HAMI_DEFAULT_PRIORITY or upol != "default":
                self.record("limit", f"group {group!r}: priority {prio}, utilization policy {upol}",
                            group=group, priority=prio, utilization_policy=upol)
        current = self.table.limits(group)
        for dev in range(self.devices.count):
            vis = physical_to_visible(dev, cvd, self.devices.uuid_to_index) if cvd is not None else dev
            # A device the process cannot see by its environment still gets
            # the policy's limit: the environment it started with need not be
            # the one the driver reads (setenv before cuInit).
            env = info.env if info and self.cfg.env_limits and vis is not None else None
            mem, sm = effective_limits(self.policy, group, env, dev, visible_index=vis)
            self._apply_sm_cap(group, dev, sm)
            old = current.get(dev)
            new = mem if old is None else (old if mem is None else min(old, mem))
            if new != old:
                self.table.apply(GroupLimitSet(group, dev, new))
                self._sync_bpf_limit(group, dev)
                self.record("limit", f"group {group!r} device {dev}: limit {new} bytes",
                            group=group, device=dev, limit=new)

    def _sched(self, group: str) -> tuple[int, str]:
        """(priority, utilization policy) of a group; HAMi's defaults if unset."""
        return self.sched.get(group, (HAMI_DEFAULT_PRIORITY, "default"))

    def _apply_sm_cap(self, group: str, dev: int, sm: int | None) -> None:
        """Like memory: a member can lower its group's SM cap, never raise it."""
        if sm is None or sm <= 0 or sm >= 100:
            return
        if not self.cfg.sm_limits:
            if group not in self._sm_unenforced:
                self._sm_unenforced.add(group)
                self.record("config", f"group {group!r} asks for an SM cap of {sm}%: not enforced "
                            "(the daemon runs with --no-sm-limits)", group=group, sm=sm)
            return
        caps = self.sm_caps.setdefault(group, {})
        old = caps.get(dev)
        if old is not None and old <= sm:
            return
        caps[dev] = sm
        self.record("limit", f"group {group!r} device {dev}: SM cap {sm}%", group=group,
                    device=dev, sm=sm)
        self._sync_launch_probes()

    def _sync_launch_probes(self) -> None:
        """Launch probes cost ~1 us per launch: attached only while a group has an
        SM cap (or --count-launches asks), detached when the last one goes."""
        want = bool(self.cfg.count_launches or self.sm_caps)
        have = self.probes.launch_probes_attached() > 0
        if want and not have:
            from . import libcuda
            for lib in self.libs:
                self.probes.attach_launch(str(lib), libcuda.cuda_symbols(lib))
            self.record("probes", f"launch probes attached ({self.probes.launch_probes_attached()})")
        elif have and not want:
            for lib in self.libs:
                self.probes.detach_launch(str(lib))
            self.record("probes", "launch probes detached: no SM cap left")
        self.mechanisms["launch"] = ("throttling uprobes" if self.sm_caps else
                                     "counting uprobes" if self.cfg.count_launches else "off")

    def _throttle_tick(self, now: float) -> None:
        use = self.probes.sm_use()
        rates: dict[int, dict[tuple[int, int], float]] = collections.defaultdict(dict)
        for key, (consumed, *_rest) in use.items():
            prev = self._prev_use.get(key)
            if prev and now > prev[0]:
                rates[key[1]][key] = max(0, consumed - prev[1]) / (now - prev[0])
                if consumed > prev[1]:
                    self._last_busy[key] = now
            if consumed:
                self._first_busy.setdefault(key, now)
            self._prev_use[key] = (now, consumed)
        prio_of = {g.index: self._sched(g.name)[0] for g in self.table.groups()
                   } if self.cfg.sm_lend_idle or self.cfg.sm_learn_alone else {}
        holds = self._learn_alone(now, use, prio_of) if self.cfg.sm_learn_alone else frozenset()
        for k in holds:
            # Held groups are off the device for the learner (their last
            # grant, a slot's work at most, drains first): neither busy nor unpaced.
            rates.get(k[1], {}).pop(k, None)
        # Only a budget still learning reads the device (a new one learns too):
        # no NVML call per tick once every capped group has its rate.
        # A budget on a device its group never launched on stays "learning"
        # (nothing to learn from) and needs no reading.
        learning = any(b.learning and (b.active_since is not None
                                       or use.get(k, (0,))[0] > b.start_consumed)
                       for k, b in self.budgets.items()) or any(
            (g.index, dev) not in self.budgets for name, caps in self.sm_caps.items()
            if (g := self.table.group(name)) is not None for dev in caps
            if self.duty.mode((g.index, dev)) is not duty.Mode.DUTY)
        share = {}
        if learning:
            util = self.devices.utilization() if self.devices.has_utilization else {}
            known = {k: b for k, b in self.budgets.items() if not b.learning}
            done_rates = {}
            for key, (_c, _n, completed, _s, done_ns, _y) in use.items():
                track = self._done.setdefault(key, Completions())
                track.note(now, completed or None, done_ns / 1e9 if done_ns else None)
                done_rates[key] = completion_rate(track, now)
            # Busy lately, yet no completions to pace it by: a group blocked
            # on its full launch queue, or one that never synchronizes.
            unpaced = frozenset(k for k in use if done_rates.get(k) is None and k not in known
                                and k not in holds
                                and now - self._last_busy.get(k, -1e9) <= UNPACED_S)
            for dev, r in rates.items():
                share.update(neighbours(util.get(dev), r, known, now, done_rates,
                                        frozenset(k for k in unpaced if k[1] == dev)))
        if self.cfg.sm_turns:
            self._take_turns(use)
        paced = self._duty_step(now, use)
        util_now: dict[int, float | None] | None = None
        for group, caps in list(self.sm_caps.items()):
            g = self.table.group(group)
            if g is None:
                continue
            room = True
            for dev, cap in caps.items():
                key = (g.index, dev)
                if key in paced.keys and paced.keys[key].mode is duty.Mode.DUTY:
                    room = room and g.index in paced.release
                    continue
                b = self.budgets.get(key)
                if b is None:
                    b = self.budgets[key] = Budget(cap=cap, probe_s=self.probe_cost_s)
                b.cap = cap
                consumed, n_launch, completed, sync_ns, done_ns, _syncs = use.get(
                    key, (0, 0, 0, 0, 0, 0))
                if key in holds:
                    # Held while another group learns here alone (or until its
                    # first launch here is its turn): nothing granted, nothing
                    # learned (a held learner starts over).
                    b.granted, b.credit, b.turn_open = consumed, float(consumed), False
                    self.probes.set_sm_grant(g.index, dev, consumed, True, checkpoint=False)
                    # Not launching here, it runs on as its other devices allow.
                    room = room and not consumed
                    continue
                was_learning = b.learning
                granted = budget_tick(b, now=now, consumed=consumed, launches=n_launch,
                                      completed=completed or None, sync_ns=sync_ns,
                                      completed_at=done_ns / 1e9 if done_ns else None,
                                      device=share.get(key), turn=self.turns.get(key))
                if was_learning and not b.learning:
                    self.record("throttle", f"group {group!r} device {dev}: cap {cap}% of a "
                                f"learned full rate of {b.full_rate:.4g} units/s (pace "
                                f"{b.pace:.4g}/s{', contended' if b.contended else ''}"
                                f"{', launcher-bound' if b.launcher_bound else ''}"
                                f"{f', host-bound: +{b.probe_share:.1%} for the probe' if b.probe_share else ''}"
                                f"{', from completions' if b.by_completion else ''})",
                                group=group, device=dev, full_rate=b.full_rate, pace=b.pace,
                                work_per_unit=b.work_per_unit, contended=b.contended,
                                # launched, not known done: runs at the GPU's
                                # full pace whatever the grant (checkpoints)
                                queued=consumed - (completed or 0))
                if self.cfg.sm_lend_idle:
                    others = [(prio_of.get(k[0], HAMI_DEFAULT_PRIORITY),
                               now - self._last_busy.get(k, -1e9) <= BUSY_S)
                              for k in use if k[1] == dev and k[0] != g.index]
                    held = held_to_cap(*self._sched(group), True, others)
                    if not held:
                        granted = max(granted, consumed + UNLIMITED)
                    if held == (key in self.lending):
                        (self.lending.discard if held else self.lending.add)(key)
                        self.record("throttle", f"group {group!r} device {dev}: "
                                    + ("held to its cap again" if held else
                                       "may use what is idle (no busy group of higher or equal "
                                       "priority)"), group=group, device=dev, lending=not held)
                if b.learning and learning and group not in self.throttled:
                    self.guard.reference(key, util.get(dev))
                if not b.learning and key not in self.turns and key not in self.lending \
                        and self.devices.has_utilization:
                    if util_now is None:
                        util_now = util if learning else self.devices.utilization()
                    self._guard(key, group, b, now, util_now.get(dev),
                                held=group in self.throttled)
                # No checkpoint for a group free to use what is idle: it is
                # not held to anything the learning would apply.
                self.probes.set_sm_grant(g.index, dev, granted, True,
                                         checkpoint=b.learning and key not in self.lending)
                # Resume with some budget in hand, not a sliver: fewer, longer holds.
                margin = (b.rate or 0) * RESUME_MARGIN_S
                room = room and consumed + margin < granted
                self.sm_share[key] = b.last_share
                if log.isEnabledFor(logging.DEBUG) and now - self._budget_logged.get(key, 0) >= 0.5:
                    self._budget_logged[key] = now
                    log.debug("budget %s dev %d: cap %s learning=%s F=%.4g R=%s consumed=%d "
                              "launches=%d completed=%d granted=%d held=%s cut_short=%d episodes=%d",
                              group, dev, cap, b.learning, b.full_rate, b.rate and round(b.rate),
                              consumed, n_launch, completed, granted, group in self.throttled,
                              self.counters["holds_cut_short"], self.counters["throttle_episodes"])
            held_for = now - self.throttle_since.get(group, now)
            if group in self.throttled and (room or held_for > self.duty.max_hold_s):
                if g.index in paced.cut_short or not room and not any(
                        k[0] == g.index and use.get(k, (0,))[0] for k in holds):
                    # A hold must never outlive one refill period: whatever the
                    # budget says, the group runs again (and is counted).
                    self.counters["holds_cut_short"] += 1
                self._resume_group(group)
            if group in self.throttled:
                self.last_throttled[group] = now
        if self.turns and not learning and self.devices.has_utilization:
            self._calibrate_turns(now)

    def _guard(self, key: tuple[int, int], group: str, b: Budget, now: float,
               util: float | None, held: bool) -> None:
        """Check a budget-paced group's learned rate against the GPU (sm.guard)
        and correct it: a group held while its device idles is loosened at once."""
        shared = any(k[1] == key[1] and k != key and now - t <= BUSY_S
                     for k, t in self._last_busy.items())
        source = guard.Source.DEVICE
        per_pid = self.devices.process_utilization(key[1]) if self.devices.nvml else None
        g = self.table.group(group)
        if per_pid and g is not None:
            # The group's own part: neighbours no longer blur the reading.
            util = min(100.0, sum(per_pid.get(k.pid, 0.0) for k in g.slots))
            shared, source = False, guard.Source.PROCESS
        c = self.guard.observe(key, now=now, cap=b.cap, held=held, util=util, shared=shared,
                               source=source)
        if c is None:
            return
        correct_rate(b, c.gain)
        self.counters[f"sm_corrections_{c.reason.value}"] += 1
        self.record("throttle", f"group {group!r} device {key[1]}: device {c.util:.0f}% busy where "
                    f"its cap of {c.cap:g}% allows {c.target:.0f}%, while the launch budget held "
                    f"it: rate x{c.gain:.3g} ({c.reason.value}, from {c.source.value})",
                    group=group, device=key[1], sm_correction=c.reason.value,
                    gain=round(c.gain, 4), util=round(c.util, 1), target=round(c.target, 1),
                    cap=c.cap, source=c.source.value, rate=b.rate)

    def _duty_step(self, now: float, use: dict) -> duty.Decision:
        """Step duty pacing (sm.duty) for every capped (group, device) and
        write what it asks of the groups it paces: a stop at the next
        synchronize's return, or at the next launch where none came."""
        caps, held, names = {}, {}, {}
        for name, per_dev in self.sm_caps.items():
            g = self.table.group(name)
            if g is None:
                continue
            names[g.index] = name
            for dev, cap in per_dev.items():
                caps[(g.index, dev)] = cap
            if name in self.throttled:
                held[g.index] = self.throttle_since.get(name, now)
        waiting = self.probes.sync_waiting() if caps else {}
        obs = duty.Observation(now=now, caps=caps, held=held, use={
            k: duty.Use(consumed=v[0], syncs=v[5], waiting=waiting.get(k, 0))
            for k, v in use.items() if k in caps})
        d = self.duty.step(obs)
        for key, mode in d.mode_changes:
            name = names.get(key[0], str(key[0]))
            self.counters[f"sm_mode_{mode.value}"] += 1
            if mode is duty.Mode.DUTY:
                self._forget_budget(key)
                self.turns.pop(key, None)
            self.record("throttle", f"group {name!r} device {key[1]}: paced by "
                        + ("time, held at its synchronizes" if mode is duty.Mode.DUTY
                           else "its launch budget (it synchronizes rarely)"),
                        group=name, device=key[1], sm_mode=mode.value)
        for key, kd in d.keys.items():
            if kd.mode is not duty.Mode.DUTY:
                continue
            if log.isEnabledFor(logging.DEBUG) and now - self._budget_logged.get(key, 0) >= 0.5:
                self._budget_logged[key] = now
                log.debug("duty %s dev %d: cap %s debt %.3f ask %s held %s syncs %d waiting %d",
                          names.get(key[0], key[0]), key[1], caps[key], kd.debt, kd.ask.value,
                          key[0] in held, obs.use[key].syncs if key in obs.use else -1,
                          obs.use[key].waiting if key in obs.use else -1)
            consumed = use.get(key, (0,))[0]
            granted = consumed if kd.ask is duty.Ask.LAUNCH else consumed + UNLIMITED
            self.probes.set_sm_grant(key[0], key[1], granted, True,
                                     hold_at_sync=kd.ask is not duty.Ask.NONE)
            self.sm_share[key] = None
        self._duty_next = d.next_step if d.next_step is not None else (
            now if any(kd.mode is duty.Mode.DUTY for kd in d.keys.values()) else None)
        return d

    def _learn_alone(self, now: float, use: dict, prio: dict[int, int]) -> frozenset:
        """Let one group at a time learn its rate on each device while the
        device's other capped groups are held (throttle.learn_alone), at most
        LEARN_ALONE_S each; not where an uncapped group is busy (it is never
        held, so no one learns alone there). A capped group's first launch on
        a device is held too, until it is its turn (or no one else's): else
        groups starting together would each queue a second of work that runs
        in the other's learning. `prio`: group index -> priority. Returns the
        keys held this tick."""
        waited = {k for _l, h in self.alone.values() for k in h}

        def launched(k):
            return use.get(k, (0,))[0] > 0

        def busy(k):
            return now - self._last_busy.get(k, -1e9) <= BUSY_S

        new: dict[int, tuple[tuple[int, int] | None, frozenset]] = {}
        restart: set = set()
        for dev in sorted({d for _gi, d in self.budgets}):
            if any(k[1] == dev and k not in self.budgets and busy(k) for k in use):
                continue
            capped = {k: prio.get(k[0], HAMI_DEFAULT_PRIORITY) for k in self.budgets if k[1] == dev}
            cur = self.alone.get(dev, (None,))[0]
            # A learner begins busy or held waiting, and keeps its turn while
            # it launches nothing too (blocked on its full queue, synchronizing).
            learners = {k: (self._first_busy.get(k, now), capped[k]) for k in capped
                        if (b := self.budgets[k]).learning
                        and (k == cur or (launched(k) and (busy(k) or k in waited)))
                        and (b.alone_since is None or now - b.alone_since <= LEARN_ALONE_S)}
            learner, held = learn_alone(learners, capped, current=cur)
            if learner is None:
                # No one learning: a first launch is held until the next tick
                # picks whose turn it is.
                new[dev] = (None, frozenset(k for k in capped if not launched(k)
                                            and self.budgets[k].learning))
                continue
            if learner in waited:
                restart.add(learner)    # held from its first launch: learn from now
            elif any(launched(k) for k in held):
                b = self.budgets[learner]
                if b.alone_since is None:
                    # From completions after the others were held: what they
                    # still have queued runs on for a slot's work at most
                    # (H200 turns: 70 ms), a few percent of a learning span,
                    # where waiting for another synchronize would take a second.
                    b.alone_since = now
                    b.fresh_since = max(b.fresh_since, now)
            new[dev] = (learner, held)
        for key in restart:
            self._restart_learning(key, now, alone=True)
        self.alone = new
        names = self._group_names()

        def said(keys):
            return ", ".join(repr(names.get(k[0], k[0])) for k in sorted(keys))

        for dev in sorted(set(self._alone_said) | set(new)):
            # Only holds of groups that launched here are news.
            (l0, h0) = self._alone_said.get(dev, (None, frozenset()))
            l1, h1 = new.get(dev, (None, ()))
            h1 = frozenset(k for k in h1 if launched(k))
            if l0 is not None and (l0 != l1 or not h1):
                lb = self.budgets.get(l0)
                how = ("learned its rate" if lb is not None and not lb.learning else
                       f"not learned in {LEARN_ALONE_S:g} s (it learns beside them)"
                       if lb is not None and now - (lb.alone_since or now) > LEARN_ALONE_S
                       else "stopped launching")
                self.record("throttle", f"group {names.get(l0[0], l0[0])!r} device {dev}: {how}; "
                            f"{said(h0)} released", group=names.get(l0[0]), device=dev, alone=False)
            if l1 is not None and h1 and (l1 != l0 or h1 - h0):
                self.record("throttle", f"group {names.get(l1[0], l1[0])!r} learns its rate on "
                            f"device {dev} alone: {said(h1)} held (at most {LEARN_ALONE_S:g} s)",
                            group=names.get(l1[0]), device=dev, alone=True,
                            held=sorted(names.get(k[0], str(k[0])) for k in h1))
            if l1 is not None and h1:
                self._alone_said[dev] = (l1, h1 | (h0 if l1 == l0 else frozenset()))
            else:
                self._alone_said.pop(dev, None)
        held_now = {k for _l, h in new.values() for k in h}
        for key, b in list(self.budgets.items()):
            if key in waited and key not in held_now and key not in restart and b.learning:
                self._restart_learning(key, now)   # its learning ran across a hold
        return frozenset(held_now)

    def _restart_learning(self, key: tuple[int, int], now: float, alone: bool = False) -> None:
        """Start a budget's learning over, from completions after `now`;
        `alone`: it learns alone from now. Its turn alone is counted once
        (LEARN_ALONE_S), however often it starts over."""
        b = self.budgets[key]
        since = b.alone_since if b.alone_since is not None or not alone else now
        self.budgets[key] = Budget(cap=b.cap, probe_s=self.probe_cost_s, fresh_since=now,
                                   alone_since=since)

    def _calibrate_turns(self, now: float) -> None:
        """Raise the rates of groups taking turns where the GPU idles in them
        (throttle.turn_gains): every TURN_CALIBRATE_S, from the utilization
        since the last reading; the first reading only starts the count."""
        if self._turns_read is not None and now - self._turns_read < TURN_CALIBRATE_S:
            return
        util = self.devices.utilization()
        first, self._turns_read = self._turns_read is None, now
        for dev in sorted({d for _g, d in self.turns}):
            keys = [k for k in self.turns if k[1] == dev and k in self.budgets]
            budgets = [self.budgets[k] for k in keys]
            # The mean of two readings since the last change: NVML's swing
            # by 5-8 points between windows in one steady state. Not one
            # taken while slots came up short (turns settling in, or
            # overrunning): idle then is no measure of the rates.
            prev = self._turns_util.pop(dev, None)
            both = None if prev is None or util.get(dev) is None else (prev + util[dev]) / 2
            gains = None if first else turn_gains(both, [self.turns[k] for k in keys], budgets)
            # Kept for the next reading unless a change follows it: readings
            # from before a change say nothing after it.
            if not first and gains is None and not any(b.turn_short for b in budgets):
                self._turns_util[dev] = util.get(dev)
            log.debug("turns on device %d: %s%% busy, slots %s, short %s, gains %s", dev,
                      util.get(dev), [b.turn_slots for b in budgets],
                      [b.turn_short for b in budgets], gains)
            if gains is not None:
                names = self._group_names()
                for b, gain in zip(budgets, gains):
                    scale_rate(b, gain)
                busy = 100 * sum(self.turns[k].length for k in keys)
                said = ", ".join(f"{names.get(k[0], k[0])!r} x{gain:.3f}"
                                 for k, gain in zip(keys, gains) if gain != 1.0)
                self.record("throttle", f"device {dev}: {both:.1f}% busy in turns that "
                            f"should fill {busy:.0f}%: " + (
                                f"rates learned side by side were short, raised: {said}"
                                if max(gains) > 1.0 else f"raised rates overran their turns, "
                                f"lowered: {said}"),
                            device=dev, gains=dict(zip((names.get(k[0], str(k[0])) for k in keys),
                                                       gains)), util=both)
            for b in budgets:
                b.turn_short_before, b.turn_slots, b.turn_short = b.turn_short, 0, 0

    def _take_turns(self, use: dict) -> None:
        """GPU-bound groups capped on one device take turns where two or more
        have their rates; not one learning (it runs free), lending idle time,
        host-bound (throttle.gpu_bound), or launching on another device too
        (a hold stops all of a group's processes, so its turns on two
        devices would stop it in both)."""
        devices = collections.defaultdict(set)
        for (gi, dev), (consumed, *_r) in use.items():
            if consumed:
                devices[gi].add(dev)
        caps = collections.defaultdict(dict)
        for key, b in self.budgets.items():
            if (not b.learning and gpu_bound(b) and key not in self.lending
                    and devices.get(key[0]) == {key[1]}):
                caps[key[1]][key] = b.cap
        new = {}
        for dev, on in caps.items():
            new.update(turns(on, epoch=self._turn_epoch, period=self.cfg.sm_turn_ms / 1000))
        for dev in sorted({d for _g, d in new} | {d for _g, d in self.turns}):
            mine = sorted(k for k in new if k[1] == dev)
            if mine == sorted(k for k in self.turns if k[1] == dev):
                continue
            names = self._group_names()
            self.record("throttle", f"device {dev}: " + (
                "groups " + ", ".join(f"{names.get(k[0], k[0])!r} ({new[k].length:.0%})" for k in mine)
                + f" take turns every {self.cfg.sm_turn_ms:g} ms" if mine else "no turns"),
                device=dev, turns={names.get(k[0], str(k[0])): round(new[k].length, 4) for k in mine})
            self._turns_read = None     # the utilization of other turns says nothing
            self._turns_util.pop(dev, None)
        self.turns = new

    def _group_names(self) -> dict[int, str]:
        """Group index -> name (the budgets and turns are keyed by index)."""
        return {g.index: g.name for g in self.table.groups()}

    def _forget_budget(self, key: tuple[int, int]) -> None:
        """Drop what an SM cap kept for (group index, device): its budget and
        what the views show of it. Launch and completion history stay while
        the group does (neighbours are split by them)."""
        self.budgets.pop(key, None)
        self.guard.forget(key)
        self.sm_share.pop(key, None)
        self._budget_logged.pop(key, None)
        self.lending.discard(key)

    def _group_share(self, group_index: int) -> float | None:
        vals = [v for (gi, _d), v in self.sm_share.items() if gi == group_index and v is not None]
        return round(max(vals), 1) if vals else None

    def _throttle(self, e: abi.Event) -> None:
        """A launch found its group's budget spent and BPF stopped its process:
        stop the rest of the group too, so peers are held and released together."""
        pid = e.tgid
        view = self.table.process(pid)
        if view is None or view.group not in self.sm_caps:
            enforce.resume(pid)
            return
        group = view.group
        if e.flags & abi.F_AT_SYNC:
            self.counters["sm_holds_at_sync"] += 1
        held = self.throttled.setdefault(group, set())
        now = time.monotonic()
        self.last_throttled[group] = now
        if not held:
            # From the probe's stop, not from reading its event (same clock).
            at = e.ts_ns / 1e9
            self.throttle_since[group] = at if 0 < at <= now else now
            self.counters["throttle_episodes"] += 1
        g = self.table.group(group)
        new = [(key.pid, key.start_time) for key in (g.slots if g else ())
               if key.pid not in held and (key.pid == pid or enforce.proc_state(key.pid)
                                           not in ("T", "t"))]   # else: someone else's stop
        if not new:
            return
        # Recorded before they are stopped: a controller killed in between
        # leaves a record of a running process (recovery skips it), never a
        # stopped process without one.
        self.stopped.add_many(new, f"SM cap of group {group}")
        gone = []
        for p, _st in new:
            if p != pid:
                try:
                    os.kill(p, signal.SIGSTOP)
                except ProcessLookupError:
                    gone.append(p)
                    continue
            held.add(p)
        if gone:
            self.stopped.remove_many(gone)

    def _resume_group(self, group: str) -> None:
        held = self.throttled.pop(group, set())
        since = self.throttle_since.pop(group, None)
        if since is not None:
            self.counters["throttle_ms"] += int((time.monotonic() - since) * 1000)
        for pid in held:
            enforce.resume(pid)   # exactly once per hold
        self.stopped.remove_many(held)

    def _context_reserve(self, group: str, dev: int) -> int:
        """Bytes the group's contexts hold on the device: one per member using it."""
        if not self.ctx_bytes:
            return 0
        g = self.table.group(group)
        if g is None:
            return 0
        n = 0
        for key in g.slots:
            p = self.table.process(key.pid)
            if p is not None and p.used.get(dev):
                n += 1
        return n * self.ctx_bytes

    def _sync_bpf_limit(self, group: str, dev: int) -> None:
        """Admission in BPF sees the limit less the group's context reserve;
        memory info keeps reporting the limit itself as total."""
        g = self.table.group(group)
        if g is None:
            return
        limit = g.limits.get(dev)
        if limit is None:
            self.probes.set_group_limit(g.index, dev, None, None)
            return
        self.probes.set_group_limit(g.index, dev, max(0, limit - self._context_reserve(group, dev)),
                                    limit)

    def _exit(self, pid: int, ts_ns: int) -> None:
        if self.table.resolve(pid) is None:
            return
        self._act(self.table.apply(ProcessExited(pid, None, ts_ns)))
        self.watch.release(pid)
        lat = max(0, time.monotonic_ns() - ts_ns)
        self.exit_latency_ns.append(lat)
        observe_exit_latency(self.counters, lat)

    def _exec(self, pid: int, ts_ns: int) -> None:
        """The process replaced its image: the old image's memory died with it
        (BPF gave its bytes back already), so it leaves its group as at an
        exit. The new image is classified afresh, from its new environment, at
        its first libcuda call (held at cuInit like any new process)."""
        view = self.table.process(pid)
        if view is None:
            return
        self.counters["execs"] += 1
        self.record("exec", f"pid {pid} ({view.comm}) replaced its image: released from group "
                    f"{view.group!r}", pid=pid, group=view.group)
        self._act(self.table.apply(ProcessExited(pid, None, ts_ns)))
        self.watch.release(pid)

    def _act(self, actions, new_pid: int | None = None, existing: bool = False) -> None:
        self._after_release = []
        self._act_each(actions, new_pid, existing)
        for group, devs in self._after_release:
            for dev in devs:
                self._sync_bpf_limit(group, dev)

    def _act_each(self, actions, new_pid: int | None, existing: bool) -> None:
        for a in actions:
            if isinstance(a, WriteSlot):
                info = self.info.get(a.key.pid)
                first = a.key.pid == new_pid or (existing and a.key.pid in self.info)
                ok = self.probes.write_proc_cfg(a.key.pid, a.group_index, a.slot,
                                                info.phys if info else None, must_exist=not first)
                if not ok and not first:
                    # The exit program already dropped it: its exit event is on the way.
                    self.counters["slot_write_after_exit"] += 1
            elif isinstance(a, ReleaseProcess):
                self.info.pop(a.key.pid, None)
                held = self.throttled.get(a.group)
                if held and a.key.pid in held:
                    held.discard(a.key.pid)
                    self.stopped.remove(a.key.pid)
                if self.ctx_bytes:
                    self._after_release.append((a.group, tuple(a.released)))
                self.memory.forget(a.key.pid)
                if enforce.proc_start_time(a.key.pid) != a.key.start_time:
                    self.probes.delete_proc_cfg(a.key.pid)
            elif isinstance(a, DeleteGroup):
                self.probes.delete_group(a.index)
                self._sm_unenforced.discard(a.name)
                self.sched.pop(a.name, None)
                self.last_throttled.pop(a.name, None)
                self.throttled.pop(a.name, None)
                self.throttle_since.pop(a.name, None)
                # Everything kept per (group index, device): the index is reused.
                for key in [k for k in self.budgets if k[0] == a.index]:
                    self._forget_budget(key)
                self.duty.forget_group(a.index)
                self.guard.forget_group(a.index)
                for per_key in (self._prev_use, self._last_busy, self._first_busy, self._done):
                    for key in [k for k in per_key if k[0] == a.index]:
                        del per_key[key]
                if self.sm_caps.pop(a.name, None):
                    self._sync_launch_probes()
                if self.cfg.hami_regions:
                    self._publish_regions(None, gone=a.name)
                self.record("group", f"group {a.name!r} is empty: deleted", group=a.name)
            elif isinstance(a, Compacted):
                moves = [{"pid": k.pid, "from": f, "to": t} for k, f, t in a.moves]
                self.counters["compactions"] += 1
                self.record("compact", f"group {a.group!r}: pid {a.removed.pid} left; " +
                            (", ".join(f"pid {m['pid']} slot {m['from']}->{m['to']}" for m in moves)
                             or "no move needed"), group=a.group, removed=a.removed.pid, moves=moves)
            elif isinstance(a, (CreateGroup, ClearSlot)):
                pass

    # -- enforcement -------------------------------------------------------------

    def _place(self, pid: int, device: int) -> Place | None:
        """Where `pid`'s memory on `device` is accounted (memory.MemoryEnforcer)."""
        view = self.table.process(pid)
        if view is None:
            return None
        return Place(view.group, view.group_index, self.table.limits(view.group).get(device))

    # -- housekeeping -------------------------------------------------------------

    def _reap(self) -> None:
        """Repair lost exit events: a process whose /proc entry is gone or reused has exited."""
        for p in self.table.processes():
            if enforce.proc_start_time(p.key.pid) != p.key.start_time:
                self.counters["reaped"] += 1
                self._act(self.table.apply(ProcessExited(p.key.pid, p.key.start_time,
                                                         time.monotonic_ns())))
                self._dirty = True
        # Users of libraries found by discovery that are not registered (or
        # whose exit event was lost): gone or reused -> maybe detach.
        self.watch.housekeeping(time.monotonic())

    def _rebuild_snapshot(self) -> None:
        self._dirty = False
        counting = self.probes is not None and self.probes.launch_probes_attached() > 0
        launches = self.probes.launches() if counting else {}
        denied_by_group: dict[int, int] = collections.Counter()
        if self.probes:
            for (gidx, _dev), (_used, denied) in self.probes.group_mem().items():
                denied_by_group[gidx] += denied
        procs = []
        now = time.monotonic()
        for p in self.table.processes():
            limits = self.table.limits(p.group)
            devs = {d: DeviceUsage(u, limits.get(d)) for d, u in p.used.items()}
            info = self.info.get(p.key.pid)
            procs.append(ProcessInfo(
                pid=p.key.pid, start_time=p.key.start_time, comm=p.comm, group=p.group, slot=p.slot,
                devices=devs,
                launches=launches.get(p.key.pid, 0) if counting else None,
                state="throttled" if (p.key.pid in self.throttled.get(p.group, ()) or
                                      now - self.last_throttled.get(p.group, -1e9) < THROTTLED_SHOWN_S)
                else "running",
                sm_share=self._group_share(p.group_index),
                visible_devices={phys: vis for vis, phys in enumerate(info.phys[:self.devices.count])
                                 if phys != vis} if info else {},
                denied=self.memory.denied(p.key.pid),
                ns_pid=info.ns_pid if info else None,
                labels=info.labels if info else {}))
        groups = []
        for g in self.table.groups():
            devs = {d: DeviceUsage(g.used.get(d, 0), g.limits.get(d))
                    for d in sorted(set(g.used) | {d for d, v in g.limits.items() if v is not None})}
            groups.append(GroupInfo(id=g.name, index=g.index, proc_num=g.proc_num,
                                    slots=tuple(SlotInfo(i, k.pid, k.start_time) for i, k in enumerate(g.slots)),
                                    devices=devs, denied=denied_by_group.get(g.index, 0),
                                    sm_limit=min(self.sm_caps[g.name].values()) if self.sm_caps.get(g.name) else None,
                                    priority=self._sched(g.name)[0],
                                    sm_lending=tuple(sorted(d for gi, d in self.lending if gi == g.index)),
                                    sm_turns=tuple(sorted(d for gi, d in self.turns if gi == g.index))))
        counters = dict(self.table.stats)
        counters.update(self.counters)
        if self.probes:
            counters.update(self.probes.stats())
        counters["launch_probes"] = self.probes.launch_probes_attached() if self.probes else 0
        self._snap = Snapshot(SCHEMA_VERSION, time.time(), self.simulated, self.mechanisms,
                              self.devices.infos() if hasattr(self, "devices") else (),
                              tuple(procs), tuple(groups), counters)
        if self.cfg.hami_regions:
            self._publish_regions(now)

    def _publish_regions(self, now: float | None, gone: str | None = None) -> None:
        """--hami-regions DIR: one HAMi shared-region file per group
        (DIR/<pod uid>_<container>/hami-bpf.cache for a pod's container, else
        DIR/<sanitized group name>/hami-bpf.cache), so HAMi's node monitor keeps
        working. At most once a second; unchanged regions are not rewritten.
        ``gone``: that group was deleted, remove its file now. I/O errors are
        recorded (once per path) and never stop the daemon; an unsafe DIR is
        refused at start-up."""
        import hashlib
        import re
        import stat as st_
        from . import hami_region as hr
        s = self.__dict__.get("_hr")
        if s is None:
            s = self._hr = {"files": {}, "last": {}, "errors": set(), "next": 0.0, "checked": False}
        root = os.path.abspath(self.cfg.hami_regions)

        def err(path: str, what: str) -> None:
            if path not in s["errors"]:
                s["errors"].add(path)
                self.record("error", f"--hami-regions: {what}", path=path)

        def remove(group: str) -> None:
            d, f, made = s["files"].pop(group)
            s["last"].pop(f, None)
            try:
                os.unlink(f)
                if made:
                    os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as e:
                err(f, f"removing {f}: {e}")

        if gone is not None:
            if gone in s["files"]:
                remove(gone)
            return
        # The directory must be ours alone: a link or a directory others can
        # write to would let them steer what root writes.
        first = not s["checked"]
        try:
            if first:
                os.makedirs(root, 0o755, exist_ok=True)
            st = os.lstat(root)
            bad = ("is a symbolic link" if st_.S_ISLNK(st.st_mode) else
                   "is not a directory" if not st_.S_ISDIR(st.st_mode) else
                   "is writable by group or others" if st.st_mode & 0o022 else
                   f"is owned by uid {st.st_uid}, not {os.geteuid()}" if st.st_uid != os.geteuid()
                   else None)
        except OSError as e:
            bad = str(e)
        if bad:
            if first:
                raise DaemonError(f"--hami-regions {root}: {bad}; refusing to write there")
            err(root, f"{root} {bad}: not publishing")
            return
        s["checked"] = True
        s["errors"].discard(root)
        if now is not None and now < s["next"]:
            self._dirty = True          # come back when due: the change must not be lost
            return
        s["next"] = (now if now is not None else time.monotonic()) + 1.0
        snap = self._snap
        js = snap.to_json()
        by_pid = {p.pid: p for p in snap.processes}
        devinfo = {d.index: d for d in snap.devices}
        ndev = min(self.devices.count if hasattr(self, "devices") else len(devinfo), hr.MAX_DEVICES)
        live = set()
        for g in snap.groups:
            if self.table.group(g.id) is None:
                continue    # deleted since the snapshot: its region went with it
            live.add(g.id)
            first_pid = g.slots[0].pid if g.slots else None
            info = self.info.get(first_pid) if first_pid is not None else None
            p0 = by_pid.get(first_pid) if first_pid is not None else None
            lab = dict(p0.labels) if p0 else {}
            if lab.get("pod_uid") and lab.get("container"):
                name = hr.region_dir_name(lab["pod_uid"], lab["container"])
            else:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", g.id)[:120]
                if name != g.id or name.startswith("."):
                    name = f"{name}-{hashlib.sha1(g.id.encode()).hexdigest()[:8]}"
            if "/" in name or name in (".", ".."):
                name = "group-" + hashlib.sha1(g.id.encode()).hexdigest()[:16]
            d = os.path.join(root, name)
            f = os.path.join(d, "hami-bpf.cache")
            old = s["files"].get(g.id)
            if old and old[1] != f:
                remove(g.id)
                old = None
            visible = [x for x in (info.phys if info else range(ndev))][:ndev]
            uuids = [(devinfo[x].uuid if x in devinfo and devinfo[x].uuid else f"hami-bpf-dev{x}")
                     for x in visible]
            caps = self.sm_caps.get(g.id, {})
            try:
                region = hr.region_from_snapshot(js, g.id, uuids, visible,
                                                 context_bytes=self.ctx_bytes,
                                                 sm_limits=[caps.get(x, 0) for x in visible])
                if old is None:
                    made = not os.path.isdir(d)
                    if made:
                        os.mkdir(d, 0o755)
                    s["files"][g.id] = (d, f, made)
                elif not os.path.isdir(d):     # removed under us (HAMi's monitor cleans up)
                    os.mkdir(d, 0o755)
                if s["last"].get(f) == region and os.path.exists(f):
                    continue
                s["last"].pop(f, None)
                hr.publish_region(f, region)
                s["last"][f] = region
                s["errors"].discard(f)
            except (OSError, ValueError) as e:
                err(f, f"group {g.id!r}: writing {f}: {e}")
        for group in [x for x in s["files"] if x not in live]:
            remove(group)


# Signals whose default action ends the process: each gets SIGTERM's
# clean-up (resume what we stopped, detach, close). SIGKILL and SIGSTOP cannot
# be caught; SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT and SIGTRAP report a
# fault of this process and are left to their default.
FATAL_SIGNALS = tuple(sorted(
    {signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
     signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF, signal.SIGIO, signal.SIGPWR,
     signal.SIGXCPU, signal.SIGXFSZ, signal.SIGSYS, signal.SIGPIPE}
    | {getattr(signal, "SIGSTKFLT", signal.SIGTERM)}
    | set(range(signal.SIGRTMIN, signal.SIGRTMAX + 1))))
# Stops asked for: exit status 0. Any other fatal signal: 128 + its number,
# as a shell reports a process it ended, after the same clean-up.
REQUESTED_STOPS = (signal.SIGTERM, signal.SIGINT)


def run(cfg: DaemonConfig) -> int:
    """Run the daemon until a fatal signal; returns the exit status."""
    logging.basicConfig(level=logging.DEBUG if cfg.verbose else logging.INFO,
                        format="hami-bpf: %(message)s", stream=sys.stderr)
    d = Daemon(cfg)

    def _on_signal(signum, frame):
        d.stop(signum)

    old = {}
    for s in FATAL_SIGNALS:
        try:
            # Not one ignored on purpose (SIGPIPE); Python's own SIGINT
            # handler (KeyboardInterrupt) would skip the clean-up's order.
            if signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler):
                old[s] = signal.signal(s, _on_signal)
        except (OSError, ValueError):
            pass
    old[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda signum, frame: d.request_reload())
    try:
        d.start()
        d.loop()
    finally:
        d.shutdown()
        # Clean-up is done and the status decided: a signal still arriving
        # (a burst of them, a supervisor repeating itself) must not turn a
        # clean exit into death by signal, so the rest of the way out
        # ignores them rather than going back to the defaults.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
    sig = d._stop_signal
    if sig is not None and sig not in REQUESTED_STOPS:
        try:
            name = signal.Signals(sig).name
        except ValueError:          # a real-time signal
            name = f"signal {sig}"
        log.info("stopped (%s)", name)
        return 128 + sig
    log.info("stopped")
    return 0
