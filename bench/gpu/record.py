#!/usr/bin/env python3
"""Record what a real workload asks of libcuda, for offline replay tests.

  record.py --lib LIBCUDA --out DIR [--seconds 10] WORKLOAD...
  record.py --lib LIBCUDA --out DIR --cmd "PROGRAM ARGS" NAME

Needs bcc (bench/gpu/prelude.sh brings it) and root; no hami-bpf daemon. One
small uprobe program of its own, compiled once, filtered in BPF to the
workload's process (tgid), which runs as a child (bench/gpu/workloads/
WORKLOAD.py --seconds N, plus ARGS_<workload> from the environment):

  launches  cuLaunchKernel[_ptsz] (cost: grid blocks x*y*z), cuLaunchKernelEx[_ptsz]
            (the grid from the CUlaunchConfig's first three unsigned ints, read
            from user memory), cuGraphLaunch[_ptsz] (cost 1, counted as a graph);
            summed in BPF into 1 ms bins per thread, drained every 0.5 s
  syncs     entry and return of cuStreamSynchronize[_ptsz], cuCtxSynchronize[_v2],
            cuEventSynchronize: one ring-buffer record per call
  nvml      nvmlDeviceGetSamples(NVML_GPU_UTILIZATION_SAMPLES) (the driver's own
            timestamped samples) and nvmlDeviceGetUtilizationRates, every 100 ms
Symbols missing from the library are skipped (and listed).

Output: DIR/WORKLOAD.json.gz, one JSON object:
  header      workload, argv, seconds, driver, gpu, lib, clock ("CLOCK_MONOTONIC"),
              t0_monotonic_ns (time 0: just before the child was started),
              symbols {attached, missing}, sync_fns (names for syncs.fn), lost
              {launch_bins, syncs, sync_enter}: records the BPF side could not
              keep (a full map or ring buffer), exit (the child's status),
              workload_summary (its last JSON line), totals
  launches    columns t_ms, tid, n, cost, graphs (1 ms bins; graphs: how many
              of the n were cuGraphLaunch)
  syncs       columns tid, t_enter_us, t_return_us, fn (index into sync_fns), rc
  nvml        columns t_us, util (percent) from nvmlDeviceGetSamples; its
              timestamps are taken as CLOCK_REALTIME microseconds and moved onto
              the monotonic clock with the offset in header.nvml_realtime_offset_us
              (raw values in ts_raw)
  nvml_rates  columns t_us, gpu, mem (percent) from nvmlDeviceGetUtilizationRates
  rates       the workload's own JSON lines (its "t" counts from its timed
              loop, which began at header.workload_summary.mono0 - t0)
All times are relative to t0.
"""
from __future__ import annotations

import argparse
import ctypes
import gzip
import json
import os
import shlex
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WDIR = os.path.join(HERE, "workloads")

LAUNCH = {
    "cuLaunchKernel": "on_launch",
    "cuLaunchKernel_ptsz": "on_launch",
    "cuLaunchKernelEx": "on_launch_ex",
    "cuLaunchKernelEx_ptsz": "on_launch_ex",
    "cuGraphLaunch": "on_graph",
    "cuGraphLaunch_ptsz": "on_graph",
}
SYNC_FNS = ["cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuCtxSynchronize_v2",
            "cuEventSynchronize"]

PROG = r"""
#include <uapi/linux/ptrace.h>

struct bin_key { u32 tid; u32 ms; };
struct bin_val { u64 n; u64 cost; u64 graphs; };
struct sync_at_t { u64 ts; u32 fn; u32 pad; };
struct sync_ev { u32 tid; u32 fn; u64 t_enter; u64 t_return; s64 rc; };

BPF_ARRAY(target, u32, 1);          /* the workload's tgid; 0: none */
BPF_ARRAY(origin, u64, 1);          /* time 0, bpf_ktime_get_ns() (CLOCK_MONOTONIC) */
BPF_HASH(bins, struct bin_key, struct bin_val, 262144);
BPF_HASH(sync_at, u32, struct sync_at_t, 16384);
BPF_RINGBUF_OUTPUT(syncs, 512);     /* pages: 2 MiB */
BPF_PERCPU_ARRAY(lost, u64, 4);     /* 0: bins full, 1: ring buffer full, 2: sync_at full */

static __always_inline void lose(int i)
{
	u64 *l = lost.lookup(&i);
	if (l)
		(*l)++;
}

static __always_inline int mine(u32 *tid)
{
	u64 id = bpf_get_current_pid_tgid();
	int z = 0;
	u32 *t = target.lookup(&z);
	if (!t || *t == 0 || *t != (u32)(id >> 32))
		return 0;
	*tid = (u32)id;
	return 1;
}

static __always_inline void count(u32 tid, u64 cost, u64 graph)
{
	int z = 0;
	u64 *o = origin.lookup(&z);
	u64 now = bpf_ktime_get_ns(), t0 = o ? *o : 0;
	struct bin_key k = { .tid = tid, .ms = now > t0 ? (u32)((now - t0) / 1000000) : 0 };
	struct bin_val zero = {};
	struct bin_val *v = bins.lookup_or_try_init(&k, &zero);
	if (!v) {
		lose(0);
		return;
	}
	__sync_fetch_and_add(&v->n, 1);
	__sync_fetch_and_add(&v->cost, cost);
	if (graph)
		__sync_fetch_and_add(&v->graphs, 1);
}

/* cuLaunchKernel(f, gridX, gridY, gridZ, ...) */
int on_launch(struct pt_regs *ctx)
{
	u32 tid;
	if (!mine(&tid))
		return 0;
	u64 gx = (u32)PT_REGS_PARM2(ctx), gy = (u32)PT_REGS_PARM3(ctx), gz = (u32)PT_REGS_PARM4(ctx);
	count(tid, gx * gy * gz, 0);
	return 0;
}

/* cuLaunchKernelEx(const CUlaunchConfig *config, ...): gridDimX, Y, Z lead the struct */
int on_launch_ex(struct pt_regs *ctx)
{
	u32 tid;
	if (!mine(&tid))
		return 0;
	u32 grid[3] = {};
	u64 cfg = PT_REGS_PARM1(ctx);
	if (cfg)
		bpf_probe_read_user(&grid, sizeof(grid), (void *)cfg);
	count(tid, (u64)grid[0] * grid[1] * grid[2], 0);
	return 0;
}

int on_graph(struct pt_regs *ctx)
{
	u32 tid;
	if (!mine(&tid))
		return 0;
	count(tid, 1, 1);
	return 0;
}

static __always_inline int sync_enter(u32 fn)
{
	u32 tid;
	if (!mine(&tid))
		return 0;
	struct sync_at_t a = { .ts = bpf_ktime_get_ns(), .fn = fn };
	if (sync_at.update(&tid, &a))
		lose(2);
	return 0;
}

SYNC_ENTRIES

int sync_return(struct pt_regs *ctx)
{
	u32 tid = (u32)bpf_get_current_pid_tgid();
	struct sync_at_t *a = sync_at.lookup(&tid);
	if (!a)
		return 0;
	struct sync_ev *e = syncs.ringbuf_reserve(sizeof(struct sync_ev));
	if (!e) {
		lose(1);
		sync_at.delete(&tid);
		return 0;
	}
	e->tid = tid;
	e->fn = a->fn;
	e->t_enter = a->ts;
	e->t_return = bpf_ktime_get_ns();
	e->rc = PT_REGS_RC(ctx);
	syncs.ringbuf_submit(e, 0);
	sync_at.delete(&tid);
	return 0;
}
"""


class SyncEv(ctypes.Structure):
    _fields_ = [("tid", ctypes.c_uint32), ("fn", ctypes.c_uint32), ("t_enter", ctypes.c_uint64),
                ("t_return", ctypes.c_uint64), ("rc", ctypes.c_int64)]


class Recorder:
    def __init__(self, lib: str):
        from bcc import BPF
        entries = "\n".join(f"int sync_enter_{i}(struct pt_regs *ctx) {{ return sync_enter({i}); }}"
                            for i in range(len(SYNC_FNS)))
        self.b = BPF(text=PROG.replace("SYNC_ENTRIES", entries))
        self.lib = lib
        self.attached, self.missing = [], []
        for sym, fn in LAUNCH.items():
            self._attach(sym, fn)
        for i, sym in enumerate(SYNC_FNS):
            if self._attach(sym, f"sync_enter_{i}"):
                try:
                    self.b.attach_uretprobe(name=lib.encode(), sym=sym.encode(), fn_name=b"sync_return")
                except Exception as e:  # noqa: BLE001
                    self.missing.append(f"{sym} (return: {str(e)[:80]})")
        self.bins = self.b["bins"]
        self.sync_at = self.b["sync_at"]
        self.events: list[SyncEv] = []

        def cb(_ctx, data, _size):
            self.events.append(SyncEv.from_buffer_copy(ctypes.string_at(data, ctypes.sizeof(SyncEv))))
            return 0
        self._cb = cb                    # bcc keeps only a C pointer
        self.b["syncs"].open_ring_buffer(cb)

    def _attach(self, sym: str, fn: str) -> bool:
        try:
            self.b.attach_uprobe(name=self.lib.encode(), sym=sym.encode(), fn_name=fn.encode())
        except Exception as e:  # noqa: BLE001 - a symbol this driver lacks
            self.missing.append(f"{sym} ({str(e)[:80]})")
            return False
        self.attached.append(sym)
        return True

    def lost(self) -> list[int]:
        m = self.b["lost"]
        return [int(m.sum(m.Key(i)).value) for i in range(4)]

    def set_u(self, name: str, value: int) -> None:
        m = self.b[name]
        m[m.Key(0)] = m.Leaf(value)

    def drain(self, agg: dict, older_than_ms: int | None) -> None:
        """Move bins (all, or those before older_than_ms) from the map into agg."""
        take = {}                # (a key listed twice while probes insert: once)
        for k, v in self.bins.items():
            if older_than_ms is None or k.ms < older_than_ms:
                take[(k.ms, k.tid)] = (k.ms, k.tid, v.n, v.cost, v.graphs, k)
        for ms, tid, n, cost, graphs, k in take.values():
            try:
                del self.bins[k]
            except KeyError:
                pass
            a = agg.get((ms, tid))
            if a is None:
                agg[(ms, tid)] = [n, cost, graphs]
            else:          # the same bin again: a probe that ran late
                a[0] += n
                a[1] += cost
                a[2] += graphs

    def record(self, w: str, seconds: float, out_dir: str, nvml, cmd: list[str] | None = None) -> dict:
        argv = cmd or [sys.executable, os.path.join(WDIR, f"{w}.py"), "--seconds", str(seconds)] + \
            os.environ.get(f"ARGS_{w}", "").split()
        self.bins.clear()
        self.sync_at.clear()
        self.b.ring_buffer_consume()
        self.events = []
        lost0 = self.lost()
        t0 = time.monotonic_ns()
        self.set_u("origin", t0)
        rt_off_us = (time.time_ns() - time.monotonic_ns()) / 1000.0
        lines: list[dict] = []
        err = open(os.path.join(out_dir, f"{w}.stderr.log"), "w")
        child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True)
        self.set_u("target", child.pid)

        def read():
            for line in child.stdout:
                try:
                    o = json.loads(line)
                except ValueError:
                    continue
                if isinstance(o, dict):
                    o["recv_us"] = round((time.monotonic_ns() - t0) / 1000)
                    lines.append(o)
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        agg: dict = {}
        nv = {"t_us": [], "util": [], "ts_raw": []}
        rates = {"t_us": [], "gpu": [], "mem": []}
        last_ts = nvml.last_sample_ts() if nvml else 0
        deadline = time.monotonic() + seconds + 180
        last_drain = time.monotonic()
        while child.poll() is None and time.monotonic() < deadline:
            self.b.ring_buffer_poll(100)
            if nvml:
                last_ts = nvml.sample(nv, rates, last_ts, t0, rt_off_us)
            if time.monotonic() - last_drain > 0.5:
                self.drain(agg, int((time.monotonic_ns() - t0) / 1e6) - 100)
                last_drain = time.monotonic()
        if child.poll() is None:
            child.kill()
        child.wait()
        err.close()
        time.sleep(0.1)
        self.set_u("target", 0)
        self.b.ring_buffer_consume()
        self.drain(agg, None)
        if nvml:
            nvml.sample(nv, rates, last_ts, t0, rt_off_us)
        reader.join(5)
        lost = [a - b for a, b in zip(self.lost(), lost0)]
        keys = sorted(agg)
        launches = {"t_ms": [k[0] for k in keys], "tid": [k[1] for k in keys],
                    "n": [agg[k][0] for k in keys], "cost": [agg[k][1] for k in keys],
                    "graphs": [agg[k][2] for k in keys]}
        evs = sorted(self.events, key=lambda e: e.t_enter)
        syncs = {"tid": [e.tid for e in evs],
                 "t_enter_us": [round((e.t_enter - t0) / 1000) for e in evs],
                 "t_return_us": [round((e.t_return - t0) / 1000) for e in evs],
                 "fn": [e.fn for e in evs], "rc": [e.rc for e in evs]}
        summary = next((o for o in reversed(lines) if o.get("summary")), None)
        dur_us = (time.monotonic_ns() - t0) / 1000
        # NVML documents its sample timestamps as "CPU timestamp in microseconds";
        # taken as CLOCK_REALTIME, they must fall within the recording.
        plausible = bool(nv["t_us"]) and all(-5e6 <= t <= dur_us + 5e6 for t in nv["t_us"][-5:])
        header = {
            "workload": w, "argv": argv if cmd else argv[1:], "seconds": seconds, "lib": self.lib,
            "driver": nvml.driver if nvml else None, "gpu": nvml.name if nvml else None,
            "clock": "CLOCK_MONOTONIC", "t0_monotonic_ns": t0, "bin_ms": 1,
            "symbols": {"attached": self.attached, "missing": self.missing}, "sync_fns": SYNC_FNS,
            "lost": {"launch_bins": lost[0], "syncs": lost[1], "sync_enter": lost[2]},
            "nvml_realtime_offset_us": rt_off_us,
            "nvml_clock": ("no samples" if not nv["t_us"] else
                           "CLOCK_REALTIME (checked: samples fall within the recording)" if plausible
                           else "unknown: nvml.t_us may be meaningless, see nvml.ts_raw"),
            "exit": child.returncode,
            "workload_summary": summary,
            "totals": {"launches": sum(launches["n"]), "cost": sum(launches["cost"]),
                       "graphs": sum(launches["graphs"]), "syncs": len(evs), "threads": len(set(launches["tid"])),
                       "duration_s": round((time.monotonic_ns() - t0) / 1e9, 3)},
        }
        obj = {"header": header, "launches": launches, "syncs": syncs, "nvml": nv, "nvml_rates": rates,
               "rates": lines}
        path = os.path.join(out_dir, f"{w}.json.gz")
        with gzip.open(path, "wt", compresslevel=9) as f:
            json.dump(obj, f, separators=(",", ":"))
        header["bytes"] = os.path.getsize(path)
        return header


class Nvml:
    def __init__(self):
        import pynvml
        self.p = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(self.h)
        drv = pynvml.nvmlSystemGetDriverVersion()
        self.name = name.decode() if isinstance(name, bytes) else name
        self.driver = drv.decode() if isinstance(drv, bytes) else drv

    def last_sample_ts(self) -> int:
        try:
            _t, samples = self.p.nvmlDeviceGetSamples(self.h, self.p.NVML_GPU_UTILIZATION_SAMPLES, 0)
            return max((s.timeStamp for s in samples), default=0)
        except self.p.NVMLError:
            return 0

    def sample(self, nv: dict, rates: dict, last_ts: int, t0: int, off_us: float) -> int:
        now_us = round((time.monotonic_ns() - t0) / 1000)
        try:
            u = self.p.nvmlDeviceGetUtilizationRates(self.h)
            rates["t_us"].append(now_us)
            rates["gpu"].append(u.gpu)
            rates["mem"].append(u.memory)
        except self.p.NVMLError:
            pass
        try:
            _t, samples = self.p.nvmlDeviceGetSamples(self.h, self.p.NVML_GPU_UTILIZATION_SAMPLES, last_ts)
        except self.p.NVMLError:            # NOT_FOUND: nothing new since last_ts
            return last_ts
        for s in sorted(samples, key=lambda s: s.timeStamp):
            if s.timeStamp <= last_ts:
                continue
            nv["ts_raw"].append(s.timeStamp)
            nv["t_us"].append(round(s.timeStamp - off_us - t0 / 1000))
            nv["util"].append(s.sampleValue.uiVal)
            last_ts = s.timeStamp
        return last_ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--lib", required=True, help="the libcuda file to probe")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--cmd", default=None,
                    help="record this command line (split as a shell would) instead, named by the one WORKLOAD")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cmd = shlex.split(a.cmd) if a.cmd else None
    if cmd and len(a.workloads) != 1:
        ap.error("--cmd records one command: give one name")
    for w in a.workloads:
        if not cmd and not os.path.exists(os.path.join(WDIR, f"{w}.py")):
            ap.error(f"no workload {w}")
    try:
        nvml = Nvml()
    except Exception as e:  # noqa: BLE001 - record without it
        print(f"record: no NVML ({e})", file=sys.stderr)
        nvml = None
    t = time.monotonic()
    rec = Recorder(a.lib)
    print(json.dumps({"compiled_and_attached_s": round(time.monotonic() - t, 2), "attached": rec.attached,
                      "missing": rec.missing}), flush=True)
    for w in a.workloads:
        h = rec.record(w, a.seconds, a.out, nvml, cmd)
        print(json.dumps({k: h[k] for k in ("workload", "exit", "lost", "totals", "bytes")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
