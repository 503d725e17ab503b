"""Start-up and recovery: which libraries and mechanisms, the kept state of a
predecessor (waited for, then adopted), the probes attached, and the stops a
previous controller left behind finished.

Each step takes what it works on as arguments and says what it found in the
``mechanisms`` dict (shown by `hami-bpf doctor` and the snapshot) and the
event log. Failures that stop the daemon are DaemonError.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from . import __version__, abi, enforce, kept, procfs
from .devices import Devices, Fallback
from .events import UsageObserved
from .libwatch import LockError, lock_file
from .policyfile import DaemonError

log = logging.getLogger("hami_bpf")

CONTROL_NICE = -10         # the daemon's CPU priority (raise_priority)
GRAPH_COST = 4096          # cost units per cuGraphLaunch (feedback corrects it where NVML is)
HEARTBEAT_STALE_NS = 2_000_000_000
MAX_PROCS = 4096           # procs map size (maps.h), part of the kept layout


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


OOM_ACTIONS = {"return-oom": abi.ACT_RETURN_OOM, "stop-rewrite": abi.ACT_STOP_REWRITE,
               "kill": abi.ACT_KILL, "observe": abi.ACT_OBSERVE}


class Startup:
    def __init__(self, cfg, *, mechanisms: dict, record, counters):
        self.cfg = cfg
        self.mechanisms = mechanisms
        self._record = record
        self.counters = counters
        self.previous_version: str | None = None   # of the daemon whose kept state we adopt
        self.adopting = False
        self.locks: list[int] = []
        self._entry_offs: dict[Path, dict[str, int]] = {}

    def raise_priority(self) -> None:
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
            self._record("config", "nice", nice=CONTROL_NICE, error=str(e))

    def choose_libs(self) -> tuple[list[Path], object | None]:
        """(libraries to probe, the stand-in libcuda built for the demo or None)."""
        from . import libcuda
        cfg = self.cfg
        libs: list[Path] = []
        if cfg.libcuda:
            for p in cfg.libcuda:
                try:
                    libcuda.validate_libcuda(p)
                except (libcuda.LibcudaError, OSError) as e:
                    raise DaemonError(str(e)) from None
            libs = [Path(p).resolve() for p in cfg.libcuda]
        elif cfg.demo is not True:
            libs = [p for p in libcuda.find_libcuda(None)]
        if cfg.demo or (cfg.demo is None and not libs):
            from . import demo, fakecuda
            fake = fakecuda.build(None)
            print(demo.SIMULATED_BANNER, file=sys.stderr, flush=True)
            return [Path(fake.libcuda)], fake
        return libs, None

    def discover_devices(self, simulated: bool) -> Devices:
        """The node's GPUs, and which utilization the SM guard reads of them."""
        cfg = self.cfg
        devices = Devices.discover(simulated, Fallback(
            cfg.fallback_devices, cfg.fallback_total_mem, cfg.sim_gpu, cfg.sim_proc_mem))
        self.mechanisms["sm_utilization"] = devices.utilization_source()
        return devices

    def lock_libs(self, libs: list[Path]) -> None:
        """One controller per library: two would both stop, rewrite and resume
        the same processes. The lock dies with the process, SIGKILL included."""
        self.locks = []
        for lib in libs:
            try:
                fd, path = lock_file(lib.stat())
            except LockError as e:
                raise DaemonError(str(e)) from None
            if fd is None:
                raise DaemonError(f"another hami-bpf daemon is attached to {lib} "
                                  f"(lock {path} is held)") from None
            self.locks.append(fd)

    def features(self):
        """(features, OOM action, register writes usable, probe_write_user usable)."""
        from . import probes
        try:
            feats = probes.probe_features()
        except probes.ProbeError as e:
            raise DaemonError(str(e)) from None
        want, meminfo = choose_mechanisms(feats, self.cfg.oom_action)
        if want == "return-oom" and not feats.reg_write:
            raise DaemonError("--oom-action return-oom: this kernel refuses uprobe register writes "
                              f"({feats.errors.get('reg_write', 'refused')})")
        if want in ("stop-rewrite", "kill") and not feats.send_signal:
            raise DaemonError(f"--oom-action {want}: this kernel refuses bpf_send_signal "
                              f"({feats.errors.get('send_signal', 'refused')})")
        self.mechanisms.update({
            "daemon": f"hami-bpf {__version__}",
            "oom": want,
            "meminfo": meminfo,
            "exit": "tracepoint sched_process_exit",
            "events": "ringbuf" if feats.ringbuf else "none",
            "launch": "counting uprobes" if self.cfg.count_launches else "off",
        })
        return (feats, OOM_ACTIONS[want], feats.reg_write and want == "return-oom",
                feats.probe_write_user)

    def state_write_failed(self, what: str, err: int | None) -> None:
        """The stopped-process record cannot be written (a full or read-only
        state directory): said once; limits and stops go on as before."""
        self.counters["state_write_errors"] += 1
        self._record("error", "state_write_failed", path=self.cfg.state_dir, errno=err,
                     state_write_failed=True, detail=what)

    def stopped_set(self, libs: list[Path]) -> enforce.StoppedSet:
        """The record of processes we stop; what a crashed run left is said.
        One stopped at a denied allocation stays so until our probes attach
        (recover_bpf_stops answers it)."""
        from . import probes
        cfg = self.cfg
        os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)

        def denied_at(pid: int) -> str | None:
            offs = self._entry_offsets(libs)    # read only where a record is left
            return next((sym for lib in libs for sym, _ in _stopped_at(pid, lib, offs[lib]).values()
                         if sym in probes.ALLOC_SYMBOLS), None)
        # A previous run that crashed may have left processes stopped.
        for pid, what in enforce.StoppedSet.recover(cfg.state_dir, at_probe=denied_at).items():
            self._record("recover", "left_stopped", pid=pid, stop=what)
        stopped = enforce.StoppedSet(cfg.state_dir)
        stopped.on_error = self.state_write_failed
        return stopped

    def prepare_kept_state(self) -> str | None:
        """Where the kept maps are pinned (None: in this process only), once the
        previous daemon's probes are gone. Sets adopting when there is state
        to take over."""
        from . import probes
        cfg = self.cfg
        self.adopting = False
        if not cfg.pin_dir:
            self.mechanisms["state"] = "in this process only (--no-keep-state)"
            return None
        fp = probes.layout_fingerprint(MAX_PROCS)
        try:
            path, self.adopting = probes.prepare_pin_dir(cfg.pin_dir, fp, cfg.fresh)
        except probes.PinRefused as e:
            raise DaemonError(str(e)) from None
        except probes.ProbeError as e:
            self.mechanisms["state"] = f"in this process only ({e})"
            self._record("fallback", "state_in_process", pin_dir=cfg.pin_dir, error=str(e))
            return None
        self.mechanisms["state"] = f"kept in {path}"
        if cfg.fresh:
            self._record("state", "fresh", pin_dir=cfg.pin_dir)
        return path

    def wait_for_predecessor(self) -> None:
        """The previous daemon's probes must be gone before ours attach and
        before its maps are read: both would count every call otherwise."""
        cfg = self.cfg
        self.previous_version = kept.predecessor_version(cfg.state_dir)
        left = kept.wait_for_predecessor(cfg.state_dir,
                                         said=lambda pids: self._record("state", "waiting", pids=pids))
        if left:
            raise DaemonError(f"the previous daemon (pid {', '.join(map(str, left))}) still has its "
                              f"probes attached after {kept.PREDECESSOR_WAIT_S:.0f} s: adopting its "
                              "maps beside them would count every call twice")
        try:
            kept.write_owner(cfg.state_dir)
        except OSError as e:
            self.state_write_failed(f"recording this daemon in {cfg.state_dir}: {e.strerror}",
                                    e.errno)

    def config_flags(self, probes, *, feats, gate_missing: str | None, gate_init: bool,
                     oom_action: int) -> None:
        """The `config` map: what BPF enforces, and how the mechanisms read."""
        flags = abi.CFG_ENFORCE_MEM
        if self.mechanisms["meminfo"] != "off":
            flags |= abi.CFG_VIRT_MEMINFO
        # Limits can come from a new process's environment or the policy: hold
        # it at cuInit until its group and limits are in the maps (~1 ms once).
        if gate_init and feats.send_signal:
            flags |= abi.CFG_GATE_INIT
            self.mechanisms["admission"] = "gated at cuInit"
        else:
            self.mechanisms["admission"] = "from first classified call"
        # A driver library a process opens (a private copy included) is
        # probed before the process can map it.
        if gate_missing is None and not probes.open_gate:
            gate_missing = f"the kernel refused its programs: {probes.open_gate_error}"
            self._record("fallback", "open_gate", reason=gate_missing)
        if gate_missing is None:
            flags |= abi.CFG_GATE_LIBS
            self.mechanisms["private_libs"] = "held at open until probed"
        else:
            self.mechanisms["private_libs"] = (f"found by scanning /proc (about every second; "
                                               f"{gate_missing})")
        probes.set_config(flags=flags, oom_action=oom_action, stale_ns=HEARTBEAT_STALE_NS)
        probes.set_graph_cost(GRAPH_COST)

    def adopt(self, probes, registry) -> None:
        """Take over the maps a previous daemon kept: what exited while no
        daemon ran goes back to its group, reservations of calls whose return
        no probe saw are given back, and every living process is registered
        in the group index its bytes are charged to (kept.plan)."""
        st = probes.kept_state()
        a = kept.plan(st["procs"], st["assigned"], st["pmem"], st["calls"], st["group_keys"],
                      kept.start_ns)
        for p in a.dead:
            probes.forget_process(p.pid, p.charged, p.used)
        for r in a.reservations:
            probes.give_back(r.tid, r.group, r.device, r.size)
        for tid in a.stale_calls:
            probes.give_back(tid, None, 0, 0)
        threads = probes.forget_threads(procfs.thread_exists)
        # A group index is never reused: entries of one no process is in any
        # more are deleted below, but not before a new group could take it.
        registry.reset(first_group_index=max(a.indices, default=0) + 1)
        table = registry.table
        moved = 0
        for p in a.live:
            old = p.charged if p.charged is not None else p.assigned
            registry.register(p.pid, time.monotonic_ns(), existing=True, index=old)
            view = table.process(p.pid)
            if view is None:        # gone meanwhile: as if it exited unseen
                probes.forget_process(p.pid, p.charged, p.used)
                continue
            if p.charged is not None and p.charged != view.group_index:
                probes.move_charge(p.pid, p.charged, view.group_index, p.used)
                moved += 1
            if p.used:
                table.apply(UsageObserved(p.pid, p.used, view.key.start_time))
        for idx in a.indices - {g.index for g in table.groups()}:
            probes.delete_group(idx)
        self.counters["adopted_processes"] += len(a.live)
        self.counters["adopted_exited"] += len(a.dead)
        self._record("adopt", "adopted", adopted=len(a.live),
                     adopted_bytes=a.bytes_adopted, exited=len(a.dead),
                     released_bytes=a.bytes_released, reservations=len(a.reservations),
                     moved=moved, threads_forgotten=threads, version=__version__,
                     previous_version=self.previous_version)

    def attach(self, probes_, libs: list[Path], watch, oom_action: int) -> None:
        """The core probes (and launch probes with --count-launches) on every
        library, and NVML's beside each."""
        from . import libcuda, probes
        watch.entry_ok = {}
        for lib in libs:
            syms = libcuda.cuda_symbols(lib)
            try:
                a = probes_.attach_core(str(lib), syms)
            except probes.ProbeError as e:
                raise DaemonError(str(e)) from None
            for sym, why in a.skipped.items():
                log.info("%s: skipping %s: %s", lib, sym, why)
            if self.cfg.count_launches:
                probes_.attach_launch(str(lib), syms)
            offs = libcuda.symbol_file_offsets(lib, probes.ALLOC_SYMBOLS)
            watch.entry_ok[str(lib)] = {s: enforce.prologue_ok(str(lib), o, s)
                                        for s, o in offs.items()}
            if oom_action == abi.ACT_STOP_REWRITE:
                for s, (ok, why) in watch.entry_ok[str(lib)].items():
                    if not ok:
                        self._record("fallback", "stop_rewrite_refused", symbol=s,
                                     lib=str(lib), reason=why)
            nvml = find_libnvml(lib)
            if nvml is not None:
                got = probes_.attach_nvml(str(nvml), libcuda.read_symbols(nvml))
                if got:
                    log.info("attached %d probes to %s (nvidia-smi-style memory queries)",
                             len(got), nvml)
            log.info("attached %d probes to %s%s", len(a.core), lib,
                     f" (+{len(a.launch)} launch probes)" if a.launch else "")

    def measure_probe_cost(self, probes, libs: list[Path]) -> float:
        """Seconds the launch probe adds to a launch (0.0 without SM limits)."""
        if not (self.cfg.sm_limits and libs):
            return 0.0
        # Measured before any process is registered: the daemon maps
        # libcuda for it and must not count itself as a CUDA process.
        lib = str(libs[0])
        try:
            cost = probes.measure_launch_probe_cost(lib)
            self.mechanisms["launch_probe_cost"] = (
                f"{cost * 1e6:.2f} us per launch (measured on {lib})")
            return cost
        except Exception as e:  # noqa: BLE001 - the controller works without it
            self.mechanisms["launch_probe_cost"] = f"unknown ({e})"
            self._record("fallback", "probe_cost", lib=str(lib), error=str(e))
            return 0.0

    def _entry_offsets(self, libs: list[Path]) -> dict[Path, dict[str, int]]:
        """Each library's file offsets of the entries our probes stop at (read
        once: a real libcuda's symbol table is large)."""
        from . import libcuda, probes
        for lib in libs:
            if lib not in self._entry_offs:
                self._entry_offs[lib] = libcuda.symbol_file_offsets(
                    lib, probes.ALLOC_SYMBOLS + probes.LAUNCH_SYMBOLS + ("cuInit",))
        return self._entry_offs

    def recover_bpf_stops(self, libs: list[Path], watch, stopped) -> None:
        """Finish what a previous controller left: processes its probes stopped
        before it could act (it was SIGKILLed). Such a thread sits exactly one
        byte past a probed entry (the emulated push %rbp), which is where no
        one else's stop can leave it; /proc/PID/task/TID/syscall shows its pc
        without ptrace. A denied allocation is failed now; a hold at cuInit is
        released. Other stopped processes are not ours: left alone."""
        from . import probes
        offs = self._entry_offsets(libs)
        for lib in libs:
            for pid in watch.pids_of(lib):
                if pid == os.getpid():
                    continue
                for tid, (sym, entry) in _stopped_at(pid, lib, offs[lib]).items():
                    if sym == "cuInit" or sym in probes.LAUNCH_PROBES:
                        enforce.resume(pid)
                        self._record("recover", "hold_released", pid=pid, symbol=sym)
                        continue
                    try:
                        enforce.fail_call(pid, tid, entry, stopped=stopped)
                        self._record("recover", "denial_finished", pid=pid, symbol=sym)
                    except enforce.EnforceError as e:
                        self._record("error", "denial_unfinished", pid=pid, error=str(e))

    def serve(self, snapshot, events_since):
        """(socket server, metrics server or None), both started."""
        from .server import ServerError, SnapshotServer
        cfg = self.cfg
        server = SnapshotServer(cfg.socket, snapshot, events_since, cfg.socket_group)
        try:
            server.start()
        except (ServerError, OSError) as e:
            raise DaemonError(f"serving {cfg.socket}: {e}") from None
        metrics = None
        if cfg.metrics_addr:
            from .metrics import MetricsError, start_metrics_server
            try:
                metrics = start_metrics_server(cfg.metrics_addr, snapshot)
            except (MetricsError, OSError) as e:
                server.close()
                raise DaemonError(f"serving metrics on {cfg.metrics_addr}: {e}") from None
        return server, metrics

    @staticmethod
    def scan_existing(libs: list[Path], watch, registry) -> None:
        """Register every process already mapping a probed library."""
        for lib in libs:
            for pid in watch.pids_of(lib):
                if pid != os.getpid() and registry.table.resolve(pid) is None:
                    registry.register(pid, time.monotonic_ns(), existing=True)


def _stopped_at(pid: int, lib: Path, offs: dict[str, int]) -> dict[int, tuple[str, int]]:
    """{tid: (symbol, entry address)} of pid's threads stopped (state T) one
    byte past a probed entry of `lib` (the emulated push %rbp): where only a
    probe's stop leaves a thread."""
    entries = {}
    for sym, off in offs.items():
        addr = enforce.entry_address(pid, str(lib), off)
        if addr is not None:
            entries[addr] = sym
    out = {}
    if not entries:
        return out
    for tid in [t for t in procfs.tasks(pid) if procfs.state(pid, t) == "T"]:
        pc = procfs.user_pc(pid, tid)
        sym = entries.get(pc - 1) if pc else None
        if sym is not None:
            out[tid] = (sym, pc - 1)
    return out
