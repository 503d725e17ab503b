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
from .limits import (EnvLimits, PolicyError, clipped, effective_limits,
                     effective_sched, load_policy, parse_env_limits, physical_to_visible,
                     visible_entries, visible_to_physical)
from .metrics import observe_exit_latency
from .slots import SlotTable
from .regionpub import RegionError, RegionPublisher
from .smcontrol import SmControl
from .snapshot import (SCHEMA_VERSION, DeviceUsage, EventRecord, GroupInfo, ProcessInfo,
                       SlotInfo, Snapshot)

log = logging.getLogger("hami_bpf")

POLL_MS = 100
CONTROL_NICE = -10         # the daemon's CPU priority (_raise_priority)
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
        self.events_log: collections.deque[EventRecord] = collections.deque(maxlen=EVENT_LOG_LEN)
        self._seq = 0
        self._log_lock = threading.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.exit_latency_ns: collections.deque[int] = collections.deque(maxlen=10000)
        self.mechanisms: dict[str, str] = {}
        self._previous_version: str | None = None   # of the daemon whose kept state we adopt
        self.regions = RegionPublisher(
            cfg.hami_regions, record=self.record,
            group_exists=lambda name: self.table.group(name) is not None,
            phys=lambda pid: self.info[pid].phys if pid in self.info else None,
            ndev=lambda: self.devices.count if hasattr(self, "devices") else 0,
            sm_caps=lambda name: self.sm.caps(name),
            ctx_bytes=lambda: self.ctx_bytes) if cfg.hami_regions else None
        # SM caps: every piece of SM state and every hold (smcontrol).
        self.sm = SmControl(cfg, probes=lambda: self.probes, table=lambda: self.table,
                            devices=lambda: self.devices, stopped=lambda: self.stopped,
                            libs=lambda: self.libs, mechanisms=lambda: self.mechanisms,
                            record=self.record, counters=self.counters)
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
        self.sm.probe_cost_s = 0.0
        if cfg.sm_limits and self.libs:
            # Measured before any process is registered: the daemon maps
            # libcuda for it and must not count itself as a CUDA process.
            lib = str(self.libs[0])
            try:
                self.sm.probe_cost_s = self.probes.measure_launch_probe_cost(lib)
                self.mechanisms["launch_probe_cost"] = (
                    f"{self.sm.probe_cost_s * 1e6:.2f} us per launch (measured on {lib})")
            except Exception as e:  # noqa: BLE001 - the controller works without it
                self.mechanisms["launch_probe_cost"] = f"unknown ({e})"
                self.record("fallback", f"measuring the launch probe's cost on {lib}: {e}; "
                            "host-bound launchers will run a little under their caps")
        self.watch.pin_configured()
        self.watch.discover(register=False)   # _scan_existing registers their users
        self._recover_bpf_stops()
        self._scan_existing()
        from .server import ServerError, SnapshotServer
        try:
            self._rebuild_snapshot()
        except RegionError as e:
            raise DaemonError(str(e)) from None
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
            if self.sm.active:
                self.sm.tick(now)
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
            if self._dirty or self.cfg.count_launches or self.sm.active:
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

    def _poll_ms(self) -> int:
        due_at = self.memory.next_due()
        if due_at is not None:
            due = due_at - time.monotonic()
            return max(1, min(POLL_MS, math.ceil(due * 1000)))
        wait = self.sm.wait_s(time.monotonic())
        if wait is None:
            return POLL_MS
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
            self.sm.sync_launch_probes()
            self.record("config", f"policy {self.cfg.policy} reloaded", policy=str(self.cfg.policy))
            self._dirty = True
        if self._reload_again:
            self.reload_policy()

    def _recompute_limits(self, group: str) -> None:
        g = self.table.group(group)
        if g is None:
            return
        old_limits = dict(self.table.limits(group))
        old_caps = self.sm.clear_group_caps(group)
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
        self.sm.caps_reread(group, g.index, old_caps)

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
            self.sm.on_hold(e)

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
        changed = self.sm.set_sched(group, prio, upol)
        if changed:
            prio, upol = changed
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
            self.sm.apply_cap(group, dev, sm)
            old = current.get(dev)
            new = mem if old is None else (old if mem is None else min(old, mem))
            if new != old:
                self.table.apply(GroupLimitSet(group, dev, new))
                self._sync_bpf_limit(group, dev)
                self.record("limit", f"group {group!r} device {dev}: limit {new} bytes",
                            group=group, device=dev, limit=new)

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
                self.sm.release(a.group, a.key.pid)
                if self.ctx_bytes:
                    self._after_release.append((a.group, tuple(a.released)))
                self.memory.forget(a.key.pid)
                if enforce.proc_start_time(a.key.pid) != a.key.start_time:
                    self.probes.delete_proc_cfg(a.key.pid)
            elif isinstance(a, DeleteGroup):
                self.probes.delete_group(a.index)
                self.sm.forget_group(a.name, a.index)
                if self.regions:
                    self.regions.gone(a.name)
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
                state="throttled" if self.sm.shown_throttled(p.group, p.key.pid, now)
                else "running",
                sm_share=self.sm.group_share(p.group_index),
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
                                    **self.sm.group_view(g.name, g.index)))
        counters = dict(self.table.stats)
        counters.update(self.counters)
        if self.probes:
            counters.update(self.probes.stats())
        counters["launch_probes"] = self.probes.launch_probes_attached() if self.probes else 0
        self._snap = Snapshot(SCHEMA_VERSION, time.time(), self.simulated, self.mechanisms,
                              self.devices.infos() if hasattr(self, "devices") else (),
                              tuple(procs), tuple(groups), counters)
        if self.regions and self.regions.publish(self._snap, now) is False:
            self._dirty = True          # not due yet: come back, the change must not be lost


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
