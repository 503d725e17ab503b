#!/usr/bin/env python3
"""What stopping and continuing a workload does to its speed, with no daemon.

hami-bpf holds a group by SIGSTOP and releases it by SIGCONT. This runs one
workload of bench/gpu/workloads/ and drives the same signals from here on a
plan of segments: `free:S` (never stopped), `dC:S` (duty: in every
--period, running C% of it, stopped the rest), `capC:S` (the daemon caps
the workload's group at C%: its --policy file rewritten, then SIGHUP to
--daemon-pid) and `capCdD:S` (both: cap99d50 attaches the daemon's probes,
which hold almost never at 99, while the script stops the workload), each S
seconds. The process's stops are read from /proc every
millisecond, whoever made them, and its units' times from the workload
(BENCH_UNIT_TRACE), so each segment also says its stops per second, their
and the slices' mean length, and its rate by time since the last resume. Per segment it
prints the workload's rate, the rate per second of running (rate / C%), that
against the mean of the free segments on either side, the process's CPU
seconds per second of running and work units per CPU second, and the CPUs its
main thread ran on.

If a workload runs as fast between stops as it runs free, the rate per
running second is ~100% of free: a controller that runs it C% of the time
gets C% of its speed. Below 100% is what stopping itself costs (caches,
clocks, scheduling), which no controller can see from outside.

    python3 bench/gpu/stopcont.py [--workload llm_decode] [--period 0.2]
        [--plan "free:6 d50:8 free:6 d25:8 free:6 d75:8 free:6"]
        [--pin CPU] [--spin CPU,CPU] [--idle-spin CPU] [--json F] [-- workload args]
"""
import argparse
import bisect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TICK = os.sysconf("SC_CLK_TCK")


def parse_plan(text):
    """[(name, duty, cap, seconds)]: free (duty 100, no cap), dC (the script
    stops it), capC (the daemon caps its group at C; duty 100 here)."""
    out = []
    for item in text.split():
        name, _, secs = item.partition(":")
        capped, _, stops = name.partition("d")
        cap = int(capped[3:]) if capped.startswith("cap") else None
        duty = 100 if name == "free" or (cap and not stops) else int(stops)
        if not 0 < duty <= 100 or (cap is not None and not 0 < cap <= 100):
            raise SystemExit(f"plan item {item!r}: duty and cap must be 1..100")
        out.append((name, duty, cap, float(secs)))
    return out


class StopSampler(threading.Thread):
    """The process's stopped/running transitions, read from /proc every
    SAMPLE_S: where the holds fell, whoever made them."""
    SAMPLE_S = 0.001

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.edges, self.halt = pid, [], threading.Event()

    def run(self):
        last = False
        while not self.halt.wait(self.SAMPLE_S):
            now = stopped(self.pid)
            if now is None:
                return
            if now != last:
                self.edges.append((time.monotonic(), now))
                last = now


class GpuSampler(threading.Thread):
    """The GPU's SM clock (MHz) and power (W) every SAMPLE_S from NVML: a
    GPU that lowers its clocks while a group is held runs the group's next
    slice slower, which a stop's cost on the host alone would not show."""
    SAMPLE_S = 0.005

    def __init__(self, index=0):
        super().__init__(daemon=True)
        self.index, self.samples, self.halt = index, [], threading.Event()

    def run(self):
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(self.index)
        except Exception as e:  # noqa: BLE001 - a bench without NVML reports no clocks
            print(f"no NVML clocks: {e}", file=sys.stderr)
            return
        while not self.halt.wait(self.SAMPLE_S):
            try:
                self.samples.append((time.monotonic(),
                                     pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                                     pynvml.nvmlDeviceGetPowerUsage(h) / 1000))
            except Exception:  # noqa: BLE001
                pass


def clock_profile(samples, spans, t0, t1):
    """Mean SM clock and power while running and while stopped, and the SM
    clock by time since resume (BINS)."""
    run, held = [], []
    by = [[] for _ in BINS]
    resumes = [t0] + [b for _, b in spans]
    k = 0
    for t, mhz, watts in samples:
        if not t0 <= t < t1:
            continue
        while k < len(spans) and spans[k][1] <= t:
            k += 1
        if k < len(spans) and spans[k][0] <= t < spans[k][1]:
            held.append((mhz, watts))
            continue
        run.append((mhz, watts))
        by[since_bin(t, resumes)].append(mhz)
    mean = lambda xs, i: sum(x[i] for x in xs) / len(xs) if xs else None
    return {"sm_mhz_run": mean(run, 0), "sm_mhz_held": mean(held, 0),
            "watts_run": mean(run, 1), "watts_held": mean(held, 1),
            "sm_mhz_by_since": [sum(b) / len(b) if b else None for b in by]}


def stopped_spans(edges, t0, t1):
    """[(start, end)] stopped inside [t0, t1]."""
    spans, start = [], None
    for t, stopped in edges:
        if stopped and start is None:
            start = t
        elif not stopped and start is not None:
            spans.append((start, t))
            start = None
    if start is not None:
        spans.append((start, t1))
    return [(max(a, t0), min(b, t1)) for a, b in spans if b > t0 and a < t1]


# Time since the last resume, in seconds: a loop slower just after a stop
# than later shows what each stop costs, apart from what holds it steadily.
BINS = (0.0, 0.025, 0.05, 0.1, 0.2, 0.4)


def since_bin(t, resumes):
    """The BINS index of the time from the last resume at or before t
    (resumes in order, the first at or before t)."""
    return bisect.bisect_right(BINS, t - resumes[bisect.bisect_right(resumes, t) - 1]) - 1


def slice_profile(times, units, spans, t0, t1):
    """Units per second of running in each BINS bin of time since resume,
    the stops' count and mean length, the running slices' mean length."""
    run_s = [0.0] * len(BINS)
    done = [0.0] * len(BINS)
    resumes = [t0] + [b for _, b in spans]
    stops_at = [a for a, _ in spans] + [t1]
    for r, e in zip(resumes, stops_at):
        for i, lo in enumerate(BINS):
            hi = BINS[i + 1] if i + 1 < len(BINS) else float("inf")
            run_s[i] += max(0.0, min(e, r + hi) - (r + lo))
    for t, n in zip(times, units):
        if t0 <= t < t1:
            done[since_bin(t, resumes)] += n
    slices = [e - r for r, e in zip(resumes, stops_at)]
    return {"stops": len(spans),
            "stop_ms": 1000 * sum(b - a for a, b in spans) / len(spans) if spans else None,
            "slice_ms": 1000 * sum(slices) / len(slices) if spans else None,
            "by_since": [{"from_ms": int(1000 * lo), "run_s": round(rs, 3),
                          "rate": (d / rs) if rs > 0.05 else None}
                         for lo, rs, d in zip(BINS, run_s, done)]}


def stopped(pid):
    """Whether the process is stopped now (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return None


def cpu_seconds(pid):
    """User + system CPU seconds of a process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK
    except (OSError, IndexError, ValueError):
        return None


def main_cpu(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return None


def spinner(cpu, idle=False):
    # idle: SCHED_IDLE, so it runs only while nothing else wants that CPU
    # (the stopped workload's CPU stays busy, and yields the moment it runs).
    cmd = ["taskset", "-c", str(cpu), sys.executable, "-c", "while True: pass"]
    return subprocess.Popen(["chrt", "-i", "0", *cmd] if idle else cmd)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="llm_decode")
    ap.add_argument("--plan", default="free:6 d50:8 free:6 d25:8 free:6 d75:8 free:6")
    ap.add_argument("--period", type=float, default=0.2, help="seconds of one stop-and-run cycle")
    ap.add_argument("--pin", default=None, help="taskset CPU list for the workload")
    ap.add_argument("--spin", default="", help="CPUs to keep busy with a Python spin loop meanwhile")
    ap.add_argument("--idle-spin", default="",
                    help="CPUs to keep busy with a SCHED_IDLE spin loop (e.g. the --pin CPU: it never idles)")
    ap.add_argument("--json", default=None, help="write the per-segment results here")
    ap.add_argument("--label", default="")
    ap.add_argument("--policy", default=None,
                    help="the daemon's policy file, for capC items (with --daemon-pid)")
    ap.add_argument("--daemon-pid", type=int, default=None)
    a, rest = ap.parse_known_args()
    rest = [r for r in rest if r != "--"]
    plan = parse_plan(a.plan)
    if any(cap for _, _, cap, _ in plan) and not (a.policy and a.daemon_pid):
        raise SystemExit("capC items need --policy and --daemon-pid")
    total = sum(s for _, _, _, s in plan)
    sync = tempfile.mkdtemp(prefix="stopcont-")
    trace = os.path.join(sync, "units.json")
    group = f"stopcont-{os.getpid()}"
    if a.policy:
        from suite_ab import write_policy   # this directory: the daemon's policy file
        set_cap = lambda cap: (write_policy(a.policy, {group: cap}), os.kill(a.daemon_pid, signal.SIGHUP))
        set_cap(None)
    cmd = [sys.executable, os.path.join(HERE, "workloads", f"{a.workload}.py"),
           "--seconds", str(total + 1), "--sync-dir", sync, *rest]
    if a.pin:
        cmd = ["taskset", "-c", a.pin, *cmd]
    env = dict(os.environ, BENCH_UNIT_TRACE=trace, HAMI_GROUP=group)
    if a.policy:
        env.pop("CUDA_DEVICE_SM_LIMIT", None)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(json.loads(l) for l in p.stdout
                                                         if l.startswith("{")), daemon=True)
    reader.start()
    open(os.path.join(sync, "go"), "w").close()
    while not os.path.exists(os.path.join(sync, "ready")):
        if p.poll() is not None:
            raise SystemExit(f"{a.workload} exited {p.returncode} before it was ready")
        time.sleep(0.05)
    spins = ([spinner(c) for c in a.spin.split(",") if c]
             + [spinner(c, idle=True) for c in a.idle_spin.split(",") if c])
    segs = []
    sampler = StopSampler(p.pid)
    sampler.start()
    gpu = GpuSampler()
    gpu.start()
    try:
        open(os.path.join(sync, "start"), "w").close()
        for name, duty, cap, secs in plan:
            if cap:
                set_cap(cap)
            t0, c0 = time.monotonic(), cpu_seconds(p.pid)
            cpus = {}
            end = t0 + secs
            while time.monotonic() < end:
                cyc = time.monotonic()
                run_for = min(a.period * duty / 100, end - cyc)
                c = main_cpu(p.pid)
                cpus[c] = cpus.get(c, 0) + 1
                time.sleep(max(run_for, 0))
                if duty < 100 and time.monotonic() < end:
                    os.kill(p.pid, signal.SIGSTOP)
                    time.sleep(min(a.period - run_for, max(end - time.monotonic(), 0)))
                    os.kill(p.pid, signal.SIGCONT)
            t1, c1 = time.monotonic(), cpu_seconds(p.pid)
            if cap:
                set_cap(None)
            segs.append({"name": name, "duty": duty, "cap": cap, "t0": t0, "t1": t1,
                         "cpu_s": (c1 - c0) if c0 is not None and c1 is not None else None,
                         "cpus": {str(k): v for k, v in sorted(cpus.items(), key=lambda kv: -kv[1])}})
    finally:
        if a.policy:
            set_cap(None)
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        for s in spins:
            s.kill()
    p.wait(timeout=120)
    reader.join(timeout=5)
    sampler.halt.set()
    gpu.halt.set()
    try:
        with open(trace) as f:
            tr = json.load(f)
    except (OSError, ValueError):
        tr = {"t": [], "n": []}
    summ = next((l for l in lines if l.get("summary")), None)
    if summ is None:
        raise SystemExit(f"{a.workload}: no summary line (exit {p.returncode})")
    mono0 = summ["mono0"]
    for s in segs:
        # Whole intervals only, inside the segment, after its first second.
        units = secs = 0.0
        for l in lines:
            if l.get("summary"):
                continue
            lo, hi = mono0 + l["t"], mono0 + l["t"] + l["dt"]
            if lo >= s["t0"] + 1.0 and hi <= s["t1"]:
                units += l["n"]
                secs += l["dt"]
        s["rate"] = units / secs if secs else None
        # Running time from /proc (whoever stopped it), after the first second.
        spans = stopped_spans(sampler.edges, s["t0"] + 1.0, s["t1"])
        s["ran"] = (s["t1"] - s["t0"] - 1.0) - sum(b - a for a, b in spans)
        s["run_frac"] = s["ran"] / (s["t1"] - s["t0"] - 1.0)
        whole = stopped_spans(sampler.edges, s["t0"], s["t1"])
        s["ran_all"] = (s["t1"] - s["t0"]) - sum(b - a for a, b in whole)
        s["profile"] = slice_profile(tr["t"], tr["n"], spans, s["t0"] + 1.0, s["t1"])
        s["clocks"] = clock_profile(gpu.samples, spans, s["t0"] + 1.0, s["t1"])
        s["rate_per_run_s"] = s["rate"] / s["run_frac"] if s["rate"] else None
        s["cpu_per_run_s"] = s["cpu_s"] / s["ran_all"] if s["cpu_s"] is not None and s["ran_all"] else None
        s["units_per_cpu_s"] = (units / secs * (s["t1"] - s["t0"]) / s["cpu_s"]
                                if s["cpu_s"] and secs else None)
    for i, s in enumerate(segs):
        if s["name"] == "free":
            continue
        near = [segs[j]["rate"] for j in (i - 1, i + 1)
                if 0 <= j < len(segs) and segs[j]["name"] == "free" and segs[j]["rate"]]
        ref = sum(near) / len(near) if near else None
        s["free_ref"] = ref
        s["of_free"] = 100 * s["rate"] / ref if ref and s["rate"] else None
        s["run_of_free"] = 100 * s["rate_per_run_s"] / ref if ref and s["rate_per_run_s"] else None
    unit = summ.get("unit", "")
    print(f"# {a.workload} {a.label} period {a.period}s pin {a.pin or '-'} spin {a.spin or '-'} "
          f"idle-spin {a.idle_spin or '-'} ({unit})")
    print("| segment | rate | % of free | per running s, % of free | stops/s | stop / slice ms "
          "| per running s by time since resume (ms), % of free | CPU s / running s "
          "| units / CPU s | SM MHz running / held | SM MHz by time since resume | W running / held "
          "| main thread's CPUs |")
    print("|---|---:|---:|---:|---:|---|---|---:|---:|---|---|---|---|")
    f = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"
    for s in segs:
        pr, ref, ck = s["profile"], s.get("free_ref") or s["rate"], s["clocks"]
        since = " ".join(f"{b['from_ms']}+:{f(100 * b['rate'] / ref, 0) if b['rate'] and ref else '-'}"
                         for b in pr["by_since"])
        print(f"| {s['name']} | {f(s['rate'])} | {f(s.get('of_free'))} | {f(s.get('run_of_free'))} | "
              f"{f(pr['stops'] / max(s['t1'] - s['t0'] - 1.0, 1e-9), 1)} | "
              f"{f(pr['stop_ms'], 0)} / {f(pr['slice_ms'], 0)} | {since} | "
              f"{f(s['cpu_per_run_s'], 2)} | {f(s['units_per_cpu_s'])} | "
              f"{f(ck['sm_mhz_run'], 0)} / {f(ck['sm_mhz_held'], 0)} | "
              f"{' '.join(f(v, 0) for v in ck['sm_mhz_by_since'])} | "
              f"{f(ck['watts_run'], 0)} / {f(ck['watts_held'], 0)} | "
              f"{' '.join(f'{k}:{v}' for k, v in list(s['cpus'].items())[:4])} |")
    if a.json:
        with open(a.json, "a") as fh:
            fh.write(json.dumps({"workload": a.workload, "label": a.label, "period": a.period,
                                 "pin": a.pin, "spin": a.spin, "idle_spin": a.idle_spin,
                                 "segments": segs}) + "\n")


if __name__ == "__main__":
    main()
