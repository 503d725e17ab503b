"""SM limiting with real launch probes on real (stand-in libcuda) processes.

The stand-in's launches busy-wait FAKECUDA_LAUNCH_NS, so a launch loop looks
like a GPU-bound workload. Caps come from HAMi's CUDA_DEVICE_SM_LIMIT.
These tests assert behaviour (stopped, resumed, never stopped, probes attached
or not); throughput ratios are measured by bench/, not here.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from hami_bpf.fakecuda import CudaProc, build
from hami_bpf.enforce import proc_state
from helpers import (DEADLINES, Daemon, Launching, Tracked, finish_daemon, gname, launch_probes,
                     stopped_pids, wait_for)

pytestmark = pytest.mark.bpf

LAUNCH_NS = "3000"


def spawn(fake, group: str, sm: int | None = None, **extra) -> CudaProc:
    env = {"FAKECUDA_LAUNCH_NS": LAUNCH_NS, **extra}
    if sm is not None:
        env["CUDA_DEVICE_SM_LIMIT"] = str(sm)
    return Tracked.spawn(fake, group, env=env).proc


@pytest.fixture(scope="module")
def daemon(fakecuda):
    d = Daemon(fakecuda).start()      # SM caps are enforced by default
    yield d
    finish_daemon(d)


def test_no_cap_means_no_launch_probe(daemon, fakecuda):
    assert launch_probes(daemon) == 0
    p = spawn(fakecuda, gname("free"))
    try:
        run = Launching(p, 20000)
        samples = run.sample_until_done()
        assert run.reply["rc"] == "0"
        assert all(s[0] != "T" for s in samples), "an uncapped process was stopped"
        assert launch_probes(daemon) == 0
        assert next(x for x in daemon.snapshot()["processes"] if x["pid"] == p.pid)["launches"] is None
    finally:
        p.close()


def test_capped_group_is_stopped_and_resumed_uncapped_never(daemon, fakecuda):
    g = gname("cap")
    capped = spawn(fakecuda, g, sm=30)
    idle_peer = spawn(fakecuda, g, sm=30)      # same group, not launching
    free = spawn(fakecuda, gname("free"))
    try:
        wait_for(lambda: None if launch_probes(daemon) > 0 else "no launch probe yet", 5,
                 what="launch probes attached for the first SM cap")
        # No synchronize here: the controller waits up to 3 s for one before it
        # learns from the launch rate, so launch for longer than that.
        run_free = Launching(free, 1600000)
        run = Launching(capped, 1600000, watch=(idle_peer.pid,))
        samples = run.sample_until_done()
        run_free.sample_until_done()
        assert run.reply["rc"] == "0" and run_free.reply["rc"] == "0"
        assert any(s[0] == "T" for s in samples), "the capped process was never stopped"
        # Held together: while the launcher was held, its idle peer was too.
        assert any(s == ("T", "T") for s in samples), "the group's idle peer was never held"
        assert all(s != "T" for s in (x[0] for x in run_free.samples)), "uncapped process stopped"
        # Resumed: nothing of ours is left stopped once the work is done.
        wait_for(lambda: None if proc_state(idle_peer.pid) != "T" else "peer still stopped", 2,
                 what="peer resumed")
        snap = daemon.snapshot()
        grp = next(x for x in snap["groups"] if x["id"] == g)
        assert grp["sm_limit"] == 30
        assert snap["counters"].get("throttle_episodes", 0) > 0
    finally:
        for p in (capped, idle_peer, free):
            p.close()
    # The last capped group is gone: its probes go with it.
    wait_for(lambda: None if launch_probes(daemon) == 0 else "launch probes still attached", 5,
             what="launch probes detached")


def test_utilization_policy_disable_never_throttles(daemon, fakecuda):
    p = spawn(fakecuda, gname("dis"), sm=20, GPU_CORE_UTILIZATION_POLICY="disable")
    try:
        run = Launching(p, 60000)
        samples = run.sample_until_done()
        assert all(s[0] != "T" for s in samples)
        assert launch_probes(daemon) == 0
    finally:
        p.close()


def test_sigkill_daemon_while_throttled_then_restart_leaves_none_stopped(tmp_path):
    # Its own copy of the library: the module's daemon must not see these processes.
    fakecuda = build(tmp_path / "lib")
    d = Daemon(fakecuda, extra=["--sm-limits"]).start()
    g = gname("kill")
    procs = [spawn(fakecuda, g, sm=10) for _ in range(2)]
    try:
        wait_for(lambda: None if launch_probes(d) > 0 else "no launch probe", 5, what="probes")
        runs = [Launching(p, 3000000) for p in procs]
        wait_for(lambda: None if any(proc_state(p.pid) == "T" for p in procs) else "not throttled yet",
                 10, what="a throttle stop")
        d.proc.send_signal(signal.SIGKILL)
        d.wait_exit()
        # The new daemon ignores the env caps, so any stop left 2 s after its
        # start is one the dead daemon left behind, not a new throttle.
        d2 = Daemon(fakecuda, workdir=d.workdir, extra=["--no-env-limits"]).start()
        try:
            limit = DEADLINES.timeout(2.0)
            deadline = time.monotonic() + limit
            while time.monotonic() < deadline and {p.pid for p in procs} & stopped_pids():
                time.sleep(0.05)
            left = {p.pid for p in procs} & stopped_pids()
            assert not left,  f"left stopped {limit:.1f} s ({DEADLINES.explain(2.0)}) after " \
                              f"restart: {left}\n{d2.log()[-1500:]}"
            for r in runs:   # and they finish their work
                r.t.join(60)
                assert r.reply and r.reply.get("rc") == "0", r.reply
        finally:
            for p in procs:
                p.kill()
            for r in runs:
                r.t.join(30)
            finish_daemon(d2)
    finally:
        for p in procs:
            p.close()


def test_a_burst_of_signals_still_shuts_down_and_resumes_every_hold(tmp_path):
    # SIGTERM from a supervisor and a ^C from a user, or `timeout` forwarding
    # the ^C it got too: a second signal arriving while the first one's
    # handler ran once deadlocked the daemon before its shutdown, leaving
    # whatever it held stopped.
    fakecuda = build(tmp_path / "lib")
    d = Daemon(fakecuda, extra=["--sm-limits"]).start()
    p = spawn(fakecuda, gname("burst"), sm=10)
    try:
        run = Launching(p, 3000000)
        wait_for(lambda: None if proc_state(p.pid) == "T" else "not throttled yet", 10,
                 what="a throttle stop")
        # Signals as fast as they can be sent for a while: some arrive while
        # a handler runs.
        end, i = time.monotonic() + 2.0, 0
        while time.monotonic() < end and d.proc.poll() is None:
            try:
                os.kill(d.proc.pid, signal.SIGINT if i % 2 else signal.SIGTERM)
            except ProcessLookupError:
                break
            i += 1
        try:
            rc = d.proc.wait(DEADLINES.timeout(20))
        except Exception:
            d.proc.kill()
            raise AssertionError(f"daemon still running {DEADLINES.timeout(20):.1f} s after the "
                                 f"signals\n{d.log()[-1500:]}")
        assert rc == 0, d.log()[-1500:]
        assert "stopped" in d.log().splitlines()[-1], d.log()[-1500:]
        assert p.pid not in stopped_pids(), "the daemon left its hold in place"
        run.t.join(60)
        assert run.reply and run.reply.get("rc") == "0", run.reply
    finally:
        p.close()
        d.cleanup()


def test_caps_are_not_enforced_with_no_sm_limits(tmp_path):
    """With --no-sm-limits a capped group runs untouched, no launch probe is
    attached, and the daemon says why."""
    fakecuda = build(tmp_path / "lib")   # the module's --sm-limits daemon must not see it
    d = Daemon(fakecuda, extra=["--no-sm-limits"]).start()
    try:
        p = spawn(fakecuda, gname("capoff"), sm=20)
        try:
            run = Launching(p, 200000)
            samples = run.sample_until_done()
            assert all(s[0] != "T" for s in samples)
            assert launch_probes(d) == 0
            assert "not enforced" in d.log()
        finally:
            p.close()
    finally:
        finish_daemon(d)
