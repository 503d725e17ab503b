"""SIGHUP re-reads --policy: limits of running groups follow the new file
(raised as well as lowered), SM caps come and go with their launch probes,
and a file that fails a check changes nothing."""
from __future__ import annotations

import signal

from hami_bpf.fakecuda import build

from helpers import (Daemon, Launching, Tracked, converge, finish_daemon, gname, launch_probes,
                     wait_for, write_policy)

MiB = 1 << 20
OOM = 2


def limit_of(d: Daemon, pid: int) -> int | None:
    doc = d.cli_json("ps", "--pid", str(pid))
    return next(p for p in doc["processes"] if p["pid"] == pid)["devices"]["0"]["limit_bytes"]


def reload(d: Daemon, policy, text: str) -> None:
    write_policy(policy, text)
    d.proc.send_signal(signal.SIGHUP)


def test_sighup_reloads_the_policy(tmp_path):
    fake = build(tmp_path / "lib")      # its own library: no other test's daemon sees it
    g = gname("reload")
    policy = write_policy(tmp_path / "policy.toml", f'[[group]]\nmatch = "{g}"\nmemory = "64Mi"\n')
    d = Daemon(fake, policy=policy).start()
    try:
        # Launches busy-wait 3 us: a launch loop looks GPU-bound (test_smlimit.py).
        with Tracked.spawn(fake, g, env={"FAKECUDA_LAUNCH_NS": "3000"}) as t:
            t.alloc("alloc 1M", 0)
            converge(d, [t])
            assert limit_of(d, t.pid) == 64 * MiB
            assert launch_probes(d) == 0
            assert t.alloc("alloc 100M", 0, expect_rc=None)[0] == OOM

            # Raised, and an SM cap added: the running group follows.
            reload(d, policy, f'[[group]]\nmatch = "{g}"\nmemory = "128Mi"\nsm = 30\n')
            wait_for(lambda: None if limit_of(d, t.pid) == 128 * MiB else limit_of(d, t.pid),
                     what="the raised memory limit after SIGHUP")
            t.alloc("alloc 100M", 0)
            wait_for(lambda: None if launch_probes(d) > 0 else "no launch probe",
                     what="launch probes for the new SM cap")
            # ... and holds the running process to it (learning waits 3 s).
            run = Launching(t.proc, 1600000)
            assert any(s[0] == "T" for s in run.sample_until_done()), "never held to the new cap"
            assert run.reply["rc"] == "0", run.reply

            # A file that fails a check (world-writable) changes nothing.
            write_policy(policy, f'[[group]]\nmatch = "{g}"\nmemory = "1Mi"\n')
            policy.chmod(0o666)
            d.proc.send_signal(signal.SIGHUP)
            wait_for(lambda: None if "reloading policy" in d.log() else "no error logged",
                     what="the refused reload on the daemon's stderr")
            assert "previous policy stays" in d.log()
            assert limit_of(d, t.pid) == 128 * MiB

            # Both gone: no limit, no SM cap, no launch probe.
            reload(d, policy, '[[group]]\nmatch = "someone-else"\nmemory = "1Gi"\n')
            wait_for(lambda: None if limit_of(d, t.pid) is None else limit_of(d, t.pid),
                     what="no memory limit after SIGHUP")
            wait_for(lambda: None if launch_probes(d) == 0 else "launch probes still attached",
                     what="launch probes detached with the last SM cap")
            t.alloc("alloc 200M", 0)
            run = Launching(t.proc, 200000)
            assert all(s[0] != "T" for s in run.sample_until_done()), "held without a cap"
            assert d.proc.poll() is None, "daemon died"
    finally:
        finish_daemon(d)
