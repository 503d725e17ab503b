"""What being held costs a launch-bound group, measured while it runs.

Pure: observations in, samples out; no I/O, no clock reads.

A launch-bound loop (its GPU has finished its work by the time it
synchronizes: an LLM decode step of a few hundred small kernels) runs slower
per second of running for as long as it is held at all, by an amount that
changes from process to process and minute to minute (0-23% for a decode
loop on the H200 VM, its SM clock unchanged). The probes show that amount
for such a loop alone: its progress is its launches, since its GPU keeps up
with them, so its launches per second of running while it is paced, against
the same figure while it runs unheld, is what the holds cost it.

So the duty pacer lets a launch-bound group alone on its device run FREE_S
unheld every LOSS_EVERY_S (the first after LOSS_FIRST_S of pacing). Its books
keep counting meanwhile: the stretch is repaid by the holds after it, so
its share of the time stays its cap's. At a low cap the stretch is shorter,
so that it owes at most FREE_DEBT_S (repaid in bounded holds, during which
it runs little), and under MIN_FREE_S there is none: below a cap of about
20% nothing is measured, and what holds cost it (at most a quarter of its
cap, 5 points) is not given back. The stretch's first FREE_SETTLE_S is
left out (a loop picks up after its last release), and the rest gives the
free rate; the rate over the paced running time since the last stretch is
the held rate over the last HELD_WINDOW_S of paced running before it (close
in time: a loop's own speed drifts over minutes, and its phases differ). A
sample is 1 - held / free. The share given back is the median of the last
SAMPLES samples less NOISE, clamped to [0, the most it may be]: noise in
one sample (a phase change, another process of the group starting) moves
it little, and a loop that loses nothing, whose samples scatter a few
percent either side of 0, is given about nothing.

A sample is dropped, not taken, where the group idled (its rate is then
its idleness), was held during its free stretch, ran too little between
stretches to tell, or its rates differ by more than PLAUSIBLE (a phase
change between the two: a warm-up's rate against its steady state's). Everything that makes a sample impossible (a neighbour on
the device, a group that is not launch-bound, another mode) starts the
count again: `reset`.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum

LOSS_FIRST_S = 1.0      # paced this long before the first free stretch
LOSS_EVERY_S = 4.0      # ... and this long between stretches
FREE_S = 0.8            # a free stretch's length
FREE_SETTLE_S = 0.25    # ... of which the first part is left out
FREE_DEBT_S = 2.0       # ... shorter where it would owe more than this many seconds held
MIN_FREE_S = 0.5        # ... and none where it would be shorter than this (caps under ~20%)
MIN_HELD_RUN_S = 0.2    # running while paced, at least, for a held rate
HELD_WINDOW_S = 1.0     # ... taken over this much of its last running while paced
MIN_LAUNCHES = 200      # launches, at least, behind either rate
RETRY_S = 1.0           # after a dropped sample, the next stretch this soon
SAMPLES = 5             # the share is the median of the last this many samples
PLAUSIBLE = 0.5         # a sample further from 0 than this is a phase change, not a hold's cost
NOISE = 0.03            # taken off the median: what a loop that loses nothing measures


class Phase(str, Enum):
    PACED = "paced"         # held as its cap says; counting its held rate
    SETTLE = "settle"       # free, its first FREE_SETTLE_S
    FREE = "free"           # free, counting its free rate


@dataclass(frozen=True)
class Sample:
    held_rate: float        # launches per second of running while paced
    free_rate: float        # ... while unheld
    loss: float             # 1 - held_rate / free_rate

    @property
    def fields(self) -> dict:
        return {"held_rate": round(self.held_rate, 1), "free_rate": round(self.free_rate, 1),
                "loss": round(self.loss, 4)}


@dataclass
class HoldLoss:
    """One (group, device)'s meter. `step` at every pacer step with its
    cumulative launches and running seconds (time held left out)."""
    now: float
    launches: int
    run_s: float
    phase: Phase = Phase.PACED
    due: float = 0.0                    # the next free stretch, at the earliest
    since: float = 0.0                  # in its phase since
    mark: tuple = (0, 0.0)              # (launches, run_s) where its rate is counted from
    paced: collections.deque = field(default_factory=collections.deque)  # (launches, run_s) per step
    held_rate: float | None = None      # the paced rate behind the stretch under way
    stretch_s: float = FREE_S           # the stretch under way's length
    samples: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SAMPLES))

    def __post_init__(self) -> None:
        self.reset(self.now, self.launches, self.run_s)

    def reset(self, now: float, launches: int, run_s: float, *, first_in: float = LOSS_FIRST_S) -> None:
        """Counts start again (paced from now), samples kept."""
        self.phase, self.since, self.due = Phase.PACED, now, now + first_in
        self.mark, self.held_rate = (launches, run_s), None
        self.paced.clear()
        self.paced.append(self.mark)

    @property
    def free(self) -> bool:
        """Whether it is to run unheld now."""
        return self.phase is not Phase.PACED

    def share(self, most: float) -> float:
        """Its running time to give back: the samples' median less NOISE,
        in [0, most]."""
        if not self.samples:
            return 0.0
        s = sorted(x.loss for x in self.samples)
        mid = len(s) // 2
        med = s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
        return min(max(med - NOISE, 0.0), most)

    def _rate(self, launches: int, run_s: float) -> float | None:
        n, ran = launches - self.mark[0], run_s - self.mark[1]
        if n < MIN_LAUNCHES or ran <= 0:
            return None
        return n / ran

    def step(self, now: float, launches: int, run_s: float, *, active: bool, held: bool,
             will_hold: bool, stretch_s: float = FREE_S) -> Sample | None:
        """`active`: it launched or synchronized lately (a held group is
        not, and is not idle either); `held`: stopped now; `will_hold`: the
        pacer would ask it to stop now, were it not free (and the last free
        stretch is repaid); `stretch_s`: how long a stretch that starts now may
        run unheld (under MIN_FREE_S: none starts). Returns a sample
        where a free stretch just ended with one."""
        if launches < self.mark[0]:     # its counters started over
            self.reset(now, launches, run_s)
            return None
        if self.phase is Phase.PACED:
            if not (active or held):    # idle: its rate would be its idleness
                self.reset(now, launches, run_s, first_in=max(self.due - now, 0.0))
                return None
            self.paced.append((launches, run_s))
            while len(self.paced) > 2 and run_s - self.paced[1][1] >= HELD_WINDOW_S:
                self.paced.popleft()
            if now < self.due or held or not will_hold or stretch_s < MIN_FREE_S:
                return None     # a stretch starts where a hold would: the paced slice ends
            self.mark = self.paced[0]
            if run_s - self.mark[1] < MIN_HELD_RUN_S or (rate := self._rate(launches, run_s)) is None:
                return None
            self.held_rate, self.phase, self.since = rate, Phase.SETTLE, now
            self.stretch_s = min(stretch_s, FREE_S)
            return None
        if held or not active:      # held or idle in its stretch: no sample from it
            self.reset(now, launches, run_s, first_in=RETRY_S)
            return None
        if self.phase is Phase.SETTLE:
            if now - self.since >= FREE_SETTLE_S:
                self.phase, self.mark = Phase.FREE, (launches, run_s)
            return None
        if now - self.since < self.stretch_s:
            return None
        free_rate, held_rate = self._rate(launches, run_s), self.held_rate
        self.reset(now, launches, run_s, first_in=LOSS_EVERY_S)
        if free_rate is None or held_rate is None:
            self.due = now + RETRY_S
            return None
        sample = Sample(held_rate, free_rate, 1.0 - held_rate / free_rate)
        if abs(sample.loss) > PLAUSIBLE:
            self.due = now + RETRY_S
            return None
        self.samples.append(sample)
        return sample
