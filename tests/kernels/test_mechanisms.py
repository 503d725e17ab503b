"""Each enforcement mechanism, forced and checked on whatever kernel runs this.

`make test-kernels` runs this file in Debian kernels booted under qemu and on
the host (tests/kernels/run_matrix.py); `make test` runs it on the host too.

What the kernel allows comes from `hami-bpf doctor --json` ("features",
"mechanisms"), i.e. the same start-up probe the daemon uses. A mechanism the
kernel lacks is SKIPPED with the kernel's own refusal as the reason, never
passed vacuously. Every test records the mechanism it exercised
(`record_property("mechanism", ...)`, in the JUnit XML) and checks from the
daemon's counters and event log that this mechanism, and no other, did the
work:

  oom return-oom    denials counted in BPF, no stop, events say return-oom
  oom stop-rewrite  one BPF stop per denial, events say stop-rewrite
  meminfo probe-write-user   right values, no stop, no controller rewrite
  meminfo stop-write         right values, written by the controller

The daemon always prefers bpf_probe_write_user for memory info where the
kernel allows it; stop-write is then exercised only after lockdown has been
raised to integrity (run_matrix.py does so in a second pass inside the guest).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bpf"))
from helpers import (DEADLINES, write_policy, Daemon, DaemonError, Tracked, converge,  # noqa: E402
                     finish_daemon, hami_bpf_bin, wait_for, wait_registered)

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 32 * MiB
OOM = 2
# Base seconds for the daemon to settle; helpers scale it to this machine.
SETTLE = 2.0

OOM_FEATURE = {"return-oom": "reg_write", "stop-rewrite": "send_signal"}
MEMINFO_FEATURE = {"probe-write-user": "probe_write_user", "stop-write": "send_signal"}


@pytest.fixture(scope="module")
def doctor() -> dict:
    # guest.sh has just run `doctor --json` in this boot and lockdown state
    # (minutes of compiles under TCG): its report is reused rather than redone.
    saved = os.environ.get("HAMI_TEST_DOCTOR_JSON")
    if saved and os.path.exists(saved):
        with open(saved) as f:
            out, why = f.read(), f"{saved} (written by `hami-bpf doctor --json`)"
    else:
        r = subprocess.run([hami_bpf_bin(), "doctor", "--json"], capture_output=True, text=True,
                           timeout=DEADLINES.ready_timeout()[0])
        out, why = r.stdout, f"hami-bpf doctor --json (exit {r.returncode}): {r.stderr[-2000:]}"
    try:
        rep = json.loads(out)
    except ValueError:
        pytest.fail(f"no JSON in {why}")
    feats = rep.get("features") or {}
    if "error" in feats:
        pytest.fail(f"doctor could not probe features: {feats['error']}")
    return rep


def _refused(rep: dict, feature: str) -> str | None:
    f = rep["features"]
    if f.get(feature):
        return None
    return f.get("errors", {}).get(feature) or "refused"


def _kernel(rep: dict) -> str:
    return f"kernel {rep['kernel']['value']}, lockdown {rep['lockdown']['value']}"


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        f'[[group]]\nmatch = "mech*"\nmemory = {LIMIT}\n')


def gname() -> str:
    return f"mech-{uuid.uuid4().hex[:6]}"


def _counters(d: Daemon) -> dict:
    return dict(d.snapshot()["counters"])


def _delta(before: dict, after: dict, key: str) -> int:
    return int(after.get(key, 0)) - int(before.get(key, 0))


def _actions(d: Daemon) -> list[str]:
    from hami_bpf.server import fetch_events
    batch, _ = fetch_events(d.socket, 0)
    out = []
    for ev in batch:
        j = ev.to_json()
        if j.get("kind") == "deny":
            out.append((j.get("data") or {}).get("action"))
    return out


@pytest.mark.parametrize("mech", ["return-oom", "stop-rewrite"])
def test_oom_mechanism(mech, doctor, fakecuda, policy_file, record_property):
    """A denied allocation returns CUDA_ERROR_OUT_OF_MEMORY through `mech`."""
    why = _refused(doctor, OOM_FEATURE[mech])
    if why:
        pytest.skip(f"oom {mech}: {_kernel(doctor)} refuses {OOM_FEATURE[mech]}: {why}")
    record_property("mechanism", f"oom={mech}")
    d = Daemon(fakecuda, policy=policy_file, oom_action=mech).start()
    try:
        assert d.snapshot()["mechanisms"]["oom"] == mech
        with Tracked.spawn(fakecuda, gname()) as t:
            wait_registered(d, [t], timeout=SETTLE * 5)
            ids = [t.alloc("alloc 8M", 0)[1] for _ in range(4)]      # exactly LIMIT
            converge(d, [t], timeout=SETTLE)
            before = _counters(d)
            lines = ("alloc 1", "allocmanaged 4096", "allocasync 1M", "allocpitch 512 1 4",
                     "create 2M 0")
            for line in lines:
                rc, _ = t.alloc(line, 0, expect_rc=None)
                assert rc == OOM, f"{mech}: {line!r} over the limit returned rc={rc}"
            assert t.proc.returncode is None and int(t.cmd("pid")["pid"]) == t.pid
            converge(d, [t], timeout=SETTLE)          # nothing was charged
            wait_for(lambda: None if _delta(before, _counters(d), "denials") >= len(lines)
                     else f"controller saw {_delta(before, _counters(d), 'denials')} denials",
                     timeout=SETTLE * 5, what="denial events")
            after = _counters(d)
            assert _delta(before, after, "bpf_denials") == len(lines)
            stops = _delta(before, after, "bpf_stops")
            actions = _actions(d)[-len(lines):]
            if mech == "return-oom":
                assert stops == 0, f"return-oom stopped the process {stops} times"
            else:
                assert stops == len(lines), f"stop-rewrite: {stops} stops for {len(lines)} denials"
            assert actions == [mech] * len(lines), f"deny events: {actions}"
            # it carries on: free, allocate again, refused again at the limit
            t.free(ids[0])
            t.alloc("alloc 8M", 0)
            assert t.alloc("alloc 1", 0, expect_rc=None)[0] == OOM
            converge(d, [t], timeout=SETTLE)
    finally:
        finish_daemon(d)


def test_return_oom_refused_where_the_kernel_refuses(doctor, fakecuda, record_property):
    """`--oom-action return-oom` on a kernel that refuses register writes:
    the daemon does not start, and says what the kernel said."""
    why = _refused(doctor, "reg_write")
    if not why:
        pytest.skip(f"{_kernel(doctor)} allows uprobe register writes: return-oom is not refused")
    record_property("mechanism", "oom=return-oom (refused)")
    d = Daemon(fakecuda, oom_action="return-oom")
    with pytest.raises(DaemonError) as ei:
        d.start()
    d.cleanup()
    msg = str(ei.value)
    assert "--oom-action return-oom: this kernel refuses uprobe register writes" in msg, msg
    assert why in msg, f"the kernel's refusal {why!r} is not in: {msg}"
    assert d.returncode not in (None, 0)


@pytest.mark.parametrize("mech", ["probe-write-user", "stop-write"])
def test_meminfo_mechanism(mech, doctor, fakecuda, policy_file, record_property):
    """cuMemGetInfo_v2 / cuDeviceTotalMem_v2 report the group's limit through `mech`."""
    why = _refused(doctor, MEMINFO_FEATURE[mech])
    if why:
        pytest.skip(f"meminfo {mech}: {_kernel(doctor)} refuses {MEMINFO_FEATURE[mech]}: {why}")
    chosen = doctor["mechanisms"]["meminfo"]
    if chosen != mech:
        pytest.skip(f"meminfo {mech}: the daemon chooses {chosen} on {_kernel(doctor)} "
                    "(no switch forces another)")
    record_property("mechanism", f"meminfo={mech}")
    d = Daemon(fakecuda, policy=policy_file).start()
    try:
        assert d.snapshot()["mechanisms"]["meminfo"] == mech
        with Tracked.spawn(fakecuda, gname()) as t:
            converge(d, [t], timeout=SETTLE * 5)
            t.alloc("alloc 10M", 0)
            t.alloc("allocpitch 1000 3 4", 0)
            used = sum(t.expected().values())
            converge(d, [t], timeout=SETTLE)
            before = _counters(d)
            for _ in range(3):
                rc, free, total = t.proc.meminfo()
                assert (rc, total, free) == (0, LIMIT, LIMIT - used)
                r = t.cmd("totalmem 0")
                assert (int(r["rc"]), int(r["total"])) == (0, LIMIT)
            if mech == "stop-write":   # the controller counts a rewrite after resuming
                wait_for(lambda: None if _delta(before, _counters(d), "meminfo_rewrites") >= 6
                         else "rewrites not counted yet", timeout=SETTLE * 5, what="rewrites")
            after = _counters(d)
            rewrites = _delta(before, after, "meminfo_rewrites")
            stops = _delta(before, after, "bpf_stops")
            if mech == "probe-write-user":
                assert (rewrites, stops) == (0, 0), \
                    f"probe-write-user: controller rewrote {rewrites}, BPF stopped {stops}"
            else:
                assert rewrites == 6 and stops == 6, \
                    f"stop-write: {rewrites} controller rewrites, {stops} stops for 6 calls"
    finally:
        finish_daemon(d)
