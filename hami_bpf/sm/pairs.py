"""Recordings replayed side by side on one modelled GPU, each process its own
group under one duty pacer, as the daemon paces a pair of containers.

Pure, as hami_bpf.sm.replay, whose engine it drives: the modelled GPU runs
every process's work in the order it was launched, so processes running at
once slow each other, as time-slicing does (less its switches).
PairController gives the pacer the daemon's view of each group, and which
ones share the device; `compare_pair` judges each side against its own
replay alone over the seconds all their timed loops ran.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import duty, sharing
# the replay's engine: its processes, device and stepping loop
from .replay import (_EPS, LOOP_SETTLE_S, TICK_S, Cold, Step, _Device, _longest_below, _Proc,
                     _simulate, _step_of, equivalent_time, fit, reached, replay)


class PairController:
    """duty.DutyPacer for several groups on one device, one process each, as
    the daemon drives it: their caps (None: uncapped, seen launching but not
    paced), their probes' counts, which are held, which share the device
    (another group launched there within throttle.BUSY_S: nothing is
    measured there) and the share of its time no cap claims."""

    def __init__(self, caps: list, pacer: duty.DutyPacer | None = None) -> None:
        self.caps = caps
        self.pacer = pacer or duty.DutyPacer()
        self.last_launch: dict[int, float] = {}
        self.launches: dict[int, int] = {}

    def wants_util(self, now: float) -> bool:
        return 0 in self.pacer.wants_util(now)

    def step(self, now: float, procs: list, seen: list, util: float | None) -> tuple:
        """Step the pacer; procs and seen for every group, capped or not.
        Returns each capped group's Step, in order, and the next step's time."""
        for g, p in enumerate(procs):
            if p.launches != self.launches.get(g):
                self.launches[g], self.last_launch[g] = p.launches, now
        capped = [g for g, c in enumerate(self.caps) if c is not None]
        keys = [(g, 0) for g in capped]
        active = sharing.active({(g, 0): t for g, t in self.last_launch.items()}, now)
        shared = sharing.shared(keys, active)
        caps = {(g, 0): self.caps[g] for g in capped}
        obs = duty.Observation(
            now=now, caps=caps,
            use={(g, 0): procs[g].use() for g in capped},
            held={g: seen[g] for g in capped if seen[g] is not None},
            shared=shared, util=None if util is None else {0: util},
            spare=sharing.spare_time(caps, active), active=frozenset(active))
        d = self.pacer.step(obs)
        return [_step_of(d, k) for k in keys], d.next_step


def replay_pair(wls: list, caps: list, *, horizon: float | None = None, tick: float = TICK_S,
                colds: list | None = None, pacer: duty.DutyPacer | None = None) -> list:
    """Several recordings replayed side by side on one modelled GPU, each
    process its own group capped at its entry of `caps` (None: uncapped,
    never held), one pacer over all of them; `colds`: each process's Cold
    (or None). One Run per workload."""
    procs = [_Proc(wl, c) for wl, c in zip(wls, colds or [None] * len(wls))]
    capped = [i for i, c in enumerate(caps) if c is not None]
    ctl = PairController(list(caps), pacer)
    none = Step(duty.Ask.NONE, False, None, duty.Mode.BUDGET)

    def step(now: float, dev: _Device, seen: list) -> tuple[list, float | None]:
        util = dev.nvml_util(now) if ctl.wants_util(now) else None
        got, nxt = ctl.step(now, procs, seen, util)
        steps = [none] * len(procs)
        for i, s in zip(capped, got):
            steps[i] = s
        return steps, nxt

    now, dev = _simulate(procs, step, bool(capped), horizon=horizon, tick=tick,
                         seen_after=0.0, late_by=0.0)
    return [p.result(c, now, dev.busy) for p, c in zip(procs, caps)]


@dataclass
class Side:
    """One side of a pair over the seconds both timed loops ran (from
    LOOP_SETTLE_S after the later one began): its unthrottled seconds of work
    per second, and its longest run of 1 s windows below cap - 10 points."""
    workload: str
    cap: float | None
    mean: float
    below_longest_s: float
    window: tuple


def compare_pair(runs: list, bases: list, loops: list) -> list:
    """Each side of a pair (replay_pair's runs, each workload's unthrottled
    replay alone, its recording's (loop_start, loop_end)) over the window
    in which all their timed loops ran."""
    spans = []
    for run, base, (start, end) in zip(runs, bases, loops):
        began = reached(run, base, start)
        ended = reached(run, base, end) if end is not None else None
        spans.append((run.end if began is None else began, run.end if ended is None else ended))
    lo = max(a for a, _ in spans) + LOOP_SETTLE_S
    hi = min(b for _, b in spans)
    sides = []
    for run, base in zip(runs, bases):
        tau = equivalent_time(run, base)
        n = int(hi - lo + _EPS)
        mean = (tau(hi) - tau(lo)) / (hi - lo) if hi > lo else float("nan")
        below = _longest_below([tau(lo + i + 1) - tau(lo + i) for i in range(max(n, 0))], run.cap)
        sides.append(Side(run.workload, run.cap, mean, float(below[0]), (lo, hi)))
    return sides


def cli(a, cold: Cold | None, recs: list) -> int:
    """`python3 -m hami_bpf.sm.replay A B --pair SPLITS`: each split's sides."""
    if len(recs) != 2:
        raise SystemExit("--pair takes exactly two recordings")
    wls = [fit(r) for r in recs]
    bases = [replay(wl) for wl in wls]
    colds = [cold if a.slowed in ("both", side) else None for side in ("first", "second")]
    for split in a.pair.split(","):
        caps = [None if c == "none" else float(c) for c in split.split(":")]
        runs = replay_pair(wls, caps, horizon=a.horizon, colds=colds,
                           pacer=duty.DutyPacer(sample_share=a.sample_pct / 100))
        sides = compare_pair(runs, bases, [(r.loop_start, r.loop_end) for r in recs])
        lo, hi = sides[0].window
        print(f"{split:>7}  both loops {lo:.0f}-{hi:.0f} s  " + "  ".join(
            f"{s.workload} cap {'-' if s.cap is None else f'{s.cap:g}'}: {100 * s.mean:5.1f} "
            f"(below cap-10 {s.below_longest_s:.0f} s)"
            for s in sides))
    return 0
