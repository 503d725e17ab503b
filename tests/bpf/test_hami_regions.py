"""`hami-bpf run --hami-regions DIR`: one HAMi shared-region file per group.

A real daemon, real (fakecuda) processes grouped by HAMI_GROUP, a policy that
limits groups named "lim*". The region file each group gets must show what
`ps --json` shows: the processes (host pids), their per-device bytes and the
group's limits; it follows exits and goes away with its group.
"""
from __future__ import annotations

import os
import stat
import uuid

import pytest

from hami_bpf.hami_region import decode_region
from helpers import (Daemon, DaemonError, Tracked, converge, finish_daemon, gname, wait_for,
                     write_policy)

pytestmark = pytest.mark.bpf

MiB = 1 << 20
LIMIT = 256 * MiB


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory):
    return write_policy(tmp_path_factory.mktemp("policy") / "policy.toml",
                        f'[[group]]\nmatch = "lim*"\nmemory = {LIMIT}\n')


@pytest.fixture(scope="module")
def regions(tmp_path_factory):
    d = tmp_path_factory.mktemp("regions")
    os.chmod(d, 0o755)
    return d


@pytest.fixture(scope="module")
def daemon(fakecuda, policy_file, regions):
    d = Daemon(fakecuda, policy=policy_file, extra=["--hami-regions", str(regions)]).start()
    yield d
    finish_daemon(d)


def _read(path):
    try:
        with open(path, "rb") as f:
            return decode_region(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _mismatch(path, ps, group_limits):
    """What differs between the region file and `ps --json` (None: nothing)."""
    r = _read(path)
    if r is None:
        return f"{path}: missing or not a region yet"
    want = {p["pid"]: {int(k): int(v["used_bytes"]) for k, v in p["devices"].items()
                       if int(v["used_bytes"])} for p in ps}
    got = {p.host_pid: dict(p.used) for p in r.procs}
    if got != want:
        return f"region procs {got} != ps {want}"
    for dev, lim in group_limits.items():
        if dev >= len(r.limits) or r.limits[dev] != lim:
            return f"region limits {r.limits} != ps limit {lim} on device {dev}"
    return None


def test_region_follows_the_group(daemon, fakecuda, regions):
    group = gname("limR")
    path = regions / group / "hami-bpf.cache"
    t = Tracked.spawn(fakecuda, group)
    u = Tracked.spawn(fakecuda, group)
    try:
        t.alloc("alloc 3M", 0)
        u.alloc("alloc 5M", 0)
        t.ok("device 1")
        t.alloc("alloc 1M", 1)
        converge(daemon, [t, u])

        def check(pids):
            ps = [p for p in daemon.cli_json("ps")["processes"] if p["group"] == group]
            if {p["pid"] for p in ps} != set(pids):
                return f"ps shows {[p['pid'] for p in ps]}, expected {pids}"
            limits = {int(k): v["limit_bytes"] for p in ps for k, v in p["devices"].items()
                      if v["limit_bytes"] is not None}
            if not limits:
                return "no limit in ps yet"
            return _mismatch(path, ps, limits)

        wait_for(lambda: check([t.pid, u.pid]), 10, what="region file matching ps --json")
        r = _read(path)
        assert r.limits[0] == LIMIT
        assert r.total(0) >= 8 * MiB
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
        assert st.st_mode & 0o7133 == 0, oct(st.st_mode)     # 0644 at most
        assert os.lstat(path.parent).st_mode & 0o022 == 0

        u.close()
        u.mark_dead()
        wait_for(lambda: check([t.pid]), 10, what="region without the exited process")
    finally:
        u.close()
        t.close()
    # The file, then its directory (two steps: wait for both).
    wait_for(lambda: None if not path.parent.exists() else f"{path.parent} still there", 10,
             what="region directory removed with its group")
    assert "Traceback" not in daemon.log()


def test_unlimited_group_gets_a_sanitized_dir(daemon, fakecuda, regions):
    group = "free/" + uuid.uuid4().hex[:6]
    with Tracked.spawn(fakecuda, group) as t:
        t.alloc("alloc 2M", 0)
        converge(daemon, [t])

        def found():
            for d in regions.iterdir():
                r = _read(d / "hami-bpf.cache")
                if r and any(p.host_pid == t.pid for p in r.procs):
                    return d
            return None
        wait_for(lambda: None if found() else "no region with the process", 10, what="region")
        d = found()
        assert d.parent == regions and "/" not in d.name and d.name.startswith("free_")
        r = _read(d / "hami-bpf.cache")
        assert r.procs[0].used.get(0) == 2 * MiB and all(x == 0 for x in r.limits)


@pytest.mark.parametrize("kind", ["world-writable", "symlink"])
def test_unsafe_dir_is_refused(fakecuda, tmp_path, kind):
    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    target = real
    if kind == "world-writable":
        os.chmod(real, 0o777)
    else:
        target = tmp_path / "link"
        target.symlink_to(real)
    d = Daemon(fakecuda, extra=["--hami-regions", str(target)])
    try:
        with pytest.raises(DaemonError, match="hami-regions"):
            d.start()
    finally:
        d.stop()
        d.cleanup()
