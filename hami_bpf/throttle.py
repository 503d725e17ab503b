"""The SM-share controller: a launch budget per (group, device). Pure: no I/O.

The launch probes add each launch's cost (its grid's block count; a graph
launch costs `graph_cost`) to `sm_use.consumed`; a launch that finds
`consumed > granted` stops its process until the controller grants more.
This module decides `granted` on every tick.

The model (measured on the H200 and reproduced by the stand-in libcuda's
simulated GPU, bench/sim_sm.py; docs/performance.md):

1. Learn the full rate F. A new (group, device) runs unthrottled. The host
   can queue a second or more of GPU work before the driver pushes back, so
   the host's early launch rate says nothing about the GPU. Where the
   workload synchronizes (cuStreamSynchronize, cuCtxSynchronize[_v2],
   cuEventSynchronize: PyTorch does at every .item(), .cpu() and
   torch.cuda.synchronize()), the probes report `completed`: cost known done
   on the GPU, whose rate is the GPU's real pace (each completion stamped
   with the probe's own time). Completions from before the queue filled
   count only where the GPU was busy with this group alone. Without
   synchronizations, the launch rate after the queue has filled is the pace.
   While a group learns, a synchronize's return also spends its grant (a
   BPF checkpoint, at most every 200 ms), so the grant that learning sets
   applies before the workload refills a second-deep queue.
   A group learns alone where it can (learn_alone(), and
   hami_bpf.sm.controller's SmController._learn_alone): the device's other
   capped groups are held meanwhile, at most
   LEARN_ALONE_S, since next to another process the GPU time-slices and
   the pace comes out short (H200 matmuls: 92% side by side, 72-74% next to
   a group capped at 70); 2 is for where it cannot (an uncapped group busy
   there, a higher-priority one, or learning that outlasts the hold).
2. Correct F for contention. If the device was saturated while learning
   (device utilization >= SATURATED), other groups were taking part of it:
   the group's own part of the busy time, Ug (utilization attributed to it:
   SmController._shares), scales the pace to what the whole device would
   give it: F = pace x Ud / Ug. Alone, Ug = Ud and F = pace. The group's
   GPU time per cost unit, w = Ug / pace, is kept so that other groups
   learning later can subtract this one's part (rate x w) from the device.
   F is never more than the launcher's own loop can launch: cost per second
   of its time outside synchronize calls (`sync_ns`), so a launch-bound
   group next to another is not taken for a GPU-bound one.
   Where the device had room, the launcher set the pace: F is credited
   the part of its time the launch probe took (measured at start-up).
3. Open loop. The allowed rate is R = cap% x F; a token bank refilled at R,
   holding at most `burst_s` of it, so an idle group cannot save up a long
   uncapped burst. Throughput relative to uncapped is R / F = cap, whatever a
   block or a graph really costs: the units cancel out.

4. Turns. Two processes time-slicing one GPU finish less work together
   than either alone (H200, 8192^2 matmuls: the pair 92.3% of one alone),
   so two groups capped at 30 and 70, each paced at its cap, could not both
   reach it. Where two or more groups capped on one device only have their
   rates, they take turns instead (turns()): each owns a slot of a period
   (TURN_PERIOD_S) as long as its cap, is granted the slot's work
   (TURN_FILL of it) as it begins and nothing once it ends, so their work
   reaches the GPU one group at a time (taking turns by the clock, the same
   pair did 97.4%: bench/gpu/turns.sh). Rates learned side by side are
   short by the time-slicing loss; in turns the GPU then idles, and
   turn_gains() raises them by what NVML shows idle.

No feedback loop trims R afterwards. Two were tried on the H200 and in the
simulator: one on completions, one on NVML utilization. Both react to a
signal that lags the launches by the whole launch queue (up to ~1 s), and
both made it worse: the first wound down under the cap and crawled back,
the second starved graph replays (utilization stays 100% while a queue
drains). The one correction left is in turns, only upward from what
learning side by side lost, and bounded (turn_gains).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import NamedTuple

LEARN_S = 1.0         # at least this long unthrottled
LEARN_FROM = 0.4      # fraction of the learning window ignored (queue filling)
LEARN_MAX_S = 1.5     # of launching without a synchronize: use the host-side rate (a
                      # queue fills in ~1 s; JAX waits on a host callback no probe sees,
                      # and would run unthrottled for as long as this)
HOST_WINDOW_S = 1.0   # the host-side rate is measured over this long
SUSTAINED = 0.8       # ... once the group launched in every tick of this part of it
LEARN_IDLE_S = 0.5    # learning: this long with nothing launched or left to complete starts it over
LEARN_GIVEUP_S = 10.0  # or after this long launching, sustained or not
LEARN_SHARED_S = 5.0  # next to a busy group: wait this long at most for a steady pace
STEADY_TOL = 0.15
BURST_S = 0.05
MIN_RATE = 1.0        # cost units per second
UNLIMITED = 1 << 40   # a grant this far above consumption never stops a launch
SATURATED = 90.0      # device utilization (percent) at which groups contend
MIN_PART = 0.05       # a group's part of a saturated device is at least this

DONE_WINDOW_S = 1.0   # completion rate is measured over about this long
DONE_MIN_SPAN_S = 0.4
DONE_KEEP_S = 6.0     # ... or, where synchronizes are sparse, over the last few within this
TICKS_KEEP_S = DONE_KEEP_S  # learning ticks kept (host rate, host-side ceiling)
HOST_BOUND_SHARE = 0.01  # a probe share under this is no sign the launcher set the pace
LEARN_ALONE_S = 2.0   # a learning group holds its device's other capped groups at most this long
TURN_PERIOD_S = 0.1   # groups capped on one device take turns within this period
TURN_FILL = 0.97      # a slot is granted this much of its length's work: handing the GPU over
                      # takes the rest (H200: 2.6%, bench/gpu/turns.sh); with none left, work
                      # spills into the next slot, and once two groups' work overlaps the GPU
                      # time-slices it and falls further behind (simulator: 70 -> 64%)
TURN_SHORT = 0.05     # a slot's work left unlaunched past this part of it: the slot was short of work
TURN_CALIBRATE_S = 1.5  # turns' device utilization is read over this long (NVML lags ~1 s)
TURN_IDLE_PTS = 5.0   # points of its turns' time a device may idle before their rates are raised
TURN_MAX_GAIN = 1.4   # ... by at most this much in all (H200: one learning next to a capped
                      # group learned 72-74% of its rate)
TURN_STEP = 1.02      # a raised rate whose turns overran is lowered by this at a time
TURN_HEADROOM = 5.0   # points of its turns' time left idle after raising: the handoffs between
                      # turns take ~2.6 (bench/gpu/turns.sh) and NVML reads ~2 low; less
                      # pushed slots' work into the next ones on the H200, where it
                      # time-slices (4: the 70 group fell from 69% to 65% after a raise)


class Sample(NamedTuple):
    """One tick while learning."""
    t: float
    util: float | None          # device utilization, percent
    known_others: float         # percent of it taken by neighbours whose w is known
    rate: float                 # this group's launched cost per second
    others_rate: float          # the other neighbours' launched cost per second
    launches: int               # this group's launches so far
    sync_s: float = 0.0         # this group's threads' time in synchronize calls so far
    others_unpaced: bool = False  # another group busy here whose pace is not known yet


@dataclass
class Budget:
    cap: float                      # percent, 0 < cap < 100
    granted: int = 0
    rate: float | None = None       # allowed cost units per second (None while learning)
    full_rate: float = 0.0          # learned rate with the whole device, F
    pace: float = 0.0               # learned unthrottled rate as seen (before contention)
    work_per_unit: float | None = None  # device seconds per cost unit, w (with utilization)
    contended: bool = False         # the device was saturated while learning
    probe_s: float = 0.0            # host time the launch probe adds per launch (measured)
    probe_share: float = 0.0        # learned: the part of the launcher's time the probe took
    started: float | None = None
    start_consumed: int = 0
    active_since: float | None = None   # learning counts from the first launch seen
    ticks: collections.deque = field(default_factory=collections.deque)
    # ^ (time, consumed, seconds in synchronize) per tick while learning, last TICKS_KEEP_S
    last_t: float | None = None
    last_consumed: int = 0
    credit: float | None = None     # granted, unrounded
    last_share: float | None = None  # achieved, percent of F (smoothed)
    utils: list = field(default_factory=list)   # Sample per tick while learning
    done: list = field(default_factory=list)    # (time, completed) when completed advanced
    host_ceiling: float | None = None  # learned: cost per second of the launcher's own time
    fresh_since: float = 0.0        # learn only from completions after this (a neighbour changed)
    launcher_bound: bool = False    # F was capped by host_ceiling
    by_completion: bool = False     # the pace came from completions (the GPU's)
    turn_k: int | None = None       # the period whose turn it was last granted
    turn_open: bool = False         # its slot is running (granted, not yet taken back)
    turn_lump: float = 0.0          # the work granted at its slot's start
    turn_slots: int = 0             # slots ended since the device's utilization was last read
    turn_short: int = 0             # ... of them with work left unlaunched (TURN_SHORT)
    turn_short_before: int = 0      # turn_short at the reading before
    turn_gain: float = 1.0          # what turn_gains() scaled its full rate by, in all
    alone_since: float | None = None  # when it began learning with its device's capped groups held
    idle_since: float | None = None   # learning: nothing launched or outstanding since
    restarts: int = 0                 # learning started over after an idle spell

    @property
    def learning(self) -> bool:
        return self.rate is None

    def hold(self, consumed: int) -> None:
        """Held off its device (another group learns there alone): nothing
        granted past what it launched, and no slot running."""
        self.granted, self.credit, self.turn_open = consumed, float(consumed), False

    def device_part(self, rate: float) -> float | None:
        """Fraction of the device this group takes at `rate` units/s, if known."""
        return None if self.work_per_unit is None else rate * self.work_per_unit


def _recent_done(b: Budget, now: float) -> list[tuple[float, int]]:
    """The completions of about the last DONE_WINDOW_S; where a workload
    synchronizes less often than that (a batch of large matmuls, then one
    synchronize: every 1-2 s on the H200), the last two of DONE_KEEP_S."""
    recent = [(t, c) for t, c in b.done if now - t <= DONE_WINDOW_S + 0.5]
    if len(recent) >= 2:
        return recent
    return [(t, c) for t, c in b.done if now - t <= DONE_KEEP_S][-2:]


def completion_span(b: Budget, now: float) -> tuple[float, float, float] | None:
    """(rate, from, to): the completion rate over the recent completions."""
    pts = _recent_done(b, now)
    if len(pts) < 2 or pts[-1][0] - pts[0][0] < DONE_MIN_SPAN_S:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0]), pts[0][0], pts[-1][0]


def _sharing(b: Budget, since: float, until: float) -> bool:
    """Other groups launched on a saturated device during the span."""
    xs = [x for x in b.utils if since <= x.t <= until and x.util is not None]
    return bool(xs) and (sum(x.util for x in xs) / len(xs) >= SATURATED
                         and any(x.known_others > 0 or x.others_rate > 0 for x in xs))


def _busy_alone(b: Budget, since: float, until: float) -> bool:
    """No other group launched on the device over the span, and the device
    was saturated (NVML) or the group waited in synchronize calls for most
    of it (the GPU was behind its work: NVML's average lags by up to a
    second after an idle spell). Then the GPU worked for this group
    throughout, and completions from before its queue had filled count too."""
    after = [x for x in b.utils if since < x.t]
    xs = [x for x in after if x.t <= until]
    if len(xs) < 2 or any(x.known_others > 0 or x.others_rate > 0 or x.others_unpaced
                          for x in xs):
        return False
    utils = [x.util for x in xs if x.util is not None]
    if utils and sum(utils) / len(utils) >= SATURATED:
        return True
    # The closing synchronize's wait is counted when it returns: at `until`.
    last = next((x for x in after if x.t >= until), xs[-1])
    return last.sync_s - xs[0].sync_s >= 0.5 * (until - since)


def _steady(b: Budget, now: float) -> bool:
    """The completion pace of the older and the newer half of the window agree."""
    pts = _recent_done(b, now)
    if len(pts) < 3:
        return False
    mid = (pts[0][0] + pts[-1][0]) / 2
    k = min(range(1, len(pts) - 1), key=lambda i: abs(pts[i][0] - mid))
    (t0, c0), (t1, c1), (t2, c2) = pts[0], pts[k], pts[-1]
    if t1 - t0 < 0.2 or t2 - t1 < 0.2:
        return False
    a, z = (c1 - c0) / (t1 - t0), (c2 - c1) / (t2 - t1)
    return a > 0 and z > 0 and abs(a - z) / max(a, z) <= STEADY_TOL


def completion_rate(b: Budget, now: float) -> float | None:
    span = completion_span(b, now)
    return None if span is None else span[0]


def _host_rate(b: Budget, since: float, until: float) -> float | None:
    """Cost launched per second of the launcher's own time (wall time less
    the time its threads waited in synchronize calls) over the span: what it
    would launch if the GPU never kept it waiting."""
    # A synchronize's wait is counted when it returns, in the tick at or
    # after its completion's own time: the span runs to that tick, or the
    # closing wait would be left out (H200, matmul pair: a group waiting
    # 1.5 s of every 2 s learned itself launcher-bound, 13.8% for cap 30).
    pts = [x for x in b.ticks if x[0] >= since - 1e-9]
    end = next((i for i, x in enumerate(pts) if x[0] >= until - 1e-9), None)
    if end is None or end < 1:
        return None
    (t0, c0, s0), (t1, c1, s1) = pts[0], pts[end]
    own = (t1 - t0) - (s1 - s0)
    if c1 <= c0 or own <= 0.1 * (t1 - t0):
        return None
    return (c1 - c0) / own


def _waited(samples: list[Sample]) -> bool:
    """The group spent most of the samples' span in synchronize calls: the
    GPU, not its launcher, set its pace (NVML's average can still read low
    after an idle spell), so the launch probe cost it nothing that counts."""
    first, last = samples[0], samples[-1]
    return last.t > first.t and last.sync_s - first.sync_s >= 0.5 * (last.t - first.t)


def _probe_share(b: Budget, samples: list[Sample], *, own: bool) -> float:
    """The part of the launcher's time (of its own time, outside synchronize
    calls, if `own`) that the launch probe took over the samples."""
    first, last = samples[0], samples[-1]
    span = last.t - first.t - ((last.sync_s - first.sync_s) if own else 0.0)
    if b.probe_s <= 0 or span <= 0:
        return 0.0
    return min(0.5, (last.launches - first.launches) / span * b.probe_s)


def _learned(b: Budget, pace: float, since: float, until: float, consumed: int) -> int:
    """End learning with the unthrottled `pace` measured from `since` to
    `until`; the device's utilization is split over the same span."""
    samples = [x for x in b.utils if since < x.t <= until and x.util is not None]
    b.pace = pace
    b.full_rate = pace
    # Only where it synchronizes: there the GPU keeps it waiting in
    # synchronize calls; without any, it waits inside full launch queues.
    b.host_ceiling = _host_rate(b, since, until) if b.by_completion else None
    if samples and pace > 0:
        # Over the window, not per tick: launches run ahead of the GPU by the
        # launch queue, so a tick's launches say little about that tick's busy time.
        n = len(samples)
        ud = sum(x.util for x in samples) / n
        known = sum(x.known_others for x in samples) / n
        # In the neighbours' terms (completions where they synchronize).
        # A tick with a busy neighbour whose pace is not known yet (blocked
        # on its full queue: it launches nothing) says nothing about the
        # split: use the other ticks; if there are none, the GPU time-slices
        # between contexts that both have work, so take it as an equal part
        # (H200, matmul pair: the 30% group gave such a neighbour 13% of the
        # device and learned 53% of its whole, 15.9% for its cap of 30).
        paced = [x for x in samples if not x.others_unpaced] or samples
        m = len(paced)
        mine = pace * m if b.by_completion else sum(x.rate for x in paced)
        theirs = sum(x.others_rate if not x.others_unpaced else
                     max(x.others_rate, pace if b.by_completion else x.rate) for x in paced)
        left = max(0.0, ud - known)
        ug = left * mine / (mine + theirs) if mine + theirs > 0 else left
        part = max(ug, MIN_PART * 100.0)
        b.work_per_unit = part / 100.0 / pace
        if ud >= SATURATED and part < ud:
            b.contended = True
            b.full_rate = pace * ud / part
            if b.host_ceiling is not None and b.host_ceiling < b.full_rate:
                # The group cannot launch faster than its own host loop does,
                # however much of the device it would have alone: two
                # launch-bound groups fill NVML's utilization without
                # either being held back by half (H200, small kernels).
                b.launcher_bound = True
                b.probe_share = _probe_share(b, samples, own=True)
                b.full_rate = max(pace, b.host_ceiling / (1.0 - b.probe_share))
        elif ud < SATURATED and b.probe_s > 0 and len(samples) > 1 and not _waited(samples):
            # The device had room: the launcher, not the GPU, set the pace,
            # and the probe's trap took part of each launch. Without probes
            # (uncapped) it would run that much faster; caps are shares of that.
            b.probe_share = _probe_share(b, samples, own=False)
            if b.probe_share < HOST_BOUND_SHARE:
                # A few launches a second: a GPU-bound group whose NVML
                # average still lagged (H200 matmuls alone: 0.04%), not one
                # its launcher holds back; `hami-bpf events` said "host-bound".
                b.probe_share = 0.0
            b.full_rate = pace / (1.0 - b.probe_share)
    b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
    b.granted, b.credit = consumed, float(consumed)   # the bank starts empty
    b.utils = []
    b.ticks.clear()
    return b.granted


def _idle_restart(b: Budget, now: float, dt: float, consumed: int, completed: int | None,
                  launched: bool) -> bool:
    """A learning group with nothing launched and nothing left to complete for
    LEARN_IDLE_S (it waits on a barrier, a peer, a request) starts learning
    over: a pace measured across the wait would be its work spread over the
    idle time too, a small fraction of what it does busy, and its cap a share
    of that (H200: a prefill group that waited 5 s for its neighbour's warm-up
    learned 1/7000 of its rate). Returns whether it is idle now."""
    if launched or completed is None or completed < consumed:
        b.idle_since = None
        return False
    if b.idle_since is None:
        b.idle_since = now - dt
    if b.active_since is not None and now - b.idle_since >= LEARN_IDLE_S:
        b.active_since = None
        b.start_consumed = consumed
        b.done.clear()
        b.ticks.clear()
        b.utils = []
        b.fresh_since = now
        b.restarts += 1
    return b.active_since is None


def learn_alone(learners: dict, capped: dict, *, current=None) -> tuple:
    """Which group learning on a device learns there alone now, and which
    capped groups it holds meanwhile: (key, frozenset of keys), or (None,
    frozenset()). `learners`: {key: (since, priority)} of the groups that
    may learn there now; `capped`: {key: priority} of every capped group
    there (one that has not launched yet is held at its first launch). A
    smaller priority number is higher (HAMi's).

    One at a time, highest priority first, then the first to arrive; the one
    learning keeps its turn unless a higher priority arrives. It holds only
    groups of its own or lower priority. Learning beside another process, a
    group learns the rate a time-slicing GPU gives it, which does less in all
    than one alone (H200 matmuls: both 92% of the truth together; 72-74% next
    to a group capped at 70): its cap is then a share of too little."""
    if not learners:
        return None, frozenset()
    best = min(learners, key=lambda k: (learners[k][1], learners[k][0], k))
    key = current if current in learners and learners[current][1] <= learners[best][1] else best
    prio = learners[key][1]
    return key, frozenset(k for k, p in capped.items() if k != key and p >= prio)


class Turn(NamedTuple):
    """A group's slot: [start, start + length) of every period (fractions of
    it) counted from `epoch`, in seconds on the daemon's clock."""
    epoch: float
    period: float
    start: float
    length: float

    def edges(self, now: float) -> tuple[float, float]:
        """The start and end of the slot now running, or of the next one."""
        k = math.floor((now - self.epoch) / self.period - self.start)
        t0 = self.epoch + (k + self.start) * self.period
        if now >= t0 + self.length * self.period:
            t0 += self.period
        return t0, t0 + self.length * self.period


def turns(caps: dict, *, epoch: float, period: float = TURN_PERIOD_S) -> dict:
    """Slots for the groups capped on one device ({key: cap percent}), in
    key order, each as long as its cap (as its share of the caps' sum where
    they add up past 100); what caps leave is the period's tail, for
    uncapped groups. One group alone takes no turn."""
    if len(caps) < 2:
        return {}
    scale = max(100.0, float(sum(caps.values())))
    out, at = {}, 0.0
    for key in sorted(caps):
        out[key] = Turn(epoch, period, at, caps[key] / scale)
        at += caps[key] / scale
    return out


def next_edge(slots, now: float) -> float | None:
    """When the next slot of any of `slots` begins or ends."""
    edges = [e for t in slots for e in t.edges(now) if e > now]
    return min(edges, default=None)


def _take_turn(b: Budget, turn: Turn, now: float, consumed: int) -> int:
    start, end = turn.edges(now)
    if start <= now < end:
        k = round((start - turn.epoch) / turn.period)
        if b.turn_k != k:
            # The slot's work at once: a GPU-bound launcher queues it
            # and the GPU runs it while the others wait their turns.
            b.turn_k, b.turn_open = k, True
            b.turn_lump = b.full_rate * turn.length * turn.period * TURN_FILL
            # A launch that found the last slot's work spent was still let
            # through (the probe stops its process after it): this slot pays.
            owed = max(0.0, consumed - (b.credit if b.credit is not None else consumed))
            b.credit = consumed + max(0.0, b.turn_lump - owed)
            b.granted = int(math.ceil(b.credit))
    else:
        if b.turn_open:
            b.turn_open = False
            b.turn_slots += 1
            if b.granted - consumed > TURN_SHORT * b.turn_lump:
                b.turn_short += 1
        if b.granted > consumed:
            # Not its slot: work it launched now would run in another's.
            b.granted, b.credit = consumed, float(consumed)
        else:
            b.credit = min(b.credit if b.credit is not None else consumed, float(consumed))
    return b.granted


def gpu_bound(b: Budget) -> bool:
    """Its pace was the GPU's (completions), not its launcher's: only such
    groups take turns. A host-bound loop would have to launch a slot's work
    in the slot at full speed right after each resume, which it does not
    (H200, small kernels 30/70: 20.4/50.8% in turns, 21.3/64.8% without)."""
    return b.by_completion and not b.launcher_bound and not b.probe_share


def turn_gains(util: float | None, slots: list, budgets: list) -> list[float] | None:
    """What to multiply the full rates of the groups taking `slots` on a
    device by, given that it was `util` percent busy meanwhile (the mean of
    two readings: NVML's swings by several points); None: as they are.

    Groups that learned side by side (`contended`) learned the rate they got
    from a GPU time-slicing them, which does less in all than one alone
    (H200 matmuls: 92%), and so learned their full rates short. Taking
    turns, such a group launches its slot's work and the GPU finishes it
    early: it idles at the end of the slot. Where every group used every
    slot's work, that idle time (less TURN_HEADROOM) is what the contended
    groups' slots fall short by: they are raised by it; a group that learned
    alone has its rate right. When the turns overrun on a busy device (slots
    come up short in two readings running: synchronizes waited past them),
    every raised group is lowered a step (H200: raised alike, the 70 group
    came to 71.9% of its whole; whose synchronizes wait says little of
    which group overran)."""
    busy = 100.0 * sum(t.length for t in slots)
    if util is None or util <= 0 or any(b.turn_slots < 3 for b in budgets):
        return None
    if util < busy - TURN_IDLE_PTS:
        raised = [t.length * 100.0 for t, b in zip(slots, budgets) if b.contended]
        if not raised or any(b.turn_short for b in budgets):
            return None
        gain = 1.0 + (busy - TURN_HEADROOM - util) / sum(raised)
        gains = [min(gain, TURN_MAX_GAIN / b.turn_gain) if b.contended else 1.0 for b in budgets]
        return gains if any(g > 1.005 for g in gains) else None
    if not any(b.turn_short and b.turn_short_before for b in budgets):
        return None     # once may be a synchronize that happened to span a slot
    gains = [max(1.0 / b.turn_gain, 1.0 / TURN_STEP) if b.turn_gain > 1.0 else 1.0
             for b in budgets]
    return gains if any(g < 1.0 for g in gains) else None


def scale_rate(b: Budget, gain: float) -> None:
    b.full_rate *= gain
    b.turn_gain *= gain
    b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)


def correct_rate(b: Budget, gain: float) -> None:
    """A correction from the GPU itself (sm.guard): the learned full rate was
    wrong by `gain`; turns' own calibration (turn_gain) is left as it is."""
    b.full_rate *= gain
    b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)


def tick(b: Budget, *, now: float, consumed: int, launches: int = 0, completed: int | None = None,
         completed_at: float | None = None, sync_ns: int = 0,
         device: "DeviceView | None" = None, learn_s: float = LEARN_S,
         burst_s: float = BURST_S, turn: Turn | None = None) -> int:
    """Advance one budget to `now` given the probes' cumulative `consumed`,
    `completed` (and when it last advanced, `completed_at`, on the same
    clock as `now`) and `sync_ns`, and where known what the device did over
    the last tick (`device`, from neighbours()); return the new `granted`.
    With a `turn` (turns()), a group that has its rate is granted only in
    its slots."""
    note_done(b.done, now, completed, completed_at)
    if b.started is None:
        b.started = b.last_t = now
        b.last_consumed = b.start_consumed = consumed
        b.granted = max(b.granted, consumed + UNLIMITED)   # unthrottled while learning
        return b.granted
    dt = now - b.last_t
    if dt <= 0:
        return b.granted
    rate_seen = max(0, consumed - b.last_consumed) / dt
    launched = consumed > b.last_consumed
    b.last_t, b.last_consumed = now, consumed

    if b.rate is None:
        if _idle_restart(b, now, dt, consumed, completed, launched):
            return b.granted
        if b.active_since is None:
            if consumed <= b.start_consumed:
                return b.granted       # nothing launched yet: nothing to learn from
            b.active_since = now - dt
        active = now - b.active_since
        if device is not None:
            if device.known_others > 0 and b.utils and b.utils[-1].known_others <= 0:
                # A neighbour finished learning and is held to its cap from
                # now on: a pace measured across the change, split by the
                # state after it, would be neither (H200, matmul pair 30/70:
                # the later group learned 3x its pace).
                b.fresh_since = now
            b.utils.append(Sample(now, device.util, device.known_others, rate_seen,
                                  device.unknown_others_rate, launches, sync_ns / 1e9,
                                  device.others_unpaced))
        b.ticks.append((now, consumed, sync_ns / 1e9))
        while now - b.ticks[0][0] > TICKS_KEEP_S:
            b.ticks.popleft()
        if active < learn_s * LEARN_FROM:
            return b.granted
        # Completions from before the queue had filled say little (a
        # synchronize in set-up, then host work before the steady loop):
        # wait until they have left the window, unless the GPU was busy
        # with this group alone all along (matmuls: their first
        # synchronize after warm-up comes ~1 s in, the second ~1 s later).
        since = max(b.active_since + learn_s * LEARN_FROM * 0.5, b.fresh_since)
        span = completion_span(b, now)
        if span and (span[1] >= since or (b.fresh_since <= span[1]
                                          and _busy_alone(b, span[1], span[2]))):
            if active < LEARN_SHARED_S and (
                    (_sharing(b, span[1], span[2]) and not _steady(b, now))
                    or any(x.others_unpaced for x in b.utils if span[1] < x.t <= span[2])):
                # Arriving next to another group, the first second is a
                # transient (this group's queue fill runs ahead of the other's
                # work, or behind it): wait until the pace holds still, and
                # until every busy neighbour's own pace is known: one blocked
                # on its full queue launches nothing, yet holds the device.
                return b.granted
            b.by_completion = True
            return _learned(b, span[0], span[1], span[2], consumed)
        if active < LEARN_MAX_S:
            return b.granted       # most workloads synchronize: wait for the GPU's pace
        if active < LEARN_GIVEUP_S and any(t > b.active_since for t, _c in b.done):
            return b.granted       # it synchronizes, only rarely: wait for the next one
        # It has not synchronized: the host's launch rate over the last
        # window, once launching is sustained (a process still setting up
        # launches in bursts, and a rate learned then would starve it later).
        ticks = [x for x in b.ticks if now - x[0] <= HOST_WINDOW_S]
        run = len(ticks) - 1        # the trailing run of ticks that all launched
        while run > 0 and ticks[run][1] > ticks[run - 1][1]:
            run -= 1
        run = min(run + 1, len(ticks) - 1)   # its first interval may be partial
        sustained = ticks[-1][0] - ticks[run][0]
        if sustained < SUSTAINED * HOST_WINDOW_S and active < LEARN_GIVEUP_S:
            return b.granted
        (t0, c0, _s0), (t1, c1, _s1) = (ticks[run] if sustained > 0 else ticks[0]), ticks[-1]
        if t1 <= t0 or c1 <= c0:
            return b.granted
        return _learned(b, (c1 - c0) / (t1 - t0), t0, t1, consumed)

    b.rate = max(MIN_RATE, b.cap / 100.0 * b.full_rate)
    pace = completion_rate(b, now) if b.by_completion else None
    seen = 100.0 * (pace if pace is not None else rate_seen) / b.full_rate
    b.last_share = seen if b.last_share is None else 0.8 * b.last_share + 0.2 * seen
    if turn is not None:
        return _take_turn(b, turn, now, consumed)
    b.turn_k, b.turn_open = None, False
    # Credit is kept as a float: at a few units per second, rounding each
    # tick's grant down to an integer would grant nothing, ever.
    credit = b.credit if b.credit is not None else float(b.granted)
    b.credit = max(credit, min(credit + b.rate * dt, consumed + b.rate * burst_s))
    b.granted = max(b.granted, int(math.ceil(b.credit)))
    return b.granted


@dataclass
class Completions:
    """When the work of one (group, device) was known done: its GPU-side
    pace (completion_rate works on it as on a Budget)."""
    done: list = field(default_factory=list)    # (time, completed)

    def note(self, now: float, completed: int | None, completed_at: float | None) -> None:
        note_done(self.done, now, completed, completed_at)


def note_done(done: list, now: float, completed: int | None, completed_at: float | None) -> None:
    """Append (time, completed) if it advanced, and forget what is older than
    DONE_KEEP_S. The time is the probe's own (`completed_at`, same clock as
    `now`) where it is plausible: a tick can be 50 ms late, 5% of a
    one-second span."""
    if completed is None or (done and completed <= done[-1][1]):
        return
    at = now
    if completed_at is not None and (not done or completed_at > done[-1][0]) and completed_at <= now:
        at = completed_at
    done.append((at, completed))
    done[:] = [(t, c) for t, c in done if now - t <= DONE_KEEP_S]


@dataclass(frozen=True)
class DeviceView:
    """One device over one tick, as one group sees it."""
    util: float | None          # device utilization, percent
    known_others: float         # percent taken by other groups whose w is known
    unknown_others_rate: float  # cost units/s launched by the other groups
    others_unpaced: bool = False  # another group was busy here lately, pace not known yet


def neighbours(device_util: float | None, rates: dict, known: dict,
               now: float | None = None, done_rates: dict | None = None,
               unpaced: frozenset = frozenset()) -> dict:
    """{key: cost rate over the last tick} of the groups on one device ->
    {key: DeviceView}. A group whose GPU time per unit is known (`known`:
    {key: Budget}) takes rate x w of the device, where its rate is what it
    completed if it synchronizes (what it launched can run ahead of what the
    device gives it while others contend); the others' rates are passed on,
    for a learning group to split what is left by cost: what they completed
    where they synchronize (`done_rates`), else what they launched. A group
    blocked on its full launch queue launches nothing for a while, yet the
    device is busy with its work all along (in the simulator a 70% group
    learned half the device as its whole, so). `unpaced`: keys busy here
    lately whose pace is known neither way yet."""
    done_rates = done_rates or {}
    rates = {k: (done_rates.get(k) or r) for k, r in rates.items()}
    parts = {}
    for k, r in rates.items():
        if k in known and now is not None and known[k].by_completion:
            r = completion_rate(known[k], now) or r
        p = known[k].device_part(r) if k in known else None
        if p is not None:
            parts[k] = 100.0 * p
    out = {}
    for k in rates:
        out[k] = DeviceView(
            device_util,
            sum(p for j, p in parts.items() if j != k),
            sum(r for j, r in rates.items() if j != k and j not in parts),
            any(j != k and j not in parts for j in unpaced))
    return out


BUSY_S = 0.5    # a group that launched on a device this recently is busy there


def held_to_cap(priority: int, policy: str, lend_idle: bool, others) -> bool:
    """Whether a capped group is held to its cap on a device this tick.
    `others`: (priority, busy) of the other groups on the device. Without
    lending, or under GPU_CORE_UTILIZATION_POLICY=force, always. With it, only
    while a group of higher or equal priority (HAMi: a smaller number is
    higher) is busy: what they leave idle is free to use, and a lower-priority
    group's activity never holds a higher one back."""
    if not lend_idle or policy == "force":
        return True
    return any(busy and p <= priority for p, busy in others)
