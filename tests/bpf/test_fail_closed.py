"""Memory limits stay exact against hostile workloads and a failing host:
odd environments, exec, a full state directory, signals to the daemon.
Real uprobes on fakecuda processes; a policy limits groups "lim*" to 1 GiB.
"""
from __future__ import annotations

import errno
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from helpers import Daemon, Tracked, converge, finish_daemon, gname, wait_registered, \
    write_policy
from hami_bpf.fakecuda import build

pytestmark = pytest.mark.bpf

MiB = 1 << 20
GiB = 1 << 30
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
HUGE = "9" * 5000   # past Python's 4300-digit int() limit


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        '[[group]]\nmatch = "lim*"\nmemory = "1Gi"\n')


@pytest.fixture(scope="module")
def daemon(fakecuda, policy_file):
    d = Daemon(fakecuda, policy=policy_file).start()
    yield d
    finish_daemon(d)


def _rec(snap, pid):
    return next((p for p in snap["processes"] if p["pid"] == pid), None)


@pytest.mark.parametrize("var", ["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0",
                                 "CUDA_DEVICE_SM_LIMIT"])
def test_a_5000_digit_value_gets_the_policy_limit(daemon, fakecuda, var):
    errors = int(daemon.snapshot()["counters"].get("handler_errors", 0))
    with Tracked.spawn(fakecuda, gname("lim"), env={var: HUGE}) as t:
        wait_registered(daemon, [t])
        t.alloc("alloc 768M", 0)
        assert t.alloc("alloc 512M", 0, expect_rc=None)[0] == OOM
        snap = converge(daemon, [t])
        assert _rec(snap, t.pid)["devices"]["0"]["limit_bytes"] == GiB
    assert int(daemon.snapshot()["counters"].get("handler_errors", 0)) == errors


@pytest.mark.parametrize("how", ["exec", "thread exec"])
def test_exec_gives_back_what_the_old_image_held(daemon, fakecuda, how):
    g = gname("lim")
    with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b:
        wait_registered(daemon, [a, b])
        a.alloc("alloc 512M", 0)
        converge(daemon, [a, b])
        for _ in range(3):
            a.ok(how)
            a.held.clear()       # the old image's memory died with it
            # The new image is a fresh process to CUDA: init, then allocate.
            a.ok("init")
            a.ok("device 0")
            a.alloc("alloc 512M", 0)
            converge(daemon, [a, b])
        # 512 MiB held in the group now, not 4 x 512: the peer fits 512 more.
        b.alloc("alloc 512M", 0)
        assert b.alloc("alloc 1", 0, expect_rc=None)[0] == OOM
        snap = converge(daemon, [a, b])
        assert _rec(snap, a.pid)["group"] == _rec(snap, b.pid)["group"]


def test_a_full_state_directory_still_denies(fakecuda, policy_file, tmp_path):
    """Every write of the stopped-process record fails with ENOSPC (a full
    tmpfs as the state directory): registration and denials go on, the
    limit holds, and the failure is recorded once."""
    fakecuda = build(tmp_path / "lib")    # its own library: the module's daemon holds the shared one
    workdir = Path(tempfile.mkdtemp(prefix="hami-f-"))
    state = workdir / "state"
    state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(state)],
                   check=True)
    try:
        d = Daemon(fakecuda, policy=policy_file, workdir=workdir).start()
        try:
            try:                                          # fill it up
                with open(state / "filler", "wb") as f:
                    while True:
                        f.write(b"x" * 4096)
                        f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC
            with pytest.raises(OSError):
                (state / "probe").write_bytes(b"x" * 4096)
            with Tracked.spawn(fakecuda, gname("lim")) as t:
                wait_registered(d, [t])
                t.alloc("alloc 1G", 0)
                for _ in range(3):
                    assert t.alloc("alloc 1M", 0, expect_rc=None)[0] == OOM
                converge(d, [t])
            failed = [e for e in d.events() if e["data"].get("state_write_failed")]
            assert len(failed) == 1, failed
            assert failed[0]["data"]["errno"] == errno.ENOSPC
            assert d.snapshot()["counters"].get("handler_errors", 0) == 0
        finally:
            finish_daemon(d)
    finally:
        subprocess.run(["umount", str(state)], check=False)
        import shutil
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------ locks

def _own_lib(fakecuda, tmp_path):
    """A copy of the stand-in libcuda: a file (dev, inode) no other daemon
    on this machine probes, so its lock names are this test's own."""
    import dataclasses
    import shutil
    d = tmp_path / "libcopy"
    d.mkdir()
    shutil.copy2(fakecuda.libcuda, d / "libcuda.so.1")
    return dataclasses.replace(fakecuda, lib_dir=d, libcuda=d / "libcuda.so.1")


def test_lock_names_in_the_old_world_writable_place_do_not_matter(fakecuda, tmp_path):
    import fcntl
    fake = _own_lib(fakecuda, tmp_path)
    st = os.stat(fake.libcuda)
    old = Path(f"/run/lock/hami-bpf-{st.st_dev}-{st.st_ino}.lock")
    fd = os.open(old, os.O_RDWR | os.O_CREAT, 0o666)   # taken first, and held
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        d = Daemon(fake).start()
        finish_daemon(d)
    finally:
        os.close(fd)
        old.unlink()


def test_a_link_in_place_of_a_lock_is_refused(fakecuda, tmp_path):
    from hami_bpf.libwatch import LOCK_DIR
    fake = _own_lib(fakecuda, tmp_path)
    st = os.stat(fake.libcuda)
    os.makedirs(LOCK_DIR, 0o700, exist_ok=True)
    lock = Path(LOCK_DIR) / f"{st.st_dev}-{st.st_ino}.lock"
    # A lock file of an earlier library with the same inode number (tmpfs
    # reuses them) is nobody's now: the link takes its place.
    if lock.is_symlink() or lock.exists():
        lock.unlink()
    target = tmp_path / "elsewhere"
    lock.symlink_to(target)
    try:
        d = Daemon(fake)
        with pytest.raises(Exception):
            d.start(ready_timeout=30)
        assert d.returncode == 2, d.log()[-2000:]
        assert str(lock) in d.log()
        assert not target.exists()
        d.cleanup()
    finally:
        lock.unlink()


# ---------------------------------------------------------------- signals

@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGQUIT"])
def test_any_fatal_signal_shuts_down_cleanly(tmp_path, sig):
    """The daemon holds a capped group (SM cap 10%: its launch loop is
    stopped most of the time) when a fatal signal other than SIGTERM comes:
    it resumes the process, logs "stopped" and exits 128 + the signal."""
    import signal
    import time

    from helpers import Launching, proc_state
    fake = build(tmp_path / "lib")      # its own library: no other test's daemon sees it
    g = gname("cap")
    policy = write_policy(tmp_path / "policy.toml", f'[[group]]\nmatch = "{g}"\nsm = 10\n')
    d = Daemon(fake, policy=policy).start()
    try:
        with Tracked.spawn(fake, g, env={"FAKECUDA_LAUNCH_NS": "3000"}) as t:
            # still launching when its first hold comes (learning alone takes
            # 1.5 s; a million launches of the stand-in take about as long)
            run = Launching(t.proc, 3_000_000)
            deadline = time.monotonic() + 30
            while proc_state(t.pid) != "T" and time.monotonic() < deadline:
                time.sleep(0.002)
            assert proc_state(t.pid) == "T", "never held"
            signum = getattr(signal, sig)
            d.proc.send_signal(signum)
            rc = d.proc.wait(30)
            run.sample_until_done()
            assert run.reply.get("rc") == "0", run.reply
            assert proc_state(t.pid) not in ("T", "t")
            assert rc == 128 + signum, d.log()[-2000:]
            assert any(line.startswith("hami-bpf: stopped") for line in d.log().splitlines())
            assert not d.new_stopped() & {t.pid}
    finally:
        d.stop()
        d.cleanup()
