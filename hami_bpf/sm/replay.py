"""Replay a recorded CUDA workload under an SM controller, in virtual time.

Pure (no I/O beyond `load`, no clock reads, no bcc): a recording made on a
GPU by bench/gpu/record.py becomes a model of its host program and GPU work
(`fit`), which `replay` runs with or without a controller stepping over it;
`compare` turns a throttled run and the unthrottled one into throughput
ratios. `python3 -m hami_bpf.sm.replay [TRACE.json.gz ...] --caps 25,50,75`
prints them (the synthetic workloads of hami_bpf.sm.synth without a trace).

Recording (gzip'd JSON; extra fields are ignored):
  header    {"workload": str, "seconds": float, "lost": int, ...}
  launches  [[t_ms, tid, n, cost_sum], ...]  launches per 1 ms bin and thread
  syncs     [[tid, t_enter_us, t_return_us, fn], ...]
  nvml      [[t_us, util_percent], ...]     each sample: the busy share of its period
  rates     [{"t", "dt", "recv_us", ...}, ...]  the workload's own per-second lines
            (optional; recv_us: when the line arrived)

The workload model
  Per thread, the recorded sequence of host actions (a launch bin, a
  synchronize call) with the host time between them. A bin that overlaps one
  of its thread's synchronize calls is split around it (the thread cannot
  launch while it waits), in proportion to the bin's time before and after;
  a bin (or part) is placed at the middle of the time it covers. A
  synchronize call nested in another of the same thread (a memcpy's own
  synchronize) is folded into the outer one. The GPU is one FIFO: a launch
  runs once the GPU finished what came before it and it was launched; a
  synchronize returns `floor` after the GPU finished everything launched
  before it was entered, by any thread (the recording does not say which
  stream a call waited for; floor: the shortest synchronize recorded, at
  most FLOOR_MAX_S, its own cost). A stopped process's threads do not advance (host time is frozen);
  the GPU keeps draining its queue.

The fit (GPU time per launch bin)
  Synchronize calls, taken in the order they were entered, cut the launches
  into segments: the launches before a call that no earlier call covered.
  Within a segment every cost unit takes the same GPU time `a`, so the
  segment's FIFO finishes at max(c0 + a W, max_k t_k + a W_k) (c0: when the
  GPU finished the previous segment; t_k: a bin's launch time; W_k: the cost
  from that bin to the segment's end). A synchronize that waited (returned
  more than WAIT_EPS_S after enter + floor) says exactly when the GPU
  finished: `a` solves finish = return - floor, in closed form. One that did
  not wait only bounds it (finish <= return - floor); there `a` comes from
  NVML (busy share x the segment's span / W) under that bound, and is the
  bound itself without NVML. Launches after the last synchronize: `a` from
  NVML over the rest of the recording; without NVML the GPU is taken as busy
  throughout (a loop that never synchronizes is held back by the launch
  queue). Bias: a bin's launches are all placed at its middle, so in a
  host-bound loop the last bin before a synchronize can make the GPU look up
  to half a bin busier than it was; the replayed timing is unaffected.

The controller
  Stepped every TICK_S of virtual time and at the next_step it asks for,
  with what the probes would have counted (cost launched, synchronize
  returns, threads inside a synchronize now) and since when the process is
  held. Ask SYNC: the process stops when one of its threads next returns
  from a synchronize; ask LAUNCH: at its next launch (before it), or at a
  synchronize's return if one comes first; release: it resumes at once.

Progress and ratios
  Progress is the number of recorded actions completed (a launch bin issued,
  a synchronize returned). A throttled run's time t maps to the time the
  unthrottled replay took to complete as many actions (interpolated), so a
  window's ratio is the unthrottled seconds of work it did per second, which
  stays meaningful across phases whose actions take very different times.

The timed loop
  A real recording covers the whole process: imports, set-up and warm-up,
  where progress is bound by the host and a GPU cap rightly costs little,
  then the workload's timed loop. `Recording.loop_start`/`loop_end` say when
  the loop ran (from its rate lines and summary); `compare` maps them through
  action indices onto the throttled run (whose time stretches) and reports the
  ratio over the loop from LOOP_SETTLE_S after its start (`loop_mean`) and the
  longest stretch below cap - 10 points there, so that the pacer is judged
  where the workload is bound by the GPU.

Not modelled: the launch budget (hami_bpf.throttle); a group in BUDGET mode
runs freely here and the report says how long it was in that mode. Launch
queue back-pressure is only present as the recorded host gaps.
"""
from __future__ import annotations

import argparse
import ast
import bisect
import gzip
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from . import duty

WAIT_EPS_S = 20e-6     # a synchronize this much above its floor waited for the GPU
FLOOR_MAX_S = 50e-6    # a synchronize's own cost is no more (when every one waited, the
                       # shortest is mostly waiting)
TICK_S = 0.01          # the daemon's tick
MIN_STEP_S = 1e-6      # a requested step no sooner than this after the last one
WARMUP_S = 5.0         # ratios before this are not in the mean
LOOP_SETTLE_S = 5.0    # the timed loop's first seconds of a throttled run are not in its mean
_EPS = 1e-12

LAUNCH, SYNC = 0, 1


@dataclass(frozen=True)
class Recording:
    header: dict
    launches: list      # (t_s, tid, n, cost)
    syncs: list         # (tid, enter_s, return_s, fn)
    nvml: list          # (t_s, util 0..1)
    loop_start: float | None = None     # the workload's timed loop, seconds since the
    loop_end: float | None = None       # recording's start (None: no rate lines)

    @property
    def workload(self) -> str:
        return str(self.header.get("workload", "?"))


def _rows(table, columns: tuple[str, ...]) -> list:
    """Rows of a table given as rows (lists) or as columns ({name: [...]},
    as bench/gpu/record.py writes them), in `columns`' order."""
    if isinstance(table, dict):
        cols = [table.get(c) for c in columns]
        n = min((len(c) for c in cols if c is not None), default=0)
        return [[c[i] if c is not None else None for c in cols] for i in range(n)]
    return list(table or [])


def _lost(v) -> int:
    """Events the recorder lost: a number, or one per kind ({kind: n})."""
    if isinstance(v, dict):
        return sum(int(x or 0) for x in v.values())
    return int(v or 0)


def from_obj(obj: dict) -> Recording:
    launches = sorted((float(r[0]) / 1e3, int(r[1]), int(r[2]), int(r[3]))
                      for r in _rows(obj.get("launches"), ("t_ms", "tid", "n", "cost")))
    syncs = sorted(((int(r[0]), float(r[1]) / 1e6, float(r[2]) / 1e6,
                     str(r[3]) if len(r) > 3 and r[3] is not None else "")
                    for r in _rows(obj.get("syncs"), ("tid", "t_enter_us", "t_return_us", "fn", "rc"))
                    if r[2] is not None and (len(r) < 5 or not r[4])),
                   key=lambda s: (s[1], s[0]))
    nvml = sorted((float(r[0]) / 1e6, min(max(float(r[1]) / 100.0, 0.0), 1.0))
                  for r in _rows(obj.get("nvml"), ("t_us", "util")))
    header = dict(obj.get("header", {}))
    loop_start, loop_end = _loop(obj.get("rates", header.get("rates")),
                                 header.get("workload_summary"))
    return Recording(header, launches, syncs, nvml, loop_start, loop_end)


def _loop(rates, summary) -> tuple[float | None, float | None]:
    """When the timed loop began and ended: its first per-second line arrived
    dt (and t) after the loop began; the summary says how long it ran."""
    if isinstance(rates, dict):     # columns
        names = list(rates)
        rates = [dict(zip(names, row)) for row in _rows(rates, tuple(names))]
    lines = [r for r in rates or [] if isinstance(r, dict)]
    if isinstance(summary, str):
        try:
            summary = ast.literal_eval(summary)
        except (ValueError, SyntaxError):
            summary = None
    if not isinstance(summary, dict):
        summary = next((r for r in lines if r.get("summary")), None)
    steps = [r for r in lines if not r.get("summary") and r.get("recv_us") is not None
             and r.get("dt") is not None]
    if not steps:
        return None, None
    first = steps[0]
    start = (float(first["recv_us"]) / 1e6 - float(first.get("t") or 0.0)
             - float(first["dt"]))
    if summary and summary.get("seconds") is not None:
        end = start + float(summary["seconds"])
    else:
        end = float(steps[-1]["recv_us"]) / 1e6
    return start, end


def load(path: str | Path) -> Recording:
    with gzip.open(path, "rt") as f:
        return from_obj(json.load(f))


def dump(obj: dict, path: str | Path) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(obj, f)


@dataclass
class Thread:
    tid: int
    kinds: list = field(default_factory=list)    # LAUNCH or SYNC
    gaps: list = field(default_factory=list)     # host seconds before the action
    costs: list = field(default_factory=list)    # launch: cost units
    gpu: list = field(default_factory=list)      # launch: GPU seconds (the fit)
    at: list = field(default_factory=list)       # recorded time: launch, or synchronize's return


@dataclass
class Workload:
    name: str
    threads: list
    floor: float                # a synchronize's own time
    recorded_end: float         # the last action's recorded completion
    recorded_returns: list      # recorded synchronize returns (folded), sorted
    actions: int
    nested: int                 # synchronize calls folded into an outer one
    lost: int


class _Nvml:
    """Mean utilization over an interval; sample k covers (t_{k-1}, t_k]."""

    def __init__(self, samples: list) -> None:
        self.t = [s[0] for s in samples]
        self.u = [s[1] for s in samples]
        if len(self.t) > 1:
            self.t0 = self.t[0] - (self.t[-1] - self.t[0]) / (len(self.t) - 1)
        elif self.t:
            self.t0 = self.t[0] - 0.1
        else:
            self.t0 = 0.0

    def __bool__(self) -> bool:
        return bool(self.t)

    def mean(self, a: float, b: float) -> float:
        t, u = self.t, self.u
        k = min(bisect.bisect_left(t, a), len(t) - 1)
        if b - a <= _EPS:
            return u[k]
        total, lo = 0.0, a
        while lo < b:
            hi = min(b, t[k]) if k < len(t) - 1 else b
            if hi > lo:
                total += u[k] * (hi - lo)
            lo = max(hi, lo)
            if k == len(t) - 1:
                break
            k += 1
        return total / (b - a)


def _fold_syncs(syncs: list) -> tuple[dict, int]:
    by_tid: dict[int, list] = {}
    nested = 0
    for tid, e, r, _fn in syncs:
        lst = by_tid.setdefault(tid, [])
        if lst and e < lst[-1][1]:
            nested += 1
            if r > lst[-1][1]:
                lst[-1] = (lst[-1][0], r)
            continue
        lst.append((e, r))
    return by_tid, nested


def _pieces(rec: Recording, syncs: dict) -> list:
    """Launch bins split around their thread's synchronize calls: (t, tid, cost)."""
    out = []
    enters = {tid: [s[0] for s in lst] for tid, lst in syncs.items()}
    for t0, tid, n, cost in rec.launches:
        t1 = t0 + 1e-3
        lst = syncs.get(tid, [])
        k = bisect.bisect_left(enters.get(tid, []), t1)
        over = []
        j = k - 1
        while j >= 0 and lst[j][1] > t0:
            over.append(lst[j])
            j -= 1
        if not over:
            out.append(((t0 + t1) / 2, tid, cost))
            continue
        over.reverse()
        parts, cur = [], t0
        for e, r in over:
            if e > cur:
                parts.append((cur, min(e, t1)))
            cur = max(cur, r)
        if cur < t1:
            parts.append((cur, t1))
        if not parts:           # all of it inside a synchronize: launched after it returned
            out.append((cur, tid, cost))
            continue
        span = sum(b - a for a, b in parts)
        done, acc = 0, 0.0
        for a, b in parts:
            acc += b - a
            upto = round(cost * acc / span)
            if upto > done:
                out.append(((a + b) / 2, tid, upto - done))
            done = upto
    out.sort()
    return out


def _alpha_to_finish(c0: float, seg: list, target: float) -> float:
    """GPU seconds per cost unit that make the segment's FIFO finish at target."""
    total = sum(p[2] for p in seg)
    if total <= 0:
        return 0.0
    best = (target - c0) / total
    rest = total
    for t, _tid, cost in seg:
        if rest > 0:
            best = min(best, (target - t) / rest)
        rest -= cost
    return max(best, 0.0)


def _finish(c0: float, seg: list, alpha: float) -> float:
    c = c0
    for t, _tid, cost in seg:
        c = max(c, t) + alpha * cost
    return c


def fit(rec: Recording) -> Workload:
    syncs, nested = _fold_syncs(rec.syncs)
    pieces = _pieces(rec, syncs)
    flat = sorted((e, r, tid) for tid, lst in syncs.items() for e, r in lst)
    floor = min(max(min((r - e for e, r, _ in flat), default=0.0), 0.0), FLOOR_MAX_S)
    nvml = _Nvml(rec.nvml)
    gpu = [0.0] * len(pieces)
    idx, c0, target, alpha = 0, 0.0, 0.0, None
    for e, r, _tid in flat:
        lo = idx
        while idx < len(pieces) and pieces[idx][0] < e:
            idx += 1
        target = max(r - floor, target)
        if idx == lo:
            continue
        seg = pieces[lo:idx]
        alpha = _alpha_to_finish(c0, seg, target)
        if r - e - floor <= WAIT_EPS_S and nvml:
            start = max(c0, seg[0][0])
            busy = nvml.mean(start, e) * max(e - start, 0.0)
            alpha = min(alpha, busy / max(sum(p[2] for p in seg), 1))
        for i in range(lo, idx):
            gpu[i] = alpha * pieces[i][2]
        c0 = _finish(c0, seg, alpha)
    last_action = max([p[0] for p in pieces[-1:]] + [r for _e, r, _ in flat[-1:]] + [0.0])
    if idx < len(pieces):
        seg = pieces[idx:]
        start = max(c0, seg[0][0])
        end = max(float(rec.header.get("seconds", 0.0)), seg[-1][0])
        share = nvml.mean(start, end) if nvml else 1.0
        alpha = share * max(end - start, 0.0) / max(sum(p[2] for p in seg), 1)
        for i in range(idx, len(pieces)):
            gpu[i] = alpha * pieces[i][2]

    threads: dict[int, Thread] = {}
    acts = [(t, 0, tid, LAUNCH, t, cost, g) for (t, tid, cost), g in zip(pieces, gpu)]
    acts += [(e, 1, tid, SYNC, r, 0, 0.0) for e, r, tid in flat]
    acts.sort()
    last: dict[int, float] = {}
    for start, _o, tid, kind, end, cost, g in acts:
        th = threads.setdefault(tid, Thread(tid))
        th.gaps.append(max(start - last.get(tid, 0.0), 0.0))
        th.kinds.append(kind)
        th.costs.append(cost)
        th.gpu.append(g)
        th.at.append(end)
        last[tid] = end
    return Workload(name=rec.workload, threads=[threads[k] for k in sorted(threads)],
                    floor=floor, recorded_end=last_action,
                    recorded_returns=sorted(r for _e, r, _ in flat), actions=len(acts),
                    nested=nested, lost=_lost(rec.header.get("lost")))


# -- controllers -------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    ask: duty.Ask
    release: bool
    next_step: float | None
    mode: duty.Mode
    debt: float = 0.0


class Controller(Protocol):
    def step(self, now: float, consumed: int, syncs: int, held_since: float | None,
             waiting: int = 0) -> Step: ...


class DutyController:
    """duty.DutyPacer for one group on one device, as the daemon would drive it."""

    def __init__(self, cap: float, group: int = 0, device: int = 0) -> None:
        self.cap = cap
        self.key = (group, device)
        self.pacer = duty.DutyPacer()

    def step(self, now: float, consumed: int, syncs: int, held_since: float | None,
             waiting: int = 0) -> Step:
        g = self.key[0]
        obs = duty.Observation(now=now, caps={self.key: self.cap},
                               use={self.key: duty.Use(consumed, syncs, waiting)},
                               held={g: held_since} if held_since is not None else {})
        d = self.pacer.step(obs)
        k = d.keys[self.key]
        return Step(k.ask, g in d.release, d.next_step, k.mode, k.debt)


# -- the replay ----------------------------------------------------------------

_HOST, _WAIT, _DONE = 0, 1, 2


@dataclass
class Run:
    workload: str
    cap: float | None
    end: float                  # virtual seconds simulated
    finished: bool
    done_at: list               # completion time of each action, in order
    returns: list               # synchronize return times
    holds: list                 # (start, end)
    stops: dict                 # how holds began: {"sync": n, "launch": n}
    modes: list                 # (t, mode) at every step
    mode_changes: int
    debt_max: float


def replay(wl: Workload, controller: Controller | None = None, *, cap: float | None = None,
           horizon: float | None = None, tick: float = TICK_S) -> Run:
    ths = wl.threads
    n = len(ths)
    idx = [0] * n
    state = [_HOST if th.kinds else _DONE for th in ths]
    rem = [th.gaps[0] if th.kinds else 0.0 for th in ths]
    ready = [0.0] * n
    now, gpu_free, consumed, syncs = 0.0, 0.0, 0, 0
    held_since: float | None = None
    ask = duty.Ask.NONE
    done_at: list[float] = []
    returns: list[float] = []
    holds: list[tuple[float, float]] = []
    stops = {"sync": 0, "launch": 0}
    modes: list = []
    mode_changes, last_mode, debt_max = 0, None, 0.0
    ticks = 0
    next_tick = 0.0 if controller is not None else math.inf
    step_at: float | None = None
    live = sum(1 for s in state if s != _DONE)

    def finish_action(i: int) -> None:
        nonlocal live
        done_at.append(now)
        idx[i] += 1
        if idx[i] < len(ths[i].kinds):
            state[i], rem[i] = _HOST, ths[i].gaps[idx[i]]
        else:
            state[i] = _DONE
            live -= 1

    def stop(how: str) -> None:
        nonlocal held_since, ask
        held_since, ask = now, duty.Ask.NONE
        stops[how] += 1

    while live and (horizon is None or now < horizon):
        t_next = next_tick
        if step_at is not None:
            t_next = min(t_next, step_at)
        if held_since is None:
            for i in range(n):
                if state[i] == _HOST:
                    t_next = min(t_next, now + rem[i])
                elif state[i] == _WAIT:
                    t_next = min(t_next, ready[i])
        if horizon is not None:
            t_next = min(t_next, horizon)
        if t_next == math.inf:
            break
        t_next = max(t_next, now)
        if held_since is None:
            dt = t_next - now
            for i in range(n):
                if state[i] == _HOST:
                    rem[i] -= dt
        now = t_next
        progressed = True
        while progressed and held_since is None:
            progressed = False
            for i in range(n):
                if held_since is not None:
                    break
                th = ths[i]
                if state[i] == _HOST and rem[i] <= _EPS:
                    k = idx[i]
                    if th.kinds[k] == LAUNCH:
                        if ask is duty.Ask.LAUNCH:
                            stop("launch")       # before the launch: it is issued on release
                            break
                        start = now if now > gpu_free else gpu_free
                        gpu_free = start + th.gpu[k]
                        consumed += th.costs[k]
                        finish_action(i)
                    else:
                        state[i] = _WAIT
                        ready[i] = max(now, gpu_free) + wl.floor
                    progressed = True
                elif state[i] == _WAIT and ready[i] <= now + _EPS:
                    syncs += 1
                    returns.append(now)
                    finish_action(i)
                    progressed = True
                    if ask is not duty.Ask.NONE:
                        stop("sync")
        step_now = controller is not None and (
            now >= next_tick - _EPS or (step_at is not None and now >= step_at - _EPS))
        if step_now:
            if now >= next_tick - _EPS:
                ticks += 1
                next_tick = ticks * tick
            s = controller.step(now, consumed, syncs, held_since,
                                waiting=sum(1 for st in state if st == _WAIT))
            modes.append((now, s.mode))
            if last_mode is not None and s.mode != last_mode:
                mode_changes += 1
            last_mode = s.mode
            debt_max = max(debt_max, s.debt)
            if s.release and held_since is not None:
                holds.append((held_since, now))
                held_since = None
            ask = s.ask if held_since is None else duty.Ask.NONE
            step_at = None if s.next_step is None else max(s.next_step, now + MIN_STEP_S)
    if held_since is not None:
        holds.append((held_since, now))
    return Run(workload=wl.name, cap=cap, end=now, finished=live == 0, done_at=done_at,
               returns=returns, holds=holds, stops=stops, modes=modes,
               mode_changes=mode_changes, debt_max=debt_max)


def replay_capped(wl: Workload, cap: float, *, horizon: float | None = None) -> Run:
    return replay(wl, DutyController(cap), cap=cap, horizon=horizon)


# -- what a run shows ----------------------------------------------------------

@dataclass
class Report:
    workload: str
    cap: float | None
    seconds: float
    finished: bool
    ratios: list                # per 1 s window: unthrottled seconds of work done
    mean: float | None          # mean ratio after WARMUP_S (whole windows)
    duty_mean: float | None     # ... over those windows spent wholly in DUTY mode
    duty_share: float           # share of the steps after WARMUP_S in DUTY mode
    holds: int
    longest_hold: float
    held_share: float
    stops: dict
    below_longest_s: float      # the longest run of windows below cap - 10 points
    below_total_s: float
    mode_changes: int
    debt_max: float
    loop_mean: float | None = None      # mean ratio over the timed loop after LOOP_SETTLE_S
    loop_below_longest_s: float | None = None   # ... longest run of its windows below cap - 10
    loop_window: tuple | None = None    # (from, to): the run's seconds that loop_mean covers
    loop_duty_share: float | None = None    # share of the steps in that window in DUTY mode

    def line(self) -> str:
        f = lambda v: "-" if v is None else f"{100 * v:5.1f}"  # noqa: E731
        return (f"{self.workload:<12} cap {self.cap if self.cap is not None else '-':>4}  "
                f"mean {f(self.mean)}  duty-mean {f(self.duty_mean)}  "
                f"loop-mean {f(self.loop_mean)}  "
                f"in-duty {100 * self.duty_share:5.1f}%  holds {self.holds:5d} "
                f"(sync {self.stops.get('sync', 0)}, launch {self.stops.get('launch', 0)}) "
                f"longest {1000 * self.longest_hold:5.1f} ms  "
                f"below-10 {self.below_longest_s:.0f} s (total {self.below_total_s:.0f} s"
                + ("" if self.loop_below_longest_s is None
                   else f", loop {self.loop_below_longest_s:.0f} s") + ")  "
                f"windows [{' '.join(f(r).strip() for r in self.ratios)}]")


def equivalent_time(run: Run, base: Run):
    """t in the run -> seconds the unthrottled base took for the same progress."""
    s = [0.0] + run.done_at
    u = [0.0] + base.done_at

    def tau(t: float) -> float:
        k = bisect.bisect_right(s, t) - 1
        if k + 1 >= len(s) or k + 1 >= len(u):
            return u[min(k, len(u) - 1)]
        span = s[k + 1] - s[k]
        frac = 0.0 if span <= 0 else (t - s[k]) / span
        return u[k] + (u[k + 1] - u[k]) * frac
    return tau


def reached(run: Run, base: Run, t: float) -> float | None:
    """When the run completed what the unthrottled base had completed at its
    time t (None: it never did)."""
    k = bisect.bisect_right(base.done_at, t)
    if k == 0:
        return 0.0
    return run.done_at[k - 1] if k <= len(run.done_at) else None


def _longest_below(ratios: list, cap: float | None) -> tuple[int, int]:
    longest = total = run_len = 0
    if cap is not None:
        for r in ratios:
            if r < (cap - 10) / 100.0:
                run_len += 1
                total += 1
                longest = max(longest, run_len)
            else:
                run_len = 0
    return longest, total


def compare(run: Run, base: Run, loop: tuple[float, float] | None = None) -> Report:
    """loop: (start, end) of the timed loop in the base's seconds (the
    recording's loop_start and loop_end)."""
    tau = equivalent_time(run, base)
    windows = int(run.end + _EPS)
    ratios = [tau(w + 1) - tau(w) for w in range(windows)]
    loop_mean = loop_below = loop_window = loop_duty = None
    if loop is not None and loop[0] is not None:
        began = reached(run, base, loop[0])
        ended = reached(run, base, loop[1]) if loop[1] is not None else None
        if began is not None:
            lo, hi = began + LOOP_SETTLE_S, run.end if ended is None else ended
            n = int(hi - lo + _EPS)
            if n >= 1:
                loop_window = (lo, hi)
                loop_mean = (tau(hi) - tau(lo)) / (hi - lo)
                loop_below = float(_longest_below(
                    [tau(lo + i + 1) - tau(lo + i) for i in range(n)], run.cap)[0])
                inside = [m for t, m in run.modes if lo <= t < hi]
                loop_duty = (sum(1 for m in inside if m is duty.Mode.DUTY) / len(inside)
                             if inside else 0.0)
    after = list(range(min(int(WARMUP_S), windows), windows))
    mean = (tau(windows) - tau(WARMUP_S)) / (windows - WARMUP_S) if windows > WARMUP_S else None
    mode_at = [(t, m) for t, m in run.modes]
    per_window: dict[int, set] = {}
    for t, m in mode_at:
        per_window.setdefault(int(t), set()).add(m)
    duty_w = [w for w in after if per_window.get(w) == {duty.Mode.DUTY}]
    duty_mean = sum(ratios[w] for w in duty_w) / len(duty_w) if duty_w else None
    late = [m for t, m in mode_at if t >= WARMUP_S]
    duty_share = sum(1 for m in late if m is duty.Mode.DUTY) / len(late) if late else 0.0
    longest, total = _longest_below(ratios, run.cap)
    lengths = [b - a for a, b in run.holds]
    return Report(workload=run.workload, cap=run.cap, seconds=run.end, finished=run.finished,
                  ratios=ratios, mean=mean, duty_mean=duty_mean, duty_share=duty_share,
                  holds=len(lengths), longest_hold=max(lengths, default=0.0),
                  held_share=sum(lengths) / run.end if run.end > 0 else 0.0,
                  stops=dict(run.stops), below_longest_s=float(longest),
                  below_total_s=float(total), mode_changes=run.mode_changes,
                  debt_max=run.debt_max, loop_mean=loop_mean,
                  loop_below_longest_s=loop_below, loop_window=loop_window,
                  loop_duty_share=loop_duty)


def fidelity(wl: Workload, base: Run) -> dict:
    """How well the unthrottled replay reproduces the recording: its length,
    its synchronize returns, and how far apart the two counts of returns so
    far ever are at a whole second (as a share of all returns)."""
    rec = wl.recorded_returns
    got = base.returns
    worst = 0
    for w in range(int(max(wl.recorded_end, base.end)) + 2):
        worst = max(worst, abs(bisect.bisect_right(rec, w) - bisect.bisect_right(got, w)))
    replayed_end = base.done_at[-1] if base.done_at else 0.0
    return {"recorded_s": wl.recorded_end, "replayed_s": replayed_end,
            "duration_error": (abs(replayed_end - wl.recorded_end) / wl.recorded_end
                               if wl.recorded_end > 0 else 0.0),
            "recorded_returns": len(rec), "replayed_returns": len(got),
            "returns_drift": worst / len(rec) if rec else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="*", help="recordings (.json.gz); none: the synthetic ones")
    ap.add_argument("--caps", default="25,50,75")
    ap.add_argument("--horizon", type=float, default=None, help="virtual seconds per run at most")
    a = ap.parse_args(argv)
    caps = [float(c) for c in a.caps.split(",") if c]
    if a.traces:
        recs = [load(p) for p in a.traces]
    else:
        from . import synth
        recs = [from_obj(gen()) for gen in synth.WORKLOADS.values()]
    for rec in recs:
        wl = fit(rec)
        base = replay(wl)
        fi = fidelity(wl, base)
        print(f"{wl.name}: recorded {fi['recorded_s']:.2f} s, replayed {fi['replayed_s']:.2f} s, "
              f"{fi['recorded_returns']} synchronize returns ({fi['replayed_returns']} replayed, "
              f"drift {100 * fi['returns_drift']:.1f}%), lost {wl.lost}, nested {wl.nested}"
              + (f", timed loop {rec.loop_start:.2f}-{rec.loop_end:.2f} s"
                 if rec.loop_start is not None else ""))
        for cap in caps:
            run = replay_capped(wl, cap, horizon=a.horizon)
            print("  " + compare(run, base, (rec.loop_start, rec.loop_end)).line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
