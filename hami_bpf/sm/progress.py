"""A paced group's speed per second of running, measured against free samples.

Pure: observations in, a measurement out; no I/O, no clock reads.

Why measure it: paced by time, a group does cap% of its uncapped work only
if it does as much per second of running as it does free, and that is not
so on real workloads, nor stable. Held by the pacer at cap 50, an LLM decode
loop did 77-93% of its free work per second of running in one minute and
101-112% in the next (its thread did less per CPU second; no queue hides a
launch-bound loop's host: docs/facts.md). A fixed allowance is right in one
such minute and 10-15 points off in the next.

How: a group alone on its device (or beside uncapped groups only, which
take no turns and run through its samples and its paced seconds alike),
paced by time, runs free now and then
for a sample (no holds: what it owes for that time is repaid over the
following seconds, see duty.DutyPacer), and its launches per second over
the sample after its first SAMPLE_SKIP_S are its free rate; its launches
per second of running over its last PACED_WINDOW_S of running before the
sample (close to it in time: a loop's phases launch at different rates) are
its paced rate. Their ratio is its speed: run cap / speed of the time and
it does cap% of its free work.
Launches stand for work: a loop repeats its steps, and a step its launches,
so launches per second are steps per second whatever each launch costs.

The sample's first SAMPLE_SKIP_S are left out: a held loop stays slow for
a while after a stop, and the free rate is the loop's own. So the longer
the sample, the more of the loop's own speed it sees; but what it runs over
the cap's share is owed, and repaid no faster than duty.REPAY_SHARE allows:
on a short cap most of it would still be owed when the cap ends. A sample
is SAMPLE_S long, and longer where the cap leaves less to owe (up to
SAMPLE_MAX_S, while it owes at most SAMPLE_OWES_S): 1.5 s up to cap 60, 2 s
from cap 70 up, where a speed's error moves the share most (by 8 points
per 0.1 at cap 75, 5 at 50). On the H200 at cap 75, launch-bound loops
sampled for 1.5 s sat 4-9 s under cap - 10; sampled for 2 s, in the same
process a minute later, none did.
Samples take SAMPLE_SHARE of a group's running time: the first comes after
FIRST_RUN_S of paced running (the estimate is in use within seconds of the
group being paced), the next after RUN_GROWTH times as much (a first
sample taken in a warm-up is soon outvoted), and so on until they are
a sample's length / SAMPLE_SHARE of running apart (a phase change is
followed within that); after a dropped sample the next comes after
FIRST_RUN_S again.

Only a loop that spends little of its running time inside synchronize
calls is measured (duty.LAUNCH_BOUND_SHARE): its launching thread sets its
pace, and the stops' cost shows there. One that waits for the GPU (a CNN
training step, an LLM prefill: 17-20% of its time inside synchronize calls)
did 98-105% of its free work per second of running, held or not, and a free
sample would only add noise.

Fail safe: a sample with too few launches (a loop that launches a few
times a second, as a graph replay may) measures nothing; one interrupted
(a neighbour began to use the device, the group was held, or left DUTY mode)
is dropped, and so is one the loop changed phase around: its paced rate
is measured again over as much running after the sample, and the two must
agree within SAME_PHASE (set-up and warm-up launch at rates far from a
timed loop's own, twice or half of it), and the ratio, against their mean,
lie within [MIN_RATIO, MAX_RATIO].

One reading is noisy: a launch-bound loop's own launch rate moves 10-30%
from one second to the next on the H200's VM (an encoder loop recorded
free: 18,500-28,800 launches a second), so the ratio of two one-second
rates is good to about 15%. A tighter SAME_PHASE drops most samples of such
a loop, each one's free seconds spent for nothing. So the speed is the mean
of the last ESTIMATES readings and of the first guess (`prior`: the speed
the pacer assumes before any sample, 1 - duty.HOST_STOP_SHARE, counted as
PRIOR_WEIGHT readings, more where the readings spread more than the first
guess's own spread, PRIOR_SPREAD), within [MIN_SPEED, MAX_SPEED]. The mean,
not a median, and averaged before it is bounded: bounded first, noise
around a speed near 1 would only ever pull it down. The prior, because a
few readings that happen to run high would have a loop that loses 15% when
held run its bare cap's share (replayed, an encoder loop spent 6-16 s in a
row under cap - 10 so); weighed by their spread, because where the meter
cannot tell it errs open: readings that agree (a decode loop's, within
0.03) move the speed all the way, noisy ones (an encoder loop's, 0.1-0.2
apart) leave it nearer the first guess. A loop paced NEW_PHASE times faster
or slower than at its last reading (a warm-up was sampled, then came its
timed loop) is in another phase: its readings are forgotten, the first
guess holds again, and samples come as they did at first.

A speed under 1 lets the group run more than its cap's share of the time
(it errs open). None runs it less: over 1 counts as 1. Readings over 1
come from loops whose GPU still has work queued when they are held; paced
by them, an encoder loop ran 6-9 points under a cap of 75 for seconds at a
time. A loop that really does more paced than free runs over its cap by
as much.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from enum import Enum

SAMPLE_S = 1.5          # a sample's length, run free, at least
SAMPLE_MAX_S = 2.0      # ... at most
SAMPLE_OWES_S = 0.6     # ... as long as what it runs over its cap's share stays within this
SAMPLE_SKIP_S = 1.0     # ... its first this long not measured
SAMPLE_SHARE = 0.1      # samples' share of a paced group's running time (default)
FIRST_RUN_S = 1.0       # paced running before the first sample, and after a dropped one
RUN_GROWTH = 3.0        # ... and RUN_GROWTH times as long before each next one, until the
                        # share sets the pace
PACED_SETTLE_S = 0.3    # after a sample, paced running left out of the paced rate
PACED_WINDOW_S = 3.0    # the paced rate: over this much running before a sample, at most
MIN_LAUNCHES = 50       # launches a rate is taken over, at least (each of paced and free)
MIN_SPEED = 0.7         # the speed, at least (run cap / 0.7 of the time at most)
MAX_SPEED = 1.0         # ... at most: never under its cap's share of the time
ESTIMATES = 3           # the speed: the mean of this many last readings and the prior
PRIOR_WEIGHT = 1        # ... the prior counted as this many readings, at least
PRIOR_SPREAD = 0.07     # ... or as (the readings' spread / this)^2: the first guess's own spread
                        # (held decode loops did 0.77-0.93 of their free speed); 0: never
MIN_RATIO = 0.5         # a ratio outside these: a phase change, not the stops' cost
MAX_RATIO = 1.6
SAME_PHASE = 0.3        # paced rates before and after a sample this close (relative): one phase
NEW_PHASE = 1.6         # paced this many times faster or slower than at the last reading: another
                        # phase, whose readings are forgotten
PHASE_CHECK_S = 1.0     # ... told over this much paced running, at least


def sample_s(cap: float) -> float:
    """A free sample's length at a cap (percent): SAMPLE_S, longer where it
    runs less over the cap's share, up to SAMPLE_MAX_S."""
    over = 1.0 - min(max(cap, 0.0), 99.0) / 100.0
    return min(max(SAMPLE_OWES_S / over, SAMPLE_S), SAMPLE_MAX_S)


class Phase(str, Enum):
    OFF = "off"             # not measured: not alone, or not paced by time
    PACED = "paced"         # paced: its launches per second of running are counted
    SAMPLING = "sampling"   # running free: its free launch rate is measured
    CONFIRMING = "confirming"   # paced after a sample: the same phase still?


@dataclass(frozen=True)
class Sample:
    """One measurement: launches per second, free and per second of running
    while paced (before and after the sample); the ratio they gave, and the
    speed that is now in use."""
    free_hz: float
    paced_hz: float
    ratio: float
    speed: float            # the speed in use after it
    after_hz: float = 0.0


def _ran(mark: tuple, now: float, held_s: float) -> float:
    """Seconds run (wall time less time held) since a (time, launches, held_s) mark."""
    return (now - mark[0]) - (held_s - mark[2])


class _Window:
    """Launches per second of running over the last `span` seconds of it."""

    def __init__(self, span: float) -> None:
        self.span = span
        self.marks: collections.deque = collections.deque()   # (time, launches, held_s)
        self.ran = 0.0      # running since cleared

    def clear(self) -> None:
        self.marks.clear()
        self.ran = 0.0

    def add(self, now: float, launches: int, held_s: float) -> None:
        marks = self.marks
        if marks:
            self.ran += _ran(marks[-1], now, held_s)
        marks.append((now, launches, held_s))
        while len(marks) > 2 and _ran(marks[1], now, held_s) >= self.span:
            marks.popleft()

    def rate(self) -> tuple[float, int] | None:
        """(launches per second of running, launches) over the window."""
        if len(self.marks) < 2:
            return None
        first, (t1, n1, h1) = self.marks[0], self.marks[-1]
        ran = _ran(first, t1, h1)
        return ((n1 - first[1]) / ran, n1 - first[1]) if ran > 0 else None


class ProgressMeter:
    """One (group, device)'s speed when paced; `step` once per tick."""

    def __init__(self, share: float = SAMPLE_SHARE, prior: float = MAX_SPEED) -> None:
        self.share = share      # 0: never sampled
        self.prior = prior      # the speed assumed before any sample (the pacer's first guess)
        self.phase = Phase.OFF
        self.speed: float | None = None     # None until a sample measured it
        self.samples = 0
        self.phases = 0                     # readings forgotten for a new phase
        self.new_phase = (0.0, 0.0)         # ... the last time: (paced rate now, at the readings)
        self._run = 0                       # samples since the first of this phase
        self.dropped = 0
        self._paced = _Window(PACED_WINDOW_S)
        self._retry = False                 # the last sample was dropped: the next one soon
        self._settle_until = 0.0
        self._since = 0.0                   # phase began
        self._free_mark: tuple[float, int] | None = None
        self._held_at_sample = 0.0
        self._before = (0.0, 0.0)           # (paced rate, running it was taken over)
        self._free_hz = 0.0
        self._readings: collections.deque = collections.deque(maxlen=ESTIMATES)
        self._sample_s = SAMPLE_S           # the next (or current) sample's length

    @property
    def sampling(self) -> bool:
        return self.phase is Phase.SAMPLING

    def _to(self, phase: Phase, now: float, launches: int, held_s: float,
            settle: float = 0.0) -> None:
        self.phase, self._since = phase, now
        self._settle_until = now + settle
        self._paced.clear()
        self._paced.add(now, launches, held_s)

    def _drop(self) -> None:
        self.dropped += 1
        self._retry = True

    def _due(self) -> float:
        """Paced running before the next sample: FIRST_RUN_S before the first
        and after a dropped one, RUN_GROWTH times as long after each one that
        measured, until the share sets the pace."""
        steady = self._sample_s * (1.0 / self.share - 1.0)
        if self._retry:
            return min(FIRST_RUN_S, steady)
        return min(FIRST_RUN_S * RUN_GROWTH ** self._run, steady)

    def step(self, now: float, launches: int, held_s: float, measured: bool,
             held: bool = False, cap: float = 0.0) -> Sample | None:
        """`launches`: launches counted so far; `held_s`: time held so far;
        `measured`: alone on its device (or beside uncapped groups only),
        paced by time, and launch-bound;
        `held`: held now (a sample starts once it runs); `cap`: its cap
        (percent), which sets the next sample's length. A Sample when one
        measured the group's speed."""
        if self.phase is not Phase.SAMPLING:
            self._sample_s = sample_s(cap)
        if not measured or self.share <= 0:
            if self.phase in (Phase.SAMPLING, Phase.CONFIRMING):
                self._drop()
            self.phase = Phase.OFF
            self._paced.clear()
            return None
        if self.phase is Phase.OFF:
            self._to(Phase.PACED, now, launches, held_s)
            return None
        if self.phase is Phase.SAMPLING:
            return self._sampling(now, launches, held_s)
        w = self._paced
        if now < self._settle_until:
            w.clear()
        w.add(now, launches, held_s)
        r = w.rate()
        if self.phase is Phase.PACED:
            if (r is not None and self._readings and w.ran >= PHASE_CHECK_S
                    and r[1] >= MIN_LAUNCHES and not self._same_phase(r[0])):
                self._forget(r[0])
            if r is None or w.ran < self._due() or held:
                return None
            if r[1] < MIN_LAUNCHES:
                w.clear()       # too few to tell: count afresh
                return None
            self._before = (r[0], min(w.ran, PACED_WINDOW_S))
            self.phase, self._since = Phase.SAMPLING, now
            self._free_mark, self._held_at_sample = None, held_s
            return None
        # CONFIRMING: as much paced running after the sample as before it
        if r is None or w.ran < self._before[1]:
            return None
        self._to(Phase.PACED, now, launches, held_s)
        before, after = self._before[0], r[0]
        paced = (before + after) / 2
        ratio = paced / self._free_hz
        if (r[1] < MIN_LAUNCHES or abs(before - after) > SAME_PHASE * paced
                or not MIN_RATIO <= ratio <= MAX_RATIO):
            self._drop()
            return None
        self._retry = False
        self.samples += 1
        self._estimate(ratio, paced)
        return Sample(free_hz=self._free_hz, paced_hz=before, ratio=ratio, speed=self.speed,
                      after_hz=after)

    def _same_phase(self, paced_hz: float) -> bool:
        """Paced at a rate within NEW_PHASE of the last reading's."""
        return 1.0 / NEW_PHASE <= paced_hz / self._readings[-1][1] <= NEW_PHASE

    def _forget(self, paced_hz: float) -> None:
        """The loop changed phase since its readings (a warm-up was sampled,
        then came its timed loop): they are forgotten, the speed is unknown
        again (the pacer's first guess), and the next sample comes soon, the
        ones after it as they did after the first."""
        self.new_phase = (paced_hz, self._readings[-1][1])
        self._readings.clear()
        self.speed = None
        self.phases += 1
        self._run = 0
        self._retry = True

    def _estimate(self, ratio: float, paced_hz: float) -> None:
        """The speed: the mean of the last ESTIMATES readings, unbounded,
        and the prior, then bounded. The prior counts as PRIOR_WEIGHT
        readings, or as many more as the readings' spread against
        PRIOR_SPREAD says (each reading's error against the prior's): the
        noisier they are, the closer the speed stays to the first guess."""
        if self._readings and not self._same_phase(paced_hz):
            self._forget(paced_hz)
        self._run += 1
        self._readings.append((ratio, paced_hz))
        ratios = [r for r, _hz in self._readings]
        weight = float(PRIOR_WEIGHT)
        if PRIOR_SPREAD > 0 and len(ratios) >= 2:
            weight = max(weight, (statistics.stdev(ratios) / PRIOR_SPREAD) ** 2)
        speed = (sum(ratios) + weight * self.prior) / (len(ratios) + weight)
        self.speed = min(max(speed, MIN_SPEED), MAX_SPEED)

    def _sampling(self, now: float, launches: int, held_s: float) -> None:
        if held_s > self._held_at_sample + 1e-9:
            self._drop()        # held by someone else's rule: not free
            self._to(Phase.PACED, now, launches, held_s, PACED_SETTLE_S)
            return None
        if self._free_mark is None:
            if now - self._since >= SAMPLE_SKIP_S:
                self._free_mark = (now, launches)
            return None
        if now - self._since < self._sample_s:
            return None
        t1, n1 = self._free_mark
        if launches - n1 < MIN_LAUNCHES or now <= t1:
            self._drop()
            self._to(Phase.PACED, now, launches, held_s, PACED_SETTLE_S)
            return None
        self._free_hz = (launches - n1) / (now - t1)
        self._to(Phase.CONFIRMING, now, launches, held_s, PACED_SETTLE_S)
        return None
