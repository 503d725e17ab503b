"""A recorded CUDA workload and the model fitted to it (pure but for `load`).

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
"""
from __future__ import annotations

import ast
import bisect
import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path

WAIT_EPS_S = 20e-6     # a synchronize this much above its floor waited for the GPU
FLOOR_MAX_S = 50e-6    # a synchronize's own cost is no more (when every one waited, the
                       # shortest is mostly waiting)
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


def repeat_loop(rec: Recording, times: int) -> Recording:
    """The recording with its timed loop run `times` times over, back to
    back (what came after the loop is left out): a steady state long enough
    for what the pacer measures over tens of seconds, from a loop that was
    recorded for a few."""
    t0, t1 = rec.loop_start, rec.loop_end
    if t0 is None or t1 is None or times < 1:
        raise ValueError("a recording without a timed loop cannot be repeated")
    span = t1 - t0

    def tiled(rows: list) -> list:
        """Rows timed by their first field: those before the loop, then the loop's, repeated."""
        loop = [r for r in rows if t0 <= r[0] < t1]
        return [r for r in rows if r[0] < t0] + [
            (r[0] + i * span,) + tuple(r[1:]) for i in range(times) for r in loop]
    syncs = [r for r in rec.syncs if r[1] < t0]
    loop_syncs = [r for r in rec.syncs if t0 <= r[1] and r[2] < t1]
    syncs += [(r[0], r[1] + i * span, r[2] + i * span, r[3])
              for i in range(times) for r in loop_syncs]
    launches, nvml = tiled(rec.launches), tiled(rec.nvml)
    return Recording(rec.header, launches, syncs, nvml, t0, t0 + times * span)


def dump(obj: dict, path: str | Path) -> None:
    with gzip.open(path, "wt") as f:
        json.dump(obj, f)


@dataclass
class Thread:
    tid: int
    kinds: list = field(default_factory=list)    # LAUNCH or SYNC
    gaps: list = field(default_factory=list)     # host seconds before the action
    costs: list = field(default_factory=list)    # launch: cost units
    counts: list = field(default_factory=list)   # launch: launches in it (a bin's share)
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
    """Launch bins split around their thread's synchronize calls: (t, tid, cost, n)."""
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
            out.append(((t0 + t1) / 2, tid, cost, n))
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
            out.append((cur, tid, cost, n))
            continue
        span = sum(b - a for a, b in parts)
        done, done_n, acc = 0, 0, 0.0
        for a, b in parts:
            acc += b - a
            upto, upto_n = round(cost * acc / span), round(n * acc / span)
            if upto > done:
                out.append(((a + b) / 2, tid, upto - done, upto_n - done_n))
                done_n = upto_n
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
    for t, _tid, cost, _n in seg:
        if rest > 0:
            best = min(best, (target - t) / rest)
        rest -= cost
    return max(best, 0.0)


def _finish(c0: float, seg: list, alpha: float) -> float:
    c = c0
    for t, _tid, cost, _n in seg:
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
    acts = [(t, 0, tid, LAUNCH, t, cost, g, n) for (t, tid, cost, n), g in zip(pieces, gpu)]
    acts += [(e, 1, tid, SYNC, r, 0, 0.0, 0) for e, r, tid in flat]
    acts.sort()
    last: dict[int, float] = {}
    for start, _o, tid, kind, end, cost, g, n in acts:
        th = threads.setdefault(tid, Thread(tid))
        th.gaps.append(max(start - last.get(tid, 0.0), 0.0))
        th.kinds.append(kind)
        th.costs.append(cost)
        th.counts.append(n)
        th.gpu.append(g)
        th.at.append(end)
        last[tid] = end
    return Workload(name=rec.workload, threads=[threads[k] for k in sorted(threads)],
                    floor=floor, recorded_end=last_action,
                    recorded_returns=sorted(r for _e, r, _ in flat), actions=len(acts),
                    nested=nested, lost=_lost(rec.header.get("lost")))
