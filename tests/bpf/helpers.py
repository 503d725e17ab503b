"""Shared helpers for the black-box BPF tests (and bench/compaction_latency.py).

Everything here talks to `hami-bpf run` only the way a user would: the
command line, the control socket (``hami_bpf.server.query``) and the
``ps --json`` / ``slots --json`` commands.  Processes are the fakecuda
``cudaprog`` workload, so the uprobes fire on a real (stand-in) libcuda.

    with Daemon(fake, group_by="env:HAMI_GROUP") as d:
        with Tracked.spawn(fake, "grp-a") as p:
            p.alloc("alloc 1M", dev=0)
            wait_for(lambda: accounting_problems(d.snapshot(), [p]))
"""
from __future__ import annotations

import json
import os
import sys
import resource
import select
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from hami_bpf.enforce import proc_state
from hami_bpf.fakecuda import CudaProc, FakeCuda, FakeCudaError
from hami_bpf.server import ServerError, query

GROUP_ENV = "HAMI_GROUP"

# ---------------------------------------------------------------- deadlines
#
# Every deadline of these tests is derived here, from what this machine shows,
# not from how fast some other machine was. The yardstick is a daemon start:
# bcc compiling bpf_programs/hami.bpf.c takes ~5 s on an unloaded 2-core host
# and minutes in an emulated (TCG) guest, and everything else slows alike.
#
#   * The first start in a test run may take FIRST_READY_TIMEOUT
#     (env HAMI_TEST_READY_TIMEOUT, default 900 s).
#   * Later starts may take READY_FACTOR x the slowest start so far (at least
#     READY_FLOOR_S).
#   * Every other timeout in the helpers (wait_for, converge, wait_registered,
#     process commands, stop) is given in seconds for a machine where a start
#     takes REFERENCE_READY_S, and is multiplied by scale() = slowest start /
#     REFERENCE_READY_S (never below 1).
FIRST_READY_TIMEOUT = float(os.environ.get("HAMI_TEST_READY_TIMEOUT", "900"))
REFERENCE_READY_S = 4.0
READY_FACTOR = 4.0
READY_FLOOR_S = 60.0
CONVERGE_TIMEOUT = 2.0   # base seconds, scaled


class Deadlines:
    """The one place deadlines are computed (module-wide: DEADLINES)."""

    def __init__(self, first_ready_timeout: float = FIRST_READY_TIMEOUT, *,
                 reference_ready_s: float = REFERENCE_READY_S,
                 ready_factor: float = READY_FACTOR, ready_floor_s: float = READY_FLOOR_S):
        self.first_ready_timeout = first_ready_timeout
        self.reference_ready_s = reference_ready_s
        self.ready_factor = ready_factor
        self.ready_floor_s = ready_floor_s
        self.slowest_ready: float | None = None   # seconds, of the starts so far

    def saw_ready(self, seconds: float) -> None:
        if self.slowest_ready is None or seconds > self.slowest_ready:
            self.slowest_ready = seconds

    def scale(self) -> float:
        if self.slowest_ready is None:
            return 1.0
        return max(1.0, self.slowest_ready / self.reference_ready_s)

    def ready_timeout(self) -> tuple[float, str]:
        """(seconds a daemon start may take, where that bound comes from)."""
        if self.slowest_ready is None:
            return self.first_ready_timeout, \
                "the first start in this test run; HAMI_TEST_READY_TIMEOUT sets it"
        t = max(self.ready_floor_s, self.ready_factor * self.slowest_ready)
        return t, f"scaled from the slowest start so far, {self.slowest_ready:.1f} s"

    def timeout(self, base: float) -> float:
        """`base` seconds (right where a start takes reference_ready_s), here."""
        return base * self.scale()

    def explain(self, base: float) -> str:
        if self.slowest_ready is None:
            return f"{base:g} s unscaled: no daemon start measured yet"
        return (f"{base:g} s x {self.scale():.1f}, scaled from the slowest daemon start "
                f"so far, {self.slowest_ready:.1f} s")


DEADLINES = Deadlines()


def hami_bpf_bin() -> str:
    """The `hami-bpf` entry point under test (override: HAMI_BPF_BIN): the one
    next to the running Python first, so that `make test VENV=...` tests that
    virtual environment's code."""
    env = os.environ.get("HAMI_BPF_BIN")
    if env:
        return env
    beside = os.path.join(os.path.dirname(sys.executable), "hami-bpf")
    if os.access(beside, os.X_OK):
        return beside
    venv = "/opt/hami-bpf/venv/bin/hami-bpf"
    if os.access(venv, os.X_OK):
        return venv
    found = shutil.which("hami-bpf")
    if found:
        return found
    return venv  # let the caller fail with a clear "not found"


def gname(prefix: str) -> str:
    """A group name no other test (or earlier run) uses."""
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def proc_env(group: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a test workload in `group` (two simulated devices)."""
    return {GROUP_ENV: group, "FAKECUDA_DEVICES": "2", **(env or {})}


def no_core_dumps() -> None:
    """`crash` must not leave core files (children inherit the soft limit)."""
    try:
        _, hard = resource.getrlimit(resource.RLIMIT_CORE)
        resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    except (ValueError, OSError):
        pass


# ---------------------------------------------------------------- processes

def stopped_pids() -> set[int]:
    """Pids in state T (stopped) or t (tracing stop) among this test process's
    descendants (every workload is one): a stopped process of anyone else on
    the host is none of these tests' business."""
    out: set[int] = set()
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        if len(fields) < 2:
            continue
        parent[int(d)] = int(fields[1])
        if fields[0] in ("T", "t"):
            out.add(int(d))
    me = os.getpid()

    def ours(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            pid = parent.get(pid, 0)
            if pid == me:
                return True
            seen += 1
        return False

    return {pid for pid in out if ours(pid)}


def describe_pids(pids: Iterable[int]) -> str:
    parts = []
    for pid in sorted(pids):
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = "?"
        parts.append(f"{pid}({comm})")
    return ", ".join(parts)


# ------------------------------------------------------------------- daemon

def write_policy(path: str | os.PathLike, text: str) -> Path:
    """A policy file the daemon accepts: root-owned, 0600 (it refuses anything
    a workload could have written)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chown(path, 0, 0)
    os.chmod(path, 0o600)
    return path


class DaemonError(RuntimeError):
    pass


PIN_ROOT = "/sys/fs/bpf"
_PIN_DIRS: set[str] = set()     # made by this test run: removed at its end (conftest)


def pin_dir_for(workdir: str | os.PathLike) -> str:
    """The --bpf-pin-dir of daemons working in ``workdir``."""
    import hashlib
    digest = hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:16]
    path = f"{PIN_ROOT}/hami-t-{digest}"
    _PIN_DIRS.add(path)
    return path


def remove_pin_dir(path: str) -> None:
    """Unpin a test daemon's kept maps (the kernel frees them with their last user)."""
    shutil.rmtree(path, ignore_errors=True)
    _PIN_DIRS.discard(path)


def remove_pin_dirs() -> None:
    for path in list(_PIN_DIRS):
        remove_pin_dir(path)


def _default_stops() -> None:
    """In the daemon's child: SIGINT and SIGQUIT back at their defaults. A
    test run started in the background by a shell without job control
    inherits them ignored, and the daemon keeps an inherited ignore (as
    nohup expects), so the signal tests would test the shell instead."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class Daemon:
    """`hami-bpf run` as a foreground subprocess with a private socket and state dir.

    stderr goes to a file (never a pipe that could fill up); ``log()`` reads it.
    """

    def __init__(self, fake: FakeCuda, *, group_by: str = f"env:{GROUP_ENV}",
                 count_launches: bool = False, policy: str | os.PathLike | None = None,
                 oom_action: str | None = None, extra: Sequence[str] = (),
                 workdir: str | os.PathLike | None = None,
                 deadlines: Deadlines | None = None, command: str | None = None):
        self.fake = fake
        self.deadlines = deadlines or DEADLINES
        # AF_UNIX paths are limited to 108 bytes: keep the socket's dir short.
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="hami-t-"))
        self.socket = str(self.workdir / "s.sock")
        self.state_dir = str(self.workdir / "state")
        self.stderr_path = self.workdir / "daemon.stderr"
        # Kept maps per working directory: a daemon started again on the same
        # one adopts them, as on a node; other tests' daemons never see them.
        self.pin_dir = pin_dir_for(self.workdir)
        self.argv = [command or hami_bpf_bin(), "run", "--libcuda", str(fake.libcuda),
                     "--socket", self.socket, "--state-dir", self.state_dir,
                     "--bpf-pin-dir", self.pin_dir,
                     "--group-by", group_by, "--no-demo"]
        if count_launches:
            self.argv.append("--count-launches")
        if policy is not None:
            self.argv += ["--policy", str(policy)]
        if oom_action is not None:
            self.argv += ["--oom-action", oom_action]
        self.argv += list(extra)
        self.proc: subprocess.Popen | None = None
        self.stopped_before: set[int] = set()
        self.returncode: int | None = None
        self.ready_after: float | None = None

    # -- lifecycle --------------------------------------------------------
    def start(self, ready_timeout: float | None = None) -> "Daemon":
        """Start and wait for 'ready' (within the derived bound unless
        `ready_timeout` is given) and for the control socket to answer."""
        if ready_timeout is None:
            ready_timeout, why = self.deadlines.ready_timeout()
        else:
            why = "given by the test"
        self.stopped_before = stopped_pids()
        err = open(self.stderr_path, "wb")
        try:
            # Its own process group: the child that closes the probes after
            # the daemon exits (probes.Probes.close) is found by it.
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL,
                                         stdout=err, stderr=err, close_fds=True,
                                         start_new_session=True, preexec_fn=_default_stops)
        finally:
            err.close()
        t0 = time.monotonic()
        deadline = t0 + ready_timeout
        while True:
            if "ready" in self.log():
                self.ready_after = time.monotonic() - t0
                self.deadlines.saw_ready(self.ready_after)
                break
            rc = self.proc.poll()
            if rc is not None:
                self.returncode = rc
                raise DaemonError(f"`{' '.join(self.argv)}` exited with {rc} before "
                                  f"printing 'ready' ({time.monotonic() - t0:.1f} s after "
                                  f"it started); stderr:\n{self.log()[-4000:]}")
            if time.monotonic() > deadline:
                took = time.monotonic() - t0
                self.stop()
                raise DaemonError(f"daemon start: no 'ready' within {ready_timeout:.4g} s "
                                  f"({why}); gave up after {took:.1f} s; "
                                  f"stderr:\n{self.log()[-4000:]}")
            time.sleep(0.05)
        # 'ready' means probes are attached; the socket must answer too.
        wait_for(lambda: None if self._pings() else "socket does not answer", 10,
                 what="daemon start: control socket", deadlines=self.deadlines)
        return self

    def _pings(self) -> bool:
        try:
            query(self.socket, "ping", timeout=1)
            return True
        except ServerError:
            return False

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM and wait; returns the exit status (SIGKILL after `timeout`
        base seconds, scaled)."""
        if self.proc is None:
            return -1
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.deadlines.timeout(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.returncode = -9
                return self.returncode
        self.returncode = self.proc.returncode
        self.wait_group_gone()
        return self.returncode

    def group_pids(self) -> set[int]:
        """Live processes of the daemon's process group (its background
        children); zombies are gone as far as probes are concerned."""
        if self.proc is None:
            return set()
        out = set()
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == self.proc.pid:
                out.add(int(d))
        return out

    def wait_group_gone(self, timeout: float = 60) -> set[int]:
        """Wait until the daemon's background children have exited: until
        then the probes they hold still fire in every process of the next
        test. Returns those still there after `timeout` base seconds, scaled."""
        deadline = time.monotonic() + self.deadlines.timeout(timeout)
        while True:
            left = self.group_pids()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def wait_exit(self, timeout: float = 60) -> int:
        """Wait for the daemon to exit (after a signal the test sent); `timeout`
        base seconds, scaled. A killed daemon's exit includes the kernel
        detaching every probe, which takes seconds even on an idle host."""
        assert self.proc is not None
        limit = self.deadlines.timeout(timeout)
        t0 = time.monotonic()
        try:
            self.returncode = self.proc.wait(limit)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"daemon exit: pid {self.proc.pid} still there after {limit:.1f} s "
                f"({self.deadlines.explain(timeout)}); waited "
                f"{time.monotonic() - t0:.1f} s") from None
        self.wait_group_gone()
        return self.returncode

    def new_stopped(self) -> set[int]:
        """Processes in state T that were not stopped before the daemon started."""
        return stopped_pids() - self.stopped_before

    def cleanup(self) -> None:
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            remove_pin_dir(self.pin_dir)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.cleanup()

    # -- reading ----------------------------------------------------------
    def log(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")
        except OSError:
            return ""

    def snapshot(self, timeout: float = 5) -> dict:
        return query(self.socket, "snapshot", timeout=self.deadlines.timeout(timeout))

    def events(self) -> list[dict]:
        """Every event the daemon still keeps, oldest first."""
        return query(self.socket, "events", since=0)["events"]

    def cli_json(self, command: str, *args: str) -> dict:
        """`hami-bpf <command> --json --socket SOCK [args]` parsed."""
        r = subprocess.run([hami_bpf_bin(), command, "--json", "--socket", self.socket, *args],
                           capture_output=True, text=True,
                           timeout=self.deadlines.timeout(60))
        if r.returncode != 0:
            raise AssertionError(f"hami-bpf {command} --json exited {r.returncode}: "
                                 f"{r.stderr.strip()}")
        return json.loads(r.stdout)


def finish_daemon(d: Daemon) -> None:
    """Fixture teardown: SIGTERM -> exit 0, and no process left stopped."""
    rc = d.stop()
    lingering = d.group_pids()
    leftover = d.new_stopped()
    log = d.log()
    d.cleanup()
    assert rc == 0, f"daemon exited {rc} on SIGTERM; stderr tail:\n{log[-3000:]}"
    assert not leftover, f"processes left in state T after the daemon exited: " \
                         f"{describe_pids(leftover)}"
    assert not lingering, f"the daemon's children outlived it (holding its probes): " \
                          f"{describe_pids(lingering)}"


# ------------------------------------------------------------ tracked procs

class ScaledCudaProc(CudaProc):
    """A CudaProc whose reply and wait timeouts are base seconds, scaled to
    this machine (Deadlines); what Tracked workloads use."""

    def reply(self, timeout: float = 10) -> dict[str, str]:
        return super().reply(DEADLINES.timeout(timeout))

    def wait(self, timeout: float | None = None) -> int:
        return super().wait(None if timeout is None else DEADLINES.timeout(timeout))


def _devices(devs: Mapping[str, Mapping]) -> dict[int, int]:
    """JSON devices -> {device: used_bytes}, zero entries dropped."""
    return {int(k): int(v["used_bytes"]) for k, v in devs.items() if int(v["used_bytes"])}


class Tracked:
    """A CudaProc plus what it should hold: alloc id -> (device, bytes)."""

    def __init__(self, proc: CudaProc, group: str):
        self.proc = proc
        self.group = group
        self.held: dict[int, tuple[int, int]] = {}
        self.launches = 0
        self.dead = False

    @classmethod
    def spawn(cls, fake: FakeCuda, group: str, *, init: bool = True, device: int | None = 0,
              env: Mapping[str, str] | None = None, stderr=subprocess.DEVNULL) -> "Tracked":
        no_core_dumps()
        t = cls(ScaledCudaProc(fake, env=proc_env(group, env), stderr=stderr), group)
        return t.started(init, device)

    def started(self, init: bool, device: int | None,
                first: Callable[["Tracked"], None] | None = None) -> "Tracked":
        """Finish starting: `first` (checks on the new process), then `init`
        and `device N` as asked; the process is closed if any of it fails."""
        try:
            if first is not None:
                first(self)
            if init:
                self.ok("init")
            if init and device is not None:
                self.ok(f"device {device}")
        except BaseException:
            self.close()
            raise
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cmd(self, line: str, timeout: float = 10) -> dict[str, str]:
        """`line` to the process; its reply within `timeout` base seconds, scaled
        (by ScaledCudaProc; a plain CudaProc waits `timeout`)."""
        return self.proc.cmd(line, timeout)

    def ok(self, line: str, timeout: float = 10) -> dict[str, str]:
        """A command that must return rc=0."""
        r = self.cmd(line, timeout)
        assert r.get("rc", "0") == "0", f"pid {self.pid}: {line!r} -> {r}"
        return r

    def alloc(self, line: str, dev: int, *, expect_rc: int | None = 0) -> tuple[int, int]:
        """Run an allocating command (alloc/allocmanaged/allocasync/allocpool/
        allocpitch/create/vmm) charged to `dev`; returns (rc, id) and records it."""
        r = self.cmd(line)
        rc, aid = int(r["rc"]), int(r.get("id", -1))
        if expect_rc is not None:
            assert rc == expect_rc, f"pid {self.pid}: {line!r} -> {r}, expected rc={expect_rc}"
        if rc == 0:
            self.held[aid] = (dev, alloc_size(line, r))
        return rc, aid

    def free(self, aid: int, *, via_thread: bool = False) -> None:
        r = self.cmd(("thread " if via_thread else "") + f"free {aid}")
        assert r["rc"] == "0", f"pid {self.pid}: free {aid} -> {r}"
        del self.held[aid]

    def expected(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for dev, size in self.held.values():
            out[dev] = out.get(dev, 0) + size
        return out

    def mark_dead(self) -> None:
        self.dead = True
        self.held.clear()

    def close(self) -> None:
        self.proc.close()

    def resume_and_close(self) -> None:
        """Close it, continued first if it is stopped (at a denial no daemon
        answered), so it can exit."""
        try:
            os.kill(self.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        self.close()

    def __enter__(self) -> "Tracked":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Tracked(pid={self.pid}, group={self.group!r}, held={self.expected()})"


_SUFFIX = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(s: str) -> int:
    s = s.upper().removesuffix("B").removesuffix("I")
    if s and s[-1] in "KMGT":
        return int(s[:-1], 0) << _SUFFIX[s[-1]]
    return int(s, 0)


# What the probes charge a CUDA array (bpf_programs/hami.h): the plain
# formats by their channel's bytes, any other at the most an element takes.
ARRAY_CHANNEL_BYTES = {0x01: 1, 0x08: 1, 0x02: 2, 0x09: 2, 0x10: 2, 0x03: 4, 0x0A: 4, 0x20: 4}
ARRAY_ELEM_MAX = 16


def array_charge(w: int, h: int, d: int, fmt: int, channels: int, flags: int = 0,
                 levels: int = 1) -> int:
    """Bytes charged for a w x h x d CUDA array over `levels` mipmap levels."""
    elem = (ARRAY_CHANNEL_BYTES[fmt] * min(max(channels, 1), 4) if fmt in ARRAY_CHANNEL_BYTES
            else ARRAY_ELEM_MAX)
    w, h, d = max(w, 1), max(h, 1), max(d, 1)
    total = 0
    for _ in range(max(levels, 1)):
        total += w * h * d * elem
        w, h = max(w >> 1, 1), max(h >> 1, 1)
        if not flags & 0x05:        # layers and cube faces are not halved
            d = max(d >> 1, 1)
    return total


def alloc_size(line: str, reply: Mapping[str, str]) -> int:
    words = line.split()
    if words[0] == "thread":
        words = words[1:]
    if words[0] == "allocpitch":
        return int(reply["pitch"]) * parse_size(words[2])
    if words[0] in ("array", "array3d", "mipmap"):
        v = [int(x, 0) for x in words[1:]]
        return array_charge(v[0], v[1], 1, v[2], v[3]) if words[0] == "array" else array_charge(*v)
    return parse_size(words[1])


def group_expected(procs: Iterable[Tracked]) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in procs:
        if p.dead:
            continue
        for d, b in p.expected().items():
            out[d] = out.get(d, 0) + b
    return out


# ------------------------------------------------------------------ checks

def slot_problems(snap: Mapping) -> list[str]:
    """Slot-table consistency of a whole snapshot (or a `slots --json` doc
    plus `ps --json` doc merged as {"groups": ..., "processes": ...})."""
    problems = []
    procs = {p["pid"]: p for p in snap.get("processes", [])}
    in_slots: set[int] = set()
    for g in snap.get("groups", []):
        slots = g["slots"]
        idx = [s["index"] for s in slots]
        if sorted(idx) != list(range(g["proc_num"])) or len(slots) != g["proc_num"]:
            problems.append(f"group {g['id']!r}: proc_num={g['proc_num']} but slot indices {idx}")
        if g["proc_num"] == 0:
            problems.append(f"group {g['id']!r} is empty but listed")
        for s in slots:
            in_slots.add(s["pid"])
            p = procs.get(s["pid"])
            if p is None:
                problems.append(f"group {g['id']!r} slot {s['index']}: pid {s['pid']} "
                                "is not in processes")
                continue
            if p["group"] != g["id"] or p["slot"] != s["index"] \
                    or p["start_time"] != s["start_time"]:
                problems.append(f"pid {p['pid']}: process says group {p['group']!r} slot "
                                f"{p['slot']} start {p['start_time']}, table says "
                                f"{g['id']!r} slot {s['index']} start {s['start_time']}")
    for pid in procs:
        if pid not in in_slots:
            problems.append(f"pid {pid} is in processes but in no slot")
    return problems


def accounting_problems(snap: Mapping, procs: Sequence[Tracked], *,
                        launches: bool = False) -> list[str]:
    """Byte-exact: each live proc's devices == what it holds; each group's
    devices == the sum over its live procs (all live procs of the group must be
    in `procs`); dead procs are absent. Slot consistency included."""
    problems = slot_problems(snap)
    by_pid = {p["pid"]: p for p in snap.get("processes", [])}
    groups = {g["id"]: g for g in snap.get("groups", [])}
    group_ids: dict[str, str] = {}
    members: dict[str, list[Tracked]] = {}
    for t in procs:
        rec = by_pid.get(t.pid)
        if t.dead:
            if rec is not None:
                problems.append(f"pid {t.pid} exited but is still listed (slot {rec['slot']})")
            continue
        if rec is None:
            problems.append(f"pid {t.pid} (group {t.group}) is not listed")
            continue
        got = _devices(rec["devices"])
        if got != t.expected():
            problems.append(f"pid {t.pid}: used {got} != expected {t.expected()}")
        if launches and rec.get("launches") != t.launches:
            problems.append(f"pid {t.pid}: launches {rec.get('launches')} != {t.launches}")
        gid = rec["group"]
        if group_ids.setdefault(t.group, gid) != gid:
            problems.append(f"{t.group}: members in groups {group_ids[t.group]!r} and {gid!r}")
        members.setdefault(gid, []).append(t)
    for gid, ts in members.items():
        g = groups.get(gid)
        if g is None:
            problems.append(f"group {gid!r} is not listed")
            continue
        if g["proc_num"] != len(ts):
            problems.append(f"group {gid!r}: proc_num {g['proc_num']} != {len(ts)} live members")
        got = _devices(g["devices"])
        want = group_expected(ts)
        if got != want:
            problems.append(f"group {gid!r}: used {got} != expected {want}")
    return problems


def wait_for(check: Callable[[], object], timeout: float = CONVERGE_TIMEOUT,
             interval: float = 0.02, what: str = "condition",
             deadlines: Deadlines | None = None) -> float:
    """Poll `check` (falsy or empty = satisfied; else a description of what is
    still wrong) until satisfied; returns the seconds it took, raises
    AssertionError with the last description after `timeout` base seconds,
    scaled (see Deadlines)."""
    deadlines = deadlines or DEADLINES
    limit = deadlines.timeout(timeout)
    t0 = time.monotonic()
    last: object = None
    while True:
        try:
            last = check()
        except ServerError as e:
            last = f"socket: {e}"
        if not last:
            return time.monotonic() - t0
        took = time.monotonic() - t0
        if took > limit:
            if isinstance(last, (list, tuple)):
                last = "\n  ".join(map(str, last))
            raise AssertionError(f"{what}: not reached within {limit:.1f} s "
                                 f"({deadlines.explain(timeout)}); gave up after "
                                 f"{took:.1f} s:\n  {last}")
        time.sleep(interval)


def converge(d: Daemon, procs: Sequence[Tracked], timeout: float = CONVERGE_TIMEOUT,
             **kw) -> dict:
    """Wait until the snapshot matches `procs` exactly; returns that snapshot."""
    box: dict = {}

    def check():
        box["snap"] = d.snapshot()
        return accounting_problems(box["snap"], procs, **kw)

    wait_for(check, timeout, what="accounting", deadlines=d.deadlines)
    return box["snap"]


def wait_registered(d: Daemon, procs: Sequence[Tracked], timeout: float = CONVERGE_TIMEOUT):
    pids = {t.pid for t in procs}

    def check():
        listed = {p["pid"] for p in d.snapshot()["processes"]}
        missing = pids - listed
        return f"not registered: {sorted(missing)}" if missing else None

    return wait_for(check, timeout, what="registration", deadlines=d.deadlines)


# ------------------------------------------------------------- exit timing

def kill_and_time_removal(d: Daemon, t: Tracked, how: str, *, timeout: float = 5.0,
                          extra_check: Callable[[dict], list[str]] | None = None
                          ) -> tuple[float, dict]:
    """Make `t` die (`how`: exit | kill | crash), then poll the socket as fast
    as it answers until its pid is gone and the slot table is consistent.

    Returns (seconds from the process's death to the first snapshot showing
    that, snapshot). Death is when its pidfd becomes readable (it is a
    zombie); the time is taken when the confirming reply has been *received*,
    so it is an upper bound."""
    pid = t.pid
    pidfd = os.pidfd_open(pid)
    try:
        if how == "exit":
            t.proc.send("exit 0")
        elif how == "crash":
            t.proc.send("crash")
        elif how == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            raise ValueError(how)
        limit = DEADLINES.timeout(10)
        ready, _, _ = select.select([pidfd], [], [], limit)
        t_dead = time.monotonic()
        assert ready, f"pid {pid} did not die within {limit:.1f} s after {how}"
    finally:
        os.close(pidfd)
    t.mark_dead()
    limit = DEADLINES.timeout(timeout)
    deadline = t_dead + limit
    problems: list[str] = []
    while True:
        try:
            snap = d.snapshot()
        except ServerError as e:
            snap, problems = None, [f"socket: {e}"]
        t_seen = time.monotonic()
        if snap is not None:
            problems = []
            if any(p["pid"] == pid for p in snap["processes"]):
                problems.append(f"pid {pid} still listed")
            problems += slot_problems(snap)
            if extra_check is not None:
                problems += extra_check(snap)
            if not problems:
                t.proc.wait(5)
                return t_seen - t_dead, snap
        if t_seen > deadline:
            t.proc.wait(5)
            raise AssertionError(f"pid {pid} ({how}) not removed within {limit:.1f} s "
                                 f"({DEADLINES.explain(timeout)}): "
                                 + "; ".join(problems))
        # no sleep: poll as fast as the socket answers


def machine_loaded() -> bool:
    return os.getloadavg()[0] > (os.cpu_count() or 1)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-q * len(s) // 100)) - 1))
    return s[k]


class Sampled:
    """A stand-in command running in the background; the states of its
    process (and of `watch`) are sampled every 5 ms meanwhile."""

    def __init__(self, p: CudaProc, command: str, watch: tuple[int, ...] = ()):
        self.p, self.reply, self.samples = p, None, []
        self.watch = (p.pid,) + tuple(watch)
        p.send(command)
        self.t = threading.Thread(target=self._wait)
        self.t.start()

    def _wait(self):
        try:
            self.reply = self.p.reply(timeout=120)
        except FakeCudaError as e:   # the test killed it
            self.reply = {"error": str(e)}

    def sample_until_done(self):
        while self.t.is_alive():
            self.samples.append(tuple(proc_state(pid) for pid in self.watch))
            time.sleep(0.005)
        self.t.join()
        return self.samples


def Launching(p: CudaProc, n: int, watch: tuple[int, ...] = ()) -> Sampled:
    """`launch N` in the background, sampling the process states meanwhile."""
    return Sampled(p, f"launch {n}", watch)


def launch_probes(d: Daemon) -> int:
    """Launch probes the daemon has attached (0: none, the launch path is untouched)."""
    return int(d.snapshot()["counters"].get("launch_probes", 0))
