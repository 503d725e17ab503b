#!/usr/bin/env python3
"""One run of bench/gpu/tp2_decode.sh: both ranks of workloads/tp_decode.py in
one hami-bpf group, optionally capped and with same-group churners.

  tp2_decode_run.py --run NAME --group G [--cap PCT] [--graphs] [--churn]
                    --seconds S --port P --socket SOCK --out DIR

Writes, appending, to DIR:
  tp.jsonl      every JSON line of both ranks tagged with run/mode/cap/kind,
                then one {"run_record": true} line: pids, churners, the
                daemon counters before/after, the window of the timed loop
  slots.jsonl   one line per poll: src "sock" (every ~0.2 s: the documents of
                `hami-bpf slots --json` and `ps --json` for the group, built
                from ONE snapshot, so slots and ps can be checked against each
                other) and src "cli-slots"/"cli-ps" (the CLI itself, run back
                to back as fast as it goes)
  events.jsonl  the daemon's events of the run (compactions with their moves)
Rank stderr and non-JSON stdout go to DIR/NAME-rankR.log.

Churn (--churn): three members of the group start before the ranks and wait
(churner.py --until-signal), so they hold the slots below the ranks. Slot
compaction moves the LAST member into a freed slot; the ranks are last, so the
first early exit moves one rank and the second moves the other. Those exits
come 1.5 s and 3 s into the timed loop (a clean exit, then SIGKILL), the third
(abort) at 4.5 s; no later churner is alive then, or it would be the one
moved. From 5.5 s to 2 s before the end, short-lived churners start every
0.5 s and leave by exit, SIGKILL, abort or segfault (they only move each
other). Churners alternate between the two GPUs.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from hami_bpf.server import fetch_events, fetch_snapshot  # noqa: E402
from hami_bpf.snapshot import ps_json, slots_json  # noqa: E402

PY = sys.executable
CHURNER = os.path.join(HERE, "workloads", "churner.py")
WORKLOAD = os.path.join(HERE, "workloads", "tp_decode.py")
HAMI = os.path.join(ROOT, "bench", "hami.py")
# No NVLink multicast anywhere (NCCL NVLS, torch symmetric memory, NVSHMEM):
# set for every child explicitly, whatever the caller exported.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}

lock = threading.Lock()


def append(path: str, obj: dict) -> None:
    line = json.dumps(obj, separators=(",", ":"))
    with lock, open(path, "a") as f:
        f.write(line + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--cap", type=int, default=None, help="CUDA_DEVICE_SM_LIMIT for the group")
    ap.add_argument("--graphs", action="store_true")
    ap.add_argument("--churn", action="store_true")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--port", type=int, default=29600)
    ap.add_argument("--socket", default="/tmp/h.sock")
    ap.add_argument("--out", required=True)
    ap.add_argument("--poll", type=float, default=0.2)
    ap.add_argument("--limit", type=float, default=120.0, help="kill the ranks after this many seconds")
    a = ap.parse_args()
    mode = "graphs" if a.graphs else "eager"
    kind = "capped" if a.cap is not None else "ref"
    tag = {"run": a.run, "mode": mode, "cap": a.cap, "kind": kind, "group": a.group}
    tp_path, slots_path, ev_path = (os.path.join(a.out, n) for n in ("tp.jsonl", "slots.jsonl", "events.jsonl"))

    env = dict(os.environ, HAMI_GROUP=a.group, **NO_MULTICAST)
    env.pop("CUDA_DEVICE_SM_LIMIT", None)
    if a.cap is not None:
        env["CUDA_DEVICE_SM_LIMIT"] = str(a.cap)
    snap0 = fetch_snapshot(a.socket)
    _evs, ev_since = fetch_events(a.socket, 0)
    t_begin = time.time()

    churners = []          # dicts: p, mode, device, early, t_start, t_end

    def churn(mode: str, device: int, early: bool, life: float = 0.5) -> dict:
        cmd = [PY, CHURNER, "--mode", mode, "--device", str(device)]
        cmd += ["--until-signal"] if early else ["--life", str(life)]
        c = {"p": subprocess.Popen(cmd, env=env, stderr=subprocess.DEVNULL), "mode": mode,
             "device": device, "early": early, "t_start": time.time(), "t_end": None, "sent": None}
        churners.append(c)
        return c

    early = []
    if a.churn:
        # Exit order matters only in that the first two early exits each move a rank.
        for i, m in enumerate(("exit", "hang", "abort")):
            early.append(churn(m, i % 2, True))
            time.sleep(0.3)
        deadline = time.monotonic() + 20
        want = {c["p"].pid for c in early}
        while time.monotonic() < deadline:
            g = fetch_snapshot(a.socket).group(a.group)
            if g is not None and want <= {s.pid for s in g.slots}:
                break
            time.sleep(0.1)
        else:
            print(f"{a.run}: early churners not all registered after 20 s", file=sys.stderr)

    ranks, logs = [], []
    for r in (0, 1):
        renv = dict(env, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(a.port))
        log = open(os.path.join(a.out, f"{a.run}-rank{r}.log"), "w")
        logs.append(log)
        cmd = [PY, WORKLOAD, "--seconds", str(a.seconds)] + (["--graphs"] if a.graphs else [])
        ranks.append(subprocess.Popen(cmd, env=renv, stdout=subprocess.PIPE, stderr=log, text=True))
    t0 = [None]            # wall time the timed loop began (rank 0's start line)

    def reader(r: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            s = line.strip()
            try:
                o = json.loads(s) if s.startswith("{") else None
            except ValueError:
                o = None
            if not isinstance(o, dict):
                logs[r].write(line)
                continue
            if o.get("start") and r == 0:
                t0[0] = time.time()
            append(tp_path, {**tag, **o})

    readers = [threading.Thread(target=reader, args=(r, p), daemon=True) for r, p in enumerate(ranks)]
    for t in readers:
        t.start()

    stop_cli = threading.Event()

    def cli_poller() -> None:
        # The CLI as a user runs it; slower than the socket poll, so it runs
        # back to back on its own thread.
        while not stop_cli.is_set():
            for what in ("slots", "ps"):
                ts = time.time()
                try:
                    out = subprocess.run([PY, HAMI, what, "--json", "--socket", a.socket, "--group", a.group],
                                         capture_output=True, text=True, timeout=10,
                                         env=dict(os.environ, **NO_MULTICAST)).stdout
                    doc = json.loads(out)
                except (subprocess.SubprocessError, ValueError) as e:
                    doc = {"error": str(e)[:200]}
                append(slots_path, {**tag, "src": f"cli-{what}", "ts": ts,
                                    "t": None if t0[0] is None else round(ts - t0[0], 3), what: doc})
            time.sleep(a.poll)

    cli = threading.Thread(target=cli_poller, daemon=True)
    cli.start()

    # Churn schedule, seconds after the timed loop began: (when, what).
    plan = []
    if a.churn:
        plan = [(1.5, ("signal", early[0])), (3.0, ("kill", early[1])), (4.5, ("signal", early[2]))]
        t, i = 5.5, 0
        modes = ("exit", "hang", "abort", "exit", "crash", "hang")
        while t < a.seconds - 2.0:
            plan.append((t, ("start", modes[i % len(modes)], i % 2)))
            t, i = t + 0.5, i + 1
    limit = time.monotonic() + a.limit
    killed = False
    while any(p.poll() is None for p in ranks):
        now = time.time()
        if time.monotonic() > limit and not killed:
            print(f"{a.run}: ranks still running after {a.limit} s: killed", file=sys.stderr)
            for p in ranks:
                p.kill()
            killed = True
        if t0[0] is not None:
            while plan and now - t0[0] >= plan[0][0]:
                _t, act = plan.pop(0)
                if act[0] == "signal":
                    act[1]["p"].send_signal(signal.SIGUSR1)
                    act[1]["sent"] = now
                elif act[0] == "kill":
                    act[1]["p"].send_signal(signal.SIGKILL)
                    act[1]["sent"] = now
                else:
                    churn(act[1], act[2], False, life=0.3 + 0.1 * (len(churners) % 5))
        for c in churners:
            # Late enough that it has usually registered (python + cuInit).
            if c["mode"] == "hang" and not c["early"] and c["sent"] is None and now - c["t_start"] > 1.5:
                c["p"].send_signal(signal.SIGKILL)
                c["sent"] = now
            if c["t_end"] is None and c["p"].poll() is not None:
                c["t_end"] = now
        try:
            snap = fetch_snapshot(a.socket)
            g = snap.group(a.group)
            append(slots_path, {**tag, "src": "sock", "ts": now,
                                "t": None if t0[0] is None else round(now - t0[0], 3),
                                "slots": slots_json([g] if g else []),
                                "ps": ps_json([p for p in snap.processes if p.group == a.group]),
                                "compactions": snap.counters.get("compactions", 0)})
        except Exception as e:  # noqa: BLE001 - a missed poll is recorded, not fatal
            append(slots_path, {**tag, "src": "sock", "ts": now, "error": str(e)[:200]})
        time.sleep(max(0.0, a.poll - (time.time() - now)))
    t_end = time.time()
    stop_cli.set()
    for t in readers:
        t.join(10)
    for c in churners:
        if c["p"].poll() is None:
            c["p"].kill()
        c["p"].wait(10)
        if c["t_end"] is None:
            c["t_end"] = time.time()
    cli.join(15)
    time.sleep(0.5)        # let the daemon see the last exits before the closing snapshot
    snap1 = fetch_snapshot(a.socket)
    events, _last = fetch_events(a.socket, ev_since)
    for e in events:
        append(ev_path, {**tag, "event": e.to_json()})
    append(tp_path, {**tag, "run_record": True, "seconds": a.seconds, "t_begin": t_begin, "t0": t0[0],
                     "t_end": t_end,
                     "ranks": [{"rank": r, "pid": p.pid, "rc": p.returncode} for r, p in enumerate(ranks)],
                     "churners": [{"pid": c["p"].pid, "mode": c["mode"], "device": c["device"],
                                   "early": c["early"], "rc": c["p"].returncode, "t_start": c["t_start"],
                                   "t_end": c["t_end"], "sent": c["sent"]} for c in churners],
                     "counters_before": dict(snap0.counters), "counters_after": dict(snap1.counters),
                     "events": len(events), "killed": killed})
    print(f"{a.run}: ranks rc {[p.returncode for p in ranks]}, {len(churners)} churners, "
          f"{len(events)} events", flush=True)


if __name__ == "__main__":
    main()
