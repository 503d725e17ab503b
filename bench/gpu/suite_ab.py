#!/usr/bin/env python3
"""Caps against the same process's own uncapped rate (run by bench/gpu/suite_ab.sh).

One process per workload (bench/gpu/workloads/), in a group of its own. Its
group's cap comes from the daemon's policy file and changes while it runs:
uncapped, CAPS[0], uncapped, CAPS[1], ..., uncapped (each change a SIGHUP to
the daemon). A capped stretch is compared with the mean of the uncapped
stretches just before and after it, so a host-bound loop whose own speed
drifts from one process to the next (a Python decode loop on this VM: 66 and
95 tokens/s in two processes minutes apart) is measured against itself.

A workload whose lines carry a phase (`phased`: train and eval) is compared
phase by phase: each phase's capped rate against the free stretches' rate in
that phase, weighted by the capped stretch's time in it.

Prints one JSON line per capped stretch and a markdown table at the end:
  {"w", "cap", "rate", "ref_before", "ref_after", "ref_apart", "steady", "pct",
   "within5", "cpu", "cpu_free", "under_floor_s", "series"}
where "cpu" (and "cpu_free", for the free stretches either side) says how
the workload's busiest thread used its CPU per second it ran, and what the
daemon used (cpu_use): a loop that runs slower when held either waits for a
CPU then, or does less on one. "gpu" (and "gpu_free") says the device's SM
clock, its utilization and the clock event reasons seen (gpu_use): a loop
that runs slower per second it runs while its device clocks down between
holds is slowed by its GPU, not its host. "free_series": the per-second
rates of the free stretches either side (how soon a loop is itself again).
"under_floor_s": the longest time in a row the capped stretch ran under
cap − 10 of its free stretches (the fail-open floor).
"ref_apart": how far apart the free stretches either side are, in percent
of their mean; "steady": whether that is within REF_STEADY. A launch-bound
loop's own speed moves by a quarter or more within seconds on these VMs;
where its free stretches disagree that much, ±5 of their mean is within
their own noise, and the table says so rather than leave a verdict that
the reference cannot carry.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
from suite_run import workload_command  # noqa: E402 - a sibling script, by path
SOCKET = os.environ.get("AB_SOCKET", "/tmp/h.sock")
REF_STEADY = 15.0   # free stretches either side this close (percent of their mean): a steady reference


def held_ms() -> float | None:
    """The daemon's total SM-hold time so far (counter throttle_ms)."""
    try:
        from hami_bpf.server import query
        return float(query(SOCKET, "snapshot", timeout=2)["counters"].get("throttle_ms", 0))
    except Exception:  # noqa: BLE001 - a bench reading; missing is shown as null
        return None


def held_share(samples: list, start: float, end: float) -> float | None:
    """Share of [start, end] the group spent held (from throttle_ms samples)."""
    inside = [(t, v) for t, v in samples if start <= t <= end and v is not None]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 1.0:
        return None
    (t0, v0), (t1, v1) = inside[0], inside[-1]
    return round((v1 - v0) / 1000 / (t1 - t0), 3)


def threads(pid: int) -> dict:
    """Per thread of `pid`: (ns on a CPU, ns waiting for one, involuntary
    switches, the CPU it last ran on, its state), from /proc (schedstat, stat,
    status). A thread that ended meanwhile is left out."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(base + "/schedstat") as f:
                run, wait, _n = (int(x) for x in f.read().split())
            with open(base + "/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            with open(base + "/status") as f:
                inv = next(int(ln.split()[1]) for ln in f if ln.startswith("nonvoluntary_ctxt"))
        except (OSError, ValueError, StopIteration):
            continue
        out[int(tid)] = (run, wait, inv, int(st[36]), st[0])
    return out


def cpu_use(cpu: list, start: float, end: float, held: float | None) -> dict | None:
    """Over [start, end] from `cpu` samples (t, workload threads, daemon
    threads): the workload's busiest thread's time on a CPU and waiting for
    one, per second it ran (wall time less time held); its involuntary
    switches per such second; the daemon's CPU per wall second; and the share
    of samples in which a running daemon thread sat on that thread's CPU."""
    inside = [c for c in cpu if start <= c[0] <= end]
    if len(inside) < 2:
        return None
    (t0, w0, d0), (t1, w1, d1) = inside[0], inside[-1]
    ran_s = (t1 - t0) * (1.0 - (held or 0.0))
    if ran_s <= 0:
        return None
    busiest = max((tid for tid in w1 if tid in w0), key=lambda tid: w1[tid][0] - w0[tid][0], default=None)
    if busiest is None:
        return None
    run, wait, inv = (w1[busiest][i] - w0[busiest][i] for i in range(3))
    daemon = sum(d1[t][0] - d0[t][0] for t in d1 if t in d0)
    same = sum(1 for _t, w, d in inside if busiest in w and any(
        v[4] == "R" and v[3] == w[busiest][3] for v in d.values()))
    return {"on_cpu": round(run / 1e9 / ran_s, 3), "rq_wait": round(wait / 1e9 / ran_s, 3),
            "preempted_per_s": round(inv / ran_s, 1),
            "daemon_cpu": round(daemon / 1e9 / (t1 - t0), 3),
            "daemon_same_cpu": round(same / len(inside), 3)}


class Gpu:
    """Device 0's SM clock (MHz), utilization (%) and clock event reasons
    (a bit mask), read through NVML; None where NVML cannot say."""

    def __init__(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            self.nvml, self.h = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:  # noqa: BLE001 - a bench reading; missing is shown as null
            self.nvml = self.h = None

    def read(self) -> tuple | None:
        if self.h is None:
            return None
        n = self.nvml
        try:
            reasons = (n.nvmlDeviceGetCurrentClocksEventReasons if hasattr(
                n, "nvmlDeviceGetCurrentClocksEventReasons")
                else n.nvmlDeviceGetCurrentClocksThrottleReasons)(self.h)
            return (n.nvmlDeviceGetClockInfo(self.h, n.NVML_CLOCK_SM),
                    n.nvmlDeviceGetUtilizationRates(self.h).gpu, int(reasons))
        except Exception:  # noqa: BLE001
            return None


def gpu_use(gpu: list, start: float, end: float) -> dict | None:
    """Over [start, end] from `gpu` samples (t, Gpu.read()): the mean and
    lowest SM clock, the mean utilization, and every clock event reason seen."""
    inside = [g for t, g in gpu if start <= t <= end and g is not None]
    if not inside:
        return None
    reasons = 0
    for _mhz, _u, r in inside:
        reasons |= r
    return {"sm_mhz": round(sum(g[0] for g in inside) / len(inside)),
            "sm_mhz_min": min(g[0] for g in inside),
            "util": round(sum(g[1] for g in inside) / len(inside), 1),
            "reasons": hex(reasons)}


def write_policy(path: str, caps: dict) -> None:
    """The daemon's policy file: an SM cap per group of `caps` ({group: cap};
    a cap of None or 0 leaves the group uncapped)."""
    rules = [f'[[group]]\nmatch = "{g}"\nsm = {c}\n' for g, c in caps.items() if c]
    text = "\n".join(rules) or '[[group]]\nmatch = "nobody"\nmemory = "1Gi"\n'
    tmp = path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chown(tmp, 0, 0)
    os.replace(tmp, path)


def stretch(lines: list, start: float, end: float, cap: int, before, after,
            settle: float) -> dict:
    """A capped stretch [start, end] (its first `settle` s left out) against
    the free stretches `before` and `after` ((start, end) of their counted
    part, or None): its rate, the free rates and how far apart they are
    (ref_apart, steady), its percentage of them
    (of_free), whether within 5 points of `cap`, its first seconds' rate
    against them, and its per-second series."""
    free = [sp for sp in (before, after) if sp]
    ref_before, ref_after = (mean_rate(lines, *sp)[0] if sp else None for sp in (before, after))
    rate, series = mean_rate(lines, start + settle, end)
    refs = [r for r in (ref_before, ref_after) if r]
    ref = sum(refs) / len(refs) if refs else None
    apart = ref_apart(ref_before, ref_after)
    pct = of_free(lines, free, start + settle, end)
    first = mean_rate(lines, start, start + settle)[0]
    under = under_floor_s(lines, free, start + settle, end, cap)
    return {"cap": cap, "rate": rate and round(rate, 3),
            "ref_before": ref_before and round(ref_before, 3),
            "ref_after": ref_after and round(ref_after, 3),
            "ref_apart": apart, "steady": apart is not None and apart <= REF_STEADY,
            "pct": pct and round(pct, 1),
            "within5": pct is not None and abs(pct - cap) <= 5,
            "first_s_pct": first and ref and round(100 * first / ref, 1),
            "under_floor_s": under and round(under, 1), "series": series}


def ref_apart(before: float | None, after: float | None) -> float | None:
    """How far apart two free rates are, in percent of their mean (None
    where either is missing)."""
    if not before or not after:
        return None
    return round(100 * abs(before - after) / ((before + after) / 2), 1)


def stretch_columns(ref: str) -> list:
    """markdown() columns of stretch()'s fields and "held"; `ref` names the reference."""
    return [("cap", "cap", "r"), ("capped rate", "rate", "r"),
            (f"own {ref} before / after", lambda r: f"{r['ref_before']} / {r['ref_after']}", "r"),
            (f"{ref} before / after apart (%)", lambda r: f"{r['ref_apart']} (moved)"
             if r["ref_apart"] is not None and not r["steady"] else r["ref_apart"], "r"),
            (f"% of {ref}", "pct", "r"),
            ("within ±5", lambda r: "yes" if r["within5"] else "no", "l"),
            ("first 3 s", "first_s_pct", "r"),
            ("longest under cap − 10 (s)", "under_floor_s", "r"), ("time held", "held", "r")]


def markdown(rows: list, columns: list) -> None:
    """Print rows as a markdown table: columns [(heading, key or function
    of a row, "l" or "r")]."""
    print("\n| " + " | ".join(h for h, _k, _a in columns) + " |")
    print("|" + "|".join("---" if al == "l" else "---:" for _h, _k, al in columns) + "|")
    for r in rows:
        cells = [k(r) if callable(k) else r[k] for _h, k, _a in columns]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def tally(rows: list) -> dict:
    """Stretches within ±5 of their cap, of all and of those whose
    reference was steady."""
    steady = [r for r in rows if r["steady"]]
    return {"stretches": len(rows), "within5": sum(r["within5"] for r in rows),
            "steady": len(steady), "steady_within5": sum(r["within5"] for r in steady)}


def tally_line(t: dict) -> str:
    return (f"within ±5: {t['within5']} of {t['stretches']} stretches; with a steady "
            f"reference (free stretches within {REF_STEADY:g}%): {t['steady_within5']} of {t['steady']}")


def reader(p: subprocess.Popen, q: queue.Queue) -> None:
    for line in p.stdout:
        q.put((time.monotonic(), line))
    q.put((time.monotonic(), None))


def stop(p: subprocess.Popen) -> None:
    """End a workload: SIGTERM, then SIGKILL after 20 s."""
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()


def mean_rate(lines: list, start: float, end: float, phase: str | None = None) -> tuple[float | None, list]:
    """Units per second over the workload's intervals that lie in [start, end]
    (only those of `phase`, where given)."""
    n = t = 0.0
    series = []
    for arrived, rec in lines:
        s = arrived - rec["dt"]
        if s >= start and arrived <= end and (phase is None or rec.get("phase") == phase):
            n += rec["n"]
            t += rec["dt"]
            series.append(round(rec["rate"], 2))
    return (n / t if t > 0 else None), series


def phase_times(lines: list, start: float, end: float) -> dict:
    """Seconds of intervals in [start, end] per phase (a workload whose lines
    carry "phase": train and eval steps differ in rate, and a free stretch
    holds a different mix of them each time)."""
    out: dict = {}
    for arrived, rec in lines:
        if "phase" in rec and arrived - rec["dt"] >= start and arrived <= end:
            out[rec["phase"]] = out.get(rec["phase"], 0.0) + rec["dt"]
    return out


def free_rate(lines: list, free: list, phase: str | None = None) -> float | None:
    """The mean of the free stretches' (`free`, [(start, end)]) rates, in
    `phase` where given; None where none has one."""
    rates = [r for r in (mean_rate(lines, a, b, phase)[0] for a, b in free) if r]
    return sum(rates) / len(rates) if rates else None


FLOOR_POINTS = 10       # the fail-open floor: this many points under the cap
MIN_INTERVAL_S = 0.25   # shorter intervals (a phase change's remainder) tell nothing


def under_floor_s(lines: list, free: list, start: float, end: float, cap: float) -> float | None:
    """The longest run of consecutive intervals in [start, end] whose rate is
    under cap − FLOOR_POINTS percent of the free stretches' (`free`), in
    seconds; a phase's intervals against the free rate in that phase. None
    without a free rate."""
    refs: dict = {}

    def ref(phase):
        if phase not in refs:
            refs[phase] = free_rate(lines, free, phase)
        return refs[phase]

    if ref(None) is None:
        return None
    run = longest = 0.0
    for arrived, rec in lines:
        if arrived - rec["dt"] < start or arrived > end or rec["dt"] < MIN_INTERVAL_S:
            continue
        r = ref(rec.get("phase"))
        if r is None:
            continue
        run = run + rec["dt"] if 100 * rec["rate"] / r < cap - FLOOR_POINTS else 0.0
        longest = max(longest, run)
    return longest


def of_free(lines: list, free: list, start: float, end: float) -> float | None:
    """The stretch [start, end]'s rate against the free stretches `free`
    ([(start, end)]): per phase where the lines have phases (each phase's
    rate against the free stretches' rate in that phase, weighted by the
    stretch's time in it), else overall."""
    def ratio(phase=None):
        rate, ref = mean_rate(lines, start, end, phase)[0], free_rate(lines, free, phase)
        return rate / ref if rate and ref else None
    times = phase_times(lines, start, end)
    if not times:
        r = ratio()
        return None if r is None else 100 * r
    parts = [(ratio(ph), secs) for ph, secs in times.items()]
    parts = [(r, secs) for r, secs in parts if r is not None]
    total = sum(secs for _r, secs in parts)
    return 100 * sum(r * secs for r, secs in parts) / total if total else None


def run_one(a, w: str) -> list[dict]:
    group = f"ab-{w.replace('@', '-')}-{os.getpid()}"
    seg = [None] + [c for cap in a.caps for c in (cap, None)]
    lengths = [a.ref_s if c is None else a.cap_s for c in seg]
    total = sum(lengths) + 5
    write_policy(a.policy, {group: None})
    os.kill(a.daemon_pid, signal.SIGHUP)
    env = dict(os.environ, HAMI_GROUP=group)
    env.pop("CUDA_DEVICE_SM_LIMIT", None)
    script, args = workload_command(w)
    cmd = ["python3", script, "--seconds", str(total), *args]
    if a.cpus:
        cmd = ["taskset", "-c", a.cpus, *cmd]
    log = open(os.path.join(a.out, f"ab-{w}.log"), "w")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    q: queue.Queue = queue.Queue()
    threading.Thread(target=reader, args=(p, q), daemon=True).start()
    lines: list = []
    samples: list = []
    cpu: list = []
    gpu: list = []
    dev = Gpu()
    next_sample = 0.0
    edges: list[tuple[float, int | None]] = []
    deadline = time.monotonic() + a.setup_limit
    started = None
    try:
        while True:
            timeout = max(0.0, deadline - time.monotonic())
            try:
                arrived, line = q.get(timeout=min(timeout, 0.2) or 0.01)
            except queue.Empty:
                arrived, line = time.monotonic(), ""
            if line is None:
                break
            if line.startswith("{"):
                rec = json.loads(line)
                if "rate" in rec and not rec.get("summary"):
                    lines.append((arrived, rec))
                    if started is None:
                        started = arrived - rec["dt"]
                        at = started
                        for cap, length in zip(seg, lengths):
                            edges.append((at, cap))
                            at += length
                        edges.append((at, "end"))
            now = time.monotonic()
            if started is not None and now >= next_sample:
                samples.append((now, held_ms()))
                cpu.append((now, threads(p.pid), threads(a.daemon_pid)))
                gpu.append((now, dev.read()))
                next_sample = now + 0.25
            if started is None and now > deadline:
                print(json.dumps({"w": w, "error": "no timed loop before the set-up limit"}))
                return []
            # Apply the cap of the stretch we are in (once each).
            while started is not None and edges and edges[0][0] <= now:
                at, cap = edges.pop(0)
                if cap == "end":
                    edges.clear()
                    break
                write_policy(a.policy, {group: cap})
                os.kill(a.daemon_pid, signal.SIGHUP)
                done_edges.append((at, cap))
            if started is not None and not edges and now > started + sum(lengths):
                break
    finally:
        stop(p)
        log.close()
        write_policy(a.policy, {group: None})
        os.kill(a.daemon_pid, signal.SIGHUP)
    out = []
    spans = [(at, cap, (done_edges[i + 1][0] if i + 1 < len(done_edges) else at + a.ref_s))
             for i, (at, cap) in enumerate(done_edges)]
    for i, (s, cap, e) in enumerate(spans):
        if cap is None:
            continue
        before, after = ((spans[j][0] + 1.0, spans[j][2]) if 0 <= j < len(spans) else None
                         for j in (i - 1, i + 1))
        free = [sp for sp in (before, after) if sp]
        held = held_share(samples, s + a.settle, e)
        r = {"w": w, **stretch(lines, s, e, cap, before, after, a.settle),
             "held": held, "cpu": cpu_use(cpu, s + a.settle, e, held),
             "cpu_free": [cpu_use(cpu, a0, b0, 0.0) for a0, b0 in free],
             "gpu": gpu_use(gpu, s + a.settle, e),
             "gpu_free": [gpu_use(gpu, a0, b0) for a0, b0 in free],
             "free_series": [mean_rate(lines, a0 - 1.0, b0)[1] for a0, b0 in free]}
        print(json.dumps(r), flush=True)
        out.append(r)
    return out


done_edges: list = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--daemon-pid", type=int, required=True, dest="daemon_pid")
    ap.add_argument("--out", required=True)
    ap.add_argument("--workloads", default=os.environ.get(
        "AB_WORKLOADS", "llm_decode cnn_train jax_train phased"))
    ap.add_argument("--caps", default=os.environ.get("CAPS", "25 50 75"))
    ap.add_argument("--ref-s", type=float, default=float(os.environ.get("AB_REF_S", "6")))
    ap.add_argument("--cap-s", type=float, default=float(os.environ.get("AB_CAP_S", "9")))
    ap.add_argument("--settle", type=float, default=3.0)
    ap.add_argument("--setup-limit", type=float, default=120.0)
    ap.add_argument("--cpus", default=os.environ.get("AB_CPUS", "2-5"))
    a = ap.parse_args()
    a.caps = [int(c) for c in a.caps.split()]
    rows = []
    for w in a.workloads.split():
        done_edges.clear()
        rows += run_one(a, w)
    markdown(rows, [("workload", "w", "l"), *stretch_columns("uncapped")])
    print("\n" + tally_line(tally(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
