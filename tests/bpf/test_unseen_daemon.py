"""Device memory no probed call sizes (a module's static globals), counted
against the group's limit from the driver's per-process count: NVML's list
on a bare-metal host, the stand-in driver's table here (FAKECUDA_PROC_MEM,
read by the daemon through --sim-proc-mem)."""
from __future__ import annotations

import os
import uuid

import pytest

from helpers import Daemon, Tracked, converge, finish_daemon, gname, wait_for, wait_registered, write_policy

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 64 * MiB
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture(scope="module")
def proc_mem():
    path = f"/dev/shm/hami-test-procmem-{uuid.uuid4().hex[:8]}"
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


@pytest.fixture(scope="module")
def daemon(fakecuda, tmp_path_factory, proc_mem):
    policy = write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                          f'[[group]]\nmatch = "lim*"\nmemory = {LIMIT}\n')
    d = Daemon(fakecuda, policy=policy, extra=["--sim-proc-mem", proc_mem]).start()
    yield d
    finish_daemon(d)


def _unseen(d: Daemon, pid: int) -> list[int]:
    return [e["data"]["unseen"] for e in d.events()
            if (e["kind"], e["what"]) == ("limit", "unseen") and e["data"]["pid"] == pid]


def test_module_globals_count_against_the_limit_until_unloaded(daemon, fakecuda, proc_mem):
    with Tracked.spawn(fakecuda, gname("limU"), env={"FAKECUDA_PROC_MEM": proc_mem}) as t:
        wait_registered(daemon, [t])
        t.alloc("alloc 8M", 0)
        r = t.ok("module 40M")          # 40 MiB of __device__ globals: no allocation call
        wait_for(lambda: None if _unseen(daemon, t.pid)[-1:] == [40 * MiB]
                 else f"unseen events {_unseen(daemon, t.pid)}", timeout=10,
                 what="the module's globals counted", deadlines=daemon.deadlines)
        # 8 charged + 40 unseen of 64 MiB: 24 more is refused, 8 fits
        assert t.alloc("alloc 24M", 0, expect_rc=None)[0] == OOM
        t.alloc("alloc 8M", 0)
        snap = converge(daemon, [t])    # what was charged is unchanged: only the limit moved
        assert int(snap["counters"]["memory_unseen_changes"]) >= 1
        assert t.proc.returncode is None

        t.ok(f"free {r['id']}")         # unloaded: the globals are gone
        wait_for(lambda: None if _unseen(daemon, t.pid)[-1:] == [0]
                 else f"unseen events {_unseen(daemon, t.pid)}", timeout=10,
                 what="the module's globals given back", deadlines=daemon.deadlines)
        t.alloc("alloc 24M", 0)
        converge(daemon, [t])


def test_a_group_without_a_limit_is_only_told(daemon, fakecuda, proc_mem):
    with Tracked.spawn(fakecuda, "free-" + uuid.uuid4().hex[:6],
                       env={"FAKECUDA_PROC_MEM": proc_mem}) as t:
        wait_registered(daemon, [t])
        t.ok("module 32M")
        wait_for(lambda: None if _unseen(daemon, t.pid)[-1:] == [32 * MiB]
                 else f"unseen events {_unseen(daemon, t.pid)}", timeout=10,
                 what="the module's globals counted", deadlines=daemon.deadlines)
        t.alloc("alloc 1G", 0)
        converge(daemon, [t])
