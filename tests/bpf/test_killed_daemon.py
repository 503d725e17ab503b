"""A daemon killed while processes wait at denied allocations: with no
daemon running they stay stopped, and the next daemon answers them.

In a module of its own: no other daemon may run meanwhile (one would find
the processes' library by its scan and answer them itself).
"""
from __future__ import annotations

import signal
import time

import pytest

from helpers import Daemon, Tracked, finish_daemon, gname, proc_state, wait_for, wait_registered, \
    write_policy
from hami_bpf.fakecuda import build

pytestmark = pytest.mark.bpf

OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture
def policy_file(tmp_path):
    return write_policy(tmp_path / "policy.toml", '[[group]]\nmatch = "lim*"\nmemory = "1Gi"\n')


def test_processes_a_killed_daemon_stopped_wait_for_the_next_one(policy_file, tmp_path):
    """Two processes are stopped at a denied allocation and the daemon dies
    (SIGKILL) before answering: they stay stopped while no daemon runs (the
    documented choice: a denial is never turned into a success), and the
    next daemon answers both with CUDA_ERROR_OUT_OF_MEMORY."""
    fakecuda = build(tmp_path / "lib")
    workdir = tmp_path / "w"
    workdir.mkdir()
    d = Daemon(fakecuda, policy=policy_file, workdir=workdir).start()
    procs = []
    try:
        for _ in range(2):
            procs.append(Tracked.spawn(fakecuda, gname("lim")))
        wait_registered(d, procs)
        for t in procs:
            t.alloc("alloc 1G", 0)
        # The daemon cannot answer from now on, but its heartbeat is fresh
        # for up to 2 s: the probes still stop a denied call.
        d.proc.send_signal(signal.SIGSTOP)
        for t in procs:
            t.proc.send("alloc 1M")
        wait_for(lambda: [t.pid for t in procs if proc_state(t.pid) != "T"], 5,
                 what="both stopped at the denied call")
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(120)                   # the kernel detaches its probes first
        time.sleep(1)                      # no daemon: still stopped
        assert [proc_state(t.pid) for t in procs] == ["T", "T"]
        d2 = Daemon(fakecuda, policy=policy_file, workdir=workdir).start()
        try:
            for t in procs:
                assert int(t.proc.reply(timeout=20)["rc"]) == OOM
                t.ok("pid")                # and it goes on
        finally:
            finish_daemon(d2)
    finally:
        for t in procs:
            t.resume_and_close()
        d.stop()
