"""What the duty pacer (sm.duty) is given at each step and what it decides.
Plain data: the daemon's controller and the replays fill an Observation
from the probes' maps and NVML, and act on the Decision."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from . import progress


class Mode(str, Enum):
    BUDGET = "budget"   # launch budget (hami_bpf.throttle)
    DUTY = "duty"       # held at synchronize returns for (100 - cap)% of the time


class Ask(str, Enum):
    NONE = "none"       # run
    SYNC = "sync"       # stop at the next synchronize's return
    LAUNCH = "launch"   # stop at the next launch (no synchronize came)


@dataclass(frozen=True)
class Use:
    """What the probes counted for one (group, device): sm_use."""
    consumed: int       # cost units launched in total
    syncs: int          # synchronize calls that returned
    waiting: int = 0    # threads inside a synchronize call now (sync_at entries)
    launches: int = 0   # launches counted by the probes
    sync_s: float = 0.0     # seconds its threads spent inside synchronize calls that returned


@dataclass(frozen=True)
class Observation:
    now: float                                  # monotonic seconds
    caps: Mapping[tuple[int, int], float]       # (group index, device) -> cap percent
    use: Mapping[tuple[int, int], Use]
    held: Mapping[int, float]                   # group index -> held since (monotonic)
    # keys whose launch budget takes turns with other groups' on their device:
    # their holds are the turns' time slices, which count as running here
    turns: frozenset = frozenset()
    # keys held while another group learns its rate alone on their device
    # (sm.alone): not their pacing either, so those holds count as running
    # here too (a few milliseconds run before such a hold would otherwise
    # make a synchronize rate of hundreds a second, and DUTY mode)
    alone_held: frozenset = frozenset()
    probe_s: float = 0.0    # host time the launch probe adds to each launch (measured at start)
    # keys whose device another group launched on lately: nothing is given
    # back there for being held (it would be the neighbour's time)
    shared: frozenset = frozenset()
    # device -> utilization (percent) where read this step (wants_util)
    util: Mapping[int, float | None] | None = None
    # device -> the share of its time (percent) no cap claims (sharing.spare_time)
    spare: Mapping[int, float] | None = None
    # keys, capped or not, that launched lately (sharing.active); None: unknown
    active: frozenset | None = None


@dataclass(frozen=True)
class KeyDecision:
    mode: Mode
    ask: Ask
    debt: float
    probe_share: float = 0.0    # the probes' part of its running time, given back as running
    host_paced: bool = False    # its launching thread sets its pace: held in longer slices
    quantum: float = 0.0        # the debt at which it is asked to stop (its hold's length)
    stop_share: float = 0.0     # its running time given back for what being held costs it (launch-bound)
    beside: bool = False        # in DUTY mode only for a neighbour paced by its synchronizes
    busy: float | None = None   # its device's utilization per second it ran, alone there (percent)
    speed: float | None = None  # its work per second of running paced, against free (measured)
    sampling: bool = False      # running free to measure its speed (progress.ProgressMeter)
    run_pct: float = 0.0        # the share of the time (percent) it may run (_Key.run_pct)
    spare: float | None = None  # beside neighbours: its part of the time no cap claims (percent)
    overlap: bool = False       # launch-bound beside launch-bound groups only: no turns (handoff)
    read_busy: float | None = None  # its device's utilization per second it ran, others' included
    waited: float | None = None     # its running time inside synchronize calls, last window (share)

    def overlap_fields(self) -> dict[str, float | None]:
        """What an overlap change was decided on, for its event."""
        return reading_fields(self.read_busy, self.waited)


def reading_fields(read_busy: float | None, waited: float | None) -> dict[str, float | None]:
    """A group's device reading and its share inside synchronize calls, as
    events and the debug log give them."""
    return {"gpu_busy": None if read_busy is None else round(read_busy, 1),
            "waited": None if waited is None else round(waited, 3)}


@dataclass(frozen=True)
class Decision:
    keys: Mapping[tuple[int, int], KeyDecision]
    release: frozenset[int]                     # held groups to resume now
    cut_short: frozenset[int]                   # ... of them, released with debt left (hold bound)
    mode_changes: tuple[tuple[tuple[int, int], Mode], ...]
    next_step: float | None                     # when a held group's debt is paid
    # (key, host-paced, its quantum) where a key in DUTY mode changed slices
    slice_changes: tuple[tuple[tuple[int, int], bool, float], ...] = ()
    # (key, its stop_share now) where what it is given back for being held changed
    given_back: tuple[tuple[tuple[int, int], float], ...] = ()
    # (key, the sample) where a free sample measured a group's speed
    measured: tuple[tuple[tuple[int, int], progress.Sample], ...] = ()
    # keys whose free sample was interrupted and measured nothing
    dropped: tuple[tuple[int, int], ...] = ()
    # (key, paced launch rate now, at its last reading) where the loop changed
    # phase and its speed readings were forgotten (progress.NEW_PHASE)
    forgotten: tuple[tuple[tuple[int, int], float, float], ...] = ()
    # (key, overlap now) where it began or stopped running beside launch-bound
    # groups without turns (KeyDecision.overlap)
    overlaps: tuple[tuple[tuple[int, int], bool], ...] = ()
