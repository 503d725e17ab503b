"""Replay a recorded CUDA workload under an SM controller, in virtual time.

Pure (no I/O beyond `load`, no clock reads, no bcc): a recording made on a
GPU by bench/gpu/record.py becomes a model of its host program and GPU work
(`fit`), which `replay` runs with or without a controller stepping over it;
`compare` turns a throttled run and the unthrottled one into throughput
ratios. `python3 -m hami_bpf.sm.replay [TRACE.json.gz ...] --caps 25,50,75`
prints them (the synthetic workloads of hami_bpf.sm.synth without a trace).

The recording format and the workload model are in hami_bpf.sm.workload.

Pairs
  The replay runs its processes on one modelled GPU, which runs their work
  in the order it was launched; hami_bpf.sm.pairs replays several
  recordings side by side, each its own group under one pacer
  (`python3 -m hami_bpf.sm.replay A.json.gz B.json.gz --pair 30:70,50:50`).

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

The device's utilization
  Where the pacer asks for it (duty.DutyPacer.wants_util), it is read off the
  modelled GPU as NVML reads it: the busy share of a sample period of
  NVML_PERIOD_S that ended NVML_LAG_S ago.

Not modelled: the launch budget (hami_bpf.throttle); a group in BUDGET mode
runs freely here and the report says how long it was in that mode. Launch
queue back-pressure is only present as the recorded host gaps. A stop costs
the host program nothing, unless `cold` (Cold) says what it costs.
"""
from __future__ import annotations

import argparse
import bisect
import math
from dataclasses import dataclass, field
from typing import Protocol

from . import duty, progress
from .workload import (  # noqa: F401 - the recording and its model, re-exported
    _EPS, FLOOR_MAX_S, LAUNCH, SYNC, WAIT_EPS_S, Recording, Thread, Workload, dump, fit,
    from_obj, load, repeat_loop)

TICK_S = 0.01          # the daemon's tick
MIN_STEP_S = 1e-6      # a requested step no sooner than this after the last one
WARMUP_S = 5.0         # ratios before this are not in the mean
LOOP_SETTLE_S = 5.0    # the timed loop's first seconds of a throttled run are not in its mean
NVML_PERIOD_S = 1 / 6  # NVML's utilization: the busy share of a sample period this long
NVML_LAG_S = 1.0       # ... that ended about this long ago (docs/facts.md)


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
             waiting: int = 0, launches: int = 0, sync_s: float = 0.0,
             util: float | None = None) -> Step: ...
    # Optional: def wants_util(self, now: float) -> bool, whether the step at
    # `now` is to be given the device's utilization (`util`).


class DutyController:
    """duty.DutyPacer for one group on one device, as the daemon would drive it."""

    def __init__(self, cap: float, group: int = 0, device: int = 0,
                 pacer: duty.DutyPacer | None = None, start: float = 0.0) -> None:
        self.cap = cap
        self.key = (group, device)
        self.pacer = pacer or duty.DutyPacer()
        self.start = start      # uncapped before (a cap set on a running process)

    def wants_util(self, now: float) -> bool:
        return now >= self.start and self.key[1] in self.pacer.wants_util(now)

    def step(self, now: float, consumed: int, syncs: int, held_since: float | None,
             waiting: int = 0, launches: int = 0, sync_s: float = 0.0,
             util: float | None = None) -> Step:
        if now < self.start:
            return Step(duty.Ask.NONE, False, None, duty.Mode.BUDGET)
        g = self.key[0]
        obs = duty.Observation(now=now, caps={self.key: self.cap},
                               use={self.key: duty.Use(consumed, syncs, waiting, launches,
                                                       sync_s)},
                               held={g: held_since} if held_since is not None else {},
                               util=None if util is None else {self.key[1]: util})
        return _step_of(self.pacer.step(obs), self.key)


def _step_of(d: duty.Decision, key: tuple[int, int]) -> Step:
    """What the pacer's decision says of one (group, device)."""
    k = d.keys[key]
    return Step(k.ask, key[0] in d.release, d.next_step, k.mode, k.debt)


# -- the replay ----------------------------------------------------------------

@dataclass(frozen=True)
class Cold:
    """A host program that starts cold after a stop: for `seconds` after each
    release its host work runs at `speed` of its usual pace (GPU work does not
    change). COLD_MEASURED (about 9 ms of host work lost per stop) is fitted to
    what a decode loop did on the H200's host, stopped and continued from
    outside at 50% duty (bench/gpu/stopcont.py): ~82% of its free speed per
    second of running at a 0.1 s period, ~100% at 0.4 s."""
    seconds: float
    speed: float


COLD_MEASURED = Cold(seconds=0.03, speed=0.7)
# A launch-bound loop held by the daemon at all, at any hold length: a decode
# loop ran at 77-93% (mean 85%) of its free speed per second of running
# (bench/gpu/stopcont.sh). A second after each release covers every slice.
HELD_MEASURED = Cold(seconds=1.0, speed=0.85)

_HOST, _WAIT, _DONE = 0, 1, 2


class GpuBusy:
    """The modelled GPU's busy intervals, appended in order (its work runs
    one piece after another), with the busy time before each."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.before: list[float] = []

    def add(self, start: float, end: float) -> None:
        if end > start:
            self.before.append(self.before[-1] + self.ends[-1] - self.starts[-1]
                               if self.starts else 0.0)
            self.starts.append(start)
            self.ends.append(end)

    def until(self, t: float) -> float:
        """Seconds busy before t."""
        i = bisect.bisect_right(self.starts, t) - 1
        return 0.0 if i < 0 else self.before[i] + min(t, self.ends[i]) - self.starts[i]

    def share(self, t0: float, t1: float) -> float:
        return (self.until(t1) - self.until(t0)) / (t1 - t0) if t1 > t0 else 0.0


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
    gpu: GpuBusy = field(default_factory=GpuBusy)   # when the modelled GPU ran

    def gpu_busy(self, t0: float, t1: float) -> float:
        """The share of [t0, t1] the modelled GPU was busy."""
        return self.gpu.share(t0, t1)


class _Proc:
    """One replayed process: its threads' progress, its probes' counts, its
    holds and what it completed."""

    def __init__(self, wl: Workload, cold: Cold | None) -> None:
        self.wl, self.ths, self.cold = wl, wl.threads, cold
        n = len(self.ths)
        self.idx = [0] * n
        self.state = [_HOST if th.kinds else _DONE for th in self.ths]
        self.rem = [th.gaps[0] if th.kinds else 0.0 for th in self.ths]
        self.ready = [0.0] * n
        self.entered = [0.0] * n        # when each thread entered its synchronize
        self.consumed = self.syncs = self.launches = 0
        self.sync_s = 0.0
        self.last_end = 0.0             # when its latest GPU work ends
        self.cold_until = -1.0          # the host runs at cold.speed until then
        self.held_since: float | None = None
        self.ask = duty.Ask.NONE
        self.done_at: list[float] = []
        self.returns: list[float] = []
        self.holds: list[tuple[float, float]] = []
        self.stops = {"sync": 0, "launch": 0}
        self.modes: list = []
        self.mode_changes, self.last_mode, self.debt_max = 0, None, 0.0
        self.live = sum(1 for st in self.state if st != _DONE)

    def speed(self, now: float) -> float:
        return self.cold.speed if self.cold is not None and now < self.cold_until else 1.0

    def use(self) -> duty.Use:
        """What the probes would have counted so far."""
        return duty.Use(self.consumed, self.syncs, sum(1 for st in self.state if st == _WAIT),
                        self.launches, self.sync_s)

    def next_event(self, now: float, t_next: float) -> float:
        if self.held_since is not None:
            return t_next
        speed = self.speed(now)
        if speed < 1.0:
            t_next = min(t_next, self.cold_until)
        for i, st in enumerate(self.state):
            if st == _HOST:
                t_next = min(t_next, now + self.rem[i] / speed)
            elif st == _WAIT:
                t_next = min(t_next, self.ready[i])
        return t_next

    def run_host(self, now: float, until: float) -> None:
        """Its running threads' host work from `now` to `until`."""
        if self.held_since is None:
            done = (until - now) * self.speed(now)
            for i, st in enumerate(self.state):
                if st == _HOST:
                    self.rem[i] -= done

    def _finish(self, i: int, now: float) -> None:
        self.done_at.append(now)
        self.idx[i] += 1
        if self.idx[i] < len(self.ths[i].kinds):
            self.state[i], self.rem[i] = _HOST, self.ths[i].gaps[self.idx[i]]
        else:
            self.state[i] = _DONE
            self.live -= 1

    def _stop(self, how: str, now: float) -> None:
        self.held_since, self.ask = now, duty.Ask.NONE
        self.stops[how] += 1

    def advance(self, now: float, dev: "_Device") -> bool:
        """Complete what is due at `now` (launches issued onto the device's
        queue, synchronizes entered and returned); True if anything was."""
        any_done = False
        progressed = True
        while progressed and self.held_since is None:
            progressed = False
            for i, th in enumerate(self.ths):
                if self.held_since is not None:
                    break
                st = self.state[i]
                if st == _HOST and self.rem[i] <= _EPS:
                    k = self.idx[i]
                    if th.kinds[k] == LAUNCH:
                        if self.ask is duty.Ask.LAUNCH:
                            self._stop("launch", now)   # before the launch: issued on release
                            break
                        self.last_end = dev.run(now, th.gpu[k])
                        self.consumed += th.costs[k]
                        self.launches += th.counts[k]
                        self._finish(i, now)
                    else:
                        self.state[i] = _WAIT
                        self.entered[i] = now
                        self.ready[i] = max(now, self.last_end) + self.wl.floor
                    progressed = True
                elif st == _WAIT and self.ready[i] <= now + _EPS:
                    self.syncs += 1
                    self.sync_s += now - self.entered[i]
                    self.returns.append(now)
                    self._finish(i, now)
                    progressed = True
                    if self.ask is not duty.Ask.NONE:
                        self._stop("sync", now)
            any_done |= progressed
        return any_done

    def seen_held(self, now: float, seen_after: float) -> float | None:
        h = self.held_since
        return h if h is not None and now >= h + seen_after - _EPS else None

    def apply(self, s: Step, now: float, seen: float | None) -> None:
        self.modes.append((now, s.mode))
        if self.last_mode is not None and s.mode != self.last_mode:
            self.mode_changes += 1
        self.last_mode = s.mode
        self.debt_max = max(self.debt_max, s.debt)
        if s.release and seen is not None:
            self.holds.append((self.held_since, now))
            self.held_since = None
            if self.cold is not None:
                self.cold_until = now + self.cold.seconds
        self.ask = s.ask if self.held_since is None else duty.Ask.NONE

    def result(self, cap: float | None, now: float, gpu: GpuBusy) -> Run:
        holds = self.holds + ([(self.held_since, now)] if self.held_since is not None else [])
        return Run(workload=self.wl.name, cap=cap, end=now, finished=self.live == 0,
                   done_at=self.done_at, returns=self.returns, holds=holds, stops=self.stops,
                   modes=self.modes, mode_changes=self.mode_changes, debt_max=self.debt_max,
                   gpu=gpu)


class _Device:
    """One GPU that runs its processes' work in the order it was launched
    (processes side by side share it as time-slicing does, less its switches)."""

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy = GpuBusy()

    def run(self, now: float, seconds: float) -> float:
        start = now if now > self.free_at else self.free_at
        self.free_at = start + seconds
        self.busy.add(start, self.free_at)
        return self.free_at

    def nvml_util(self, now: float) -> float:
        end = max(now - NVML_LAG_S, NVML_PERIOD_S)
        return 100.0 * self.busy.share(end - NVML_PERIOD_S, end)


def _simulate(procs: list[_Proc], step, stepping: bool, *, horizon: float | None, tick: float,
              seen_after: float, late_by: float) -> tuple[float, _Device]:
    """Run the processes on one device until all are done (or the horizon);
    `step(now, dev, seen)` steps the controller: seen[i] is when process i's
    hold began as far as the controller knows, and it returns one Step per
    process and the time it asks to be stepped next."""
    dev = _Device()
    now, ticks = 0.0, 0
    next_tick = 0.0 if stepping else math.inf
    step_at: float | None = None
    while any(p.live for p in procs) and (horizon is None or now < horizon):
        t_next = next_tick if step_at is None else min(next_tick, step_at)
        for p in procs:
            t_next = p.next_event(now, t_next)
        if horizon is not None:
            t_next = min(t_next, horizon)
        if t_next == math.inf:
            break
        t_next = max(t_next, now)
        for p in procs:
            p.run_host(now, t_next)
        now = t_next
        # every process advances each round (a list, not a short-circuit),
        # until none has anything more due now
        while any([p.advance(now, dev) for p in procs]):
            pass
        if stepping and (now >= next_tick - _EPS or (step_at is not None and now >= step_at - _EPS)):
            if now >= next_tick - _EPS:
                ticks += 1
                next_tick = ticks * tick
            seen = [p.seen_held(now, seen_after) for p in procs]
            steps, nxt = step(now, dev, seen)
            for p, s, h in zip(procs, steps, seen):
                p.apply(s, now, h)
            step_at = None if nxt is None else max(nxt + late_by, now + MIN_STEP_S)
    return now, dev


def replay(wl: Workload, controller: Controller | None = None, *, cap: float | None = None,
           horizon: float | None = None, tick: float = TICK_S, seen_after: float = 0.0,
           late_by: float = 0.0, cold: Cold | None = None) -> Run:
    """`seen_after`: a stop reaches the controller this long after it happened
    (its event in the ring buffer); steps before that see the group running.
    `late_by`: a step the controller asks for comes this much later (the
    daemon's loop busy elsewhere), so a hold due to end outlasts its debt.
    `cold`: after each release the host program runs slower for a while
    (Cold); None: a stop costs it nothing."""
    p = _Proc(wl, cold)

    def step(now: float, dev: _Device, seen: list) -> tuple[list, float | None]:
        wants = getattr(controller, "wants_util", None)
        read = {"util": dev.nvml_util(now)} if wants is not None and wants(now) else {}
        u = p.use()
        s = controller.step(now, u.consumed, u.syncs, seen[0], waiting=u.waiting,
                            launches=u.launches, sync_s=u.sync_s, **read)
        return [s], s.next_step

    now, dev = _simulate([p], step, controller is not None, horizon=horizon, tick=tick,
                         seen_after=seen_after, late_by=late_by)
    return p.result(cap, now, dev.busy)


def replay_capped(wl: Workload, cap: float, *, horizon: float | None = None,
                  seen_after: float = 0.0, late_by: float = 0.0, tick: float = TICK_S,
                  cold: Cold | None = None, pacer: duty.DutyPacer | None = None,
                  start: float = 0.0) -> Run:
    """`start`: the cap is set then (uncapped before)."""
    return replay(wl, DutyController(cap, pacer=pacer, start=start), cap=cap, horizon=horizon,
                  seen_after=seen_after, late_by=late_by, tick=tick, cold=cold)


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
    ap.add_argument("--cold", action="store_true",
                    help="the host program runs slower for a while after each stop (COLD_MEASURED)")
    ap.add_argument("--held", action="store_true",
                    help="the host program runs slower whenever it is held at all (HELD_MEASURED)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run a recording's timed loop this many times over (workload.repeat_loop)")
    ap.add_argument("--sample-pct", type=float, default=100 * progress.SAMPLE_SHARE,
                    help="running time a launch-bound group runs free to measure its speed; 0: none")
    ap.add_argument("--cap-from", type=float, default=None, metavar="S",
                    help="set the cap S seconds into the timed loop, as on a running process "
                         "(bench/gpu/suite_ab.sh), and take the loop's figures from there")
    ap.add_argument("--stretch", type=float, default=None, metavar="S",
                    help="with --cap-from: end each run S seconds after the cap is set")
    ap.add_argument("--pair", default=None, metavar="SPLITS",
                    help="replay the two recordings given side by side, one group each, at each "
                         "split of caps (e.g. 30:70,50:50; none: uncapped), each side against its "
                         "replay alone")
    ap.add_argument("--slowed", choices=("both", "first", "second"), default="both",
                    help="with --pair and --cold or --held: the side(s) a stop slows")
    a = ap.parse_args(argv)
    cold = HELD_MEASURED if a.held else COLD_MEASURED if a.cold else None
    if a.pair:
        from . import pairs
        return pairs.cli(a, cold, _recordings(a))
    caps = [float(c) for c in a.caps.split(",") if c]
    if a.traces:
        recs = _recordings(a)
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
        start, loop, horizon = 0.0, (rec.loop_start, rec.loop_end), a.horizon
        if a.cap_from is not None and rec.loop_start is not None:
            start = rec.loop_start + a.cap_from     # the run is the base's until then
            loop = (start, rec.loop_end)
            horizon = start + a.stretch if a.stretch else horizon
        for cap in caps:
            run = replay_capped(wl, cap, horizon=horizon, cold=cold, start=start,
                                pacer=duty.DutyPacer(sample_share=a.sample_pct / 100))
            print("  " + compare(run, base, loop).line())
    return 0


def _recordings(a) -> list:
    """The recordings named on the command line, timed loops repeated --repeat times."""
    recs = [load(p) for p in a.traces]
    return [repeat_loop(r, a.repeat) if a.repeat > 1 and r.loop_start is not None else r
            for r in recs]


if __name__ == "__main__":
    raise SystemExit(main())
