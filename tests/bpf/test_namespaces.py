"""Workloads in their own PID and mount namespaces, like containers on a node.

A "container" here is ``unshare --pid --fork --mount --propagation private``
running the stand-in workload (``cudaprog``).  Two flavours:

* **host driver**: the container sees the node's libcuda (the stand-in the
  daemon is started with, ``--libcuda``) -- what the NVIDIA container
  toolkit does by bind-mounting the host's driver.
* **own driver**: inside the mount namespace a private copy of the stand-in
  library directory is bind-mounted over the original one.  The workload
  loads ``libcuda.so.1`` from the very same path, but it is another file
  (another inode) -- like an image that ships CUDA forward-compatibility
  libraries.  The daemon is *not* told about that file.

The daemon finds the own-driver file in ``/proc/PID/maps`` (the fallback scan),
attaches to it through ``/proc/PID/root`` with a descriptor it holds, and
detaches after its last user exits.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hami_bpf import containers, enforce, libcuda
from hami_bpf.fakecuda import CudaProc, FakeCuda

from helpers import (Daemon, Tracked, converge, finish_daemon, gname, no_core_dumps, proc_env,
                     wait_for, wait_registered)

pytestmark = pytest.mark.bpf

MiB = 1 << 20
OOM = 2


# ------------------------------------------------------------------ containers

def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


class Contained(Tracked):
    """A Tracked cudaprog running as pid 1 of its own PID + mount namespace.

    ``pid`` is the workload's pid on the host (not unshare's)."""

    host_pid: int

    @classmethod
    def start(cls, fake: FakeCuda, group: str, *, own_lib: Path | None = None,
              env: dict[str, str] | None = None, init: bool = True,
              device: int | None = 0) -> "Contained":
        no_core_dumps()
        if own_lib is not None:
            script = 'mount --bind "$0" "$1" && exec "$2"'
            sh_args = [str(own_lib), str(fake.lib_dir), str(fake.cudaprog)]
        else:
            script = 'exec "$0"'
            sh_args = [str(fake.cudaprog)]
        launcher = FakeCuda(fake.lib_dir, fake.libcuda, Path(shutil.which("unshare")))
        proc = CudaProc(launcher, env=proc_env(group, env), stderr=subprocess.DEVNULL,
                        args=["--pid", "--fork", "--kill-child", "--mount",
                              "--propagation", "private", "--", "sh", "-c", script, *sh_args])

        def find_host_pid(t: "Contained") -> None:
            # `pid` makes cudaprog answer: by then it has exec'd (and the bind
            # mount, if any, is in place); its pid inside the namespace is 1.
            r = t.proc.cmd("pid", timeout=20)
            assert r["pid"] == "1", r
            kids = _children(proc.pid)
            assert len(kids) == 1, f"unshare {proc.pid} children: {kids}"
            t.host_pid = kids[0]

        return cls(proc, group).started(init, device, first=find_host_pid)

    @property
    def pid(self) -> int:  # type: ignore[override]
        return self.host_pid

    def close(self) -> None:
        hp = getattr(self, "host_pid", None)
        if hp is not None:
            try:
                os.kill(hp, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.close()
        if hp is not None:
            wait_gone(hp)


def wait_gone(pid: int, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return
        except OSError:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"pid {pid} still exists after {timeout}s")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def own_lib(fakecuda, tmp_path_factory) -> Path:
    """A private copy of the stand-in's library directory: same bytes, other inode."""
    d = tmp_path_factory.mktemp("ctr") / "lib"
    shutil.copytree(fakecuda.lib_dir, d, symlinks=True)
    assert os.stat(d / "libcuda.so.1").st_ino != os.stat(fakecuda.libcuda).st_ino
    return d


def perf_fds(pid: int) -> int:
    """perf_event file descriptors a process holds (bcc: one per uprobe)."""
    n = 0
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[perf_event]":
                    n += 1
            except OSError:
                pass
    except OSError:
        pass
    return n


def entry_byte(pid: int, lib_path: str, symbol: str = "cuMemAlloc_v2") -> int:
    """The first byte of ``symbol`` in ``pid``'s memory (0xcc while a uprobe is on it)."""
    off = libcuda.symbol_file_offsets(lib_path, [symbol])[symbol]
    addr = enforce.entry_address(pid, lib_path, off)
    assert addr is not None, f"{symbol} of {lib_path} not mapped in {pid}"
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(addr)
        return f.read(1)[0]


# ------------------------------------------------- the module alone (must pass)

def test_ns_pids_of_unshared_process(fakecuda):
    with Contained.start(fakecuda, gname("ns"), init=False) as c:
        assert containers.ns_pids(c.pid) == (c.pid, 1)
        assert c.pid != c.proc.pid            # not unshare itself
        v = containers.describe(c.pid)
        assert (v.host_pid, v.ns_pid, v.in_container) == (c.pid, 1, True)
        assert v.cgroup == containers.proc_cgroup_path(os.getpid())


def test_mapped_libcuda_sees_the_containers_own_file(fakecuda, own_lib):
    host_st = os.stat(fakecuda.libcuda)
    with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c, \
            Contained.start(fakecuda, gname("ns")) as h:
        [lib] = containers.mapped_libcuda(c.pid)
        # the same name as the host's library ...
        assert lib.path == str(fakecuda.libcuda)
        # ... but another file: the copy, reached through /proc/PID/root
        own_st = os.stat(own_lib / "libcuda.so.1")
        assert lib.key == (own_st.st_dev, own_st.st_ino)
        assert lib.key != (host_st.st_dev, host_st.st_ino)
        assert lib.host_path == f"/proc/{c.pid}/root{fakecuda.libcuda}"
        st = os.stat(lib.host_path)
        assert (st.st_dev, st.st_ino) == lib.key
        assert not containers.same_file(str(fakecuda.libcuda), lib)
        # a container using the host's driver maps the host's file
        [hl] = containers.mapped_libcuda(h.pid)
        assert hl.key == (host_st.st_dev, host_st.st_ino)
        assert containers.same_file(str(fakecuda.libcuda), hl)
        # the scan finds both, each with its own file
        found = containers.scan_libcuda()
        assert found[c.pid][0].key == lib.key and found[h.pid][0].key == hl.key
        # the tracker: two files, each attached once and detached with its last user
        t = containers.LibTracker()
        assert t.add(c.pid, lib) and t.add(h.pid, hl)
    assert c.pid not in containers.scan_libcuda()


def test_uprobe_through_a_held_fd_outlives_the_container(fakecuda, own_lib):
    """The integration recipe, with bcc directly: open the container's library
    through /proc/PID/root, attach through /proc/<our pid>/fd/N; after the
    container is gone that path still resolves, so bcc can detach (bcc's
    detach re-reads the ELF at the path it attached with)."""
    from bcc import BPF

    b = BPF(text=r"""
BPF_ARRAY(hits, u64, 1);
int on_alloc(struct pt_regs *ctx) {
    int k = 0;
    u64 *v = hits.lookup(&k);
    if (v) __sync_fetch_and_add(v, 1);
    return 0;
}
""")
    fd = None
    try:
        with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c, \
                Contained.start(fakecuda, gname("ns")) as h:
            [lib] = containers.mapped_libcuda(c.pid)
            fd = os.open(lib.host_path, os.O_RDONLY | os.O_CLOEXEC)
            held = f"/proc/{os.getpid()}/fd/{fd}"
            b.attach_uprobe(name=held.encode(), sym=b"cuMemAlloc_v2", fn_name=b"on_alloc")
            hits = b["hits"]
            assert entry_byte(c.pid, lib.host_path) == 0xCC      # probed in the container
            assert entry_byte(h.pid, str(fakecuda.libcuda)) == 0x55   # host file untouched
            c.alloc("alloc 1M", 0)
            h.alloc("alloc 1M", 0)
            assert hits[0].value == 1
            host_path = lib.host_path
        # the container is gone: its /proc/PID/root path no longer resolves ...
        assert not os.path.exists(host_path)
        with pytest.raises(Exception):
            b.detach_uprobe(name=host_path.encode(), sym=b"cuMemAlloc_v2")
        # ... the held fd does
        b.detach_uprobe(name=held.encode(), sym=b"cuMemAlloc_v2")
    finally:
        if fd is not None:
            os.close(fd)
        b.cleanup()


# ---------------------------------------------------------------- the daemon

GRACE_S = 2.0


@pytest.fixture(scope="module")
def daemon(fakecuda):
    # A library whose last user left stays attached this long (reuse by a
    # restarting container), then is detached in the background.
    d = Daemon(fakecuda, extra=["--lib-grace-s", str(GRACE_S)]).start()   # --libcuda: the host's file
    yield d
    finish_daemon(d)


def _rec(snap, pid):
    return next((p for p in snap["processes"] if p["pid"] == pid), None)


def test_host_driver_in_pid_namespace_is_resolved(daemon, fakecuda):
    """Works today: the container maps the host's library, the probes fire,
    ps shows the host pid and the pid inside the namespace."""
    with Contained.start(fakecuda, gname("ns")) as c:
        c.alloc("alloc 3M", 0)
        snap = converge(daemon, [c])
        rec = _rec(snap, c.pid)
        assert rec["ns_pid"] == 1
        ps = daemon.cli_json("ps")
        row = next(p for p in ps["processes"] if p["pid"] == c.pid)
        assert row["ns_pid"] == 1


def test_host_driver_limit_from_container_env(daemon, fakecuda):
    """Works today: HAMi's variable in the container's environment limits it."""
    with Contained.start(fakecuda, gname("ns"), env={"CUDA_DEVICE_MEMORY_LIMIT": "32m"}) as c:
        c.alloc("alloc 32M", 0)
        rc, _ = c.alloc("alloc 1", 0, expect_rc=None)
        assert rc == OOM
        assert c.proc.returncode is None
        converge(daemon, [c])


def test_own_driver_attached_at_first_mapping(daemon, fakecuda, own_lib):
    with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c:
        wait_for(lambda: None if entry_byte(c.pid, f"/proc/{c.pid}/root{fakecuda.libcuda}")
                 == 0xCC else "cuMemAlloc_v2 of the container's libcuda is not probed",
                 5, what="attach to the container's libcuda")
        c.alloc("alloc 2M", 0)
        snap = converge(daemon, [c])
        assert _rec(snap, c.pid)["ns_pid"] == 1


def test_own_driver_accounting_is_exact(daemon, fakecuda, own_lib):
    g = gname("ns")
    with Contained.start(fakecuda, g, own_lib=own_lib) as a, \
            Contained.start(fakecuda, g, own_lib=own_lib) as b, \
            Contained.start(fakecuda, g) as h:
        # the first allocation may come before the attach: wait for it first
        wait_registered(daemon, [a, b, h], timeout=5)
        ids = [a.alloc("alloc 4M", 0)[1]]
        a.ok("device 1")   # allocations charge the current context's device
        ids.append(a.alloc("allocasync 1M", 1)[1])
        b.alloc("create 2M 0", 0)
        h.alloc("alloc 8M", 0)
        converge(daemon, [a, b, h])
        a.free(ids[0])
        converge(daemon, [a, b, h])
        ps = daemon.cli_json("ps")
        rows = {p["pid"]: p for p in ps["processes"]}
        assert rows[a.pid]["ns_pid"] == 1 and rows[b.pid]["ns_pid"] == 1


def test_own_driver_limit_applies(daemon, fakecuda, own_lib):
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "16m"}
    with Contained.start(fakecuda, gname("ns"), own_lib=own_lib, env=env, init=False) as c:
        # cuInit of a not-yet-attached library: wait for the attach, then start
        wait_for(lambda: None if containers.mapped_libcuda(c.pid) else "not mapped", 5)
        time.sleep(1.5)
        c.ok("init")
        c.ok("device 0")
        c.alloc("alloc 16M", 0)
        rc, _ = c.alloc("alloc 1M", 0, expect_rc=None)
        assert rc == OOM
        assert c.proc.returncode is None
        converge(daemon, [c])


def test_own_driver_limit_applies_from_the_first_call(daemon, fakecuda, own_lib):
    """A process that uses only a private copy of the driver library, and
    allocates at once: the open gate holds it at the open of the copy until
    the copy is probed, so its first over-limit call is refused."""
    if daemon.snapshot()["mechanisms"].get("private_libs") != "held at open until probed":
        pytest.fail(f"the open gate is not in use here: {daemon.snapshot()['mechanisms']}")
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "16m"}
    for _ in range(2):
        with Contained.start(fakecuda, gname("ns"), own_lib=own_lib, env=env) as c:
            c.alloc("alloc 16M", 0)
            rc, _ = c.alloc("alloc 1M", 0, expect_rc=None)
            assert rc == OOM, "the first over-limit call through a private copy was let through"
            converge(daemon, [c])
    counters = daemon.snapshot()["counters"]
    assert counters.get("lib_opens_probed", 0) >= 1 and counters.get("lib_opens", 0) >= 2


def _settled_perf_fds(pid: int, timeout: float = 20.0) -> int:
    """Detaching runs in the background (~0.2 s per probe on 6.18): wait until
    an earlier test's detach is over before taking a baseline."""
    end = time.monotonic() + timeout
    last = perf_fds(pid)
    while time.monotonic() < end:
        time.sleep(1.0)
        now = perf_fds(pid)
        if now == last:
            return now
        last = now
    return last


def test_own_driver_detached_after_last_user(daemon, fakecuda, own_lib):
    pid = daemon.proc.pid
    with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c1:
        c1.alloc("alloc 1M", 0)
        attached = perf_fds(pid)
        with Contained.start(fakecuda, gname("ns"), own_lib=own_lib) as c2:
            c2.alloc("alloc 1M", 0)
            time.sleep(0.3)
            assert perf_fds(pid) == attached   # same file: attached once
        time.sleep(1.5)
        assert perf_fds(pid) == attached       # c1 still uses it
        c1.alloc("alloc 1M", 0)
    # Last user gone: detached after the grace time, in the background.
    wait_for(lambda: None if perf_fds(pid) < attached else "container's probes still attached",
             GRACE_S + 25, what="detach")
    detached = _settled_perf_fds(pid)
    assert attached - detached >= 10, (attached, detached)   # a whole library's probes went


@pytest.mark.parametrize("unlink", [False, True])
def test_a_copy_loaded_later_and_unlinked_is_limited(daemon, fakecuda, tmp_path, unlink):
    """A process already registered through the host's library loads a copy
    of the driver from another path (and, with `unlink`, removes the file at
    once) and allocates through that copy alone: the open gate held it at the
    copy's mapping until the copy was probed, so the group's limit counts what
    it allocates there."""
    if daemon.snapshot()["mechanisms"].get("private_libs") != "held at open until probed":
        pytest.fail(f"the open gate is not in use here: {daemon.snapshot()['mechanisms']}")
    copy = tmp_path / "libcuda-copy.so.1"
    shutil.copy2(fakecuda.libcuda, copy)
    env = {"CUDA_DEVICE_MEMORY_LIMIT": "16m"}
    before = _settled_perf_fds(daemon.proc.pid)
    with Tracked.spawn(fakecuda, gname("ns"), env=env) as t:
        t.alloc("alloc 8M", 0)
        converge(daemon, [t])
        r = t.cmd(f"copyalloc {copy} 12M {int(unlink)}")
        assert int(r["rc"]) == OOM, "an allocation through a private copy went past the limit"
        assert copy.exists() != unlink
        r = t.cmd(f"copyalloc {copy} 4M 0" if not unlink else "sleep 0")
        if not unlink:     # within the limit, and charged: the copy's bytes are counted
            assert int(r["rc"]) == 0, r
            t.held[-1] = (0, 4 * MiB)
        converge(daemon, [t])
        assert enforce.proc_state(t.pid) not in ("T", "t")
    # The copy's last user is gone: it is detached after the grace time (and
    # the tests after this one count the daemon's probes from here).
    wait_for(lambda: None if perf_fds(daemon.proc.pid) <= before else "the copy is still probed",
             GRACE_S + 25, what="the copy's detach")


def test_zz_daemon_consistent_after_namespaced_workloads(daemon):
    """Last in the module on purpose: the daemon fixture's teardown (exit 0 on
    SIGTERM, nothing left stopped) runs after this test, not after an xfail
    one whose marker would swallow a teardown failure."""
    from helpers import slot_problems
    wait_for(lambda: slot_problems(daemon.snapshot()), 5, what="consistent slot table")
    assert daemon.proc.poll() is None
