"""Which held groups the duty pacer lets run again, and when. Pure.

A held group is released once its debts are paid and no other paced group
runs on its devices: two processes time-slicing a busy GPU get less done
than either alone, so paced groups take turns. The exception is a pair of
launch-bound groups (each leaves its GPU idle most of the time it runs: an
LLM decode step of a few hundred small kernels, a small-batch encoder):
run together uncapped, two such loops each kept 86-92% of their speed
alone on an H100, where a turn costs each the time it waits plus what being
held costs its launching thread. So a launch-bound group waits only for
groups that are not; others wait for any. Whatever anyone runs, no hold
outlives its bound: a wrong estimate can only let a group run more.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

DUTY_WAIT_S = 0.005    # a group waiting for another's turn to end looks again this soon
DUE_EPS_S = 1e-6       # a debt or hold this close to its end has ended (rounding of next_step)


@dataclass(frozen=True)
class Paced:
    """A held group's keys paced by time, as its release needs them."""
    owed: float                 # its largest debt there (seconds)
    devices: frozenset[int]
    bound: float                # its hold bound (seconds)
    light: bool                 # every one of them launch-bound


@dataclass
class Running:
    """Devices where a paced group runs now: `any` group, or one that is
    not launch-bound (`heavy`)."""
    any: set[int]
    heavy: set[int]

    @classmethod
    def of(cls, runners: Iterable[tuple[int, bool]]) -> Running:
        """From (device, launch-bound) of each paced key running now."""
        r = cls(set(), set())
        for dev, light in runners:
            r.add({dev}, light)
        return r

    def add(self, devices: set[int] | frozenset[int], light: bool) -> None:
        self.any |= devices
        if not light:
            self.heavy |= devices

    def blocks(self, p: Paced) -> bool:
        """Whether someone running keeps `p` waiting for its turn."""
        return bool(p.devices & (self.heavy if p.light else self.any))


def release(now: float, held: Mapping[int, float], paced: Mapping[int, Paced],
            running: Running) -> tuple[set[int], set[int], float | None]:
    """Held groups (`held`: group -> held since) whose holds end now, oldest
    hold first; those of them cut short (released at their bound with debt
    left, or into a turn still running); and when to look again (a debt's
    end or a bound), None if no hold waits. Groups not in `paced` are not
    this pacer's to release."""
    out, cut, next_step = set(), set(), None
    for gi, since in sorted(held.items(), key=lambda kv: kv[1]):
        p = paced.get(gi)
        if p is None:
            continue
        if now - since >= p.bound - DUE_EPS_S:
            out.add(gi)
            if p.owed > DUE_EPS_S or running.blocks(p):
                cut.add(gi)
            running.add(p.devices, p.light)
        elif p.owed <= DUE_EPS_S and not running.blocks(p):
            out.add(gi)
            running.add(p.devices, p.light)
        else:
            due = now + min(max(p.owed, DUTY_WAIT_S), p.bound - (now - since))
            next_step = due if next_step is None else min(next_step, due)
    return out, cut, next_step
