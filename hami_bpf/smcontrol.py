"""SM caps: the controller that owns every piece of SM state.

It keeps, per group and device, the caps, the launch budgets
(hami_bpf.throttle), the duty pacer (hami_bpf.sm.duty) and the guard
(hami_bpf.sm.guard), the turns groups take on a device (hami_bpf.sm.turntable),
who learns alone, and the holds: which processes of which group it stopped,
since when. The daemon wires it to the probes, the slot table, the devices and the stopped set, and
calls it: `apply_cap` when a member's limits are read, `tick` on its loop,
`on_hold` when BPF stopped a process at a launch or synchronize, `release`
and `forget_group` as the slot table drops processes and groups, `wait_s` for
when to tick next. Every SM write to the maps and every SIGSTOP/SIGCONT of a
hold happens here; the pure decisions are in hami_bpf.throttle and
hami_bpf.sm.
"""
from __future__ import annotations

import collections
import logging
import os
import signal
import time
from typing import Callable

from . import abi, enforce
from .limits import HAMI_DEFAULT_PRIORITY
from .sm import duty, guard
from .sm.turntable import TurnTable
from .throttle import (BUSY_S, LEARN_ALONE_S, LEARN_IDLE_S, UNLIMITED, Budget, Completions,
                       completion_rate, correct_rate, held_to_cap, learn_alone, neighbours,
                       next_edge, tick as budget_tick)

log = logging.getLogger("hami_bpf")

THROTTLE_TICK_S = 0.05
UNPACED_S = 2.0     # a neighbour that launched this recently and has no pace yet: wait
HELD_TICK_S = 0.005
DUTY_TICK_S = 0.01         # duty pacing asks for holds this promptly
RESUME_MARGIN_S = 0.02
THROTTLED_SHOWN_S = 1.0   # a group held back within this long shows as throttled



class SmControl:
    def __init__(self, cfg, *, probes: Callable, table: Callable, devices: Callable,
                 stopped: Callable, libs: Callable, mechanisms: Callable,
                 record: Callable, counters: collections.Counter) -> None:
        self.cfg = cfg
        self._probes, self._table, self._devices = probes, table, devices
        self._stopped, self._libs, self._mechanisms = stopped, libs, mechanisms
        self.record, self.counters = record, counters
        self.probe_cost_s = 0.0     # what a launch probe adds per call (measured at start)
        # SM limiting: caps per group and physical device (percent), budgets per
        # (group index, device), and the pids we hold stopped per throttled group.
        self.sm_caps: dict[str, dict[int, int]] = {}
        self.budgets: dict[tuple[int, int], Budget] = {}
        # (priority, utilization policy) per group: the lowest priority and
        # the strictest policy any member asked for (limits.effective_sched).
        self.sched: dict[str, tuple[int, str]] = {}
        self._last_busy: dict[tuple[int, int], float] = {}   # (group index, device) -> last launch seen
        self._first_busy: dict[tuple[int, int], float] = {}  # ... -> when its launches were first seen
        self._budget_logged: dict[tuple[int, int], float] = {}
        self.lending: set[tuple[int, int]] = set()           # (group index, device) above its cap now
        # The turns GPU-bound groups take on a device (sm.turntable).
        self.turntable = TurnTable(cfg.sm_turn_ms / 1000, record, counters)
        # Per device, the group learning there alone and the capped groups it
        # holds meanwhile (throttle.learn_alone): (learner key, held keys).
        self.alone: dict[int, tuple[tuple[int, int] | None, frozenset]] = {}
        self._alone_said: dict[int, tuple[tuple[int, int], frozenset]] = {}  # ... as events told it
        self.throttled: dict[str, set[int]] = {}
        self.throttle_since: dict[str, float] = {}
        self._prev_use: dict[tuple[int, int], tuple[float, int]] = {}
        # Every (group, device)'s completions while some budget learns, for
        # splitting a shared device by what each group got done.
        self._done: dict[tuple[int, int], Completions] = {}
        self.last_throttled: dict[str, float] = {}
        self._sm_unenforced: set[str] = set()
        self.sm_share: dict[tuple[int, int], float | None] = {}
        # Groups that synchronize often are paced by time (sm.duty), the
        # rest by the launch budget (self.budgets).
        self.duty = duty.DutyPacer(quantum_s=cfg.sm_hold_ms / 1000,
                                    max_hold_s=max(duty.MAX_HOLD_S, 2 * cfg.sm_hold_ms / 1000),
                                    host_run_s=cfg.sm_host_run_ms / 1000)
        self.guard = guard.Guard()        # the launch budget checked against the GPU
        self._duty_next: float | None = None

    @property
    def turns(self) -> dict:
        """(group index, device) -> its slot, for the groups taking turns."""
        return self.turntable.slots

    # The daemon's parts, read when used (some are made or replaced after this).
    @property
    def probes(self):
        return self._probes()

    @property
    def table(self):
        return self._table()

    @property
    def devices(self):
        return self._devices()

    @property
    def stopped(self):
        return self._stopped()

    @property
    def libs(self):
        return self._libs()

    @property
    def mechanisms(self) -> dict:
        return self._mechanisms()

    # -- what the daemon calls ---------------------------------------------

    @property
    def active(self) -> bool:
        """Some group has an SM cap: the loop ticks this controller."""
        return bool(self.sm_caps)

    def cap_of(self, group: str) -> int | None:
        """The group's lowest SM cap over its devices (None: uncapped)."""
        caps = self.sm_caps.get(group)
        return min(caps.values()) if caps else None

    def caps(self, group: str) -> dict[int, int]:
        return self.sm_caps.get(group, {})

    def set_sched(self, group: str, prio: int, upol: str) -> tuple[int, str] | None:
        """A member's priority and utilization policy: the group keeps the
        lowest priority and the strictest policy any member asked for.
        Returns the group's new (priority, policy) where that changed."""
        old = self.sched.get(group)
        if old is not None:
            prio, upol = max(prio, old[0]), ("force" if "force" in (upol, old[1]) else upol)
        if (prio, upol) == old:
            return None
        self.sched[group] = (prio, upol)
        return (prio, upol) if old is not None or prio != HAMI_DEFAULT_PRIORITY or \
            upol != "default" else None

    def clear_group_caps(self, group: str) -> dict[int, int]:
        """Before a group's limits are read again (policy reload): its caps and
        schedule go; returns the caps it had."""
        self.sched.pop(group, None)
        return self.sm_caps.pop(group, {})

    def caps_reread(self, group: str, index: int, old_caps: dict[int, int]) -> None:
        """After they were read again: a device that lost its cap forgets its
        budget; a group with no cap left runs again."""
        caps = self.sm_caps.get(group, {})
        for dev in set(old_caps) - set(caps):
            # Count only from now on; a learned budget would be stale anyway.
            self._forget_budget((index, dev))
            self.probes.delete_sm_grant(index, dev)
            self.record("limit", "sm_cap", group=group, device=dev, sm=None)
        if group in self.throttled and not caps:
            self._resume_group(group)

    def tick(self, now: float) -> None:
        """One control step; on any failure every hold ends (fail open)."""
        try:
            self._throttle_tick(now)
        except Exception as e:   # noqa: BLE001 - SM pacing must never take the daemon down
            self.fail_open(e)

    def on_hold(self, e: abi.Event) -> None:
        """BPF stopped a process at a launch or at a synchronize's return."""
        self._throttle(e)

    def release(self, group: str, pid: int) -> None:
        """The process left its group: it is no longer ours to resume."""
        held = self.throttled.get(group)
        if held and pid in held:
            held.discard(pid)
            self.stopped.remove(pid)

    def forget_group(self, name: str, index: int) -> None:
        """The group is gone: everything kept for it, by name and by index."""
        self._sm_unenforced.discard(name)
        self.sched.pop(name, None)
        self.last_throttled.pop(name, None)
        self.throttled.pop(name, None)
        self.throttle_since.pop(name, None)
        for key in [k for k in self.budgets if k[0] == index]:
            self._forget_budget(key)
        self.duty.forget_group(index)
        self.guard.forget_group(index)
        for per_key in (self._prev_use, self._last_busy, self._first_busy, self._done):
            for key in [k for k in per_key if k[0] == index]:
                del per_key[key]
        if self.sm_caps.pop(name, None):
            self.sync_launch_probes()

    def wait_s(self, now: float) -> float | None:
        """How soon the loop should tick again (None: no cap, no hurry)."""
        if not self.sm_caps:
            return None
        wait = HELD_TICK_S if self.throttled else THROTTLE_TICK_S
        if self._duty_next is not None:
            wait = min(wait, DUTY_TICK_S)
        # Turns begin and end on time: a tick at every slot's edges.
        edge = next_edge(self.turns.values(), now) if self.turns else None
        if edge is not None:
            wait = min(wait, edge - now)
        return wait

    def shown_throttled(self, group: str, pid: int, now: float) -> bool:
        """Held now, or within THROTTLED_SHOWN_S (a view's "throttled")."""
        return (pid in self.throttled.get(group, ()) or
                now - self.last_throttled.get(group, -1e9) < THROTTLED_SHOWN_S)

    def group_view(self, group: str, index: int) -> dict:
        """What the views show of a group's SM state."""
        return dict(sm_limit=self.cap_of(group), priority=self._sched(group)[0],
                    sm_lending=tuple(sorted(d for gi, d in self.lending if gi == index)),
                    sm_turns=tuple(sorted(d for gi, d in self.turns if gi == index)))

    def fail_open(self, e: Exception) -> None:
        """SM pacing failed this tick: fail open. Every group it holds runs
        again; memory limits are untouched (they live in BPF)."""
        self.counters["sm_errors"] += 1
        log.exception("SM pacing failed; holds released")
        for group in list(self.throttled):
            self._resume_group(group)
        self.record("error", "sm_failed", error=type(e).__name__, detail=str(e))
    def _sched(self, group: str) -> tuple[int, str]:
        """(priority, utilization policy) of a group; HAMi's defaults if unset."""
        return self.sched.get(group, (HAMI_DEFAULT_PRIORITY, "default"))

    def apply_cap(self, group: str, dev: int, sm: int | None) -> None:
        """Like memory: a member can lower its group's SM cap, never raise it."""
        if sm is None or sm <= 0 or sm >= 100:
            return
        if not self.cfg.sm_limits:
            if group not in self._sm_unenforced:
                self._sm_unenforced.add(group)
                self.record("config", "sm_unenforced", group=group, sm=sm)
            return
        caps = self.sm_caps.setdefault(group, {})
        old = caps.get(dev)
        if old is not None and old <= sm:
            return
        caps[dev] = sm
        self.record("limit", "sm_cap", group=group, device=dev, sm=sm)
        self.sync_launch_probes()

    def sync_launch_probes(self) -> None:
        """Launch probes cost ~1 us per launch: attached only while a group has an
        SM cap (or --count-launches asks), detached when the last one goes."""
        want = bool(self.cfg.count_launches or self.sm_caps)
        have = self.probes.launch_probes_attached() > 0
        if want and not have:
            from . import libcuda
            for lib in self.libs:
                self.probes.attach_launch(str(lib), libcuda.cuda_symbols(lib))
            self.record("probes", "launch_attached", probes=self.probes.launch_probes_attached())
        elif have and not want:
            for lib in self.libs:
                self.probes.detach_launch(str(lib))
            self.record("probes", "launch_detached")
        self.mechanisms["launch"] = ("throttling uprobes" if self.sm_caps else
                                     "counting uprobes" if self.cfg.count_launches else "off")

    def _throttle_tick(self, now: float) -> None:
        use = self.probes.sm_use()
        rates: dict[int, dict[tuple[int, int], float]] = collections.defaultdict(dict)
        for key, (consumed, *_rest) in use.items():
            prev = self._prev_use.get(key)
            if prev and now > prev[0]:
                rates[key[1]][key] = max(0, consumed - prev[1]) / (now - prev[0])
                if consumed > prev[1]:
                    self._last_busy[key] = now
            if consumed:
                self._first_busy.setdefault(key, now)
            self._prev_use[key] = (now, consumed)
        prio_of = {g.index: self._sched(g.name)[0] for g in self.table.groups()
                   } if self.cfg.sm_lend_idle or self.cfg.sm_learn_alone else {}
        holds = self._learn_alone(now, use, prio_of) if self.cfg.sm_learn_alone else frozenset()
        for k in holds:
            # Held groups are off the device for the learner (their last
            # grant, a slot's work at most, drains first): neither busy nor unpaced.
            rates.get(k[1], {}).pop(k, None)
        # Only a budget still learning reads the device (a new one learns too):
        # no NVML call per tick once every capped group has its rate.
        # A budget on a device its group never launched on stays "learning"
        # (nothing to learn from) and needs no reading.
        learning = any(b.learning and (b.active_since is not None
                                       or use.get(k, (0,))[0] > b.start_consumed)
                       for k, b in self.budgets.items()) or any(
            (g.index, dev) not in self.budgets for name, caps in self.sm_caps.items()
            if (g := self.table.group(name)) is not None for dev in caps
            if self.duty.mode((g.index, dev)) is not duty.Mode.DUTY)
        share = {}
        if learning:
            util = self.devices.utilization() if self.devices.has_utilization else {}
            known = {k: b for k, b in self.budgets.items() if not b.learning}
            done_rates = {}
            for key, (_c, _n, completed, _s, done_ns, _y) in use.items():
                track = self._done.setdefault(key, Completions())
                track.note(now, completed or None, done_ns / 1e9 if done_ns else None)
                done_rates[key] = completion_rate(track, now)
            # Busy lately, yet no completions to pace it by: a group blocked
            # on its full launch queue, or one that never synchronizes.
            unpaced = frozenset(k for k in use if done_rates.get(k) is None and k not in known
                                and k not in holds
                                and now - self._last_busy.get(k, -1e9) <= UNPACED_S)
            for dev, r in rates.items():
                share.update(neighbours(util.get(dev), r, known, now, done_rates,
                                        frozenset(k for k in unpaced if k[1] == dev)))
        if self.cfg.sm_turns:
            self.turntable.plan(use, now, self.budgets, self.lending, self._group_names)
        paced = self._duty_step(now, use)
        util_now: dict[int, float | None] | None = None
        for group, caps in list(self.sm_caps.items()):
            g = self.table.group(group)
            if g is None:
                continue
            room = True
            for dev, cap in caps.items():
                key = (g.index, dev)
                if key in paced.keys and paced.keys[key].mode is duty.Mode.DUTY:
                    room = room and g.index in paced.release
                    continue
                b = self.budgets.get(key)
                if b is None:
                    b = self.budgets[key] = Budget(cap=cap, probe_s=self.probe_cost_s)
                b.cap = cap
                consumed, n_launch, completed, sync_ns, done_ns, _syncs = use.get(
                    key, (0, 0, 0, 0, 0, 0))
                if key in holds:
                    # Held while another group learns here alone (or until its
                    # first launch here is its turn): nothing granted, nothing
                    # learned (a held learner starts over).
                    b.granted, b.credit, b.turn_open = consumed, float(consumed), False
                    self.probes.set_sm_grant(g.index, dev, consumed, True, checkpoint=False)
                    # Not launching here, it runs on as its other devices allow.
                    room = room and not consumed
                    continue
                was_learning, restarts = b.learning, b.restarts
                granted = budget_tick(b, now=now, consumed=consumed, launches=n_launch,
                                      completed=completed or None, sync_ns=sync_ns,
                                      completed_at=done_ns / 1e9 if done_ns else None,
                                      device=share.get(key), turn=self.turns.get(key))
                if b.restarts != restarts:
                    self.counters["sm_corrections_learn_idle"] += 1
                    self.record("throttle", "learn_restarted", group=group, device=dev,
                                sm_correction="learn_idle", idle_s=LEARN_IDLE_S)
                if was_learning and not b.learning:
                    self.record("throttle", "learned", group=group, device=dev, cap=cap,
                                full_rate=b.full_rate, pace=b.pace,
                                work_per_unit=b.work_per_unit, contended=b.contended,
                                launcher_bound=b.launcher_bound, probe_share=b.probe_share,
                                by_completion=b.by_completion,
                                # launched, not known done: runs at the GPU's
                                # full pace whatever the grant (checkpoints)
                                queued=consumed - (completed or 0))
                if self.cfg.sm_lend_idle:
                    others = [(prio_of.get(k[0], HAMI_DEFAULT_PRIORITY),
                               now - self._last_busy.get(k, -1e9) <= BUSY_S)
                              for k in use if k[1] == dev and k[0] != g.index]
                    held = held_to_cap(*self._sched(group), True, others)
                    if not held:
                        granted = max(granted, consumed + UNLIMITED)
                    if held == (key in self.lending):
                        (self.lending.discard if held else self.lending.add)(key)
                        self.record("throttle", "lending", group=group, device=dev,
                                    lending=not held)
                if b.learning and learning and group not in self.throttled:
                    self.guard.reference(key, util.get(dev), now)
                if not b.learning and key not in self.turns and key not in self.lending \
                        and self.devices.has_utilization:
                    if util_now is None:
                        util_now = util if learning else self.devices.utilization()
                    self._guard(key, group, b, now, util_now.get(dev),
                                held=group in self.throttled)
                # No checkpoint for a group free to use what is idle: it is
                # not held to anything the learning would apply.
                self.probes.set_sm_grant(g.index, dev, granted, True,
                                         checkpoint=b.learning and key not in self.lending)
                # Resume with some budget in hand, not a sliver: fewer, longer holds.
                margin = (b.rate or 0) * RESUME_MARGIN_S
                room = room and consumed + margin < granted
                self.sm_share[key] = b.last_share
                if log.isEnabledFor(logging.DEBUG) and now - self._budget_logged.get(key, 0) >= 0.5:
                    self._budget_logged[key] = now
                    log.debug("budget %s dev %d: cap %s learning=%s F=%.4g R=%s consumed=%d "
                              "launches=%d completed=%d granted=%d held=%s cut_short=%d episodes=%d",
                              group, dev, cap, b.learning, b.full_rate, b.rate and round(b.rate),
                              consumed, n_launch, completed, granted, group in self.throttled,
                              self.counters["holds_cut_short"], self.counters["throttle_episodes"])
            held_for = now - self.throttle_since.get(group, now)
            if group in self.throttled and (room or held_for > self.duty.hold_bound(g.index)):
                if g.index in paced.cut_short or not room and not any(
                        k[0] == g.index and use.get(k, (0,))[0] for k in holds):
                    # A hold must never outlive one refill period: whatever the
                    # budget says, the group runs again (and is counted).
                    self.counters["holds_cut_short"] += 1
                self._resume_group(group)
            if group in self.throttled:
                self.last_throttled[group] = now
        if self.turns and self.devices.has_utilization:
            # One reading per tick: a reading may be of the time since the
            # last one (the simulated GPU's is), and a second would halve it.
            read = (lambda: util) if learning else self.devices.utilization
            self.turntable.calibrate(now, self.budgets, read, self._group_names,
                                     learning=learning)

    def _guard(self, key: tuple[int, int], group: str, b: Budget, now: float,
               util: float | None, held: bool) -> None:
        """Check a budget-paced group's learned rate against the GPU (sm.guard)
        and correct it: a group held while its device idles is loosened at once."""
        shared = any(k[1] == key[1] and k != key and now - t <= BUSY_S
                     for k, t in self._last_busy.items())
        source = guard.Source.DEVICE
        per_pid = self.devices.process_utilization(key[1]) if self.devices.nvml else None
        g = self.table.group(group)
        if per_pid and g is not None:
            # The group's own part: neighbours no longer blur the reading.
            util = min(100.0, sum(per_pid.get(k.pid, 0.0) for k in g.slots))
            shared, source = False, guard.Source.PROCESS
        c = self.guard.observe(key, now=now, cap=b.cap, held=held, util=util, shared=shared,
                               source=source)
        if c is None:
            return
        correct_rate(b, c.gain)
        self.counters[f"sm_corrections_{c.reason.value}"] += 1
        self.record("throttle", "corrected", group=group, device=key[1],
                    sm_correction=c.reason.value,
                    gain=round(c.gain, 4), util=round(c.util, 1), target=round(c.target, 1),
                    cap=c.cap, source=c.source.value, rate=b.rate)

    def _duty_step(self, now: float, use: dict) -> duty.Decision:
        """Step duty pacing (sm.duty) for every capped (group, device) and
        write what it asks of the groups it paces: a stop at the next
        synchronize's return, or at the next launch where none came."""
        caps, held, names = {}, {}, {}
        for name, per_dev in self.sm_caps.items():
            g = self.table.group(name)
            if g is None:
                continue
            names[g.index] = name
            for dev, cap in per_dev.items():
                caps[(g.index, dev)] = cap
            if name in self.throttled:
                held[g.index] = self.throttle_since.get(name, now)
        waiting = self.probes.sync_waiting() if caps else {}
        obs = duty.Observation(now=now, caps=caps, held=held, turns=frozenset(self.turns),
                               probe_s=self.probe_cost_s, use={
            k: duty.Use(consumed=v[0], syncs=v[5], waiting=waiting.get(k, 0), launches=v[1],
                        sync_s=v[3] / 1e9)
            for k, v in use.items() if k in caps})
        d = self.duty.step(obs)
        for key, mode in d.mode_changes:
            name = names.get(key[0], str(key[0]))
            self.counters[f"sm_mode_{mode.value}"] += 1
            if mode is duty.Mode.DUTY:
                self._forget_budget(key)
                self.turntable.forget(key)
            self.record("throttle", "mode", group=name, device=key[1], sm_mode=mode.value)
        for key, host, quantum in d.slice_changes:
            self.counters[f"sm_slices_{'host' if host else 'gpu'}"] += 1
            self.record("throttle", "slices", group=names.get(key[0], str(key[0])), device=key[1],
                        host_paced=host, hold_ms=round(quantum * 1000))
        for key, kd in d.keys.items():
            if kd.mode is not duty.Mode.DUTY:
                continue
            if log.isEnabledFor(logging.DEBUG) and now - self._budget_logged.get(key, 0) >= 0.5:
                self._budget_logged[key] = now
                log.debug("duty %s dev %d: cap %s debt %.3f probe %.3f ask %s held %s syncs %d "
                          "waiting %d", names.get(key[0], key[0]), key[1], caps[key], kd.debt,
                          kd.probe_share, kd.ask.value,
                          key[0] in held, obs.use[key].syncs if key in obs.use else -1,
                          obs.use[key].waiting if key in obs.use else -1)
            consumed = use.get(key, (0,))[0]
            granted = consumed if kd.ask is duty.Ask.LAUNCH else consumed + UNLIMITED
            self.probes.set_sm_grant(key[0], key[1], granted, True,
                                     hold_at_sync=kd.ask is not duty.Ask.NONE)
            self.sm_share[key] = None
        self._duty_next = d.next_step if d.next_step is not None else (
            now if any(kd.mode is duty.Mode.DUTY for kd in d.keys.values()) else None)
        return d

    def _learn_alone(self, now: float, use: dict, prio: dict[int, int]) -> frozenset:
        """Let one group at a time learn its rate on each device while the
        device's other capped groups are held (throttle.learn_alone), at most
        LEARN_ALONE_S each; not where an uncapped group is busy (it is never
        held, so no one learns alone there). A capped group's first launch on
        a device is held too, until it is its turn (or no one else's): else
        groups starting together would each queue a second of work that runs
        in the other's learning. `prio`: group index -> priority. Returns the
        keys held this tick."""
        waited = {k for _l, h in self.alone.values() for k in h}

        def launched(k):
            return use.get(k, (0,))[0] > 0

        def busy(k):
            return now - self._last_busy.get(k, -1e9) <= BUSY_S

        new: dict[int, tuple[tuple[int, int] | None, frozenset]] = {}
        restart: set = set()
        for dev in sorted({d for _gi, d in self.budgets}):
            if any(k[1] == dev and k not in self.budgets and busy(k) for k in use):
                continue
            capped = {k: prio.get(k[0], HAMI_DEFAULT_PRIORITY) for k in self.budgets if k[1] == dev}
            cur = self.alone.get(dev, (None,))[0]
            # A learner begins busy or held waiting, and keeps its turn while
            # it launches nothing too (blocked on its full queue, synchronizing).
            learners = {k: (self._first_busy.get(k, now), capped[k]) for k in capped
                        if (b := self.budgets[k]).learning
                        and (k == cur or (launched(k) and (busy(k) or k in waited)))
                        and (b.alone_since is None or now - b.alone_since <= LEARN_ALONE_S)}
            learner, held = learn_alone(learners, capped, current=cur)
            if learner is None:
                # No one learning: a first launch is held until the next tick
                # picks whose turn it is.
                new[dev] = (None, frozenset(k for k in capped if not launched(k)
                                            and self.budgets[k].learning))
                continue
            if learner in waited:
                restart.add(learner)    # held from its first launch: learn from now
            elif any(launched(k) for k in held):
                b = self.budgets[learner]
                if b.alone_since is None:
                    # From completions after the others were held: what they
                    # still have queued runs on for a slot's work at most
                    # (H200 turns: 70 ms), a few percent of a learning span,
                    # where waiting for another synchronize would take a second.
                    b.alone_since = now
                    b.fresh_since = max(b.fresh_since, now)
            new[dev] = (learner, held)
        for key in restart:
            self._restart_learning(key, now, alone=True)
        self.alone = new
        names = self._group_names()

        def said(keys):
            return [names.get(k[0], str(k[0])) for k in sorted(keys)]

        for dev in sorted(set(self._alone_said) | set(new)):
            # Only holds of groups that launched here are news.
            (l0, h0) = self._alone_said.get(dev, (None, frozenset()))
            l1, h1 = new.get(dev, (None, ()))
            h1 = frozenset(k for k in h1 if launched(k))
            if l0 is not None and (l0 != l1 or not h1):
                lb = self.budgets.get(l0)
                how = ("learned" if lb is not None and not lb.learning else "not_learned"
                       if lb is not None and now - (lb.alone_since or now) > LEARN_ALONE_S
                       else "stopped")
                self.record("throttle", "alone_done", group=names.get(l0[0]),
                            group_index=l0[0], device=dev, alone=False, outcome=how, learn_s=LEARN_ALONE_S,
                            released=said(h0))
            if l1 is not None and h1 and (l1 != l0 or h1 - h0):
                self.record("throttle", "alone_learning", group=names.get(l1[0]),
                            group_index=l1[0], device=dev, alone=True, learn_s=LEARN_ALONE_S,
                            held=sorted(names.get(k[0], str(k[0])) for k in h1))
            if l1 is not None and h1:
                self._alone_said[dev] = (l1, h1 | (h0 if l1 == l0 else frozenset()))
            else:
                self._alone_said.pop(dev, None)
        held_now = {k for _l, h in new.values() for k in h}
        for key, b in list(self.budgets.items()):
            if key in waited and key not in held_now and key not in restart and b.learning:
                self._restart_learning(key, now)   # its learning ran across a hold
        return frozenset(held_now)

    def _restart_learning(self, key: tuple[int, int], now: float, alone: bool = False) -> None:
        """Start a budget's learning over, from completions after `now`;
        `alone`: it learns alone from now. Its turn alone is counted once
        (LEARN_ALONE_S), however often it starts over."""
        b = self.budgets[key]
        since = b.alone_since if b.alone_since is not None or not alone else now
        self.budgets[key] = Budget(cap=b.cap, probe_s=self.probe_cost_s, fresh_since=now,
                                   alone_since=since)

    def _group_names(self) -> dict[int, str]:
        """Group index -> name (the budgets and turns are keyed by index)."""
        return {g.index: g.name for g in self.table.groups()}

    def _forget_budget(self, key: tuple[int, int]) -> None:
        """Drop what an SM cap kept for (group index, device): its budget and
        what the views show of it. Launch and completion history stay while
        the group does (neighbours are split by them)."""
        self.budgets.pop(key, None)
        self.guard.forget(key)
        self.sm_share.pop(key, None)
        self._budget_logged.pop(key, None)
        self.lending.discard(key)

    def group_share(self, group_index: int) -> float | None:
        vals = [v for (gi, _d), v in self.sm_share.items() if gi == group_index and v is not None]
        return round(max(vals), 1) if vals else None

    def _throttle(self, e: abi.Event) -> None:
        """A launch found its group's budget spent and BPF stopped its process:
        stop the rest of the group too, so peers are held and released together."""
        pid = e.tgid
        view = self.table.process(pid)
        if view is None or view.group not in self.sm_caps:
            enforce.resume(pid)
            return
        group = view.group
        if e.flags & abi.F_AT_SYNC:
            self.counters["sm_holds_at_sync"] += 1
        held = self.throttled.setdefault(group, set())
        now = time.monotonic()
        self.last_throttled[group] = now
        if not held:
            # From the probe's stop, not from reading its event (same clock).
            at = e.ts_ns / 1e9
            self.throttle_since[group] = at if 0 < at <= now else now
            self.counters["throttle_episodes"] += 1
        g = self.table.group(group)
        new = [(key.pid, key.start_time) for key in (g.slots if g else ())
               if key.pid not in held and (key.pid == pid or enforce.proc_state(key.pid)
                                           not in ("T", "t"))]   # else: someone else's stop
        if not new:
            return
        # Recorded before they are stopped: a controller killed in between
        # leaves a record of a running process (recovery skips it), never a
        # stopped process without one.
        self.stopped.add_many(new, f"SM cap of group {group}")
        gone = []
        for p, _st in new:
            if p != pid:
                try:
                    os.kill(p, signal.SIGSTOP)
                except ProcessLookupError:
                    gone.append(p)
                    continue
            held.add(p)
        if gone:
            self.stopped.remove_many(gone)

    def _resume_group(self, group: str) -> None:
        held = self.throttled.pop(group, set())
        since = self.throttle_since.pop(group, None)
        if since is not None:
            self.counters["throttle_ms"] += int((time.monotonic() - since) * 1000)
        for pid in held:
            enforce.resume(pid)   # exactly once per hold
        self.stopped.remove_many(held)

