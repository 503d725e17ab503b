#!/usr/bin/env python3
"""Two workloads capped side by side, each against its own uncapped rate alone
(run by bench/gpu/suite_ab.sh, section pairab).

One process per workload, each in a group of its own, started together
(workloads/common.py's --sync-dir hand-off) and kept for the whole schedule.
Per split "x:y" of --splits:
  a alone    b stopped (SIGSTOP), both groups uncapped: a's own free rate
  b alone    a stopped: b's own free rate
  together   a capped at x, b at y (the daemon's policy file + SIGHUP)
and after the last split a alone and b alone once more. Each side's rate
together is compared with the mean of its alone stretches just before and
after it: its uncapped speed with the GPU to itself, in the same process,
seconds away. A host-bound loop's speed drifts from one process to the next
(a decode loop by up to 2x on this VM), which a separate reference process
cannot cancel. A workload whose lines carry a phase is compared phase by
phase (suite_ab.of_free).

A stopped process keeps its context and memory; what it had queued runs in
the first moments of the other's stretch, which are left out (--free-settle),
as are a capped stretch's first --settle seconds. A side is stopped only
once its group is uncapped (the daemon releases a hold when a cap goes, and
that release must not undo the bench's stop), and is stopped again if it
was found running.

Prints one JSON line per side per split:
  {"pair", "side", "w", "cap", "rate", "ref_before", "ref_after", "pct",
   "within5", "first_s_pct", "held", "series"}
("held": the share of the stretch the side was found stopped, read from
/proc every HELD_SAMPLE_S)
then a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite_ab import markdown, reader, stretch, stretch_columns, tally, tally_line, write_policy   # noqa: E402 - by path
from suite_run import workload_command           # noqa: E402

STOP_DELAY_S = 0.5    # the daemon's holds let go before a side is stopped for the other's stretch
STOP_CHECK_S = 0.1      # ... and it is checked this often that it stays stopped
HELD_SAMPLE_S = 0.01    # each side's state is read this often while capped together


def state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "?"


def schedule(splits: list, ref_s: float, cap_s: float) -> list:
    """[(kind, seconds, caps (a, b) or None)]: kind "a", "b" (that side alone)
    or "both"."""
    out = []
    for x, y in splits:
        out += [("a", ref_s, None), ("b", ref_s, None), ("both", cap_s, (x, y))]
    return out + [("a", ref_s, None), ("b", ref_s, None)]


def judge(pair: str, side: str, w: str, lines: list, spans: list, settle: float,
          free_settle: float, stops: list) -> list[dict]:
    """One row per capped stretch for side `side` (its index in caps);
    "held": the share of `stops` samples in that stretch that found it
    stopped (the daemon's holds)."""
    idx = 0 if side == "a" else 1
    rows = []
    for i, (kind, s, e, caps) in enumerate(spans):
        if kind != "both":
            continue
        own = [(s0 + free_settle, e0) for k, s0, e0, _c in spans if k == side]
        before = next((sp for sp in reversed(own) if sp[1] <= s), None)
        after = next((sp for sp in own if sp[0] >= e), None)
        seen = [st[idx] for t, st in stops if s + settle <= t <= e]
        rows.append({"pair": pair, "side": side, "w": w,
                     **stretch(lines, s, e, caps[idx], before, after, settle),
                     "held": round(sum(seen) / len(seen), 3) if seen else None})
    return rows


def run_pair(a, wa: str, wb: str) -> list[dict]:
    pair = f"{wa}+{wb}"
    groups = [f"pab-{i}-{w.replace('@', '-')}-{os.getpid()}" for i, w in enumerate((wa, wb))]
    plan = schedule(a.splits, a.ref_s, a.cap_s)
    total = sum(length for _k, length, _c in plan) + 5
    write_policy(a.policy, {})
    os.kill(a.daemon_pid, signal.SIGHUP)
    sync = tempfile.mkdtemp(prefix="pab-")
    procs, queues = [], []
    for side, w, g in zip("ab", (wa, wb), groups):
        env = dict(os.environ, HAMI_GROUP=g)
        env.pop("CUDA_DEVICE_SM_LIMIT", None)
        d = os.path.join(sync, side)
        os.mkdir(d)
        script, args = workload_command(w)
        cmd = ["python3", script, "--seconds", str(total), "--sync-dir", d, *args]
        cpus = a.cpus_a if side == "a" else a.cpus_b
        if cpus:
            cmd = ["taskset", "-c", cpus, *cmd]
        log = open(os.path.join(a.out, f"pab-{pair}-{side}.log"), "w")
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        q: queue.Queue = queue.Queue()
        threading.Thread(target=reader, args=(p, q), daemon=True).start()
        procs.append(p)
        queues.append(q)
    lines: list[list] = [[], []]
    spans: list = []
    stops: list = []        # (time, [each side found stopped]) while capped together
    try:
        for side in "ab":
            open(os.path.join(sync, side, "go"), "w").close()
        deadline = time.monotonic() + a.setup_limit
        while not all(os.path.exists(os.path.join(sync, s, "ready")) for s in "ab"):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                print(json.dumps({"pair": pair, "error": "a side did not get ready"}), flush=True)
                return []
            time.sleep(0.05)
        for side in "ab":
            open(os.path.join(sync, side, "start"), "w").close()
        at = time.monotonic()
        for kind, length, caps in plan:
            spans.append((kind, at, at + length, caps))
            at += length

        def drain():
            for i, q in enumerate(queues):
                while True:
                    try:
                        arrived, line = q.get_nowait()
                    except queue.Empty:
                        break
                    if line and line.startswith("{"):
                        rec = json.loads(line)
                        if "rate" in rec and not rec.get("summary"):
                            lines[i].append((arrived, rec))

        for kind, s, e, caps in spans:
            while time.monotonic() < s:
                drain()
                time.sleep(0.02)
            if kind == "both":
                for p in procs:
                    os.kill(p.pid, signal.SIGCONT)
                write_policy(a.policy, dict(zip(groups, caps)))
                os.kill(a.daemon_pid, signal.SIGHUP)
            else:
                run, stop = (procs[0], procs[1]) if kind == "a" else (procs[1], procs[0])
                write_policy(a.policy, {})
                os.kill(a.daemon_pid, signal.SIGHUP)
                os.kill(run.pid, signal.SIGCONT)
                time.sleep(STOP_DELAY_S)     # the daemon lets go of its holds first
                os.kill(stop.pid, signal.SIGSTOP)
            while time.monotonic() < e:
                drain()
                if kind == "both":
                    time.sleep(HELD_SAMPLE_S)
                    now = time.monotonic()
                    if now >= s + a.settle:
                        stops.append((now, [state(p.pid) in ("T", "t") for p in procs]))
                    continue
                time.sleep(STOP_CHECK_S)
                if state(stop.pid) not in ("T", "t", "?"):
                    os.kill(stop.pid, signal.SIGSTOP)
        drain()
    finally:
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        write_policy(a.policy, {})
        os.kill(a.daemon_pid, signal.SIGHUP)
        shutil.rmtree(sync, ignore_errors=True)
    rows = []
    for side, w, ln in zip("ab", (wa, wb), lines):
        rows += judge(pair, side, w, ln, spans, a.settle, a.free_settle, stops)
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--daemon-pid", type=int, required=True, dest="daemon_pid")
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", default=os.environ.get("PAIRS", "cnn_train:llm_decode"),
                    help="pairs a:b, space-separated")
    ap.add_argument("--splits", default=os.environ.get("SPLITS", "30:70 50:50"),
                    help="caps x:y of a and b, space-separated")
    ap.add_argument("--ref-s", type=float, default=float(os.environ.get("PAB_REF_S", "8")),
                    help="length of each side's alone stretch")
    ap.add_argument("--cap-s", type=float, default=float(os.environ.get("PAB_CAP_S", "30")),
                    help="length of each capped stretch")
    ap.add_argument("--settle", type=float, default=3.0,
                    help="a capped stretch's first seconds, left out")
    ap.add_argument("--free-settle", type=float, default=1.5,
                    help="an alone stretch's first seconds, left out")
    ap.add_argument("--setup-limit", type=float, default=180.0)
    ap.add_argument("--cpus-a", default=os.environ.get("PAB_CPUS_A", "2-5"))
    ap.add_argument("--cpus-b", default=os.environ.get("PAB_CPUS_B", "6-9"))
    a = ap.parse_args()
    a.splits = [tuple(int(c) for c in s.split(":")) for s in a.splits.split()]
    rows = []
    for pr in a.pairs.split():
        wa, wb = pr.split(":")
        rows += run_pair(a, wa, wb)
    markdown(rows, [("pair", "pair", "l"), ("side", "w", "l"), *stretch_columns("alone")])
    print("\n" + tally_line(tally(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
