#!/usr/bin/env python3
"""The reported failure, reproduced in kind: a TP=2 job whose group churns.

Two ranks (one per GPU, NCCL) run a decode-like loop: a matmul and an
all-reduce per step. Both are in one hami-bpf group (HAMI_GROUP) with a memory
cap and CUDA_DEVICE_SM_LIMIT. Meanwhile short-lived processes of the same
group start and exit (cleanly, by SIGKILL, by crash), forcing compactions that
move the ranks' slots. The script records every step's time in each rank and
polls the daemon's slot table; it prints one JSON summary:

  max_gap_s           longest time without a step in either rank
  steps_per_s         per rank
  slots_contiguous    every polled table had slots 0..proc_num-1
  rank_moves          how often a rank's slot index changed
  accounting          per rank: daemon's used bytes vs torch.memory_reserved()
"""
import argparse
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def churner(mode: str) -> None:
    """A member of the group that allocates a little and leaves."""
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuInit(0)
    ctx = ctypes.c_void_p()
    cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0)
    cu.cuCtxSetCurrent(ctx)
    p = ctypes.c_uint64()
    cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(64 << 20))
    time.sleep(random.uniform(0.2, 1.0))
    if mode == "crash":
        ctypes.string_at(0)
    if mode == "hang":
        time.sleep(3600)
    os._exit(0)


def rank_main(rank: int, seconds: float, out_path: str, mode: str) -> None:
    import torch
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=2,
                                device_id=torch.device("cuda", rank))
    except TypeError:   # an older torch: no eager NCCL init
        dist.init_process_group("nccl", rank=rank, world_size=2)
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def body():
        torch.matmul(x, w, out=y)
        dist.all_reduce(y)

    graph_error = None
    if mode == "graph":
        # Decode with CUDA graphs: the step's matmul and all-reduce replayed
        # as one graph launch (NCCL collectives can be captured).
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    body()
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                body()
            step = g.replay
        except Exception as e:  # noqa: BLE001 - fall back, and say so
            graph_error = str(e)[:300]
            step = body
    else:
        step = body
    times = []
    t0 = time.monotonic()
    go = torch.ones(1, device="cuda")
    while True:
        step()
        y[0, 0].item()          # a decode step ends with a host sync
        times.append(time.monotonic())
        if len(times) % 64 == 0:
            # Both ranks must stop after the same step, or one waits forever
            # in a collective the other never joins.
            go.fill_(1.0 if time.monotonic() - t0 < seconds else 0.0)
            dist.all_reduce(go, op=dist.ReduceOp.MIN)
            if go.item() == 0.0:
                break
    reserved = torch.cuda.memory_reserved()
    from hami_bpf.server import fetch_snapshot
    snap = fetch_snapshot(os.environ["HAMI_SOCK"])
    me = snap.process(os.getpid())
    used = sum(d.used_bytes for d in me.devices.values()) if me else None
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "times": times, "reserved": reserved,
                   "hami_used": used, "mode": mode, "graph_error": graph_error}, f)
    # Both ranks stopped after the same step; tearing NCCL down after a graph
    # capture hung on the H200 x2 (2026-11-29), and nothing needs it here.
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--socket", default="/tmp/h.sock")
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--churner", choices=["exit", "kill", "crash", "hang"])
    ap.add_argument("--rank", type=int)
    ap.add_argument("--mode", choices=["eager", "graph"], default="eager")
    ap.add_argument("--no-churn", action="store_true")
    a = ap.parse_args()
    if a.churner:
        churner(a.churner)
        return
    if a.rank is not None:
        rank_main(a.rank, a.seconds, os.path.join(a.out, f"rank{a.rank}.json"), a.mode)
        return
    env = dict(os.environ, HAMI_SOCK=a.socket)
    # Members that join before the ranks hold the group's first slots; killing
    # them later moves the ranks' slots down (the move the reported failure needed).
    early = [] if a.no_churn else [
        subprocess.Popen([sys.executable, __file__, "--churner", "hang"], env=env,
                         stderr=subprocess.DEVNULL) for _ in range(3)]
    time.sleep(0 if a.no_churn else 5)
    ranks = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--seconds", str(a.seconds),
                               "--out", a.out, "--mode", a.mode], env=env) for r in (0, 1)]
    from hami_bpf.server import fetch_snapshot
    stop = time.monotonic() + a.seconds + 20
    contiguous, polls, slots_of = True, 0, {}
    moves = {}
    kids = []
    started = time.monotonic()
    while any(r.poll() is None for r in ranks) and time.monotonic() < stop:
        if (not a.no_churn and time.monotonic() - started > 8
                and time.monotonic() - started < a.seconds + 5):
            mode = random.choice(["exit", "kill", "crash", "exit"])
            p = subprocess.Popen([sys.executable, __file__, "--churner",
                                  "hang" if mode == "kill" else mode], env=env,
                                 stderr=subprocess.DEVNULL)
            kids.append((p, mode, time.monotonic()))
        for p, mode, t in kids:
            if mode == "kill" and p.poll() is None and time.monotonic() - t > 0.6:
                p.send_signal(signal.SIGKILL)
        if early and time.monotonic() - started > 6:
            for p in early:
                p.send_signal(signal.SIGKILL)
            early = []
        try:
            snap = fetch_snapshot(a.socket)
            polls += 1
            for g in snap.groups:
                if [s.index for s in g.slots] != list(range(g.proc_num)):
                    contiguous = False
                for s in g.slots:
                    for r in ranks:
                        if s.pid == r.pid:
                            if slots_of.get(r.pid, s.index) != s.index:
                                moves[r.pid] = moves.get(r.pid, 0) + 1
                            slots_of[r.pid] = s.index
        except Exception:
            pass
        time.sleep(0.25)
    for r in ranks:
        r.wait(60)
    for p, _m, _t in kids:
        if p.poll() is None:
            p.kill()
    res = [json.load(open(os.path.join(a.out, f"rank{r}.json"))) for r in (0, 1)]
    gaps, p99 = [], []
    for r in res:
        ts = r["times"]
        d = sorted(b - c for c, b in zip(ts, ts[1:]))
        gaps.append(d[-1] if d else None)
        p99.append(d[int(0.99 * (len(d) - 1))] if d else None)
    print(json.dumps({
        "mode": a.mode, "graph_error": [r.get("graph_error") for r in res],
        "sm_limit": os.environ.get("CUDA_DEVICE_SM_LIMIT"),
        "seconds": a.seconds, "churners": len(kids), "step_gap_p99_s": p99,
        "churner_modes": {m: sum(1 for _p, mm, _t in kids if mm == m) for m in ("exit", "kill", "crash")},
        "max_gap_s": max(g for g in gaps if g is not None) if all(gaps) else None,
        "steps_per_s": [len(r["times"]) / (r["times"][-1] - r["times"][0]) for r in res],
        "slots_contiguous": contiguous, "polls": polls,
        "rank_moves": [moves.get(r["pid"], 0) for r in res],
        "accounting": [{"rank": r["rank"], "torch_reserved": r["reserved"], "hami_used": r["hami_used"]}
                       for r in res],
    }), flush=True)


if __name__ == "__main__":
    main()
