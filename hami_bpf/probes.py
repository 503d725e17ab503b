"""The bcc boundary: the only module that imports bcc.

Loads bpf_programs/hami.bpf.c, attaches and detaches probes, polls the ring
buffer and reads and writes maps. Everything above it deals in abi structs and
plain Python values.
"""
from __future__ import annotations

import ctypes as ct
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from . import abi, procfs
from .bpfhost import (  # noqa: F401 - re-exported: the daemon and doctor use them from here
    BPFFS, DEFAULT_PIN_DIR, KEPT_MAPS, MAX_ALLOCS, MAX_GROUPS, OPEN_TRACEPOINTS, Features,
    PinRefused, ProbeError, _bcc, ensure_bpffs, ensure_tracefs, layout_fingerprint,
    open_gate_missing, prepare_pin_dir, probe_features)
from .probetable import (  # noqa: F401 - re-exported
    ALLOC_SYMBOLS, CORE_PROBES, LAUNCH_PROBES, LAUNCH_SYMBOLS, NVML_PROBES, SYNC_SYMBOLS)

log = logging.getLogger("hami_bpf.probes")

# At shutdown, how long detaches queued before (a container's library) are
# waited for; the rest are closed in the background (Probes.close).
CLOSE_WAIT_S = 5.0

BPF_ANY, BPF_NOEXIST, BPF_EXIST = 0, 1, 2


def _perf_fds() -> set[int]:
    """This process's perf event descriptors (probes and tracepoints)."""
    return {fd for fd in procfs.fds() if procfs.fd_target(fd) == "anon_inode:[perf_event]"}


# --- the loaded program -------------------------------------------------------

@dataclass
class Attached:
    lib: str
    core: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    launch: list[str] = field(default_factory=list)
    sync: list[str] = field(default_factory=list)


class Probes:
    """hami.bpf.c loaded once; attached to one or more libcuda files."""

    def __init__(self, *, reg_write: bool = False, probe_write_user: bool = False,
                 max_procs: int = 4096, ringbuf_pages: int = 256, pin_dir: str | None = None,
                 open_gate: bool = False):
        """``pin_dir``: where the kept maps are pinned (prepare_pin_dir's
        result); None keeps them in this process only."""
        BPF = _bcc()
        ensure_tracefs()
        d = abi.bpf_dir()
        cflags = [f"-I{d}", f"-DHAMI_MAX_PROCS={max_procs}", f"-DHAMI_RINGBUF_PAGES={ringbuf_pages}",
                  "-Wno-macro-redefined"]
        if pin_dir is not None:
            cflags.append(f'-DHAMI_PIN_DIR="{pin_dir}"')
        if open_gate:
            cflags.append("-DHAMI_HAVE_OPEN_GATE=1")
        self.pin_dir = pin_dir
        if reg_write:
            cflags.append("-DHAMI_HAVE_REG_WRITE=1")
        if probe_write_user:
            cflags.append("-DHAMI_HAVE_PROBE_WRITE_USER=1")
        src = d / "hami.bpf.c"
        self.open_gate_error: str | None = None
        try:
            self.bpf = BPF(src_file=str(src).encode(), cflags=cflags)
        except Exception as e:
            if not open_gate:
                raise ProbeError(f"loading {src}: {e}") from e
            # The gate's tracepoints are attached at load: a kernel that
            # refuses them must not cost the rest.
            self.open_gate_error = " ".join(str(e).split())[-300:]
            cflags.remove("-DHAMI_HAVE_OPEN_GATE=1")
            try:
                self.bpf = BPF(src_file=str(src).encode(), cflags=cflags)
            except Exception as e2:
                raise ProbeError(f"loading {src}: {e2}") from e2
        self.open_gate = open_gate and self.open_gate_error is None
        self._BPF = BPF
        self.attached: dict[str, Attached] = {}
        # Detaching one uprobe takes ~0.2 s on 6.18 (measured: 37 probes, 7.8 s),
        # so detaches run on a worker thread: the event loop (heartbeat,
        # throttling, enforcement) must never wait seconds for them. bcc's
        # per-probe bookkeeping is shared, hence the lock around each call.
        self._bcc_lock = threading.Lock()
        self._config_lock = threading.Lock()
        self._pending: set[tuple[str, str]] = set()   # (lib, sym) with a detach queued
        self._jobs: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._detach_worker, name="hami-detach",
                                        daemon=True)
        self._worker.start()
        self._handler: Callable[[abi.Event], None] | None = None
        self._closing = False    # set by close(): queued detaches are left to it
        self.map = {name: self.bpf[name] for name in (
            "procs", "proc_cfg", "pmem", "grp_mem", "grp_lim", "allocs", "inflight",
            "ctx_dev", "cur_ctx", "launches", "config", "stats", "sm_grant", "sm_use",
            "sync_at", "nvml_dev", "gate_wait")}

    # attach / detach

    def _attach(self, lib: str, sym: str, fn: str, ret: bool = False) -> None:
        while (lib, sym) in self._pending:   # a queued detach of the same probe
            time.sleep(0.01)
        with self._bcc_lock:
            if ret:
                self.bpf.attach_uretprobe(name=lib.encode(), sym=sym.encode(), fn_name=fn.encode())
            else:
                self.bpf.attach_uprobe(name=lib.encode(), sym=sym.encode(), fn_name=fn.encode())

    def _detach_now(self, lib: str, sym: str, ret: bool = False) -> None:
        with self._bcc_lock:
            if ret:
                self.bpf.detach_uretprobe(name=lib.encode(), sym=sym.encode())
            else:
                self.bpf.detach_uprobe(name=lib.encode(), sym=sym.encode())

    def _detach_later(self, lib: str, syms: list[tuple[str, bool, bool]], then=None) -> None:
        """Queue detaches: (symbol, entry probe?, return probe?) each; `then`
        runs on the worker after the last (e.g. closing the fd that `lib` names)."""
        for sym, _e, _r in syms:
            self._pending.add((lib, sym))
        self._jobs.put((lib, syms, then))

    def _detach_worker(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from bcc import libbcc
        pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="hami-detach")
        while True:
            job = self._jobs.get()
            if job is None:
                pool.shutdown()
                return
            lib, syms, then = job
            # Take the probes out of bcc's books under the lock, then close them
            # all at once: each close waits for an RCU grace period, and
            # concurrent closes share it (37 probes: 7.8 s one by one).
            events = []
            with self._bcc_lock:
                for sym, entry, ret in syms:
                    for prefix, wanted in ((b"p", entry), (b"r", ret)):
                        if not wanted:
                            continue
                        try:
                            path, addr = self._BPF._check_path_symbol(lib.encode(), sym.encode(),
                                                                      None, -1, 0)
                            ev = self.bpf._get_uprobe_evname(prefix, path, addr, -1)
                            fd = self.bpf.uprobe_fds[ev]
                            self.bpf._del_uprobe_fd(ev)
                            events.append((ev, fd))
                        except Exception as e:
                            log.warning("detaching %s from %s: %s", sym, lib, e)

            def _close(item):
                if self._closing:
                    return   # shutting down: the fd is left to close() (in the background)
                ev, fd = item
                libbcc.lib.bpf_close_perf_event_fd(fd)
                libbcc.lib.bpf_detach_uprobe(ev)
            list(pool.map(_close, events))
            for sym, _e, _r in syms:
                self._pending.discard((lib, sym))
            if then is not None:
                try:
                    then()
                except Exception as e:
                    log.warning("after detaching from %s: %s", lib, e)

    def wait_detached(self, timeout: float = 60.0) -> bool:
        """Block until every queued detach ran (tests, shutdown)."""
        end = time.monotonic() + timeout
        while (self._pending or not self._jobs.empty()) and time.monotonic() < end:
            time.sleep(0.02)
        return not self._pending

    def attach_core(self, lib: str, symbols: Iterable[str] | None = None) -> Attached:
        """Attach every core probe whose symbol the library exports; skip the rest with a reason."""
        present = set(symbols) if symbols is not None else None
        a = self.attached.setdefault(lib, Attached(lib))
        for sym, (entry, ret) in CORE_PROBES.items():
            if present is not None and sym not in present:
                a.skipped[sym] = "not exported by this libcuda"
                continue
            entry_on = False
            try:
                self._attach(lib, sym, entry)
                entry_on = True
                if ret:
                    self._attach(lib, sym, ret, ret=True)
            except Exception as e:
                if entry_on:   # no half-attached symbol: detach_core detaches only a.core
                    try:
                        self._detach_now(lib, sym)
                    except Exception as e2:
                        log.warning("detaching uprobe %s from %s: %s", sym, lib, e2)
                a.skipped[sym] = f"attaching uprobe {sym} to {lib}: {e}"
                log.info("skipping %s in %s: %s", sym, lib, e)
                continue
            a.core.append(sym)
        if "cuMemAlloc_v2" not in a.core:
            raise ProbeError(f"attaching uprobe cuMemAlloc_v2 to {lib}: "
                             f"{a.skipped.get('cuMemAlloc_v2', 'failed')}")
        return a

    def attach_nvml(self, lib: str, symbols: Iterable[str] | None = None) -> list[str]:
        """Probe libnvidia-ml's memory queries, so a limited workload's
        nvidia-smi-style view shows its limit too. Symbols it lacks are skipped."""
        present = set(symbols) if symbols is not None else None
        a = self.attached.setdefault(lib, Attached(lib))
        for sym, (entry, ret) in NVML_PROBES.items():
            if present is not None and sym not in present:
                continue
            try:
                self._attach(lib, sym, entry)
                self._attach(lib, sym, ret, ret=True)
                a.core.append(sym)
            except Exception as e:
                a.skipped[sym] = f"attaching uprobe {sym} to {lib}: {e}"
        return [s for s in a.core if s in NVML_PROBES]

    def attach_launch(self, lib: str, symbols: Iterable[str] | None = None) -> list[str]:
        a = self.attached.setdefault(lib, Attached(lib))
        present = set(symbols) if symbols is not None else None
        for sym in LAUNCH_SYMBOLS:
            if sym in a.launch or (present is not None and sym not in present):
                continue
            try:
                self._attach(lib, sym, LAUNCH_PROBES[sym])
                a.launch.append(sym)
            except Exception as e:
                log.info("skipping launch probe %s in %s: %s", sym, lib, e)
        for sym in SYNC_SYMBOLS:
            if sym in a.sync or (present is not None and sym not in present):
                continue
            try:
                self._attach(lib, sym, "uprobe__sync_enter")
                self._attach(lib, sym, "uretprobe__sync_return", ret=True)
                a.sync.append(sym)
            except Exception as e:
                log.info("skipping sync probe %s in %s: %s", sym, lib, e)
        return list(a.launch)

    def detach_launch(self, lib: str, then=None) -> None:
        """Detach the launch and sync probes of `lib` (in the background)."""
        a = self.attached.get(lib)
        if not a:
            return
        jobs = [(s, True, False) for s in a.launch] + [(s, True, True) for s in a.sync]
        a.launch.clear()
        a.sync.clear()
        if jobs or then:
            self._detach_later(lib, jobs, then)

    def detach_core(self, lib: str, then=None) -> None:
        """Detach every probe of ``lib`` (core, launch, sync) and forget it, in
        the background; `then` runs after. bcc re-reads the ELF at ``lib`` to
        detach: the path must resolve until then."""
        a = self.attached.pop(lib, None)
        if not a:
            if then:
                then()
            return
        jobs = ([(s, True, False) for s in a.launch] + [(s, True, True) for s in a.sync] +
                [(s, True, (CORE_PROBES.get(s) or NVML_PROBES[s])[1] is not None) for s in a.core])
        self._detach_later(lib, jobs, then)

    def measure_launch_probe_cost(self, lib: str, rounds: int = 3, calls: int = 20000) -> float:
        """Seconds a launch probe adds to each call, measured here and now:
        the launch handler is attached to `lib`'s cuDriverGetVersion (harmless,
        needs no cuInit, and like every driver entry begins with push %rbp, so
        the uprobe traps the way it does on cuLaunchKernel), which this
        process then calls with and without it. The controller uses it to
        tell what a host-bound launcher would do without the probe."""
        import ctypes
        fn = ctypes.CDLL(lib).cuDriverGetVersion
        v = ctypes.c_int()
        ref = ctypes.byref(v)

        def per_call() -> float:
            best = float("inf")
            for _ in range(3):
                t = time.perf_counter_ns()
                for _ in range(calls):
                    fn(ref)
                best = min(best, (time.perf_counter_ns() - t) / calls)
            return best

        diffs = []
        for _ in range(rounds):
            bare = per_call()
            self._attach(lib, "cuDriverGetVersion", "uprobe__cuLaunchKernel")
            try:
                probed = per_call()
            finally:
                self._detach_now(lib, "cuDriverGetVersion")
            diffs.append(probed - bare)
        diffs.sort()
        return max(0.0, diffs[len(diffs) // 2]) / 1e9

    def launch_probes_attached(self) -> int:
        return sum(len(a.launch) for a in self.attached.values())

    # events

    def open_events(self, handler: Callable[[abi.Event], None]) -> None:
        self._handler = handler

        def _cb(ctx, data, size):
            handler(abi.decode(data))
            return 0

        self._cb = _cb  # keep a reference: bcc holds only a C pointer
        self.bpf["events"].open_ring_buffer(_cb)

    def poll(self, timeout_ms: int) -> None:
        self.bpf.ring_buffer_poll(timeout_ms)

    def consume(self) -> None:
        self.bpf.ring_buffer_consume()

    # maps written by the controller

    def _update(self, name: str, key, value, flags: int) -> bool:
        t = self.map[name]
        rc = self._lib().bpf_update_elem(t.map_fd, ct.byref(key), ct.byref(value), flags)
        return rc == 0

    @staticmethod
    def _lib():
        from bcc import libbcc
        return libbcc.lib

    def write_proc_cfg(self, pid: int, group_index: int, slot: int, phys: list[int] | None,
                       must_exist: bool) -> bool:
        """proc_cfg[pid] := (group, slot, visible->physical). must_exist: never resurrect a pid
        whose exit the BPF side already handled."""
        v = abi.ProcCfg(group=group_index, slot=slot)
        for i in range(abi.MAX_DEVS):
            v.phys[i] = phys[i] if phys and i < len(phys) else i
        return self._update("proc_cfg", ct.c_uint32(pid), v, BPF_EXIST if must_exist else BPF_ANY)

    def read_proc_cfg(self, pid: int) -> abi.ProcCfg | None:
        t = self.map["proc_cfg"]
        try:
            v = t[t.Key(pid)]
        except KeyError:
            return None
        return abi.ProcCfg.from_buffer_copy(bytes(v))

    def ensure_proc(self, pid: int) -> None:
        """Make a process found at start-up known to the BPF side, so its exit is reported."""
        v = abi.Proc(charged=abi.GROUP_NONE, last_dev=-1)
        self._update("procs", ct.c_uint32(pid), v, BPF_NOEXIST)

    def delete_proc_cfg(self, pid: int) -> None:
        t = self.map["proc_cfg"]
        try:
            del t[t.Key(pid)]
        except KeyError:
            pass

    def set_group_limit(self, group_index: int, device: int, limit: int | None,
                        total: int | None) -> None:
        key = abi.GKey(group=group_index, device=device)
        if limit is None and not total:
            t = self.map["grp_lim"]
            try:
                del t[t.Key(group=group_index, device=device)]
            except KeyError:
                pass
            return
        v = abi.GLim(limit=abi.UNLIMITED if limit is None else limit, total=total or 0)
        self._update("grp_lim", key, v, BPF_ANY)

    def set_sm_grant(self, group_index: int, device: int, granted: int, limited: bool,
                     checkpoint: bool = False, hold_at_sync: bool = False) -> None:
        """`checkpoint`: while learning, a synchronize's return spends the
        grant (hami.h, hami_smgrant), so the next launch waits for a tick.
        `hold_at_sync`: the group's next synchronize's return stops it."""
        v = abi.SmGrant(granted=granted, limited=1 if limited else 0,
                        checkpoint=1 if checkpoint else 0, hold_at_sync=1 if hold_at_sync else 0)
        self._update("sm_grant", abi.GKey(group=group_index, device=device), v, BPF_ANY)

    def delete_sm_grant(self, group_index: int, device: int) -> None:
        t = self.map["sm_grant"]
        try:
            del t[t.Key(group=group_index, device=device)]
        except KeyError:
            pass

    def sm_use(self) -> dict[tuple[int, int], tuple[int, int, int, int, int, int]]:
        """(group index, device) -> (cost launched, launches, cost known
        completed, nanoseconds its threads spent in synchronize calls,
        CLOCK_MONOTONIC nanoseconds when `completed` last advanced,
        synchronize calls that returned)."""
        return {(k.group, k.device): (v.consumed, v.launches, v.completed, v.sync_ns,
                                      v.completed_ns, v.syncs)
                for k, v in self.map["sm_use"].items()}

    def sync_waiting(self) -> dict[tuple[int, int], int]:
        """(group index, device) -> threads inside a synchronize call now
        (sync_at; an exiting thread's entry goes with it)."""
        out: dict[tuple[int, int], int] = {}
        for v in self.map["sync_at"].values():
            k = (v.gk.group, v.gk.device)
            out[k] = out.get(k, 0) + 1
        return out

    def _set_config_fields(self, **fields) -> None:
        """Read-modify-write of the one config value: the heartbeat thread
        writes it too, so each change holds the lock."""
        with self._config_lock:
            t = self.map["config"]
            v = t[ct.c_int(0)]
            for name, value in fields.items():
                setattr(v, name, value)
            t[ct.c_int(0)] = v

    def set_graph_cost(self, cost: int) -> None:
        self._set_config_fields(graph_cost=max(1, int(cost)))

    def gate_waiting(self) -> list[int]:
        """Pids the cuInit probe holds until they are classified (gate_wait)."""
        return [k.value for k in self.map["gate_wait"].keys()]

    def claim_gate(self, pid: int) -> bool:
        """Take `pid`'s gate_wait entry: True for the one caller that deleted
        it, who must resume the process (exactly once)."""
        return self._lib().bpf_delete_elem(self.map["gate_wait"].map_fd,
                                           ct.byref(ct.c_uint32(pid))) == 0

    def _delete_where(self, name: str, doomed: Callable[[object], bool]) -> int:
        """Delete every key of map `name` for which doomed(key) holds; the
        number deleted (a key gone meanwhile is not counted)."""
        t = self.map[name]
        n = 0
        for k in [k for k in t.keys() if doomed(k)]:
            try:
                del t[k]
                n += 1
            except KeyError:
                pass
        return n

    def delete_group(self, group_index: int) -> None:
        for name in ("grp_lim", "grp_mem", "sm_grant", "sm_use"):
            self._delete_where(name, lambda k: k.group == group_index)

    # the kept maps, for a daemon adopting them (hami_bpf.kept)

    def kept_state(self) -> dict:
        """What the kept maps hold, as plain values (kept.plan's arguments)."""
        procs = {k.value: (int(v.charged), int(v.image)) for k, v in self.map["procs"].items()}
        assigned = {k.value: int(v.group) for k, v in self.map["proc_cfg"].items()}
        pmem = {(k.tgid, k.device): int(v.value) for k, v in self.map["pmem"].items()}
        calls = {k.value: (int(v.group), int(v.device), int(v.size),
                           bool(v.flags & abi.F_RESERVED))
                 for k, v in self.map["inflight"].items()}
        groups = {k.group for name in ("grp_mem", "grp_lim") for k in self.map[name].keys()}
        return {"procs": procs, "assigned": assigned, "pmem": pmem, "calls": calls,
                "group_keys": groups}

    def _add_group_mem(self, group_index: int, device: int, delta: int) -> None:
        """grp_mem[group, device].used += delta, from user space. Only while no
        program can change it (before our probes attach): not atomic with them."""
        t = self.map["grp_mem"]
        k = abi.GKey(group=group_index, device=device)
        try:
            v = t[k]
        except KeyError:
            v = abi.GMem(used=0, denied=0)
        v.used = max(0, int(v.used) + delta)
        t[k] = v

    def forget_process(self, pid: int, charged: int | None, used: Mapping[int, int]) -> None:
        """A process that exited while no daemon ran: what the exit program
        would have done (its bytes back from its group, its entries gone)."""
        if charged is not None:
            for dev, b in used.items():
                self._add_group_mem(charged, dev, -b)
        for name, key in (("procs", ct.c_uint32(pid)), ("proc_cfg", ct.c_uint32(pid)),
                          ("launches", ct.c_uint32(pid))):
            try:
                del self.map[name][key]
            except KeyError:
                pass
        self._delete_where("pmem", lambda k: k.tgid == pid)

    def give_back(self, tid: int, group_index: int | None, device: int, size: int) -> None:
        """An in-flight entry no return probe will see: its reservation back."""
        if group_index is not None and size:
            self._add_group_mem(group_index, device, -size)
        try:
            del self.map["inflight"][ct.c_uint32(tid)]
        except KeyError:
            pass

    def move_charge(self, pid: int, old: int, new: int, used: Mapping[int, int]) -> None:
        """A process's bytes from group index ``old`` to ``new`` (its group
        has another index for this daemon)."""
        for dev, b in used.items():
            self._add_group_mem(old, dev, -b)
            self._add_group_mem(new, dev, b)
        t = self.map["procs"]
        try:
            v = t[ct.c_uint32(pid)]
            v.charged = new
            t[ct.c_uint32(pid)] = v
        except KeyError:
            pass

    def forget_threads(self, alive: Callable[[int], bool]) -> int:
        """Context stacks of threads that exited while no daemon ran."""
        return self._delete_where("cur_ctx", lambda k: not alive(k.value))

    def group_used(self, group_index: int, device: int) -> int:
        """Bytes charged to a group on a device, as admission sees them."""
        try:
            return int(self.map["grp_mem"][abi.GKey(group=group_index, device=device)].used)
        except KeyError:
            return 0

    def group_mem(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(group index, device) -> (used, denied) as the BPF side counts them."""
        return {(k.group, k.device): (v.used, v.denied) for k, v in self.map["grp_mem"].items()}

    def process_mem(self) -> dict[tuple[int, int], int]:
        return {(k.tgid, k.device): v.value for k, v in self.map["pmem"].items()}

    def set_config(self, *, flags: int, oom_action: int, stale_ns: int) -> None:
        self._set_config_fields(flags=flags, oom_action=oom_action, stale_ns=stale_ns,
                                controller=os.getpid())

    def heartbeat(self) -> None:
        self._set_config_fields(heartbeat_ns=time.monotonic_ns())

    def stop_heartbeat(self) -> None:
        """Tell the BPF side nobody will resume a stop from now on."""
        self._set_config_fields(heartbeat_ns=0)

    def stats(self) -> dict[str, int]:
        t = self.map["stats"]
        out = {}
        for idx, name in abi.STAT_NAMES.items():
            out[name] = int(sum(t[ct.c_int(idx)]))
        return out

    def launches(self) -> dict[int, int]:
        return {k.value: v.value for k, v in self.map["launches"].items()}

    def bpf_procs(self) -> set[int]:
        return {k.value for k in self.map["procs"].keys()}

    def sweep(self, live: set[int]) -> int:
        """Delete records the exit program can't reach (allocations, contexts) of dead
        processes, and allocations an exec left behind (of an image not the process's)."""
        n = 0
        # Records first, images after: a record whose image is not the one
        # read later belongs to an image that is gone, whenever it was made.
        records = list(self.map["allocs"].items())
        images = {k.value: v.image for k, v in self.map["procs"].items()}
        t = self.map["allocs"]
        for k, v in records:
            if k.tgid in live and k.tgid in images and v.image != images[k.tgid]:
                try:
                    now = t[k]
                    if now.image == v.image:
                        del t[k]
                        n += 1
                except KeyError:
                    pass
        for name in ("allocs", "ctx_dev", "nvml_dev", "pmem"):
            n += self._delete_where(name, lambda k: k.tgid not in live)
        return n

    def close(self) -> None:
        try:
            self.stop_heartbeat()
        except Exception:
            pass
        # Probes left attached a little longer below must do nothing but
        # count: no stop (the heartbeat is gone), no kill, no enforcement.
        try:
            v = self.map["config"][ct.c_int(0)]
            self.set_config(flags=0, oom_action=abi.ACT_OBSERVE, stale_ns=v.stale_ns)
        except Exception:
            pass
        self._closing = True
        self.wait_detached(timeout=CLOSE_WAIT_S)   # the worker skips what it has not begun
        self._jobs.put(None)
        self.attached.clear()
        with self._bcc_lock:
            fds = list(self.bpf.uprobe_fds.items())
            for ev, _fd in fds:
                self.bpf._del_uprobe_fd(ev)
        perf = _perf_fds()
        self.closer_pid = self._close_in_background(perf)
        for _ev, fd in fds:
            try:
                os.close(fd)      # a copy now: the child holds the last one
            except OSError:
                pass
        with self._bcc_lock:
            self.bpf.cleanup()   # the tracepoints' copies, programs, maps

    @staticmethod
    def _close_in_background(perf: set[int]) -> int | None:
        """Leave the last reference to each probe (``perf``: this process's
        perf event descriptors) to a child process, so that closing our own
        copies costs nothing. Unregistering a probe waits for the kernel's
        grace periods under a lock every unregistration shares (6.18: ~0.09 s
        each, in parallel or not; 10 libraries' 370 probes 34 s), and so would
        this process's exit. The child first closes everything else (the
        libraries' locks among them), then replaces its image, which drops
        the mappings that would make it look like a CUDA process to a daemon
        scanning for them; the exec or its exit closes the probes.
        Meanwhile they only count (see close)."""
        if not perf:
            return None
        others = [fd for fd in procfs.fds() if fd not in perf]
        try:
            pid = os.fork()
        except OSError as e:
            log.warning("detaching probes in the background: %s; detaching here", e)
            return None
        if pid:
            return pid
        try:     # the child: system calls only
            for fd in others:
                try:
                    os.close(fd)
                except OSError:
                    pass
            for prog in ("/bin/true", "/bin/sh"):
                try:
                    os.execv(prog, [prog, "-c", ":"] if prog.endswith("sh") else [prog])
                except OSError:
                    pass
        finally:
            os._exit(0)
