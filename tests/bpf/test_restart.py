"""Accounting across daemon restarts: the kept (pinned) maps are adopted.

Each test starts a daemon, lets real processes allocate through the stand-in
libcuda, restarts the daemon on the same state and pin directories (SIGTERM
as a rollout does, or SIGKILL), and checks that the new daemon shows the same
bytes, still enforces the limit against them, frees what was allocated before
the restart, and leaves no process stopped.
"""
from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from hami_bpf.heartbeat import DENY_BACKOFF_MAX_S
from helpers import (DEADLINES, Daemon, Tracked, converge, finish_daemon, gname, remove_pin_dir,
                     slot_problems, stopped_pids, wait_for, write_policy)

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 64 * MiB
OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        f'[[group]]\nmatch = "keep*"\nmemory = {LIMIT}\n')


@pytest.fixture
def workdir():
    d = Path(tempfile.mkdtemp(prefix="hami-r-"))
    yield d
    import shutil
    from helpers import pin_dir_for
    remove_pin_dir(pin_dir_for(d))
    shutil.rmtree(d, ignore_errors=True)


def _events(d: Daemon, kind: str) -> list[dict]:
    """`hami-bpf events --json` records of one kind (one JSON object per line)."""
    import json
    import subprocess
    from helpers import hami_bpf_bin
    r = subprocess.run([hami_bpf_bin(), "events", "--json", "--socket", d.socket],
                       capture_output=True, text=True, timeout=DEADLINES.timeout(60))
    assert r.returncode == 0, r.stderr
    recs = [json.loads(line) for line in r.stdout.splitlines() if line.strip()]
    return [e for e in recs if e["kind"] == kind]


def _group_used(snap: dict, pid: int) -> int:
    rec = next(p for p in snap["processes"] if p["pid"] == pid)
    g = next(g for g in snap["groups"] if g["id"] == rec["group"])
    return int(g["devices"]["0"]["used_bytes"])


def _stop(d: Daemon, how: str) -> None:
    if how == "sigterm":
        assert d.stop() == 0, d.log()[-2000:]
    else:
        d.proc.send_signal(signal.SIGKILL)
        d.wait_exit()


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_usage_and_limits_survive_a_restart(fakecuda, policy, workdir, how):
    g = gname("keep")
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    d2 = None
    try:
        with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b:
            _, big = a.alloc(f"alloc {40 * MiB}", 0)
            a.alloc("alloc 1M", 0)
            b.alloc(f"alloc {8 * MiB}", 0)
            b.alloc("create 2M 0", 0)           # a cuMemCreate handle: the other name space
            snap = converge(d, [a, b])
            before = {p["pid"]: p["devices"] for p in snap["processes"]}

            _stop(d, how)
            d2 = Daemon(fakecuda, policy=policy, workdir=workdir).start()

            # byte-exact: the same per process and per group, without a new call
            snap = converge(d2, [a, b])
            assert {p["pid"]: p["devices"] for p in snap["processes"]
                    if p["pid"] in before} == before
            assert _group_used(snap, a.pid) == 51 * MiB
            adopt = _events(d2, "adopt")
            assert adopt and adopt[-1]["data"]["adopted"] >= 2
            assert adopt[-1]["data"]["adopted_bytes"] >= 51 * MiB

            # the limit still counts what was allocated before the restart
            assert a.alloc(f"alloc {20 * MiB}", 0, expect_rc=None)[0] == OOM
            a.alloc(f"alloc {13 * MiB}", 0)     # exactly the limit
            assert b.alloc("alloc 1", 0, expect_rc=None)[0] == OOM
            converge(d2, [a, b])

            # an allocation made before the restart frees correctly after it
            a.free(big)
            snap = converge(d2, [a, b])
            assert _group_used(snap, a.pid) == 24 * MiB
            a.alloc(f"alloc {40 * MiB}", 0)
            converge(d2, [a, b])
            assert not stopped_pids() & {a.pid, b.pid}
    finally:
        if d2 is not None:
            finish_daemon(d2)
        if d.proc and d.proc.poll() is None:
            d.stop()


def test_a_process_that_exits_while_no_daemon_runs_gives_its_bytes_back(fakecuda, policy,
                                                                         workdir):
    g = gname("keep")
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    d2 = None
    try:
        with Tracked.spawn(fakecuda, g) as a:
            gone = Tracked.spawn(fakecuda, g)
            gone.alloc(f"alloc {48 * MiB}", 0)
            a.alloc(f"alloc {8 * MiB}", 0)
            converge(d, [a, gone])
            assert d.stop() == 0
            gone.close()                        # exits unseen: no daemon runs
            d2 = Daemon(fakecuda, policy=policy, workdir=workdir).start()
            snap = converge(d2, [a])
            assert _group_used(snap, a.pid) == 8 * MiB
            adopt = _events(d2, "adopt")
            assert adopt[-1]["data"]["exited"] >= 1
            assert adopt[-1]["data"]["released_bytes"] >= 48 * MiB
            a.alloc(f"alloc {56 * MiB}", 0)     # its 48 MiB are free again
            assert a.alloc("alloc 1", 0, expect_rc=None)[0] == OOM
            converge(d2, [a])
    finally:
        if d2 is not None:
            finish_daemon(d2)


def test_two_restarts_with_churn_lose_nothing(fakecuda, policy, workdir):
    """Processes come and go between and across two restarts: every live
    process's usage is exact after each, and the group's is their sum."""
    g = gname("keep")
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    procs: list[Tracked] = []
    try:
        for rnd in range(3):
            for _ in range(4):
                t = Tracked.spawn(fakecuda, g)
                t.alloc("alloc 1M", 0)
                procs.append(t)
            for t in procs[:2]:
                t.close()
            procs = procs[2:]
            converge(d, procs)
            if rnd < 2:
                assert d.stop() == 0
                d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
                snap = converge(d, procs)
                assert _group_used(snap, procs[0].pid) == len(procs) * MiB
    finally:
        for t in procs:
            t.close()
        finish_daemon(d)


def test_another_layout_is_refused_and_fresh_discards_it(fakecuda, policy, workdir):
    d = Daemon(fakecuda, policy=policy, workdir=workdir)
    os.makedirs(f"{d.pin_dir}/abi0-000000000000", mode=0o700)
    try:
        from helpers import DaemonError
        with pytest.raises(DaemonError) as err:
            d.start()
        assert "--fresh" in str(err.value) and "abi0-000000000000" in str(err.value)
        d2 = Daemon(fakecuda, policy=policy, workdir=workdir, extra=["--fresh"]).start()
        try:
            assert not os.path.exists(f"{d2.pin_dir}/abi0-000000000000")
            assert "kept in" in d2.snapshot()["mechanisms"]["state"]
        finally:
            finish_daemon(d2)
    finally:
        if d.proc and d.proc.poll() is None:
            d.stop()


def test_no_process_is_left_stopped_after_restarts(fakecuda, policy, workdir):
    """Over-limit calls in flight while the daemon restarts: 2 s after the new
    daemon is ready none of the processes is stopped."""
    g = gname("keep")
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    d2 = None
    try:
        with Tracked.spawn(fakecuda, g) as a:
            a.alloc(f"alloc {LIMIT}", 0)
            for _ in range(200):
                a.proc.send("alloc 1")
            time.sleep(0.2)
            d.proc.send_signal(signal.SIGKILL)
            d.wait_exit()
            d2 = Daemon(fakecuda, policy=policy, workdir=workdir).start()
            # stopped at each denial until answered (paced: at most
            # DENY_BACKOFF_MAX_S), so it answers within 2 s plus that
            rcs = [int(a.proc.reply(timeout=2.0 + DENY_BACKOFF_MAX_S)["rc"])]
            rcs += [int(a.proc.reply(timeout=20)["rc"]) for _ in range(199)]
            # calls made while no daemon ran went through unprobed; none after
            assert set(rcs) <= {0, OOM}
            a.mark_dead()
    finally:
        if d2 is not None:
            finish_daemon(d2)


def test_paced_denials_are_answered_at_shutdown(fakecuda, policy, workdir):
    """A daemon stopped while a retry storm waits for its answers answers the
    waiting ones and leaves nothing stopped: every call returns (those after
    the daemon is gone run unprobed)."""
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    a = Tracked.spawn(fakecuda, gname("keep"))
    try:
        a.alloc(f"alloc {LIMIT}", 0)
        converge(d, [a])
        for _ in range(30):
            a.proc.send("alloc 1M")
        wait_for(lambda: None if d.snapshot()["counters"].get("denials_paced", 0)
                 else "no denial paced yet", 30, what="a paced denial", deadlines=d.deadlines)
        finish_daemon(d)       # asserts exit 0 and no process left stopped
        rcs = [int(a.proc.reply(timeout=30)["rc"]) for _ in range(30)]
        assert set(rcs) <= {0, OOM} and OOM in rcs
    finally:
        if d.proc and d.proc.poll() is None:
            d.stop()
        a.mark_dead()
        a.close()


def _previous_checkout(into: Path) -> str:
    """A second checkout of this tree whose version says it is an older
    release: the files a daemon runs from (hami_bpf, cli, bpf_programs,
    bench/hami.py), copied, and a `hami-bpf` that runs them."""
    import shutil
    import sys
    root = Path(__file__).resolve().parents[2]
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("hami_bpf", "cli", "bpf_programs"):
        shutil.copytree(root / part, into / part, ignore=skip)
    (into / "bench").mkdir()
    shutil.copy2(root / "bench" / "hami.py", into / "bench" / "hami.py")
    init = into / "hami_bpf" / "__init__.py"
    text = init.read_text()
    assert '__version__ = "' in text
    init.write_text(text.replace('__version__ = "', '__version__ = "0.0.0+previous-', 1))
    wrapper = into / "hami-bpf"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {into}/bench/hami.py "$@"\n')
    wrapper.chmod(0o700)
    return str(wrapper)


def test_a_new_version_takes_over_from_another_checkout(fakecuda, policy, workdir):
    """Live upgrade: the daemon of one checkout (an older release) runs while
    processes allocate and one of them launches under an SM cap; it is stopped
    as a rollout stops it and this checkout's daemon takes over its kept maps.
    Byte-exact per process and group, the limit counts the old bytes, an old
    allocation frees, and nothing is left stopped."""
    from hami_bpf import __version__
    from helpers import Launching
    old_tree = workdir / "previous"
    old_tree.mkdir()
    old = Daemon(fakecuda, policy=policy, workdir=workdir,
                 command=_previous_checkout(old_tree)).start()
    assert old.snapshot()["mechanisms"]["daemon"].startswith("hami-bpf 0.0.0+previous-")
    new = None
    g, capped = gname("keep"), gname("keep")
    try:
        with Tracked.spawn(fakecuda, g) as a, Tracked.spawn(fakecuda, g) as b, \
                Tracked.spawn(fakecuda, capped, env={"CUDA_DEVICE_SM_LIMIT": "30"}) as c:
            _, big = a.alloc(f"alloc {24 * MiB}", 0)
            b.alloc(f"alloc {16 * MiB}", 0)
            c.alloc(f"alloc {4 * MiB}", 0)
            snap = converge(old, [a, b, c])
            before = {p["pid"]: p["devices"] for p in snap["processes"]}
            run = Launching(c.proc, 1_000_000_000)   # until killed
            wait_for(lambda: None if old.snapshot()["counters"].get("throttle_episodes", 0)
                     else "the capped process was not held yet", 30,
                     what="an SM hold before the upgrade", deadlines=old.deadlines)

            assert old.stop() == 0, old.log()[-2000:]
            new = Daemon(fakecuda, policy=policy, workdir=workdir).start()
            assert new.snapshot()["mechanisms"]["daemon"] == f"hami-bpf {__version__}"
            adopt = _events(new, "adopt")[-1]["data"]
            assert adopt["previous_version"].startswith("0.0.0+previous-")
            assert adopt["version"] == __version__
            assert adopt["adopted"] >= 3

            snap = converge(new, [a, b, c])
            assert {p["pid"]: p["devices"] for p in snap["processes"]
                    if p["pid"] in before} == before
            assert _group_used(snap, a.pid) == 40 * MiB
            assert a.alloc(f"alloc {25 * MiB}", 0, expect_rc=None)[0] == OOM
            b.alloc(f"alloc {24 * MiB}", 0)      # exactly the limit
            a.free(big)
            a.alloc(f"alloc {24 * MiB}", 0)
            converge(new, [a, b, c])
            # the cap holds under the new daemon too, and its holds end; the
            # loop may have finished unprobed while no daemon ran: launch again
            if not run.t.is_alive():
                run = Launching(c.proc, 1_000_000_000)
            wait_for(lambda: None if new.snapshot()["counters"].get("throttle_episodes", 0) >= 2
                     else "the capped process was not held again", 30,
                     what="SM holds after the upgrade", deadlines=new.deadlines)
            c.proc.kill()
            run.t.join(30)
            c.mark_dead()
            time.sleep(2.0)
            assert not stopped_pids() & {a.pid, b.pid}, "left stopped after the upgrade"
    finally:
        if new is not None:
            finish_daemon(new)
        if old.proc and old.proc.poll() is None:
            old.stop()


def test_three_hundred_processes_churn_across_two_restarts(fakecuda, policy, workdir):
    """300 processes start, allocate and exit, some while the daemon runs and
    some while it is restarting (twice): every live process's usage is exact
    after each restart, the group's is their sum, and the processes that exited
    while no daemon ran gave their bytes back."""
    g = gname("keep")
    d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
    live: list[Tracked] = []
    started = 0
    try:
        for restart in range(3):
            for _ in range(100):
                t = Tracked.spawn(fakecuda, g)
                t.alloc(f"alloc {64 * 1024}", 0)
                live.append(t)
                started += 1
                if len(live) > 20:          # the oldest leave while others start
                    live.pop(0).close()
            converge(d, live)
            if restart == 2:
                break
            assert d.stop() == 0, d.log()[-2000:]
            for t in live[:5]:              # exit unseen: no daemon runs
                t.close()
            live = live[5:]
            d = Daemon(fakecuda, policy=policy, workdir=workdir).start()
            snap = converge(d, live)
            assert _group_used(snap, live[0].pid) == len(live) * 64 * 1024
            assert not slot_problems(snap), slot_problems(snap)
        assert started == 300
        snap = converge(d, live)
        assert _group_used(snap, live[0].pid) == len(live) * 64 * 1024
        assert not stopped_pids() & {t.pid for t in live}
    finally:
        for t in live:
            t.close()
        finish_daemon(d)
