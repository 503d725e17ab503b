"""Learning alone: per device, the one group learning its rate there and the
capped groups it holds meanwhile. Pure: no I/O, no clock.

Next to another process the GPU time-slices and a learning group's pace comes
out short (throttle.learn_alone), so one group at a time learns on each
device while the device's other capped groups are held, at most
LEARN_ALONE_S each; not where an uncapped group is busy (it is never held,
so no one learns alone there). A capped group's first launch on a device is
held too, until it is its turn (or no one else's): else groups starting
together would each queue a second of work that runs in the other's learning.

A device's state is an `AloneState`: nobody learning (a first launch may
still be held until the next tick picks whose turn it is), or one learner and
the groups it holds. `plan` says what the next state is and which budgets
start over; the controller applies it (it owns the budgets) and `commit`s it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

from ..limits import HAMI_DEFAULT_PRIORITY
from ..throttle import BUSY_S, LEARN_ALONE_S, learn_alone

Key = tuple[int, int]      # (group index, physical device)


class AloneState(NamedTuple):
    """A device's learning alone: the group learning there and the groups held meanwhile."""
    learner: Key | None
    held: frozenset


NOBODY_ALONE = AloneState(None, frozenset())


@dataclass(frozen=True)
class AlonePlan:
    new: Mapping[int, AloneState]   # device -> its state from this tick
    begin: frozenset                # learners whose time alone starts now
    restart: frozenset              # learners held from their first launch: learn from now, alone
    restart_after: frozenset        # learning that ran across a hold: starts over
    held: frozenset                 # keys held this tick


class AloneTable:
    """Owns every device's learning-alone state, and what events told of it."""

    def __init__(self, record: Callable) -> None:
        self.record = record
        self.devices: dict[int, AloneState] = {}
        self._said: dict[int, tuple[Key, frozenset]] = {}   # device -> as the events told it

    def held(self) -> frozenset:
        return frozenset(k for a in self.devices.values() for k in a.held)

    def plan(self, now: float, use: Mapping[Key, tuple], prio: Mapping[int, int],
             budgets: Mapping, last_busy: Mapping, first_busy: Mapping) -> AlonePlan:
        """Who learns alone on each device now, and whom it holds. `prio`:
        group index -> priority; `budgets`: key -> throttle.Budget of every
        capped key; `last_busy`/`first_busy`: key -> when it was last / first
        seen launching."""
        waited = self.held()

        def launched(k):
            return use.get(k, (0,))[0] > 0

        def busy(k):
            return now - last_busy.get(k, -1e9) <= BUSY_S

        new: dict[int, AloneState] = {}
        begin, restart = set(), set()
        for dev in sorted({d for _gi, d in budgets}):
            if any(k[1] == dev and k not in budgets and busy(k) for k in use):
                continue     # an uncapped group is busy here: it is never held
            capped = {k: prio.get(k[0], HAMI_DEFAULT_PRIORITY) for k in budgets if k[1] == dev}
            cur = self.devices.get(dev, NOBODY_ALONE).learner
            # A learner begins busy or held waiting, and keeps its turn while
            # it launches nothing too (blocked on its full queue, synchronizing).
            learners = {k: (first_busy.get(k, now), capped[k]) for k in capped
                        if (b := budgets[k]).learning
                        and (k == cur or (launched(k) and (busy(k) or k in waited)))
                        and (b.alone_since is None or now - b.alone_since <= LEARN_ALONE_S)}
            learner, held = learn_alone(learners, capped, current=cur)
            if learner is None:
                # No one learning: a first launch is held until the next tick
                # picks whose turn it is.
                new[dev] = AloneState(None, frozenset(k for k in capped if not launched(k)
                                                      and budgets[k].learning))
                continue
            if learner in waited:
                restart.add(learner)    # held from its first launch: learn from now
            elif any(launched(k) for k in held) and budgets[learner].alone_since is None:
                begin.add(learner)
            new[dev] = AloneState(learner, held)
        held_now = frozenset(k for a in new.values() for k in a.held)
        after = frozenset(k for k, b in budgets.items()
                          if k in waited and k not in held_now and k not in restart and b.learning)
        return AlonePlan(new, frozenset(begin), frozenset(restart), after, held_now)

    def commit(self, plan: AlonePlan, now: float, use: Mapping[Key, tuple], budgets: Mapping,
               names: Mapping[int, str]) -> None:
        """The plan is the devices' state now: events for learning alone that
        began or ended (only holds of groups that launched there are news)."""
        self.devices = dict(plan.new)

        def said(keys):
            return [names.get(k[0], str(k[0])) for k in sorted(keys)]

        for dev in sorted(set(self._said) | set(self.devices)):
            (l0, h0) = self._said.get(dev, (None, frozenset()))
            l1, h1 = self.devices.get(dev, NOBODY_ALONE)
            h1 = frozenset(k for k in h1 if use.get(k, (0,))[0] > 0)
            if l0 is not None and (l0 != l1 or not h1):
                lb = budgets.get(l0)
                how = ("learned" if lb is not None and not lb.learning else "not_learned"
                       if lb is not None and now - (lb.alone_since or now) > LEARN_ALONE_S
                       else "stopped")
                self.record("throttle", "alone_done", group=names.get(l0[0]),
                            group_index=l0[0], device=dev, alone=False, outcome=how,
                            learn_s=LEARN_ALONE_S, released=said(h0))
            if l1 is not None and h1 and (l1 != l0 or h1 - h0):
                self.record("throttle", "alone_learning", group=names.get(l1[0]),
                            group_index=l1[0], device=dev, alone=True, learn_s=LEARN_ALONE_S,
                            held=sorted(names.get(k[0], str(k[0])) for k in h1))
            if l1 is not None and h1:
                self._said[dev] = (l1, h1 | (h0 if l1 == l0 else frozenset()))
            else:
                self._said.pop(dev, None)

    def forget_group(self, name: str, index: int, names: Mapping[int, str]) -> None:
        """The group is gone: no trace of it. Its learning alone ends (said so)."""
        for dev, (learner, held) in sorted(self._said.items()):
            if learner[0] == index:
                self.record("throttle", "alone_done", group=name, group_index=index,
                            device=dev, alone=False, outcome="stopped", learn_s=LEARN_ALONE_S,
                            released=[names.get(k[0], str(k[0])) for k in sorted(held)])
                del self._said[dev]
            elif any(k[0] == index for k in held):
                self._said[dev] = (learner, frozenset(k for k in held if k[0] != index))
        for dev, (learner, held) in list(self.devices.items()):
            mine = learner is not None and learner[0] == index
            if mine or any(k[0] == index for k in held):
                self.devices[dev] = AloneState(None if mine else learner,
                                               frozenset(k for k in held if k[0] != index))
