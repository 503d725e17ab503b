"""SM caps: the pure controller. Observations in, decisions out.

`SmController` owns every piece of SM decision state: the caps per group and
device (as the daemon hands them in), the launch budgets (hami_bpf.throttle),
the duty pacer (sm.duty), the guard (sm.guard), the turns (sm.turntable), who
learns alone on each device, who lends idle time, and what it saw of each
(group index, device) so far. The shell (hami_bpf.smcontrol) reads the probes'
maps and the devices, calls `wants` to learn which readings a tick needs
(NVML is read only where a decision needs it), builds an `Observation`, calls
`step` and carries out the `Decision`: it writes the grants, resumes the groups
released, records the events, counts the counters. No I/O, no clock here.

One tick, in order (each a method below):
  observe use   -> launch rates, when each key was last / first busy
  learn alone   -> per device, the group learning alone and the groups it holds
  shares        -> while a budget learns: each group's view of its device
  turns         -> who takes turns on a device (sm.turntable.plan)
  duty          -> groups paced by time (sm.duty): their grants and releases
  budgets       -> groups paced by their launch budget: grants, lending, guard
  releases      -> held groups to resume (their budget has room, or bound hit)
  calibrate     -> turns checked against the device's utilization
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Mapping, NamedTuple

from ..limits import HAMI_DEFAULT_PRIORITY
from ..throttle import (BUSY_S, LEARN_IDLE_S, TURN_PERIOD_S, UNLIMITED, Budget, Completions,
                        completion_rate, correct_rate, gpu_bound, held_to_cap, neighbours,
                        next_edge, tick as budget_tick)
from . import duty, guard, progress, resample, sharing
from .alone import AloneTable
from .turntable import TurnTable

# -- the coordination's constants ------------------------------------------------
THROTTLE_TICK_S = 0.05     # tick period while a group is capped and none is held
HELD_TICK_S = 0.005        # tick period while a group is held: its release is due soon
DUTY_TICK_S = 0.01         # tick period while duty pacing runs: it asks for holds this promptly
UNPACED_S = 2.0            # a neighbour that launched this recently and has no pace yet: wait
RESUME_MARGIN_S = 0.02     # a held group resumes with this much of its rate in hand: fewer holds
THROTTLED_SHOWN_S = 1.0    # a group held back within this long shows as throttled in the views

Key = tuple[int, int]      # (group index, physical device)


class SmUse(NamedTuple):
    """One (group index, device) row of the probes' sm_use map (a plain tuple
    in this order is as good)."""
    consumed: int = 0       # cost units launched in total
    launches: int = 0
    completed: int = 0      # cost known done on the GPU
    sync_ns: int = 0        # nanoseconds its threads spent in synchronize calls
    done_ns: int = 0        # CLOCK_MONOTONIC ns when `completed` last advanced
    syncs: int = 0          # synchronize calls that returned


NO_USE = SmUse()


@dataclass(frozen=True)
class Group:
    """A group as the slot table and its members' limits have it."""
    index: int
    priority: int = HAMI_DEFAULT_PRIORITY     # the lowest any member asked for
    policy: str = "default"                   # utilization policy: the strictest asked for
    pids: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Reads:
    """What a tick needs read besides the probes' sm_use (`SmController.wants`)."""
    util: bool                          # device utilization (learning, the guard)
    process_devices: frozenset[int]     # per-process utilization of these devices
    waiting: bool                       # threads inside a synchronize call (sync_at)
    turn_util: bool = False             # device utilization again, after `util`: the turns'
                                        # calibration when no budget learns


@dataclass(frozen=True)
class Observation:
    now: float                                      # monotonic seconds
    use: Mapping[Key, tuple]                        # sm_use rows (SmUse order)
    groups: Mapping[str, Group]                     # every group of the slot table, by name
    held: Mapping[str, float] = field(default_factory=dict)   # held groups -> held since
    waiting: Mapping[Key, int] = field(default_factory=dict)  # threads inside a synchronize
    util: Mapping[int, float | None] | None = None  # device -> utilization; None: not read
    turn_util: Mapping[int, float | None] | None = None  # ... read for the turns (Reads)
    process_util: Mapping[int, Mapping[int, float] | None] = field(default_factory=dict)
    # ^ device -> pid -> utilization where NVML reports it per process
    probe_s: float = 0.0                            # host time a launch probe adds per launch


class Phase(str, Enum):
    """How a (group, device) is paced this tick."""
    LEARNING = "learning"       # its budget learns the group's full rate: unthrottled
    PACED = "paced"             # held to its cap by its launch budget
    TURNS = "turns"             # paced by its budget, in its turns' slots
    LENDING = "lending"         # free to use what is idle (a higher priority is not busy)
    HELD_ALONE = "held_alone"   # held while another group learns alone on the device
    DUTY = "duty"               # paced by time (sm.duty)


@dataclass(frozen=True)
class Grant:
    """What the sm_grant map is to say of a (group, device)."""
    granted: int
    checkpoint: bool = False    # a synchronize's return spends the grant (learning)
    hold_at_sync: bool = False  # the next synchronize's return stops the group (duty)
    phase: Phase = Phase.PACED


@dataclass(frozen=True)
class Event:
    kind: str
    name: str
    fields: Mapping[str, Any]


@dataclass(frozen=True)
class Decision:
    grants: Mapping[Key, Grant]             # in the order they are written
    release: tuple[str, ...]                # held groups to resume, in order
    cut_short: frozenset[str]               # ... of them, cut short: at their hold bound, their
                                            # budget or debt still saying hold
    events: tuple[Event, ...]               # in the order they happened
    counters: Mapping[str, int]             # increments
    next_step: float | None                 # duty pacing wants a step by then
    lending: frozenset[Key] = frozenset()
    turns: frozenset[Key] = frozenset()
    sm_share: Mapping[Key, float | None] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    """The daemon's SM options (config.DaemonConfig's defaults)."""
    turn_s: float = TURN_PERIOD_S   # the turns' period
    hold_s: float = duty.QUANTUM_S  # duty pacing's quantum
    host_run_s: float = duty.HOST_RUN_S
    turn_run_s: float = duty.TURN_RUN_S     # ... while it takes turns with a capped neighbour
    host_stop_share: float = duty.HOST_STOP_SHARE   # given back to a launch-bound group alone
    sample_share: float = progress.SAMPLE_SHARE     # running time spent free, measuring speed
    turns: bool = True              # capped groups on one device take turns
    lend_idle: bool = False         # a capped group may use what is idle
    learn_alone: bool = True        # one group at a time learns its rate alone

    @classmethod
    def from_config(cls, cfg) -> "Settings":
        return cls(turn_s=cfg.sm_turn_ms / 1000, hold_s=cfg.sm_hold_ms / 1000,
                   host_run_s=cfg.sm_host_run_ms / 1000, turn_run_s=cfg.sm_turn_run_ms / 1000,
                   host_stop_share=cfg.sm_giveback_pct / 100,
                   sample_share=cfg.sm_sample_pct / 100, turns=cfg.sm_turns,
                   lend_idle=cfg.sm_lend_idle, learn_alone=cfg.sm_learn_alone)


@dataclass
class _Seen:
    """What this tick's use adds to what was seen of each key."""
    rates: dict          # device -> key -> cost launched per second since the last tick
    last_busy: Mapping   # key -> last launch seen (this tick's over the old)
    first_busy: Mapping
    prev_use: dict       # key -> (now, consumed): this tick's


class SmController:
    """Every SM decision: `step` once per tick."""

    def __init__(self, settings: Settings = Settings(), *, epoch: float = 0.0) -> None:
        self.settings = settings
        self.caps: dict[str, dict[int, int]] = {}   # group -> device -> cap percent
        self.budgets: dict[Key, Budget] = {}
        self._last_busy: dict[Key, float] = {}      # last launch seen
        self._first_busy: dict[Key, float] = {}     # when its launches were first seen
        self._prev_use: dict[Key, tuple[float, int]] = {}
        # Every key's completions while some budget learns, for splitting a
        # shared device by what each group got done.
        self._done: dict[Key, Completions] = {}
        self.lending: set[Key] = set()              # above its cap now
        self.sm_share: dict[Key, float | None] = {}
        # This tick's events and counters; the turn table reports into them too.
        self._events: list[Event] = []
        self._counts: collections.Counter = collections.Counter()
        self.turntable = TurnTable(settings.turn_s, self._record, self._counts, epoch=epoch)
        self.alone = AloneTable(self._record)       # who learns alone on each device
        # Groups that synchronize often are paced by time, the rest by budget.
        self.duty = duty.DutyPacer(quantum_s=settings.hold_s,
                                   max_hold_s=max(duty.MAX_HOLD_S, 2 * settings.hold_s),
                                   host_run_s=settings.host_run_s, turn_run_s=settings.turn_run_s,
                                   host_stop_share=settings.host_stop_share,
                                   sample_share=settings.sample_share)
        self.guard = guard.Guard()
        self.resample = resample.Resampler()        # budgets' full rates, in free samples
        self.next_step: float | None = None         # duty pacing's next step
        self._probe_s = 0.0                         # the last observation's probe cost
        self._names: dict[int, str] = {}            # ... and its group names, by index

    # -- caps, as handed in ------------------------------------------------------

    def set_cap(self, group: str, dev: int, sm: int) -> bool:
        """A member's cap: the group keeps the lowest. True where it changed."""
        caps = self.caps.setdefault(group, {})
        old = caps.get(dev)
        if old is not None and old <= sm:
            return False
        caps[dev] = sm
        return True

    def clear_caps(self, group: str) -> dict[int, int]:
        return self.caps.pop(group, {})

    def uncap(self, index: int, devices) -> None:
        """Devices a group lost its cap on: their budgets go (counted afresh if it comes back)."""
        for dev in devices:
            self.forget_budget((index, dev))
            self.duty.forget((index, dev))

    def forget_group(self, name: str, index: int) -> tuple[Event, ...]:
        """The group is gone: every trace of it, by name and by index.
        Returns the events that ends (its learning alone)."""
        self._events = []
        for key in [k for k in self.budgets if k[0] == index]:
            self.forget_budget(key)
        self.duty.forget_group(index)
        self.guard.forget_group(index)
        self.resample.forget_group(index)
        self.turntable.forget_group(index)
        self.alone.forget_group(name, index, self._names)
        for per_key in (self._prev_use, self._last_busy, self._first_busy, self._done,
                        self.sm_share):
            for key in [k for k in per_key if k[0] == index]:
                del per_key[key]
        self.lending = {k for k in self.lending if k[0] != index}
        self._names.pop(index, None)
        self.caps.pop(name, None)
        return tuple(self._events)

    def forget_budget(self, key: Key) -> None:
        """Drop what an SM cap kept for a key: its budget and what the views
        show of it. Launch and completion history stay while the group does
        (neighbours are split by them)."""
        self.budgets.pop(key, None)
        self.guard.forget(key)
        self.resample.forget(key)
        self.sm_share.pop(key, None)
        self.lending.discard(key)

    # -- queries -----------------------------------------------------------------

    @property
    def turns(self) -> dict:
        """(group index, device) -> its slot, for the groups taking turns."""
        return self.turntable.slots

    def cap_of(self, group: str) -> int | None:
        caps = self.caps.get(group)
        return min(caps.values()) if caps else None

    def group_share(self, group_index: int) -> float | None:
        vals = [v for (gi, _d), v in self.sm_share.items() if gi == group_index and v is not None]
        return round(max(vals), 1) if vals else None

    def hold_bound(self, group_index: int) -> float:
        return self.duty.hold_bound(group_index)

    def wait_s(self, now: float, holding: bool) -> float | None:
        """How soon to tick again (None: no cap, no hurry); `holding`: some group is held."""
        if not self.caps:
            return None
        wait = HELD_TICK_S if holding else THROTTLE_TICK_S
        if self.next_step is not None:
            wait = min(wait, DUTY_TICK_S)
        # Turns begin and end on time: a tick at every slot's edges.
        edge = next_edge(self.turns.values(), now) if self.turns else None
        if edge is not None:
            wait = min(wait, edge - now)
        return wait

    def wants(self, now: float, use: Mapping[Key, tuple], groups: Mapping[str, Group]) -> Reads:
        """Which readings a step at `now` with this `use` needs: device
        utilization only while a budget learns, for the guard of a budget
        that has its rate, for a group paced by time that looks launch-bound
        (duty.wants_util), and for the turns' calibration when it is due; no
        NVML call per tick otherwise. Pure: the step reruns what it looks at.
        A superset at worst: in the tick a group goes to duty pacing, its
        guard's reading is taken and goes unused."""
        seen = self._seen(now, use)
        prio = self._priorities(groups)
        plan = self.alone.plan(now, use, prio, self.budgets, seen.last_busy, seen.first_busy) \
            if self.settings.learn_alone else None
        restarted = plan.restart | plan.restart_after if plan else set()
        held = plan.held if plan else frozenset()
        keys = self._capped_keys(groups)
        if self._learning(use, keys, restarted):
            # A budget may learn its rate in this step and be checked at once.
            return Reads(True, frozenset(k[1] for k in keys), bool(keys))
        guarded = self._guarded_devices(now, use, groups, prio, seen, held, keys)
        slots = self.turntable.select(use, now, self.budgets, self.lending) \
            if self.settings.turns else self.turns
        calibrate = bool(slots) and (self.turntable.due_after(slots, now)
                                     if self.settings.turns else self.turntable.due(now))
        return Reads(bool(guarded) or bool(self.duty.wants_util(now)), guarded, bool(keys),
                     turn_util=calibrate)

    # -- the step ----------------------------------------------------------------

    def step(self, obs: Observation) -> Decision:
        self._events, grants = [], {}
        self._counts.clear()
        now, use = obs.now, obs.use
        names = {g.index: name for name, g in obs.groups.items()}
        self._probe_s, self._names = obs.probe_s, names
        seen = self._observe_use(now, use)
        rates = seen.rates
        prio = self._priorities(obs.groups)
        holds = self._learn_alone(now, use, prio, names, seen) if self.settings.learn_alone \
            else frozenset()
        for k in holds:
            # Held groups are off the device for the learner (their last
            # grant, a slot's work at most, drains first): neither busy nor unpaced.
            rates.get(k[1], {}).pop(k, None)
        keys = self._capped_keys(obs.groups)
        learning = self._learning(use, keys)
        util = (obs.util or {}) if learning else obs.util
        share = self._shares(now, use, rates, util, holds) if learning else {}
        self._turns(now, use, names)
        paced = self._duty(obs, names, grants, holds)
        release, cut = self._budgets(obs, names, prio, holds, learning, util, share, paced,
                                     grants)
        self._calibrate(obs, names, learning)
        counts = dict(self._counts)
        self._counts.clear()
        return Decision(grants=grants, release=tuple(release), cut_short=frozenset(cut),
                        events=tuple(self._events), counters=counts, next_step=self.next_step,
                        lending=frozenset(self.lending), turns=frozenset(self.turns),
                        sm_share=dict(self.sm_share))

    def _record(self, kind: str, name: str, **fields) -> None:
        self._events.append(Event(kind, name, fields))

    # -- observe use ---------------------------------------------------------------

    def _seen(self, now: float, use: Mapping[Key, tuple]) -> _Seen:
        rates: dict[int, dict[Key, float]] = collections.defaultdict(dict)
        last, first, prev_use = {}, {}, {}
        for key, (consumed, *_rest) in use.items():
            prev = self._prev_use.get(key)
            if prev and now > prev[0]:
                rates[key[1]][key] = max(0, consumed - prev[1]) / (now - prev[0])
                if consumed > prev[1]:
                    last[key] = now
            if consumed and key not in self._first_busy:
                first[key] = now
            prev_use[key] = (now, consumed)
        return _Seen(rates, collections.ChainMap(last, self._last_busy),
                     collections.ChainMap(first, self._first_busy), prev_use)

    def _observe_use(self, now: float, use: Mapping[Key, tuple]) -> _Seen:
        """Launch rates since the last tick, per device; when each key was
        last and first seen launching."""
        seen = self._seen(now, use)
        self._last_busy.update(seen.last_busy.maps[0])
        self._first_busy.update(seen.first_busy.maps[0])
        self._prev_use.update(seen.prev_use)
        return seen

    def _priorities(self, groups: Mapping[str, Group]) -> dict[int, int]:
        s = self.settings
        return {g.index: g.priority for g in groups.values()} if s.lend_idle or s.learn_alone \
            else {}

    def _capped_keys(self, groups: Mapping[str, Group]) -> dict[Key, tuple[str, int]]:
        """Every capped (group index, device) of a group in the table -> (group, cap)."""
        out = {}
        for name, caps in self.caps.items():
            g = groups.get(name)
            if g is not None:
                for dev, cap in caps.items():
                    out[(g.index, dev)] = (name, cap)
        return out

    def _learning(self, use: Mapping[Key, tuple], keys, restarted=frozenset()) -> bool:
        """Some budget learns (a new one too): only then is the device read
        every tick. A budget on a device its group never launched on stays
        learning (nothing to learn from) and needs no reading. `restarted`:
        budgets about to start over (the step's learning alone)."""
        for k, b in self.budgets.items():
            consumed = use.get(k, NO_USE)[0]
            if k in restarted:
                if consumed > 0:
                    return True
            elif b.learning and (b.active_since is not None or consumed > b.start_consumed):
                return True
        return any(k not in self.budgets and self.duty.mode(k) is not duty.Mode.DUTY
                   for k in keys)

    # -- learn alone ----------------------------------------------------------------

    def _learn_alone(self, now: float, use: Mapping[Key, tuple], prio: dict[int, int],
                     names: dict[int, str], seen: _Seen) -> frozenset:
        """Let one group at a time learn its rate on each device while the
        device's other capped groups are held (sm.alone); the budgets whose
        learning starts over, start over. Returns the keys held this tick."""
        plan = self.alone.plan(now, use, prio, self.budgets, seen.last_busy, seen.first_busy)
        for key in plan.begin:
            # From completions after the others were held: what they still
            # have queued runs on for a slot's work at most (H200 turns:
            # 70 ms), a few percent of a learning span, where waiting for
            # another synchronize would take a second.
            b = self.budgets[key]
            b.alone_since = now
            b.fresh_since = max(b.fresh_since, now)
        for key in plan.restart:
            self._restart_learning(key, now, alone=True)
        self.alone.commit(plan, now, use, self.budgets, names)
        for key in plan.restart_after:
            self._restart_learning(key, now)   # its learning ran across a hold
        return plan.held

    def _restart_learning(self, key: Key, now: float, alone: bool = False) -> None:
        """Start a budget's learning over, from completions after `now`;
        `alone`: it learns alone from now. Its turn alone is counted once
        (LEARN_ALONE_S), however often it starts over."""
        b = self.budgets[key]
        since = b.alone_since if b.alone_since is not None or not alone else now
        self.budgets[key] = Budget(cap=b.cap, probe_s=self._probe_s, fresh_since=now,
                                   alone_since=since)

    # -- shares -----------------------------------------------------------------------

    def _shares(self, now: float, use: Mapping[Key, tuple], rates: dict,
                util: Mapping[int, float | None], holds: frozenset) -> dict:
        """While a budget learns: what each group sees of its device
        (throttle.neighbours), from launches and completions."""
        known = {k: b for k, b in self.budgets.items() if not b.learning}
        done_rates = {}
        for key, (_c, _n, completed, _s, done_ns, _y) in use.items():
            track = self._done.setdefault(key, Completions())
            track.note(now, completed or None, done_ns / 1e9 if done_ns else None)
            done_rates[key] = completion_rate(track, now)
        # Busy lately, yet no completions to pace it by: a group blocked on
        # its full launch queue, or one that never synchronizes.
        unpaced = frozenset(k for k in use if done_rates.get(k) is None and k not in known
                            and k not in holds
                            and now - self._last_busy.get(k, -1e9) <= UNPACED_S)
        share = {}
        for dev, r in rates.items():
            share.update(neighbours(util.get(dev), r, known, now, done_rates,
                                    frozenset(k for k in unpaced if k[1] == dev)))
        return share

    # -- turns --------------------------------------------------------------------------

    def _turns(self, now: float, use: Mapping[Key, tuple], names: dict[int, str]) -> None:
        """Who takes turns on each device this tick (sm.turntable)."""
        if self.settings.turns:
            self.turntable.plan(use, now, self.budgets, self.lending, lambda: names)

    def _calibrate(self, obs: Observation, names: dict[int, str], learning: bool) -> None:
        """The turns checked against their devices' utilization, when due:
        the learning reading while a budget learns, else the turns' own."""
        util = obs.util if learning else obs.turn_util
        if self.turns and util is not None:
            self.turntable.calibrate(obs.now, self.budgets, util, lambda: names,
                                     learning=learning)

    # -- duty ---------------------------------------------------------------------------

    def _duty(self, obs: Observation, names: dict[int, str], grants: dict,
              alone_held: frozenset) -> duty.Decision:
        """Step duty pacing for every capped (group, device); grant what it
        asks of the groups it paces: a stop at the next synchronize's return,
        or at the next launch where none came."""
        now, use = obs.now, obs.use
        caps, held = {}, {}
        for name, per_dev in self.caps.items():
            g = obs.groups.get(name)
            if g is None:
                continue
            for dev, cap in per_dev.items():
                caps[(g.index, dev)] = cap
            if name in obs.held:
                held[g.index] = obs.held[name]
        active = sharing.active(self._last_busy, now)
        shared = sharing.shared(caps, active)
        pobs = duty.Observation(now=now, caps=caps, held=held, turns=frozenset(self.turns),
                                alone_held=alone_held, probe_s=obs.probe_s, shared=shared,
                                util=obs.util, spare=sharing.spare_time(caps, active),
                                active=frozenset(active), use={
            k: duty.Use(consumed=v[0], syncs=v[5], waiting=obs.waiting.get(k, 0), launches=v[1],
                        sync_s=v[3] / 1e9)
            for k, v in use.items() if k in caps})
        d = self.duty.step(pobs)
        for key, mode in d.mode_changes:
            self._counts[f"sm_mode_{mode.value}"] += 1
            if mode is duty.Mode.DUTY:
                self.forget_budget(key)
                self.turntable.forget(key)
            self._record("throttle", "mode", group=names.get(key[0], str(key[0])),
                         device=key[1], sm_mode=mode.value, beside=d.keys[key].beside)
        for key, host, quantum in d.slice_changes:
            self._counts[f"sm_slices_{'host' if host else 'gpu'}"] += 1
            self._record("throttle", "slices", group=names.get(key[0], str(key[0])),
                         device=key[1], host_paced=host, hold_ms=round(quantum * 1000))
        for key, share in d.given_back:
            self._counts[f"sm_giveback_{'on' if share else 'off'}"] += 1
            kd = d.keys[key]
            self._record("throttle", "given_back", group=names.get(key[0], str(key[0])),
                         device=key[1], stop_share=share, spare_pct=kd.spare,
                         gpu_busy=None if kd.busy is None else round(kd.busy, 1))
        for key, sample in d.measured:
            self._counts["sm_samples_measured"] += 1
            self._record("throttle", "speed", group=names.get(key[0], str(key[0])),
                         device=key[1], free_hz=round(sample.free_hz, 1),
                         paced_hz=round(sample.paced_hz, 1),
                         after_hz=round(sample.after_hz, 1), ratio=round(sample.ratio, 3),
                         speed=round(sample.speed, 3),
                         run_pct=round(d.keys[key].run_pct, 1))
        self._counts.update(["sm_samples_dropped"] * len(d.dropped))
        for key, on in d.overlaps:
            self._counts[f"sm_overlap_{'on' if on else 'off'}"] += 1
            self._record("throttle", "overlap", group=names.get(key[0], str(key[0])),
                         device=key[1], overlap=on, **d.keys[key].overlap_fields())
        for key, now_hz, was_hz in d.forgotten:
            self._counts["sm_samples_forgotten"] += 1
            self._record("throttle", "speed_forgotten", group=names.get(key[0], str(key[0])),
                         device=key[1], paced_hz=round(now_hz, 1), was_hz=round(was_hz, 1))
        for key, kd in d.keys.items():
            if kd.mode is not duty.Mode.DUTY:
                continue
            consumed = use.get(key, NO_USE)[0]
            granted = consumed if kd.ask is duty.Ask.LAUNCH else consumed + UNLIMITED
            grants[key] = Grant(granted, hold_at_sync=kd.ask is not duty.Ask.NONE,
                                phase=Phase.DUTY)
            self.sm_share[key] = None
        self.next_step = d.next_step if d.next_step is not None else (
            now if any(kd.mode is duty.Mode.DUTY for kd in d.keys.values()) else None)
        return d

    # -- budgets, lending, guard, releases --------------------------------------------------

    def _lends(self, key: Key, group: Group, now: float, use: Mapping[Key, tuple],
               prio: dict[int, int], last_busy: Mapping) -> bool:
        """Free to use what is idle on the device this tick (throttle.held_to_cap)."""
        others = [(prio.get(k[0], HAMI_DEFAULT_PRIORITY), now - last_busy.get(k, -1e9) <= BUSY_S)
                  for k in use if k[1] == key[1] and k[0] != key[0]]
        return not held_to_cap(group.priority, group.policy, True, others)

    def _guarded_devices(self, now: float, use, groups: Mapping[str, Group], prio, seen: _Seen,
                         holds: frozenset, keys) -> frozenset[int]:
        """Devices of the budgets the guard may check this tick (a superset:
        a group that goes to duty pacing in this tick is not checked)."""
        slots = self.turntable.select(use, now, self.budgets, self.lending) \
            if self.settings.turns else self.turns
        out = set()
        for key, (name, _cap) in keys.items():
            b = self.budgets.get(key)
            if b is None or b.learning or key in holds or key in slots:
                continue
            if self.settings.lend_idle and self._lends(key, groups[name], now, use, prio,
                                                       seen.last_busy):
                continue
            out.add(key[1])
        return frozenset(out)

    def _budgets(self, obs: Observation, names: dict[int, str], prio: dict[int, int],
                 holds: frozenset, learning: bool, util, share: dict, paced: duty.Decision,
                 grants: dict) -> tuple[list[str], set[str]]:
        """Grant every budget-paced (group, device) what its budget allows,
        and say which held groups run again."""
        now, use = obs.now, obs.use
        release, cut = [], set()
        for group, caps in list(self.caps.items()):
            g = obs.groups.get(group)
            if g is None:
                continue
            held = group in obs.held
            room = True
            for dev, cap in caps.items():
                key = (g.index, dev)
                if key in paced.keys and paced.keys[key].mode is duty.Mode.DUTY:
                    room = room and g.index in paced.release
                    continue
                b = self.budgets.get(key)
                if b is None:
                    b = self.budgets[key] = Budget(cap=cap, probe_s=self._probe_s)
                b.cap = cap
                consumed, n_launch, completed, sync_ns, done_ns, _syncs = use.get(key, NO_USE)
                if key in holds:
                    # Held while another group learns here alone (or until its
                    # first launch here is its turn): nothing granted, nothing
                    # learned (a held learner starts over).
                    b.hold(consumed)
                    grants[key] = Grant(consumed, phase=Phase.HELD_ALONE)
                    # Not launching here, it runs on as its other devices allow.
                    room = room and not consumed
                    continue
                was_learning, restarts = b.learning, b.restarts
                granted = budget_tick(b, now=now, consumed=consumed, launches=n_launch,
                                      completed=completed or None, sync_ns=sync_ns,
                                      completed_at=done_ns / 1e9 if done_ns else None,
                                      device=share.get(key), turn=self.turns.get(key))
                if b.restarts != restarts:
                    self._counts["sm_corrections_learn_idle"] += 1
                    self._record("throttle", "learn_restarted", group=group, device=dev,
                                 sm_correction="learn_idle", idle_s=LEARN_IDLE_S)
                if was_learning and not b.learning:
                    self.resample.forget(key)       # a fresh rate: no sample's gain on it
                    self._record("throttle", "learned", group=group, device=dev, cap=cap,
                                 full_rate=b.full_rate, pace=b.pace, contended=b.contended,
                                 work_per_unit=b.work_per_unit, launcher_bound=b.launcher_bound,
                                 probe_share=b.probe_share, by_completion=b.by_completion,
                                 # launched, not known done: runs at the GPU's
                                 # full pace whatever the grant (checkpoints)
                                 queued=consumed - (completed or 0))
                if self.settings.lend_idle:
                    lends = self._lends(key, g, now, use, prio, self._last_busy)
                    if lends:
                        granted = max(granted, consumed + UNLIMITED)
                    if lends != (key in self.lending):
                        (self.lending.add if lends else self.lending.discard)(key)
                        self._record("throttle", "lending", group=group, device=dev,
                                     lending=lends)
                if b.learning and learning and not held:
                    self.guard.reference(key, util.get(dev), now)
                if not b.learning and key not in self.turns and key not in self.lending \
                        and self._check_rate(obs, key, group, g, b, held, consumed):
                    granted = max(granted, consumed + UNLIMITED)
                # No checkpoint for a group free to use what is idle: it is
                # not held to anything the learning would apply.
                grants[key] = Grant(granted, checkpoint=b.learning and key not in self.lending,
                                    phase=self._phase(key, b))
                margin = (b.rate or 0) * RESUME_MARGIN_S
                room = room and consumed + margin < granted
                self.sm_share[key] = b.last_share
            self._release(group, g, obs, room, holds, paced, release, cut)
        return release, cut

    def _phase(self, key: Key, b: Budget) -> Phase:
        if key in self.lending:
            return Phase.LENDING
        if b.learning:
            return Phase.LEARNING
        return Phase.TURNS if key in self.turns else Phase.PACED

    def _release(self, group: str, g: Group, obs: Observation, room: bool, holds: frozenset,
                 paced: duty.Decision, release: list, cut: set) -> None:
        """A held group runs again once every device has room, and whatever
        they say once its hold reaches its bound."""
        if group not in obs.held:
            return
        held_for = obs.now - obs.held[group]
        if room or held_for > self.duty.hold_bound(g.index):
            if g.index in paced.cut_short or not room and not any(
                    k[0] == g.index and obs.use.get(k, NO_USE)[0] for k in holds):
                # A hold must never outlive one refill period: whatever the
                # budget says, the group runs again (and is counted).
                self._counts["holds_cut_short"] += 1
                cut.add(group)
            release.append(group)

    def _check_rate(self, obs: Observation, key: Key, group: str, g: Group, b: Budget,
                    held: bool, consumed: int) -> bool:
        """Check a budget-paced group's rate in free samples (sm.resample) and
        against the GPU (sm.guard), and correct it (a group held while its
        device idles is loosened at once). True: it runs free this tick."""
        now = obs.now
        shared = sharing.beside_others(key, sharing.active(self._last_busy, now))
        free, res = self.resample.step(key, now=now, consumed=consumed, held=held, alone=not shared,
                                       full_rate=b.full_rate, host_bound=not gpu_bound(b))
        if res is not None:
            owed_s = resample.settle(b, res, consumed)
            self.resample.quiet(key, now + owed_s + guard.WINDOW_S)
            self._counts["sm_corrections_free_sample"] += res.changed
            self._record("throttle", "resampled", group=group, device=key[1],
                         free_rate=round(res.free_rate, 1), full_rate=round(res.full_rate, 1),
                         gain=round(res.gain, 4), owed_s=round(owed_s, 3))
        if not self.resample.guarded(key, now):
            self.guard.restart(key)     # a sample and its repaying: not the budget's price
        if obs.util is None or not self.resample.guarded(key, now):
            return free
        util = obs.util.get(key[1])
        source = guard.Source.DEVICE
        per_pid = obs.process_util.get(key[1])
        if per_pid:
            # The group's own part: neighbours no longer blur the reading.
            util = min(100.0, sum(per_pid.get(pid, 0.0) for pid in g.pids))
            shared, source = False, guard.Source.PROCESS
        c = self.guard.observe(key, now=now, cap=b.cap, held=held, util=util, shared=shared,
                               source=source, consumed=b.last_consumed, full_rate=b.full_rate,
                               hold_since=obs.held.get(group))
        if c is None:
            return free
        correct_rate(b, c.gain)
        self._counts[f"sm_corrections_{c.reason.value}"] += 1
        self._record("throttle", "corrected", group=group, device=key[1],
                     sm_correction=c.reason.value, gain=round(c.gain, 4), util=round(c.util, 1),
                     target=round(c.target, 1), cap=c.cap, source=c.source.value, rate=b.rate)
        return free
