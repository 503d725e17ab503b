"""Duty pacing: an SM cap as a share of wall time, for groups that synchronize.

Pure: observations in, decisions out; no I/O, no clock reads.

Why time and not a price per block: a block's cost on the GPU differs by
orders of magnitude between kernels (cudnn's autotuning, a decode step, a
prefill step), so a price learned in one phase is wrong in the next, and a
price that is too high stops a job. A group's progress, though, is
proportional to the time it is allowed to run, whatever its kernels cost:
hold a group for (100 - cap)% of the time and it does cap% of its uncapped
work. A hold only takes time off the GPU if the group has nothing left queued
there, and a synchronize's return is exactly such a moment (everything
launched before it is done). So a group that synchronizes often (PyTorch at
every .item(), .cpu() or torch.cuda.synchronize(); a decode loop once per
token) is held at its next synchronize's return, and for as long as its
running time owes.

The books, per (group index, device):
  debt += dt x (100 - cap) / cap   while the group runs and is active there
  debt -= dt                       while it is held, or idle there
A group is active on a device while it launched or synchronized there within
ACTIVE_GRACE_S, or one of its threads is inside a synchronize call there (its
work is on the GPU: a step of long kernels waits longer than the grace).
A hold counts from the probe's stop, also where its event reaches the
controller after a step that counted that time as running: the step is
corrected when the hold is first seen (at cap 25 a millisecond counted as
running owes three held, so uncorrected the group would run less than its cap).
Debt has floors (an idle group banks at most BURST_S of running; a hold that
outlasts its debt, because the daemon's turn came late or a neighbour ran, is
credited up to its hold bound) and a ceiling (MAX_DEBT_S). Once debt reaches
QUANTUM_S the group is asked to stop at its next synchronize's return (BPF,
`hold_at_sync`); if none comes within FORCE_AFTER_S, at its next launch. A
held group is released once its debts are paid and it is its turn
(sm.handoff: launch-bound groups run beside each other, others take turns),
and after its hold bound (MAX_HOLD_S; longer for a host-paced group, below)
whatever they say. A hold it asked for stays its to end when the group leaves
DUTY mode or loses its cap while held (it is released then: its debts are
forgiven).

The synchronize rate that decides the mode is counted per second of running,
time held left out: a group held three quarters of the time at cap 25
synchronizes a quarter as often per second of wall time, which would hand it
back to the launch budget and then, running freely, to this pacer again; and a
decode loop that the launch budget holds most of the time (its rate learned in
a warm-up unlike its steady state) still synchronizes a hundred times a second
of running, and is paced here. The one exception: a group that left this pacer
because it synchronized rarely while it ran freely keeps the launch budget's
holds in its rate for a while (BUDGET_STAY_S, doubled at each return, up to
BUDGET_STAY_MAX_S): a loop whose synchronizes come at set wall-clock times
synchronizes more often per second of running the longer the budget holds it,
and would go back and forth between the two. Nor does a group whose budget
takes turns with others' (Observation.turns), or which waits while another
group learns its rate alone (Observation.alone_held), leave out its holds:
those are its time slices, or another's, not an estimate gone wrong.

The launch probe's own time is the controller's, not the group's: a group
whose host loop sets its pace (its threads spend under half their running
time inside synchronize calls) runs slower by the probe's cost on every
launch, so it may run cap / (1 - s) of the time, s being the share of its
running time the probes took (launches per second of running x the probe's
measured cost, Observation.probe_s; at most MAX_PROBE_SHARE). A group that
waits for the GPU is not slowed by its launcher and gets nothing.

A group whose launching thread sets its pace is held less often, for longer:
it runs at least HOST_RUN_S between holds (its hold, the debt at which it is
asked, grows to HOST_RUN_S x (100 - cap) / cap, at most HOST_QUANTUM_MAX_S,
and its bound to twice that). Such a loop runs slower for a while after each
stop, and no queue of GPU work hides it: stopped and continued from outside at
a 0.1 s period and 50% duty a decode loop ran at ~82% of its free speed per
second of running, at a 0.4 s period at ~100%, whether or not its CPU was kept
busy while it was stopped (bench/gpu/stopcont.py). Taking turns with a capped
neighbour it runs turn_run_s (every turn also hands the GPU over), and the hold
bound of each group taking turns there covers that run and a stop. A group that
waits for the GPU loses nothing to a stop and keeps the short quantum, which
keeps neighbours' turns fine-grained. The test is the waited share: under
WAITED_SHARE of its running time inside synchronize calls over the synchronize
rate's window it is host-paced, from GPU_PACED_SHARE up it is not, and in
between (or with too little seen) it keeps what it was.

A launch-bound loop, one whose GPU has finished its work by the time it
synchronizes (under LAUNCH_BOUND_SHARE of its running time inside synchronize
calls, until it reaches LAUNCH_SLACK_SHARE again: an LLM decode step of a few
hundred small kernels), also runs slower per second of running for as long as
it is held at all, by an amount nothing outside it shows: its thread does less
per CPU second, all through each slice, while the GPU's clock stays where it
was. A decode loop capped at 50 by this pacer ran at 77-93% (mean 85%, ten
stretches) of its own free speed per second of running, with holds of 66 to
355 ms alike; loops that keep the GPU busy while they launch (a CNN training
step, an LLM prefill: 17-20% of their time waiting in synchronize calls) ran
at 98-105%: their launching thread has slack (bench/gpu/stopcont.sh). So a
launch-bound group in DUTY mode is given HOST_STOP_SHARE of its running time
back, as the probes' share is: it runs cap / (1 - HOST_STOP_SHARE) of the time
(cap 50: 58.8%), while no other group uses its device (Observation.shared):
the time given back is then time no one else wanted, where next to a neighbour
it would be the neighbour's (a CNN capped at 30 next to a decode loop at 70
given it back made 20.4% of its speed). Beside neighbours it is given back as
much of the first guess as the time their caps leave unclaimed covers
(Observation.spare: 20% beside a neighbour at 30 for a cap of 50; all of it
beside uncapped groups only, which are promised nothing), split between the
groups given some there: that time is no one's. Beside launch-bound groups
only it is given it all (KeyDecision.overlap: each paced by its own
synchronizes, quiet, and its device read under LAUNCH_IDLE_BUSY per second it
ran, alone or with their work included, for LIGHT_AFTER_S; with no reading,
never): they run beside each other (sm.handoff), so the time is not theirs.
Each slows the other a little there (its synchronizes wait for their work; the
reading holds theirs), so it stays light until it waits OVERLAP_WAITED_SHARE
of its running time, more than a hold would cost it, or its device reads
OVERLAP_BUSY (two of them read 47-52 together on an H100; a phase of one that
fills it reads more), and then takes turns for OVERLAP_RETRY_S. Otherwise,
beside others, its synchronize calls alone say whether it is launch-bound (the
device's utilization holds their work too). One that loses nothing runs that
much over its cap (errs open, where it costs no one); one that loses what the
decode loop did lands on it. How much a held decode loop loses changes from
run to run on the H200 VM (0-23%). So that share is a first guess. A quiet
group alone on its device, or beside uncapped groups only (under
LAUNCH_BOUND_SHARE inside synchronize calls, until LAUNCH_SLACK_SHARE; an
uncapped neighbour takes no turns and runs through its samples and its paced
seconds alike; beside its uncapped twin a held decode loop lost nothing in one
run and a fifth of its speed in another) has its speed measured (sm.progress:
now and then it runs free, asked for no hold, KeyDecision.sampling), and once
known it runs cap / speed of the time (stop_share = 1 - speed, below 0 where
it does more paced than free). What a sample ran over its share is kept apart
(_Key.reserve) and added to its debt at REPAY_SHARE more per second it runs:
its holds keep their length, and its share holds over the seconds after. Under
SAMPLE_FROM_CAP nothing is sampled: a free second owes too much there (three
seconds held at cap 25, a minute's repayment; three workloads capped at 25 for
30 s ran 32-37% of their free speed, held 64-66% of the time), and the first
guess is close enough: cap x (speed / (1 - HOST_STOP_SHARE) - 1) is within 5
points there for any speed from progress.MIN_SPEED to 1.

Little time inside synchronize calls does not always mean a GPU idle by the
time the loop asks: a loop whose launch queue is full waits inside its
launches, and finds its GPU nearly done when it synchronizes at the end of a
step too (a ViT training step: 97% busy, under 5% inside synchronize calls).
Its launching thread has all the slack it needs, and giving it back time
ran it 9 points over cap 75. So where the device's utilization is read
(Observation.util: the pacer asks for a reading at most every BUSY_READ_S
for a group that looks launch-bound, wants_util), a group is launch-bound
only if its device, alone there, was busy under LAUNCH_IDLE_BUSY% of its
last BUSY_RUN_S of running, and stops being so at LAUNCH_BOUND_BUSY% (paced
by the daemon on the H200: a decode loop 13-14%, a MobileNet training loop
40-54%, a ViT training loop 50-66%, each estimate swinging by 15 points from
one reading to the next). Until that is known it is given nothing back;
with no reading, the synchronize calls alone decide (and it errs open),
once BUSY_WAIT_S has gone by with none.

Groups that synchronize rarely (below PACED_HZ) are not paced here: their
work sits in a launch queue that a hold does not drain, and the launch
budget (hami_bpf.throttle) paces them. `mode()` says which one applies.
The exception is a device where another capped group is paced here (it
synchronizes at PACED_HZ or more, and was active within BESIDE_S): a group
that synchronizes rarely is paced here too, beside it (KeyDecision.beside),
and asked to stop at its next launch. A launch budget spreads its group's
work over time, so beside a group that takes turns by time the two would
time-slice the GPU for as long as both run; paced by time, the two take
turns, and only what the rare synchronizer's launch queue holds when it
stops (tens of milliseconds of a training step) runs into the other's turn.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from . import handoff, progress, sharing
from .dutyio import Ask, Decision, KeyDecision, Mode, Observation, Use, reading_fields

QUANTUM_S = 0.05       # debt at which a hold is asked for
FORCE_AFTER_S = 0.15   # asked this long with no synchronize's return: stop at the next launch
MAX_HOLD_S = 0.25      # no hold lasts longer, but a host-paced group's (twice its quantum)
MAX_DEBT_S = 1.0       # debt kept at most: a long unsynchronized run is not repaid for seconds
BURST_S = 0.1          # running time an idle (or waiting) group may bank
ACTIVE_GRACE_S = 0.05  # launched or synchronized this recently: active on the device
SYNC_WINDOW_S = 1.0    # synchronize rate measured over this long of running (held time left out)
RATE_WALL_S = 5.0      # ... looking back this far at most
MIN_SYNCS = 5          # synchronizes that make a rate over less than half a window of running
MIN_RUN_S = 0.02       # ... and the least running it is taken over
PACED_HZ = 20.0        # synchronizes per second of running at which a group is paced by time
UNPACED_HZ = 10.0      # ... and below which it goes back to the launch budget
BUDGET_STAY_S = 5.0    # back with the budget for synchronizing rarely: its holds count as running
BUDGET_STAY_MAX_S = 60.0   # ... doubled at each return, at most this
MAX_STEP_S = 0.5       # a longer gap between steps (a stalled controller) counts as this
MAX_PROBE_SHARE = 0.2  # the launch probe's part of a group's running time taken into account at most
WAITED_SHARE = 0.5     # running time inside synchronize calls from which the GPU sets the pace
HOST_RUN_S = 0.2       # running between holds, at least, for a group its launching thread paces
HOST_QUANTUM_MAX_S = 0.4   # ... whose hold (asked at this debt) grows at most to this
TURN_RUN_S = HOST_RUN_S  # ... and while it takes turns with a capped neighbour
GPU_PACED_SHARE = 0.6  # running time inside synchronize calls from which it is not host-paced again
LAUNCH_BOUND_SHARE = 0.05  # running time inside synchronize calls under which the GPU idles as it runs
LAUNCH_SLACK_SHARE = 0.1   # ... and from which its launching thread has slack again
HOST_STOP_SHARE = 0.15     # a launch-bound group's running time given back for what being held costs it
SPARE_STEP = 0.01          # ... out of unclaimed time: kept until it moves this much
LAUNCH_IDLE_BUSY = 35.0    # device busy under this much of its running time (percent): launch-bound
LAUNCH_BOUND_BUSY = 50.0   # ... this much or more: not
BUSY_RUN_S = 1.0           # ... over the last readings in which it ran this long
BUSY_MIN_RUN_S = 0.5       # ... or at least this long
BUSY_WALL_S = 10.0         # ... looking back this far at most
BUSY_WAIT_S = 3.0          # no reading this long after it looked launch-bound: syncs decide
BUSY_READ_S = 0.1          # a device reading for it at most this often
LIGHT_AFTER_S = 1.0        # launch-bound and quiet this long: runs beside its kind (handoff)
OVERLAP_WAITED_SHARE = 0.2  # running beside its kind: this much of its running time inside
                           # synchronize calls (their work costs it more than a hold does,
                           # HOST_STOP_SHARE) ...
OVERLAP_BUSY = 60.0        # ... or its device read this busy per second it ran, their work
                           # included (two launch-bound loops together read 47-52 on an H100):
                           # a phase of one of them fills it; turns again
OVERLAP_RETRY_S = 10.0     # ... at least this long
REPAY_SHARE = 0.25     # a free sample's debt is repaid at this much more per second it runs
SAMPLE_FROM_CAP = 28.0  # not sampled under this cap: HOST_STOP_SHARE is within 5 points there
BESIDE_S = 1.0         # paced here by its syncs, active this recently: paces rare syncers beside it


@dataclass
class _Key:
    cap: float
    t: float
    consumed: int
    syncs: int
    debt: float = 0.0
    mode: Mode = Mode.BUDGET
    own: Mode = Mode.BUDGET     # the mode its own synchronize rate calls for: in DUTY
                                # mode without it, it is paced beside a neighbour
    last_active: float = -1e9
    asked_since: float | None = None
    held_s: float = 0.0     # time counted held, in all
    stay_until: float = -1e9    # until then the launch budget's holds count as running
    returns: int = 0            # times it went back to the budget for synchronizing rarely
    since: float = 0.0          # in its mode since
    sync_marks: collections.deque = field(default_factory=collections.deque)
    # The last steps' running intervals (start, end, counted active), and the
    # hold last seen: a stop whose event reaches the controller after a step
    # ran was counted as running by that step.
    ran_spans: collections.deque = field(default_factory=collections.deque)
    hold_seen: float | None = None
    probe_share: float = 0.0
    host_paced: bool = False
    takes_turns: bool = False   # beside a capped neighbour, not running beside it (overlap)
    long_turns: bool = False    # ... one of them host-paced, running turn_run_s between holds
    said_host: tuple = (False, False)   # (host_paced, its longer turns) as last reported (DUTY)
    stop_share: float = 0.0     # HOST_STOP_SHARE while launch-bound in DUTY mode, else 0
    launch_bound: bool = False  # under LAUNCH_BOUND_SHARE inside synchronize calls (last window)
    quiet: bool = False         # ... in the last window, whatever the device said
    quiet_since: float = 0.0    # ... since (or since a neighbour was last seen)
    sampled: bool = False       # quiet, until LAUNCH_SLACK_SHARE: its speed is measured
    # device readings: (time, held_s then, the utilization integrated up to
    # then, percent-seconds), over wall time alone on its device, over its
    # running time beside others (where they bound its own from above)
    busy_reads: collections.deque = field(default_factory=collections.deque)
    busy_alone: bool = True
    # its device read under LAUNCH_IDLE_BUSY per second it ran (until
    # LAUNCH_BOUND_BUSY), alone or beside others (their work included), kept
    # while they come and go (a neighbour held a while leaves it alone for a
    # moment); never without a reading
    read_idle: bool = False
    read_busy: float | None = None      # the last such reading (percent)
    waited: float | None = None         # its running time inside synchronize calls, last window
    light_since: float | None = None    # _light: quiet and its device read idle since
    light_after: float = -1e9   # not light before (OVERLAP_RETRY_S)
    overlap: bool = False       # KeyDecision.overlap
    meter: progress.ProgressMeter = field(default_factory=progress.ProgressMeter)
    reserve: float = 0.0        # debt of its free samples, repaid over the seconds after

    def run_pct(self) -> float:
        """The share of the time (percent) it may run: its cap, plus what
        the probes and being held take from its running time."""
        c = self.cap / (1.0 - self.probe_share)
        c /= 1.0 - self.stop_share
        return min(c, 99.0)

    def owes_per_s(self) -> float:
        c = self.run_pct()
        return (100.0 - c) / c


def _ran_since(k: _Key, mark: tuple, now: float) -> float:
    """Seconds the group ran (wall time less time held) since a sync mark."""
    return (now - mark[0]) - (k.held_s - mark[2])


def _sync_rate(k: _Key, now: float) -> float:
    # Per second of running: a held group does not synchronize, and its rate
    # over wall time would fall under UNPACED_HZ at low caps, handing it back
    # to the launch budget, then to this pacer again once it ran freely.
    marks = k.sync_marks

    def ran(m: tuple) -> float:
        return _ran_since(k, m, now)
    while len(marks) > 1 and (ran(marks[1]) >= SYNC_WINDOW_S
                              or now - marks[1][0] >= RATE_WALL_S):
        marks.popleft()
    if not marks:
        return 0.0
    n, span = k.syncs - marks[0][1], ran(marks[0])
    if span < SYNC_WINDOW_S / 2 and (n < MIN_SYNCS or now - marks[0][0] < SYNC_WINDOW_S / 2):
        span = SYNC_WINDOW_S / 2    # too little seen to tell: counted over half a window
    # A group held nearly all the time (a budget learned in another phase)
    # runs a few tens of milliseconds in RATE_WALL_S: its rate is its
    # synchronizes over that, not over half a window it never ran.
    return n / max(span, MIN_RUN_S)


def _window(k: _Key, now: float, u: Use) -> tuple[float, float, int] | None:
    """Over the synchronize rate's window: (seconds run, share of them inside
    synchronize calls, launches). None: too little run to tell, or counters
    that started over."""
    if not k.sync_marks:
        return None
    m = k.sync_marks[0]
    ran = _ran_since(k, m, now)
    if ran < SYNC_WINDOW_S / 2 or u.launches < m[3] or u.sync_s < m[4]:
        return None
    return ran, (u.sync_s - m[4]) / ran, u.launches - m[3]


def _light(k: _Key) -> bool:
    """Paced by its own synchronizes, quiet, and its device read idle
    (_Key.read_idle), for LIGHT_AFTER_S (sm.handoff). Running beside its kind
    it stays so until it waits OVERLAP_WAITED_SHARE of its running time or
    its device reads OVERLAP_BUSY, their work included; then it takes turns
    for OVERLAP_RETRY_S."""
    return k.light_since is not None and k.t - k.light_since >= LIGHT_AFTER_S


def _busy(k: _Key, now: float, util: float | None, alone: bool) -> float | None:
    """Its device's utilization per second the group ran (percent, at most
    100) over its last BUSY_RUN_S of running; None when too little was read.
    Beside other groups only the readings' parts while it ran count, and
    theirs is in them too: its own is at most that."""
    reads = k.busy_reads
    if k.mode is not Mode.DUTY or alone != k.busy_alone:
        reads.clear()
        k.busy_alone = alone
    if k.mode is not Mode.DUTY:
        return None
    if util is not None and (not reads or now - reads[-1][0] >= BUSY_READ_S):
        # A reading covers the time since the one before.
        span = (now - reads[-1][0]) - (0.0 if alone else k.held_s - reads[-1][1]) if reads else 0.0
        reads.append((now, k.held_s, reads[-1][2] + util * span if reads else 0.0))

    def ran_from(i: int) -> float:
        return (reads[-1][0] - reads[i][0]) - (reads[-1][1] - reads[i][1])
    while len(reads) > 2 and (now - reads[0][0] > BUSY_WALL_S or ran_from(1) >= BUSY_RUN_S):
        reads.popleft()
    ran = ran_from(0) if reads else 0.0
    return min((reads[-1][2] - reads[0][2]) / ran, 100.0) if ran >= BUSY_MIN_RUN_S else None


def _host_paced(k: _Key, window: tuple[float, float, int] | None) -> bool:
    if window is None:
        return k.host_paced
    if window[1] < WAITED_SHARE:
        return True
    return False if window[1] >= GPU_PACED_SHARE else k.host_paced


def _probe_share(window: tuple[float, float, int] | None, probe_s: float) -> float:
    """The part of the group's running time its launch probes took, over the
    synchronize rate's window; none for a group the GPU keeps waiting."""
    if probe_s <= 0 or window is None or window[1] >= WAITED_SHARE:
        return 0.0
    return min(MAX_PROBE_SHARE, window[2] / window[0] * probe_s)


class DutyPacer:
    """Keeps the books of every capped (group, device); `step` once per tick."""

    def __init__(self, quantum_s: float = QUANTUM_S, max_hold_s: float = MAX_HOLD_S,
                 host_run_s: float = HOST_RUN_S, host_stop_share: float = HOST_STOP_SHARE,
                 sample_share: float = progress.SAMPLE_SHARE,
                 turn_run_s: float | None = None) -> None:
        self.quantum_s = quantum_s
        self.sample_share = sample_share    # 0: speed never measured (host_stop_share alone)
        self.host_run_s = host_run_s    # 0: a host-paced group is held as any other
        # ... and while it takes turns (None: TURN_RUN_S; never under host_run_s)
        self.turn_run_s = host_run_s and max(host_run_s, TURN_RUN_S if turn_run_s is None
                                             else turn_run_s)
        self.host_stop_share = host_stop_share  # 0: nothing given back for being held
        self.max_hold_s = max(max_hold_s, quantum_s)
        self._keys: dict[tuple[int, int], _Key] = {}
        self._asked: set[int] = set()       # groups asked to stop at the last step
        self._holding: set[int] = set()     # held groups whose hold this pacer asked for

    def forget_group(self, group_index: int) -> None:
        for key in [k for k in self._keys if k[0] == group_index]:
            del self._keys[key]
        self._asked.discard(group_index)
        self._holding.discard(group_index)

    def wants_util(self, now: float) -> frozenset[int]:
        """Devices whose utilization the next step should be given: those of
        groups paced here that look launch-bound, read BUSY_READ_S apart."""
        return frozenset(key[1] for key, k in self._keys.items()
                         if k.mode is Mode.DUTY and k.quiet
                         and (not k.busy_reads or now - k.busy_reads[-1][0] >= BUSY_READ_S))

    def forget(self, key: tuple[int, int]) -> None:
        """A (group, device) that lost its cap: a cap that comes back starts
        its books afresh. Kept, they would take the seconds it ran uncapped,
        its synchronizes not counted then, for a group that synchronizes
        rarely, and hand it to the launch budget for a moment."""
        self._keys.pop(key, None)

    def mode(self, key: tuple[int, int]) -> Mode | None:
        k = self._keys.get(key)
        return None if k is None else k.mode

    def debt(self, key: tuple[int, int]) -> float | None:
        k = self._keys.get(key)
        return None if k is None else k.debt

    def reading(self, key: tuple[int, int]) -> dict | None:
        """What its launch-bound and overlap decisions were last taken on
        (the debug log's fields); None: not paced here."""
        k = self._keys.get(key)
        return None if k is None else {
            **reading_fields(k.read_busy, k.waited),
            "alone_read": k.busy_alone, "launch_bound": k.launch_bound, "overlap": k.overlap}

    def speed(self, key: tuple[int, int]) -> float | None:
        """Its work per second of running paced against free, as measured
        (progress.ProgressMeter); None: not measured."""
        k = self._keys.get(key)
        return None if k is None else k.meter.speed

    def samples(self, key: tuple[int, int]) -> tuple[int, int, int]:
        """Its speed meter's free samples so far: (measured, dropped, and
        times its readings were forgotten for a new phase)."""
        k = self._keys.get(key)
        return (0, 0, 0) if k is None else (k.meter.samples, k.meter.dropped, k.meter.phases)

    def reserve(self, key: tuple[int, int]) -> float:
        """What its free samples ran over its share, still to be held."""
        k = self._keys.get(key)
        return 0.0 if k is None else k.reserve

    def _among_light(self, key: tuple[int, int], active: frozenset | None) -> bool:
        """Whether every other group that launched on key's device lately is
        light here (_light; uncapped ones are not known to be)."""
        others = [o for o in active or () if o[1] == key[1] and o[0] != key[0]]
        return bool(others) and all(o in self._keys and _light(self._keys[o]) for o in others)

    def _quantum(self, k: _Key) -> float:
        """The debt at which a group is asked to stop: how long it is held."""
        if not (k.host_paced and k.mode is Mode.DUTY):
            return self.quantum_s
        run_s = self.turn_run_s if k.takes_turns else self.host_run_s
        return min(max(self.quantum_s, run_s * k.owes_per_s()),
                   max(HOST_QUANTUM_MAX_S, self.quantum_s))

    def _bound(self, k: _Key) -> float:
        # taking turns beside a host-paced group: its turn comes after that one's run and stop
        turn = self.turn_run_s + 2 * FORCE_AFTER_S if k.long_turns else 0.0
        return max(self.max_hold_s, 2 * self._quantum(k), turn)

    def _bound_of(self, keys) -> float:
        """The hold bound of a group whose DUTY keys these are."""
        return max([self.max_hold_s] + [self._bound(k) for k in keys])

    def hold_bound(self, group_index: int) -> float:
        """How long a hold of this group may last at most (max_hold_s, longer
        for a host-paced group in DUTY mode): no hold outlives it."""
        return self._bound_of(k for key, k in self._keys.items()
                              if key[0] == group_index and k.mode is Mode.DUTY)

    @staticmethod
    def _held_before(k: _Key, since: float, counts_held: bool) -> None:
        """A hold seen for the first time began `since`, before the last step
        ran: the steps that counted the time after it as running (its event
        was still in the ring) are corrected, so that time is held, as it was.
        Counted as idle running it paid its seconds already; counted as
        active it owed cap-dependent seconds more, which are taken back."""
        for t0, t1, active in k.ran_spans:
            late = t1 - max(t0, since)
            if late <= 0:
                continue
            k.debt -= late * (k.owes_per_s() + 1.0) if active else 0.0
            if counts_held:
                k.held_s += late
        k.ran_spans.clear()

    def step(self, obs: Observation) -> Decision:
        now = obs.now
        for key in [k for k in self._keys if k not in obs.caps]:
            del self._keys[key]
        # A hold asked for here stays this pacer's to end even if the group
        # leaves DUTY mode (or loses its cap) while held.
        self._holding = {gi for gi in obs.held if gi in self._holding or gi in self._asked}
        decisions: dict[tuple[int, int], KeyDecision] = {}
        changes: list[tuple[tuple[int, int], Mode]] = []
        slices: list[tuple[tuple[int, int], bool, float]] = []
        given: list[tuple[tuple[int, int], float]] = []
        measured: list[tuple[tuple[int, int], progress.Sample]] = []
        dropped: list[tuple[int, int]] = []
        forgotten: list[tuple[tuple[int, int], float, float]] = []
        overlaps: list[tuple[tuple[int, int], bool]] = []
        # The groups paced here by their own synchronizes (as of the last
        # step) and when each was last active: beside one of them, on its
        # device, a group that synchronizes rarely is paced here too.
        pacers = [(key, k.last_active) for key, k in self._keys.items() if k.own is Mode.DUTY]

        # devices where a host-paced group takes turns (as of the last step)
        long_turns = {key[1] for key, k in self._keys.items() if self.turn_run_s > self.host_run_s
                      and k.takes_turns and k.host_paced and k.mode is Mode.DUTY}
        sharers = collections.Counter(key[1] for key, k in self._keys.items()
                                      if key in obs.shared and k.launch_bound and k.stop_share)

        def beside(key: tuple[int, int]) -> bool:
            return any(o[1] == key[1] and o != key and (now - seen <= BESIDE_S or o[0] in obs.held)
                       for o, seen in pacers)
        for key, cap in obs.caps.items():
            u = obs.use.get(key, Use(0, 0))
            k = self._keys.get(key)
            if k is not None and (u.syncs < k.syncs or u.consumed < k.consumed):
                # Its counters started over (the cap went and came back, and
                # the probes' entry with it): so do its books.
                k = None
            if k is None:
                k = self._keys[key] = _Key(cap=cap, t=now, consumed=u.consumed, syncs=u.syncs,
                                           meter=progress.ProgressMeter(
                                               self.sample_share, 1.0 - self.host_stop_share))
                k.sync_marks.append((now, u.syncs, 0.0, u.launches, u.sync_s))
            k.cap = min(max(cap, 1.0), 99.0)
            dt = min(max(now - k.t, 0.0), MAX_STEP_S)
            if u.consumed != k.consumed or u.syncs != k.syncs or u.waiting > 0:
                k.last_active = now
            held = key[0] in obs.held
            counts_held = k.mode is Mode.DUTY or (now >= k.stay_until and key not in obs.turns
                                                  and key not in obs.alone_held)
            if held and obs.held[key[0]] != k.hold_seen:
                k.hold_seen = obs.held[key[0]]
                self._held_before(k, k.hold_seen, counts_held)
            # A hold that began after the last step: the group ran until then.
            ran = min(max(obs.held[key[0]] - k.t, 0.0), dt) if held else dt
            active = now - k.last_active <= ACTIVE_GRACE_S
            idle_floor = -BURST_S * k.owes_per_s()
            if not active:
                k.debt = max(k.debt - ran, min(k.debt, idle_floor))
            else:
                k.debt += ran * k.owes_per_s()
            # Held past its debt (the daemon's turn came late, or a neighbour
            # ran): credited, up to one longest hold, whatever the cap.
            k.debt = max(k.debt - (dt - ran), min(k.debt, -self._bound(k)))
            if counts_held:
                k.held_s += dt - ran
            if ran > 0:
                k.ran_spans.append((k.t, k.t + ran, active))
                while k.ran_spans and k.ran_spans[0][1] < now - MAX_STEP_S:
                    k.ran_spans.popleft()
            k.t, k.consumed, k.syncs = now, u.consumed, u.syncs
            k.sync_marks.append((now, u.syncs, k.held_s, u.launches, u.sync_s))
            rate = _sync_rate(k, now)
            window = _window(k, now, u)
            k.probe_share = _probe_share(window, obs.probe_s)
            k.host_paced = _host_paced(k, window)
            was_beside = k.mode is Mode.DUTY and k.own is not Mode.DUTY
            k.own = (Mode.DUTY if rate >= PACED_HZ else
                     Mode.BUDGET if rate < UNPACED_HZ else k.own)
            mode = Mode.DUTY if k.own is Mode.DUTY or beside(key) else Mode.BUDGET
            by_neighbour = mode is Mode.DUTY and k.own is not Mode.DUTY
            if by_neighbour:
                # Its waits are inside its launches (a full queue), which no
                # probe times: whether the probes slow it is unknown, and the
                # time would be its neighbour's.
                k.probe_share = 0.0
            # beside a neighbour: the time no cap claims, split between the
            # groups there given some of it back at the last step
            spare = ((obs.spare or {}).get(key[1], 0.0) / max(1, sharers[key[1]])
                     if key in obs.shared else 0.0)
            busy = _busy(k, now, (obs.util or {}).get(key[1]), key not in obs.shared)
            if busy is not None:
                k.read_busy = busy
                k.read_idle = busy < (OVERLAP_BUSY if k.overlap else
                                      LAUNCH_BOUND_BUSY if k.read_idle else LAUNCH_IDLE_BUSY)
            if not k.busy_alone:
                busy = None     # theirs is in it: only whether it runs beside them
            gpu_busy = busy is not None and busy >= LAUNCH_BOUND_BUSY
            gpu_idle = busy is None or busy < LAUNCH_IDLE_BUSY
            if window is not None:
                k.waited = window[1]
                quiet = window[1] < LAUNCH_BOUND_SHARE
                if quiet and not k.quiet or key in obs.shared and not spare:
                    k.quiet_since = now
                k.quiet = quiet
                if quiet:
                    k.sampled = True
                elif window[1] >= LAUNCH_SLACK_SHARE:
                    k.sampled = False
            # Not before the device has been read, or no reading came: the
            # synchronize calls alone decide then.
            known = busy is not None or not (k.busy_alone and k.busy_reads) \
                and now - k.quiet_since >= BUSY_WAIT_S
            if window is not None and k.quiet and gpu_idle and known:
                k.launch_bound = True
            elif window is not None and window[1] >= LAUNCH_SLACK_SHARE or gpu_busy:
                k.launch_bound = False
            # Beside uncapped groups only it is measured as alone: they run
            # through its samples and its paced seconds alike, and the time a
            # hold costs it is no one's.
            beside_capped = key in obs.shared and not sharing.uncapped_beside(
                key, obs.caps, obs.active or ())
            alone = mode is Mode.DUTY and not by_neighbour and not beside_capped
            drops, phases = k.meter.dropped, k.meter.phases
            sample = k.meter.step(now, u.launches, k.held_s,
                                  alone and k.sampled and k.cap >= SAMPLE_FROM_CAP, held, k.cap)
            if sample is not None:
                measured.append((key, sample))
            if k.meter.dropped != drops:
                dropped.append(key)
            if k.meter.phases != phases:
                forgotten.append((key, *k.meter.new_phase))
            # beside launch-bound groups only: no turns, so what it is given back
            # is not taken from them (sm.handoff)
            light = mode is Mode.DUTY and not by_neighbour and k.read_idle and (
                k.quiet or k.overlap and (k.waited or 0.0) < OVERLAP_WAITED_SHARE) \
                and now >= k.light_after
            if k.overlap and not light:
                k.light_after = now + OVERLAP_RETRY_S   # turns make it quiet again at once
            k.light_since = (now if k.light_since is None else k.light_since) if light else None
            overlap = key in obs.shared and _light(k) and self._among_light(key, obs.active)
            if overlap != k.overlap:
                k.overlap = overlap
                overlaps.append((key, overlap))
            k.takes_turns = beside_capped and not overlap
            k.long_turns = k.takes_turns and key[1] in long_turns
            stop_share = (self.host_stop_share if k.launch_bound and alone or overlap else 0.0)
            if (alone or overlap) and k.sampled and k.meter.speed is not None:
                # measured: what it does per second of running, against free
                stop_share = 1.0 - k.meter.speed
            elif spare > 0 and k.launch_bound and mode is Mode.DUTY and not by_neighbour \
                    and not overlap:
                most = 1.0 - k.cap / ((1.0 - k.probe_share) * min(k.cap + spare, 99.0))
                stop_share = min(self.host_stop_share, max(most, 0.0))
                if k.stop_share > 0 and abs(stop_share - k.stop_share) < SPARE_STEP:
                    stop_share = k.stop_share   # the probes' share moves it every step
            if stop_share != k.stop_share and sample is None:
                given.append((key, stop_share))     # a measurement says so itself
            k.stop_share = stop_share
            if k.meter.sampling:
                # Run free: what it owes for the sample is repaid after it.
                k.reserve += max(k.debt, 0.0)
                k.debt = min(k.debt, 0.0)
            elif k.reserve > 0 and active and ran > 0:
                repay = min(k.reserve, ran * k.owes_per_s() * REPAY_SHARE)
                k.reserve -= repay
                k.debt += repay
            if mode != k.mode:
                if mode is Mode.BUDGET and not was_beside:
                    if now - k.since >= BUDGET_STAY_MAX_S:
                        k.returns = 0       # paced by time this long: a phase, not a see-saw
                    k.stay_until = now + min(BUDGET_STAY_S * 2 ** k.returns, BUDGET_STAY_MAX_S)
                    k.returns += 1
                k.mode, k.since = mode, now
                k.debt = min(k.debt, 0.0)
                k.reserve = 0.0
                k.asked_since = None
                changes.append((key, mode))
            elif mode is Mode.DUTY and by_neighbour != was_beside:
                changes.append((key, mode))     # paced by time still, for another reason
            # Bounded once its mode and pace are known: they set its hold bound.
            k.debt = min(max(k.debt, idle_floor - self._bound(k)), MAX_DEBT_S)
            ask = Ask.NONE
            quantum = self._quantum(k)
            said = k.host_paced and k.mode is Mode.DUTY and self.host_run_s > 0
            turns = said and k.takes_turns and self.turn_run_s > self.host_run_s
            if (said, turns) != k.said_host:
                k.said_host = (said, turns)
                slices.append((key, said, quantum))
            if k.mode is Mode.DUTY and not held and k.debt >= quantum and not k.meter.sampling:
                if k.asked_since is None:
                    k.asked_since = now
                # Paced beside another, it synchronizes rarely: no return to wait for.
                ask = Ask.LAUNCH if by_neighbour or now - k.asked_since >= FORCE_AFTER_S else Ask.SYNC
            else:
                k.asked_since = None
            decisions[key] = KeyDecision(k.mode, ask, k.debt, k.probe_share, k.host_paced, quantum,
                                         k.stop_share, by_neighbour, busy,
                                         k.meter.speed if alone else None, k.meter.sampling,
                                         k.run_pct(), spare if key in obs.shared else None,
                                         overlap, k.read_busy, k.waited)

        self._asked = {key[0] for key, d in decisions.items() if d.ask is not Ask.NONE}
        running = handoff.Running.of(
            (key[1], _light(k)) for key, k in self._keys.items()
            if k.mode is Mode.DUTY and key[0] not in obs.held
            and now - k.last_active <= ACTIVE_GRACE_S)
        paced = {}
        for gi in obs.held:
            mine = [(key, k) for key, k in self._keys.items()
                    if key[0] == gi and k.mode is Mode.DUTY]
            if mine or gi in self._holding:
                paced[gi] = handoff.Paced(
                    owed=max((k.debt for _, k in mine), default=0.0),
                    devices=frozenset(key[1] for key, _ in mine),
                    bound=self._bound_of(k for _, k in mine),
                    light=all(_light(k) for _, k in mine))
        release, cut, next_step = handoff.release(now, obs.held, paced, running)
        return Decision(keys=decisions, release=frozenset(release), cut_short=frozenset(cut),
                        mode_changes=tuple(changes), next_step=next_step,
                        slice_changes=tuple(slices), given_back=tuple(given),
                        measured=tuple(measured), dropped=tuple(dropped),
                        forgotten=tuple(forgotten), overlaps=tuple(overlaps))
