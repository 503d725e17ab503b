#!/usr/bin/env python3
"""Restart-to-serving time, and what a restart keeps (root, bcc; no GPU).

Starts `hami-bpf run` on the stand-in libcuda, N processes each holding an
allocation in a limited group, then restarts the daemon R times (SIGTERM, or
SIGKILL with --kill) on the same state and pin directories. For each restart
prints, as one JSON line: how long the old daemon took to exit, how long the
new one took from its start to "ready" and to a snapshot that shows every
process with its bytes (serving with the adopted accounting), and whether the
bytes matched.

    sudo python3 bench/restart.py [--procs 50] [--restarts 3] [--kill]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from hami_bpf.fakecuda import CudaProc, build  # noqa: E402
from hami_bpf.server import query  # noqa: E402

MiB = 1 << 20


def hami_bin() -> str:
    near = Path(sys.executable).with_name("hami-bpf")
    return str(near) if near.exists() else shutil.which("hami-bpf") or "hami-bpf"


def start(fake, work: Path, policy: Path) -> tuple[subprocess.Popen, float]:
    err = open(work / "daemon.stderr", "ab")
    t0 = time.monotonic()
    p = subprocess.Popen([hami_bin(), "run", "--libcuda", str(fake.libcuda), "--no-demo",
                          "--socket", str(work / "s.sock"), "--state-dir", str(work / "state"),
                          "--bpf-pin-dir", f"/sys/fs/bpf/hami-bench-{work.name}",
                          "--group-by", "env:HAMI_GROUP", "--policy", str(policy)],
                         stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
    err.close()
    return p, t0


def ready_count(work: Path) -> int:
    try:
        return (work / "daemon.stderr").read_text(errors="replace").count(" ready: ")
    except OSError:
        return 0


def wait_ready(p: subprocess.Popen, work: Path, n: int, limit: float = 600) -> float:
    t0 = time.monotonic()
    while ready_count(work) < n:
        if p.poll() is not None:
            raise SystemExit(f"daemon exited {p.returncode}: "
                             f"{(work / 'daemon.stderr').read_text()[-2000:]}")
        if time.monotonic() - t0 > limit:
            raise SystemExit("daemon not ready")
        time.sleep(0.01)
    return time.monotonic()


def shown(work: Path, procs: list[CudaProc]) -> dict[int, int] | None:
    try:
        snap = query(str(work / "s.sock"), "snapshot", timeout=5)
    except Exception:
        return None
    got = {p["pid"]: int(p["devices"].get("0", {}).get("used_bytes", 0))
           for p in snap["processes"]}
    return {p.pid: got.get(p.pid, -1) for p in procs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=50)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--kill", action="store_true", help="SIGKILL instead of SIGTERM")
    a = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root")
    work = Path(tempfile.mkdtemp(prefix="hami-rb-", dir="/run"))
    os.chmod(work, 0o700)
    policy = work / "policy.toml"
    policy.write_text(f'[[group]]\nmatch = "bench*"\nmemory = {64 * a.procs * MiB}\n')
    os.chmod(policy, 0o600)
    fake = build()
    procs: list[CudaProc] = []
    d, t0 = start(fake, work, policy)
    wait_ready(d, work, 1)
    try:
        for i in range(a.procs):
            p = CudaProc(fake, env={"HAMI_GROUP": f"bench-{i % 4}"})
            p.cmd("init")
            p.cmd("device 0")
            p.cmd(f"alloc {(i + 1) * MiB}")
            procs.append(p)
        want = {p.pid: (i + 1) * MiB for i, p in enumerate(procs)}
        while shown(work, procs) != want:
            time.sleep(0.05)
        for r in range(a.restarts):
            t_stop = time.monotonic()
            d.send_signal(signal.SIGKILL if a.kill else signal.SIGTERM)
            d.wait()
            exited = time.monotonic() - t_stop
            d, t0 = start(fake, work, policy)
            t_ready = wait_ready(d, work, r + 2)
            while True:
                got = shown(work, procs)
                if got is not None:
                    break
                time.sleep(0.005)
            t_serving = time.monotonic()
            print(json.dumps({"restart": r + 1, "signal": "SIGKILL" if a.kill else "SIGTERM",
                              "procs": a.procs, "old_exit_s": round(exited, 3),
                              "start_to_ready_s": round(t_ready - t0, 3),
                              "start_to_serving_s": round(t_serving - t0, 3),
                              "bytes_kept": got == want}), flush=True)
    finally:
        for p in procs:
            p.close()
        d.send_signal(signal.SIGTERM)
        d.wait()
        shutil.rmtree(f"/sys/fs/bpf/hami-bench-{work.name}", ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
