"""SM caps: the imperative shell around the pure controller (hami_bpf.sm.controller).

The controller owns every SM decision and its state: the caps per group and
device, the launch budgets, the duty pacer, the guard, the turns, learning
alone, lending. This shell does the I/O around it: it reads the probes' maps
and the devices (only the readings the controller `wants`), steps it, writes
the grants it decides, stops and resumes the processes of held groups (the
`throttled` pid sets and the stopped set are process state, kept here),
records its events and counts its counters. The daemon calls it:
`apply_cap` when a member's limits are read, `tick` on its loop, `on_hold`
when BPF stopped a process at a launch or synchronize, `release` and
`forget_group` as the slot table drops processes and groups, `wait_s` for
when to tick next. Any failure in a tick fails open: every hold ends.
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
from .sm.controller import (THROTTLED_SHOWN_S, Decision, Group, Observation, Settings,
                            SmController)

log = logging.getLogger("hami_bpf")

DEBUG_LOG_S = 0.5    # a budget's state is logged (debug) this often at most


class SmControl:
    def __init__(self, cfg, *, probes: Callable, table: Callable, devices: Callable,
                 stopped: Callable, libs: Callable, mechanisms: Callable,
                 record: Callable, counters: collections.Counter) -> None:
        self.cfg = cfg
        self._probes, self._table, self._devices = probes, table, devices
        self._stopped, self._libs, self._mechanisms = stopped, libs, mechanisms
        self.record, self.counters = record, counters
        self.probe_cost_s = 0.0     # what a launch probe adds per call (measured at start)
        # Turns are counted from the daemon's start.
        self.ctl = SmController(Settings.from_config(cfg), epoch=time.monotonic())
        # (priority, utilization policy) per group: the lowest priority and
        # the strictest policy any member asked for (limits.effective_sched).
        self.sched: dict[str, tuple[int, str]] = {}
        # The pids we hold stopped per throttled group, and since when.
        self.throttled: dict[str, set[int]] = {}
        self.throttle_since: dict[str, float] = {}
        self.last_throttled: dict[str, float] = {}
        self._sm_unenforced: set[str] = set()
        self._logged: dict[tuple[int, int], float] = {}   # key -> last debug line

    # The controller's state, as the views and the tests read it.
    @property
    def sm_caps(self) -> dict[str, dict[int, int]]:
        return self.ctl.caps

    @property
    def budgets(self) -> dict:
        return self.ctl.budgets

    @property
    def lending(self) -> set:
        return self.ctl.lending

    @property
    def sm_share(self) -> dict:
        return self.ctl.sm_share

    @property
    def turns(self) -> dict:
        """(group index, device) -> its slot, for the groups taking turns."""
        return self.ctl.turns

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
        return bool(self.ctl.caps)

    def cap_of(self, group: str) -> int | None:
        """The group's lowest SM cap over its devices (None: uncapped)."""
        return self.ctl.cap_of(group)

    def caps(self, group: str) -> dict[int, int]:
        return self.ctl.caps.get(group, {})

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
        return self.ctl.clear_caps(group)

    def caps_reread(self, group: str, index: int, old_caps: dict[int, int]) -> None:
        """After they were read again: a device that lost its cap forgets its
        budget; a group with no cap left runs again."""
        caps = self.caps(group)
        lost = sorted(set(old_caps) - set(caps))
        # Count only from now on; a learned budget would be stale anyway.
        self.ctl.uncap(index, lost)
        for dev in lost:
            self.probes.delete_sm_grant(index, dev)
            self.record("limit", "sm_cap", group=group, device=dev, sm=None)
        if group in self.throttled and not caps:
            self._resume_group(group)

    def tick(self, now: float) -> None:
        """One control step; on any failure every hold ends (fail open)."""
        try:
            self._tick(now)
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
        for key in [k for k in self._logged if k[0] == index]:
            del self._logged[key]
        had_caps = name in self.ctl.caps
        self._say(self.ctl.forget_group(name, index))
        if had_caps:
            self.sync_launch_probes()

    def wait_s(self, now: float) -> float | None:
        """How soon the loop should tick again (None: no cap, no hurry)."""
        return self.ctl.wait_s(now, bool(self.throttled))

    def shown_throttled(self, group: str, pid: int, now: float) -> bool:
        """Held now, or within THROTTLED_SHOWN_S (a view's "throttled")."""
        return (pid in self.throttled.get(group, ()) or
                now - self.last_throttled.get(group, -1e9) < THROTTLED_SHOWN_S)

    def group_view(self, group: str, index: int) -> dict:
        """What the views show of a group's SM state."""
        return dict(sm_limit=self.cap_of(group), priority=self._sched(group)[0],
                    sm_lending=tuple(sorted(d for gi, d in self.lending if gi == index)),
                    sm_turns=tuple(sorted(d for gi, d in self.turns if gi == index)))

    def group_share(self, group_index: int) -> float | None:
        return self.ctl.group_share(group_index)

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
        if not self.ctl.set_cap(group, dev, sm):
            return
        self.record("limit", "sm_cap", group=group, device=dev, sm=sm)
        self.sync_launch_probes()

    def sync_launch_probes(self) -> None:
        """Launch probes cost ~1 us per launch: attached only while a group has an
        SM cap (or --count-launches asks), detached when the last one goes."""
        want = bool(self.cfg.count_launches or self.ctl.caps)
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
        self.mechanisms["launch"] = ("throttling uprobes" if self.ctl.caps else
                                     "counting uprobes" if self.cfg.count_launches else "off")

    # -- one tick: read, step, carry out ------------------------------------

    def _tick(self, now: float) -> None:
        obs = self._observe(now)
        d = self.ctl.step(obs)
        probes = self.probes
        for (gi, dev), g in d.grants.items():
            probes.set_sm_grant(gi, dev, g.granted, True, checkpoint=g.checkpoint,
                                hold_at_sync=g.hold_at_sync)
        self._say(d.events)
        self.counters.update(d.counters)
        for group in d.release:
            self._resume_group(group)
        for group in self.ctl.caps:
            if group in self.throttled and group in obs.groups:
                self.last_throttled[group] = now
        if log.isEnabledFor(logging.DEBUG):
            self._log_state(obs, d)

    def _say(self, events) -> None:
        """Record the controller's events, in order (their types are
        literal where the controller makes them)."""
        say = self.record
        for ev in events:
            say(ev.kind, ev.name, **ev.fields)

    def _observe(self, now: float) -> Observation:
        """What the controller steps on: the probes' counts, the table's
        groups, the holds, and the device readings it wants."""
        use = self.probes.sm_use()
        groups = {g.name: Group(g.index, *self._sched(g.name),
                                pids=frozenset(k.pid for k in g.slots))
                  for g in self.table.groups()}
        reads = self.ctl.wants(now, use, groups)
        devices = self.devices
        util = devices.utilization() if reads.util and devices.has_utilization else None
        # The turns' reading is a reading of its own (after the guard's where
        # both are wanted): the simulated GPU's is of the time since the last.
        turn_util = devices.utilization() if reads.turn_util and devices.has_utilization \
            else None
        per_pid = {dev: devices.process_utilization(dev) for dev in sorted(reads.process_devices)
                   } if devices.nvml else {}
        return Observation(
            now=now, use=use, groups=groups,
            held={name: self.throttle_since.get(name, now) for name in self.throttled},
            waiting=self.probes.sync_waiting() if reads.waiting else {},
            util=util, turn_util=turn_util, process_util=per_pid, probe_s=self.probe_cost_s)

    def _log_state(self, obs: Observation, d: Decision) -> None:
        held = {g.index for name, g in obs.groups.items() if name in self.throttled}
        names = {g.index: name for name, g in obs.groups.items()}
        for key, grant in d.grants.items():
            if obs.now - self._logged.get(key, 0) < DEBUG_LOG_S:
                continue
            self._logged[key] = obs.now
            b = self.ctl.budgets.get(key)
            if b is None:
                log.debug("duty %s dev %d: debt %s ask_sync %s held %s %s", names.get(key[0]),
                          key[1], self.ctl.duty.debt(key), grant.hold_at_sync, key[0] in held,
                          self.ctl.duty.reading(key))
            else:
                log.debug("budget %s dev %d: %s cap %s F=%.4g R=%s granted=%d held=%s "
                          "cut_short=%d episodes=%d", names.get(key[0]), key[1],
                          grant.phase.value, b.cap, b.full_rate, b.rate and round(b.rate),
                          grant.granted, key[0] in held, self.counters["holds_cut_short"],
                          self.counters["throttle_episodes"])

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

