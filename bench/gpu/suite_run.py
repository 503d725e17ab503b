#!/usr/bin/env python3
"""Runs the real-workload SM-cap suite's processes (bench/gpu/suite.sh starts
the daemon and calls this). Every figure is taken against the same
invocation's uncapped reference of the same workload.

Order (ORDER): refs-first (default) measures every uncapped reference the
invocation needs first, with no SM cap anywhere (so no launch probe either),
then the capped runs; per-workload runs each workload's reference right
before its capped runs, waiting for the capped processes before it to exit.

Sections (SECTIONS, default "single service pair"; run in the order named, so
a budget too short for all of them leaves out the last):
  single   per workload: an uncapped reference (group base-<w>) and one run per
           cap in CAPS, each in its own group (cap<c>-<w>, CUDA_DEVICE_SM_LIMIT=<c>)
  service  llm_decode capped at SERVICE_CAP (50) while short-lived members of
           its group (workloads/churner.py) start and exit around it
  pair     for each "a:b" in PAIRS and each split "x:y" in SPLITS: a capped
           at x and b at y, in two groups, started together
  twin     for each workload in TWINS (default llm_decode): two processes of
           it at once in two groups, side a capped at each cap in CAPS and
           side b uncapped, and once both uncapped. Side a is judged against
           side b over the same seconds: a host-bound loop's own speed drifts
           with the machine's CPU from one stretch of seconds to the next (a
           decode loop by up to 2x), which a reference taken at another time
           cannot cancel and a twin running beside it does, as far as the
           drift is the machine's; the both-uncapped run says how far that is.
           With "service" too, the service run gets an uncapped twin.
A workload that a pair or the service needs and that the single section does
not measure gets its own uncapped reference too.

Environment: WORKLOADS, CAPS, PAIRS, SPLITS, TWINS, SUITE_SECONDS (timed loop per run,
default 10), SERVICE_CAP, QUICK=1 (caps 50 only, one pair at 30:70),
ARGS_<workload> (extra arguments, e.g. ARGS_cnn_train="--arch resnet18"),
a variant label <workload>@<v> wherever a workload is named (its arguments
from ARGS_<workload>_<v>; e.g. WORKLOADS="cnn_train cnn_train@big" with
ARGS_cnn_train_big="--batch 256": the same script twice, each against its
own reference),
PIN=0 (no CPU pinning).

Start-up overlaps: the next run's processes are started (on spare CPUs) while
the current run is timed; they import their libraries and wait for a "go"
file before touching the GPU (workloads/common.py). Not during a reference
run when the next one is capped: the daemon registers a process at cuInit,
which some imports reach, and a capped group attaches the launch probes
(~1 us per launch) that a reference must run without; and a reference starts
only once the previous run's processes have exited (plus --detach-wait).
Any other run waits up to --exit-wait s for them. Each run: go -> all
ready (warm-up done, SETUP_LIMIT s at most) -> start -> exit (timed loop +
EXIT_GRACE s at most, then SIGKILL). A run whose estimate would pass
--budget seconds is skipped (and listed), so the command ends in time.

Output: --out/suite.jsonl: every workload line, tagged with "run", "kind"
(ref|cap|service|pair), "cap" (null when uncapped), "group", "side" and
"ref" (the label of the uncapped run it is compared with); NVML device
utilization samples ({"nvml": ...}, every 0.5 s, tagged with the run then
timed and "rt", seconds since its start); one {"run_end": ...} line per run
(with "cpu": CPU seconds per second of the timed stretch, of each process
and of the daemon, whose pid DAEMON_PID gives),
{"exit": ...} with each process's exit status, {"stopped": run, "side",
"share": [...]} per capped process (the share of each second since the run's
start it spent stopped, read from /proc every STOP_SAMPLE_S), and
{"skipped": ...} for runs left out. Workload stderr: --out/logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from stopcont import cpu_seconds, stopped     # this directory: the script's own

HERE = os.path.dirname(os.path.abspath(__file__))
WDIR = os.environ.get("SUITE_WORKLOAD_DIR") or os.path.join(HERE, "workloads")


def workload_command(label: str) -> tuple[str, list[str]]:
    """A workload label's script and extra arguments: "<w>" runs
    workloads/<w>.py with ARGS_<w>, a variant "<w>@<v>" the same script with
    ARGS_<w>_<v>."""
    name, _, variant = label.partition("@")
    env = f"ARGS_{name}_{variant}" if variant else f"ARGS_{name}"
    return os.path.join(WDIR, f"{name}.py"), os.environ.get(env, "").split()


ALL = ["cnn_train", "llm_decode", "llm_prefill", "graph_replay", "jax_train", "triton_loop", "phased",
       "compiled_train"]
PY = sys.executable
STOP_SAMPLE_S = 0.002     # how often a capped process's state is read
DAEMON_PID = int(os.environ.get("DAEMON_PID") or 0) or None


@dataclass
class Proc:
    workload: str
    group: str
    cap: int | None
    side: str
    cpus: set[int] | None
    popen: subprocess.Popen | None = None
    sync: str = ""
    summary: dict | None = None
    reader: threading.Thread | None = None
    rc: int | None = None


@dataclass
class Run:
    label: str
    kind: str
    procs: list[Proc]
    ref: dict[str, str] = field(default_factory=dict)   # workload -> reference run label
    churn: bool = False
    t_start: float | None = None


class Suite:
    def __init__(self, a):
        self.a = a
        self.out = a.out
        os.makedirs(os.path.join(self.out, "logs"), exist_ok=True)
        self.jsonl = open(os.path.join(self.out, "suite.jsonl"), "a")
        self.lock = threading.Lock()
        self.current: Run | None = None
        self.refs: dict[str, float] = {}          # reference label -> rate after 5 s
        self.groups: set[str] = set()
        self.tmp = f"/tmp/hami-suite-{os.getpid()}"
        os.makedirs(self.tmp, exist_ok=True)
        self.t0 = time.monotonic()
        self.live: list[subprocess.Popen] = []
        ncpu = os.cpu_count() or 1
        pin = os.environ.get("PIN", "1") != "0" and ncpu >= 16
        # Timed processes on fixed CPUs (launch-bound loops run at different
        # rates on different CPUs); the next run imports on spare ones.
        self.cpus = {"a": {2, 3, 4, 5}, "b": {6, 7, 8, 9}, "spare": set(range(10, ncpu))} if pin else None
        self.stop_samplers = threading.Event()
        self.stopped: dict[tuple[str, str], list[list[int]]] = {}   # (run, side) -> [[samples, stopped]] per s

    # --- output -----------------------------------------------------------
    def write(self, obj: dict) -> None:
        with self.lock:
            self.jsonl.write(json.dumps(obj) + "\n")
            self.jsonl.flush()

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def group(self, name: str) -> str:
        g, i = name, 2
        while g in self.groups:
            g, i = f"{name}-{i}", i + 1
        self.groups.add(g)
        return g

    # --- processes --------------------------------------------------------
    def spawn(self, run: Run) -> None:
        """Start a run's processes: they import, then wait for their go file."""
        for p in run.procs:
            p.sync = os.path.join(self.tmp, f"{run.label}-{p.side}")
            shutil.rmtree(p.sync, ignore_errors=True)
            os.makedirs(p.sync)
            env = dict(os.environ, HAMI_GROUP=p.group, PYTHONUNBUFFERED="1")
            env.pop("CUDA_DEVICE_SM_LIMIT", None)
            if p.cap is not None:
                env["CUDA_DEVICE_SM_LIMIT"] = str(p.cap)
            script, extra = workload_command(p.workload)
            cmd = [PY, script, "--seconds", str(self.a.seconds),
                   "--sync-dir", p.sync, "--wait-limit", "1200"] + extra
            err = open(os.path.join(self.out, "logs", f"{run.label}-{p.side}.log"), "w")
            p.popen = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True,
                                       start_new_session=True)
            err.close()
            self.live.append(p.popen)
            if self.cpus:
                self.pin(p.popen.pid, self.cpus["spare"])
            p.reader = threading.Thread(target=self.read, args=(run, p), daemon=True)
            p.reader.start()

    def read(self, run: Run, p: Proc) -> None:
        for line in p.popen.stdout:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = {"text": line[:500]}
            if not isinstance(obj, dict):
                obj = {"value": obj}
            tag = {"run": run.label, "kind": run.kind, "cap": p.cap, "group": p.group, "side": p.side,
                   "ref": run.ref.get(p.workload)}
            tag.update(obj)
            tag["w"] = p.workload   # the label: a variant is not its script's other runs
            if obj.get("summary"):
                p.summary = obj
            self.write(tag)

    @staticmethod
    def pin(pid: int, cpus: set[int]) -> None:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            tids = [pid]
        for t in tids:
            try:
                os.sched_setaffinity(t, cpus)
            except OSError:
                pass

    def kill(self, p: subprocess.Popen) -> None:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass

    def cleanup(self) -> None:
        for p in self.live:
            if p.poll() is None:
                try:                     # a moment to exit on its own first
                    p.wait(3)
                except subprocess.TimeoutExpired:
                    pass
            self.kill(p)
        shutil.rmtree(self.tmp, ignore_errors=True)

    # --- one run ----------------------------------------------------------
    def execute(self, run: Run, nxt: Run | None) -> None:
        a = self.a
        for p in run.procs:
            if self.cpus:
                self.pin(p.popen.pid, self.cpus[p.side if p.side in ("a", "b") else "a"])
            open(os.path.join(p.sync, "go"), "w").close()
        t_go = time.monotonic()
        end = min(time.monotonic() + a.setup_limit, self.t0 + a.budget + 20)
        failed = []
        while time.monotonic() < end:
            failed = [p for p in run.procs if p.popen.poll() is not None]
            if failed or all(os.path.exists(os.path.join(p.sync, "ready")) for p in run.procs):
                break
            time.sleep(0.02)
        ok = not failed and all(os.path.exists(os.path.join(p.sync, "ready")) for p in run.procs)
        setup_s = time.monotonic() - t_go
        if not ok:
            why = "exited during set-up" if failed else f"not ready after {a.setup_limit:.0f} s"
            self.say(f"{run.label}: {why}; see {self.out}/logs/{run.label}-*.log")
        else:
            for p in run.procs:
                open(os.path.join(p.sync, "start"), "w").close()
        run.t_start = time.monotonic()
        cpu0 = self.cpu_now(run)
        self.current = run
        if nxt is not None:
            self.spawn(nxt)      # imports while this one is timed
        churn = None
        if ok and run.churn:
            churn = threading.Thread(target=self.churn, args=(run,), daemon=True)
            churn.start()
        hard = self.t0 + a.budget + 20          # never past the budget by more than this
        deadline = min(hard, run.t_start + (a.seconds + a.exit_grace if ok else 0))
        # On to the next run once every process has printed its summary; one
        # still tearing down (freeing its context) is reaped in the background.
        while time.monotonic() < deadline:
            if all(p.summary is not None or p.popen.poll() is not None for p in run.procs):
                break
            time.sleep(0.02)
        for p in run.procs:
            if p.popen.poll() is not None:
                p.reader.join(2)         # its last lines
            if p.summary is None and p.popen.poll() is None:
                self.say(f"{run.label}/{p.side}: no summary after {deadline - run.t_start:.0f} s; killed")
                self.kill(p.popen)
            threading.Thread(target=self.reap, args=(run, p), daemon=True).start()
        if churn:
            churn.join(30)
        self.current = None
        took = time.monotonic() - run.t_start
        cpu1 = self.cpu_now(run)
        cpu = {k: round((cpu1[k] - cpu0[k]) / took, 3) for k in cpu0
               if cpu0[k] is not None and cpu1.get(k) is not None and took > 0}
        self.write_stopped(run)
        res = []
        for p in run.procs:
            s = p.summary or {}
            rate = s.get("rate_after5") or s.get("rate")
            if run.kind == "ref" and rate:
                self.refs[run.label] = rate
            ref = self.refs.get(run.ref.get(p.workload, ""))
            pct = f"{100 * rate / ref:.1f}%" if rate and ref else "-"
            res.append(f"{p.workload}@{p.cap if p.cap is not None else 'uncapped'}: "
                       f"{rate if rate is not None else 'no result'} {s.get('unit', '')} ({pct})")
        self.write({"run_end": run.label, "kind": run.kind, "setup_s": round(setup_s, 2), "ok": ok,
                    "wall_s": round(time.monotonic() - run.t_start, 2), "cpu": cpu})
        self.say(f"{run.label}: " + "; ".join(res))

    @staticmethod
    def cpu_now(run: Run) -> dict[str, float | None]:
        """CPU seconds so far of the daemon and of each of the run's processes."""
        return {"daemon": cpu_seconds(DAEMON_PID) if DAEMON_PID else None,
                **{p.side: cpu_seconds(p.popen.pid) for p in run.procs}}

    def reap(self, run: Run, p: Proc) -> None:
        try:
            p.popen.wait(self.a.exit_grace)
        except subprocess.TimeoutExpired:
            self.kill(p.popen)
        p.rc = p.popen.returncode
        p.reader.join(5)
        self.write({"exit": run.label, "side": p.side, "w": p.workload, "rc": p.rc})
        if p.rc:
            self.say(f"{run.label}/{p.side}: exit status {p.rc}; see {self.out}/logs/{run.label}-{p.side}.log")

    def churn(self, run: Run) -> None:
        """Short-lived members of the service's group, while it is timed."""
        p0 = run.procs[0]
        env = dict(os.environ, HAMI_GROUP=p0.group, CUDA_DEVICE_SM_LIMIT=str(p0.cap))
        kids, counts = [], {"exit": 0, "hang": 0, "crash": 0}
        rcs: dict[str, int] = {}
        rnd = random.Random(1)
        end = run.t_start + self.a.seconds - 1
        while time.monotonic() < end and p0.popen.poll() is None:
            if sum(1 for k, _m, _t in kids if k.poll() is None) < self.a.churn_max:
                mode = rnd.choice(["exit", "exit", "hang", "crash"])
                k = subprocess.Popen([PY, os.path.join(WDIR, "churner.py"), "--mode", mode,
                                      "--life", f"{rnd.uniform(0.2, 1.2):.2f}"], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
                if self.cpus:
                    self.pin(k.pid, self.cpus["spare"])
                self.live.append(k)
                kids.append((k, mode, time.monotonic()))
                counts[mode] += 1
            for k, mode, t in kids:
                if mode == "hang" and k.poll() is None and time.monotonic() - t > 1.5:
                    self.kill(k)
            time.sleep(rnd.uniform(0.2, 0.6))
        for k, _m, _t in kids:
            if k.poll() is None:
                self.kill(k)
            rcs[str(k.returncode)] = rcs.get(str(k.returncode), 0) + 1
        self.write({"run": run.label, "churners": counts, "churner_rc": rcs})

    # --- NVML ------------------------------------------------------------
    def nvml(self) -> None:
        try:
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:  # noqa: BLE001 - the suite runs without it
            self.write({"nvml_error": str(e)[:300]})
            return
        while not self.stop_samplers.wait(0.5):
            try:
                u = pynvml.nvmlDeviceGetUtilizationRates(h)
                mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            except Exception:  # noqa: BLE001
                continue
            try:
                sm_mhz = pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)
            except Exception:  # noqa: BLE001 - a reading; missing is shown as null
                sm_mhz = None
            run = self.current
            obj = {"nvml": True, "gpu": u.gpu, "mem": u.memory, "used_gib": round(mem.used / 2 ** 30, 2),
                   "sm_mhz": sm_mhz}
            if run is not None and run.t_start is not None:
                obj.update(run=run.label, rt=round(time.monotonic() - run.t_start, 2))
            self.write(obj)

    def stop_sampler(self) -> None:
        """How much of each second a capped process spent stopped, read from
        /proc/PID/stat every STOP_SAMPLE_S: what the holds really took, beside
        what the daemon's books say."""
        while not self.stop_samplers.wait(STOP_SAMPLE_S):
            run = self.current
            if run is None or run.t_start is None:
                continue
            sec = int(time.monotonic() - run.t_start)
            for p in run.procs:
                if p.cap is None or p.popen is None:
                    continue
                state = stopped(p.popen.pid)
                if state is None:
                    continue
                per_s = self.stopped.setdefault((run.label, p.side), [])
                while len(per_s) <= sec:
                    per_s.append([0, 0])
                per_s[sec][0] += 1
                per_s[sec][1] += state

    def write_stopped(self, run: Run) -> None:
        for p in run.procs:
            per_s = self.stopped.pop((run.label, p.side), None)
            if per_s:
                self.write({"stopped": run.label, "side": p.side,
                            "share": [round(st / n, 3) if n else None for n, st in per_s]})

    # --- plan ---------------------------------------------------------------
    def plan(self) -> list[Run]:
        a = self.a
        runs: list[Run] = []
        refs: dict[str, str] = {}

        def single(w: str, cap: int | None, kind: str) -> Run:
            label = self.group(f"base-{w}" if cap is None else f"cap{cap}-{w}")
            r = Run(label, kind, [Proc(w, label, cap, "a", None)])
            if cap is not None:
                r.ref[w] = refs[w]
            return r

        def ensure_ref(w: str) -> None:
            if w not in refs:
                r = single(w, None, "ref")
                refs[w] = r.label
                runs.append(r)

        if a.order == "refs-first":
            needed = (a.workloads if "single" in a.sections else []) + \
                (["llm_decode"] if "service" in a.sections else []) + \
                ([w for p in a.pairs for w in p.split(":")] if "pair" in a.sections else [])
            for w in needed:
                ensure_ref(w)
        def add_single() -> None:
            for w in a.workloads:
                ensure_ref(w)
                for c in a.caps:
                    runs.append(single(w, c, "cap"))

        def add_service() -> None:
            ensure_ref("llm_decode")
            label = self.group(f"svc{a.service_cap}-llm_decode")
            procs = [Proc("llm_decode", label, a.service_cap, "a", None)]
            if "twin" in a.sections:
                procs.append(Proc("llm_decode", self.group(f"{label}-twin"), None, "b", None))
            r = Run(label, "service", procs, ref={"llm_decode": refs["llm_decode"]}, churn=True)
            runs.append(r)

        def add_twin() -> None:
            for w in a.twins:
                for c in [None] + a.caps:
                    label = self.group(f"twin{'free' if c is None else c}-{w}")
                    procs = [Proc(w, self.group(f"{label}-a"), c, "a", None),
                             Proc(w, self.group(f"{label}-b"), None, "b", None)]
                    runs.append(Run(label, "twin", procs))

        def add_pair() -> None:
            for i, pair in enumerate(a.pairs):
                wa, wb = pair.split(":")
                ensure_ref(wa)
                ensure_ref(wb)
                for split in a.splits:
                    ca, cb = (int(x) for x in split.split(":"))
                    label = self.group(f"pair{ca}_{cb}-{wa}+{wb}")
                    procs = [Proc(wa, self.group(f"p{i}-{ca}-{wa}"), ca, "a", None),
                             Proc(wb, self.group(f"p{i}-{cb}-{wb}"), cb, "b", None)]
                    runs.append(Run(label, "pair", procs, ref={wa: refs[wa], wb: refs[wb]}))

        # In the order SECTIONS names them: what a short budget leaves out
        # is what comes last.
        add = {"single": add_single, "service": add_service, "twin": add_twin, "pair": add_pair}
        for name in dict.fromkeys(a.sections):
            add[name]()
        return runs

    def main(self) -> int:
        a = self.a
        runs = self.plan()
        est = len(runs) * (a.seconds + a.per_run_overhead)
        self.say(f"{len(runs)} runs of {a.seconds:.0f} s; estimate {est:.0f} s; budget {a.budget:.0f} s")
        self.write({"suite": True, "runs": [r.label for r in runs], "seconds": a.seconds, "order": a.order,
                    "workloads": a.workloads, "caps": a.caps, "pairs": a.pairs, "splits": a.splits,
                    "sections": a.sections, "pin": bool(self.cpus)})
        if self.cpus:
            # The samplers (every 2 ms) and the daemon off the timed processes'
            # CPUs, as a node that reserves CPUs for its system daemons runs
            # it: their wake-ups would preempt a host-bound loop. DAEMON_CPUS
            # in the environment (empty: anywhere) leaves the daemon where
            # bench/gpu/prelude.sh put it.
            os.sched_setaffinity(0, self.cpus["spare"])
            if DAEMON_PID and "DAEMON_CPUS" not in os.environ:
                self.pin(DAEMON_PID, self.cpus["spare"])
        threading.Thread(target=self.nvml, daemon=True).start()
        threading.Thread(target=self.stop_sampler, daemon=True).start()
        try:
            todo = list(runs)
            prev = None
            while todo:
                run = todo.pop(0)
                if run.procs[0].popen is None:
                    self.spawn(run)
                left = a.budget - (time.monotonic() - self.t0)
                missing = [r for r in run.ref.values() if r not in self.refs]
                if left < a.seconds + a.per_run_overhead:
                    for r in [run] + todo:
                        self.write({"skipped": r.label, "why": "budget"})
                    self.say(f"budget: skipped {len(todo) + 1} runs: {', '.join(r.label for r in [run] + todo)}")
                    for p in run.procs:
                        self.kill(p.popen)
                    break
                if missing:
                    self.write({"skipped": run.label, "why": f"no reference: {', '.join(missing)}"})
                    self.say(f"{run.label}: skipped, no reference ({', '.join(missing)})")
                    for p in run.procs:
                        self.kill(p.popen)
                    continue
                if prev is not None:
                    # The last run's processes have printed their summaries and
                    # are tearing down. A group still there can still count
                    # for the daemon (a neighbour to take turns with): a moment
                    # for them to go. Before a reference, none may linger: a
                    # capped group keeps the launch probes attached.
                    ref = run.kind == "ref"
                    end = time.monotonic() + (a.exit_grace if ref else a.exit_wait)
                    for p in prev.procs:
                        try:
                            p.popen.wait(max(0.0, end - time.monotonic()))
                        except subprocess.TimeoutExpired:
                            if ref:
                                self.kill(p.popen)
                    if ref and any(p.cap is not None for p in prev.procs):
                        time.sleep(a.detach_wait)
                nxt = todo[0] if todo else None
                if run.kind == "ref" and nxt is not None and any(p.cap is not None for p in nxt.procs):
                    # A capped process registers at cuInit, which some imports
                    # reach: that would attach the launch probes during the
                    # reference. Its imports wait until the reference is done.
                    nxt = None
                self.execute(run, nxt)
                prev = run
        finally:
            self.stop_samplers.set()
            self.cleanup()
        self.say("done")
        return 0


def words(name: str, default: str) -> list[str]:
    return os.environ.get(name, "").split() or default.split()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget", type=float, default=float(os.environ.get("SUITE_BUDGET", "540")),
                    help="seconds; runs that would end later are skipped")
    ap.add_argument("--setup-limit", type=float, default=float(os.environ.get("SETUP_LIMIT", "60")))
    ap.add_argument("--exit-grace", type=float, default=float(os.environ.get("EXIT_GRACE", "25")))
    ap.add_argument("--per-run-overhead", type=float, default=float(os.environ.get("RUN_OVERHEAD", "4.5")),
                    help="seconds a run takes beyond its timed loop, for the estimate")
    ap.add_argument("--churn-max", type=int, default=3, help="churners alive at once")
    ap.add_argument("--exit-wait", type=float, default=3.0,
                    help="seconds to wait for the last run's processes to exit before the next run")
    ap.add_argument("--detach-wait", type=float, default=1.5,
                    help="seconds between a capped run's exit and a reference (launch probes detach)")
    a = ap.parse_args()
    quick = os.environ.get("QUICK", "0") not in ("", "0")
    a.seconds = float(os.environ.get("SUITE_SECONDS", "10"))
    a.workloads = words("WORKLOADS", " ".join(ALL))
    a.caps = [int(c) for c in words("CAPS", "50" if quick else "25 50 75")]
    a.pairs = words("PAIRS", "cnn_train:llm_decode" if quick else "cnn_train:llm_decode llm_prefill:cnn_train")
    a.splits = words("SPLITS", "30:70" if quick else "30:70 50:50")
    a.sections = words("SECTIONS", "single service pair")
    unknown = [x for x in a.sections if x not in ("single", "service", "twin", "pair")]
    if unknown:
        ap.error(f"SECTIONS: unknown {' '.join(unknown)} (single, service, twin, pair)")
    a.service_cap = int(os.environ.get("SERVICE_CAP", "50"))
    a.twins = words("TWINS", "llm_decode")
    a.order = os.environ.get("ORDER", "refs-first")
    if a.order not in ("refs-first", "per-workload"):
        ap.error("ORDER: refs-first or per-workload")
    used = ((a.workloads if "single" in a.sections else []) + (a.twins if "twin" in a.sections else [])
            + (["llm_decode"] if "service" in a.sections else [])
            + ([x for p in a.pairs for x in p.split(":")] if "pair" in a.sections else []))
    for w in used:
        script = workload_command(w)[0]
        if not os.path.exists(script):
            ap.error(f"no workload {w} ({script})")
    s = Suite(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return s.main()


if __name__ == "__main__":
    sys.exit(main())
