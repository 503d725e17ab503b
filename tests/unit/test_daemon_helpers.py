"""The /proc helpers of hami_bpf/classify.py, and a Daemon that was never
started (no bcc needed: bcc is imported only inside Daemon.start)."""
from __future__ import annotations

import os
import subprocess
import sys

from hami_bpf.classify import group_of, ns_pid, proc_cgroup, proc_comm, proc_environ


def test_proc_cgroup_of_self_is_a_path():
    cg = proc_cgroup(os.getpid())
    assert isinstance(cg, str) and cg.startswith("/")


def test_proc_cgroup_of_missing_pid_is_none():
    assert proc_cgroup(2**22 + 1) is None   # above pid_max's ceiling


def test_group_of_env():
    assert group_of(1, "env:X", {"X": "a"}) == "a"


def test_group_of_env_unset_or_empty():
    assert group_of(1, "env:X", {}) == "X(unset)"
    assert group_of(1, "env:X", {"X": ""}) == "X(unset)"
    assert group_of(1, "env:X", {"Y": "a"}) == "X(unset)"


def test_group_of_env_reads_proc_when_env_not_given():
    p = subprocess.Popen([sys.executable, "-c", "print('up', flush=True); import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         env={**os.environ, "HAMI_T_GRP": "from-proc"})
    try:
        assert p.stdout.readline() == b"up\n"   # exec'd: /proc/PID/environ is the new one
        assert group_of(p.pid, "env:HAMI_T_GRP", None) == "from-proc"
        assert proc_environ(p.pid)["HAMI_T_GRP"] == "from-proc"
    finally:
        p.stdin.close()
        p.stdout.close()
        p.wait(10)


def test_group_of_pid():
    assert group_of(4242, "pid", None) == "4242"
    assert group_of(os.getpid(), "pid", {"X": "a"}) == str(os.getpid())


def test_group_of_cgroup():
    assert group_of(os.getpid(), "cgroup", None) == proc_cgroup(os.getpid())
    assert group_of(2**22 + 1, "cgroup", None) == "(exited)"


def test_proc_comm_and_ns_pid_of_self():
    assert proc_comm(os.getpid())
    assert ns_pid(os.getpid()) is not None
    assert proc_comm(2**22 + 1) == ""
    assert ns_pid(2**22 + 1) is None


def test_a_controller_killed_while_holding_a_group_leaves_a_record_of_each_stop(tmp_path,
                                                                                monkeypatch):
    # A launch past the budget stopped one process (in BPF); the controller
    # stops its peers. Killed between a peer's SIGSTOP and writing it down,
    # it would leave that peer stopped with no record for the next run to
    # resume: each stop is recorded first.
    import signal

    from hami_bpf import abi, enforce
    from hami_bpf.config import DaemonConfig
    from hami_bpf.daemon import Daemon
    from hami_bpf.events import ProcessRegistered, ProcKey

    peers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        d = Daemon(DaemonConfig(state_dir=str(tmp_path)))
        d.stopped = enforce.StoppedSet(str(tmp_path))
        for p in peers:
            d.registry.table.apply(ProcessRegistered(ProcKey(p.pid, enforce.proc_start_time(p.pid)), "g"))
        d.sm.sm_caps["g"] = {0: 30}
        signals = []

        def dying_kill(pid, sig):
            if sig == signal.SIGSTOP:
                assert pid in enforce.StoppedSet._load(d.stopped.path), "stopped before recorded"
                signals.append(pid)
                raise KeyboardInterrupt   # the controller dies right after this stop

        monkeypatch.setattr(os, "kill", dying_kill)
        e = abi.Event()
        e.tgid = peers[0].pid
        try:
            d.sm.on_hold(e)
        except KeyboardInterrupt:
            pass
        assert signals == [peers[1].pid]
        assert set(enforce.StoppedSet._load(d.stopped.path)) == {p.pid for p in peers}
    finally:
        monkeypatch.undo()
        for p in peers:
            p.kill()
            p.wait()


def test_a_failing_sm_tick_releases_every_hold_and_the_loop_goes_on(tmp_path):
    # SM pacing errs open: whatever goes wrong in a tick, every group it
    # holds runs again, the error is counted and logged as an event, and the
    # daemon's loop (memory enforcement) carries on.
    from hami_bpf import enforce
    from hami_bpf.config import DaemonConfig
    from hami_bpf.daemon import Daemon
    from hami_bpf.events import ProcessRegistered, ProcKey

    p = subprocess.Popen(["sleep", "60"])
    try:
        d = Daemon(DaemonConfig(state_dir=str(tmp_path)))
        d.stopped = enforce.StoppedSet(str(tmp_path))
        d.registry.table.apply(ProcessRegistered(ProcKey(p.pid, enforce.proc_start_time(p.pid)), "g"))
        d.sm.sm_caps["g"] = {0: 30}
        os.kill(p.pid, 19)
        d.stopped.add_many([(p.pid, enforce.proc_start_time(p.pid))], "SM cap of group g")
        d.sm.throttled["g"] = {p.pid}
        d.sm.throttle_since["g"] = 0.0
        d.sm.fail_open(KeyError("sync_at"))
        assert "g" not in d.sm.throttled
        assert enforce.proc_state(p.pid) not in ("T", "t")
        assert d.counters["sm_errors"] == 1
        ev = [e for e in d.log if e.kind == "error"]
        assert ev and ev[-1].data["error"] == "KeyError"
    finally:
        p.kill()
        p.wait()
