"""Memory limits from a policy file, enforced on real (fakecuda) processes.

Policy (TOML, root-owned, 0600):  [[group]] match = "lim*"  memory = LIMIT
with --group-by env:HAMI_GROUP, so a process whose HAMI_GROUP is "limA-..."
is in a limited group. Every test uses its own group (each group gets its own
LIMIT), so the tests do not share budget.
"""
from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest

from helpers import (Daemon, Tracked, converge, finish_daemon, gname, wait_for, wait_registered,
                     write_policy)

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 64 * MiB
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        f'[[group]]\nmatch = "lim*"\nmemory = {LIMIT}\n')


@pytest.fixture(scope="module")
def daemon(fakecuda, policy_file):
    d = Daemon(fakecuda, policy=policy_file).start()
    yield d
    finish_daemon(d)


def _rec(snap, pid):
    return next((p for p in snap["processes"] if p["pid"] == pid), None)


def _group(snap, pid):
    rec = _rec(snap, pid)
    return next(g for g in snap["groups"] if g["id"] == rec["group"])


def test_limit_shows_in_ps(daemon, fakecuda):
    with Tracked.spawn(fakecuda, gname("limA")) as t, Tracked.spawn(fakecuda, "free-" + uuid.uuid4().hex[:6]) as u:
        t.alloc("alloc 1M", 0)
        u.alloc("alloc 1M", 0)
        snap = converge(daemon, [t, u])
        assert _rec(snap, t.pid)["devices"]["0"]["limit_bytes"] == LIMIT
        assert _group(snap, t.pid)["devices"]["0"]["limit_bytes"] == LIMIT
        assert _rec(snap, u.pid)["devices"]["0"]["limit_bytes"] is None


def test_allocations_up_to_limit_then_oom_and_recover(daemon, fakecuda):
    with Tracked.spawn(fakecuda, gname("limA")) as t:
        wait_registered(daemon, [t])   # the start-up window has its own test below
        ids = [t.alloc("alloc 16M", 0)[1] for _ in range(3)]
        t.alloc("allocasync 8M", 0)
        t.alloc(f"alloc {8 * MiB}", 0)          # exactly LIMIT now
        assert sum(t.expected().values()) == LIMIT
        converge(daemon, [t])

        # one byte over, through several entry points: refused, process alive
        for line in ("alloc 1", "allocmanaged 4096", "allocasync 1M", "allocpitch 512 1 4",
                     "create 2M 0"):
            rc, _ = t.alloc(line, 0, expect_rc=None)
            assert rc == OOM, f"{line!r} over the limit returned rc={rc}"
        assert t.proc.returncode is None
        assert int(t.cmd("pid")["pid"]) == t.pid
        converge(daemon, [t])                    # the denied calls charged nothing

        # device 1 has its own budget under `memory = N`
        t.ok("device 1")
        t.alloc("alloc 1M", 1)
        t.ok("device 0")

        # after a free the process can allocate again, up to the limit
        t.free(ids[0])
        t.alloc("alloc 16M", 0)
        rc, _ = t.alloc("alloc 1", 0, expect_rc=None)
        assert rc == OOM
        converge(daemon, [t])


def test_denied_calls_are_counted(daemon, fakecuda):
    with Tracked.spawn(fakecuda, gname("limA")) as t:
        wait_registered(daemon, [t])
        t.alloc(f"alloc {LIMIT}", 0)
        for _ in range(3):
            assert t.alloc("alloc 4096", 0, expect_rc=None)[0] == OOM
        converge(daemon, [t])
        wait_for(lambda: None if _rec(daemon.snapshot(), t.pid)["denied"] == 3
                 else f"denied={_rec(daemon.snapshot(), t.pid)['denied']}", what="denied == 3")


def test_limit_applies_from_the_first_allocation(daemon, fakecuda):
    """A real workload allocates right after cuInit: no window where the
    group's limit does not hold yet."""
    for _ in range(3):
        with Tracked.spawn(fakecuda, gname("limA")) as t:   # no wait for registration
            t.alloc(f"alloc {LIMIT}", 0)
            rc, _ = t.alloc("alloc 4096", 0, expect_rc=None)
            snap = converge(daemon, [t])
            assert rc == OOM, "over-limit allocation right after start was let through"
            assert int(_rec(snap, t.pid)["devices"]["0"]["used_bytes"]) <= LIMIT


def test_racing_processes_never_exceed_limit(daemon, fakecuda):
    g = gname("limR")
    size = 4 * MiB
    fits = LIMIT // size
    with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b:
        procs = [a, b]
        converge(daemon, procs)
        # Rounds enough that a probe whose locals another task can overwrite
        # (tests/unit/test_abi_constants.py, private stacks) shows here.
        for rnd in range(10):
            # lockstep: both requests are in flight together
            for _ in range(fits):
                for t in procs:
                    t.proc.send(f"alloc {size}")
                for t in procs:
                    r = t.proc.reply()
                    rc = int(r["rc"])
                    assert rc in (0, OOM), r
                    if rc == 0:
                        t.held[int(r["id"])] = (0, size)
            total = sum(sum(t.expected().values()) for t in procs)
            assert total <= LIMIT, f"round {rnd}: {total} bytes granted > limit {LIMIT}"
            snap = converge(daemon, procs)
            assert int(_group(snap, a.pid)["devices"]["0"]["used_bytes"]) <= LIMIT
            assert total == LIMIT, f"round {rnd}: only {total} of {LIMIT} granted"
            for t in procs:
                for aid in list(t.held):
                    t.free(aid)
            converge(daemon, procs)


def test_a_refusal_cut_short_is_still_charged(daemon, fakecuda):
    """A helper that resumes a process the moment it is stopped at a refused
    allocation (stop-rewrite) lets the call run before the controller can
    answer it. The allocation then exists: it must be charged to the
    process and its group, and counted. (Where the refusal happens in the
    kernel, return-oom, there is no stop to cut short and nothing gets by.)"""
    with Tracked.spawn(fakecuda, gname("limC")) as t:
        converge(daemon, [t])
        t.alloc(f"alloc {LIMIT}", 0)
        mech = daemon.snapshot()["mechanisms"]["oom"]
        done = threading.Event()

        def resume_forever():
            while not done.is_set():
                try:
                    os.kill(t.pid, signal.SIGCONT)
                except ProcessLookupError:
                    return

        helper = threading.Thread(target=resume_forever, daemon=True)
        helper.start()
        try:
            escaped = 0
            for _ in range(20):
                rc, aid = t.alloc(f"alloc {MiB}", 0, expect_rc=None)
                assert rc in (0, OOM)
                escaped += rc == 0
        finally:
            done.set()
            helper.join()
        snap = converge(daemon, [t])       # every granted byte is charged
        assert int(_group(snap, t.pid)["devices"]["0"]["used_bytes"]) == LIMIT + escaped * MiB
        assert int(snap["counters"].get("denials_ignored", 0)) >= escaped
        if mech == "stop-rewrite":
            assert escaped > 0, "the helper never got a refused call through: the test proves nothing"
            kinds = [e for e in daemon.events() if e["kind"] == "deny_ignored"
                     and e["data"].get("pid") == t.pid]
            assert len(kinds) == escaped and all(e["data"]["size"] == MiB for e in kinds)
        else:
            assert escaped == 0


def test_cuda_arrays_are_charged_limited_and_given_back(daemon, fakecuda):
    """Textures and surfaces take device memory through CUDA arrays, outside
    cuMemAlloc: each is charged its elements (mipmap levels summed, layers
    and cube faces not halved), refused over the limit, and given back when
    destroyed."""
    with Tracked.spawn(fakecuda, gname("limA")) as t:
        wait_registered(daemon, [t])
        ids = [t.alloc(line, 0)[1] for line in (
            "array 1024 1024 0x20 4",           # 16 MiB of float4
            "array3d 64 64 64 0x10 2 0",        # 1 MiB of half2
            "mipmap 256 256 0 0x01 1 0 9",      # 9 levels of uchar
            "mipmap 64 64 6 0x20 4 4 7",        # a cube map: 6 faces, 7 levels
            "array 16 16 0xc2 4")]              # a normalized format: 16 B an element
        assert sum(t.expected().values()) == (16 * MiB + MiB + 87381 + 6 * 5461 * 16
                                              + 16 * 16 * 16)
        converge(daemon, [t])

        # over the limit, through each entry point: refused, process alive
        for line in ("array 4096 4096 0x20 4", "array3d 256 256 256 0x20 4 0",
                     "mipmap 4096 4096 0 0x20 4 0 13"):
            rc, _ = t.alloc(line, 0, expect_rc=None)
            assert rc == OOM, f"{line!r} over the limit returned rc={rc}"
        assert int(t.cmd("pid")["pid"]) == t.pid
        t.alloc(f"alloc {LIMIT - sum(t.expected().values())}", 0)    # exactly LIMIT now
        assert t.alloc("array 1 1 0x01 1", 0, expect_rc=None)[0] == OOM
        converge(daemon, [t])

        for aid in ids:
            t.free(aid)
        t.alloc("array 1024 1024 0x20 4", 0)    # 16 MiB fits again
        converge(daemon, [t])


def test_meminfo_reports_the_limit(daemon, fakecuda):
    with Tracked.spawn(fakecuda, gname("limA")) as t:
        converge(daemon, [t])
        rc, free, total = t.proc.meminfo()
        assert (rc, total, free) == (0, LIMIT, LIMIT)
        t.alloc("alloc 10M", 0)
        t.alloc("allocpitch 1000 3 4", 0)
        used = sum(t.expected().values())
        converge(daemon, [t])
        rc, free, total = t.proc.meminfo()
        assert (rc, total, free) == (0, LIMIT, LIMIT - used)
        r = t.cmd("totalmem 0")
        assert (int(r["rc"]), int(r["total"])) == (0, LIMIT)


@pytest.mark.parametrize("cmd", ["nvmlmem", "nvmlmem2"])
def test_nvml_memory_query_reports_the_limit(daemon, fakecuda, cmd):
    """What nvidia-smi inside the workload asks (nvmlDeviceGetMemoryInfo and
    _v2, through a dlopen'ed libnvidia-ml): the group's limit as total."""
    with Tracked.spawn(fakecuda, gname("limA")) as t, Tracked.spawn(fakecuda, "free-" + uuid.uuid4().hex[:6]) as u:
        t.alloc("alloc 10M", 0)
        converge(daemon, [t, u])
        r = t.cmd(f"{cmd} 0")
        used = sum(t.expected().values())
        assert int(r["rc"]) == 0
        assert (int(r["total"]), int(r["used"]), int(r["free"])) == (LIMIT, used, LIMIT - used)
        # Unlimited group: the device's own figures, untouched.
        r = u.cmd(f"{cmd} 0")
        assert int(r["total"]) == 16 << 30 and int(r["used"]) == 0
