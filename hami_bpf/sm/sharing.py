"""Who shares a device: the groups that launched there lately, and the share
of its time their caps leave unclaimed. Pure; the SM controller and the pair
replay (sm.pairs) both ask it, so the two agree on who is a neighbour."""
from __future__ import annotations

import collections
from typing import Iterable, Mapping

from ..throttle import BUSY_S

Key = tuple[int, int]      # (group index, device)


def active(last_launch: Mapping[Key, float], now: float) -> list[Key]:
    """The keys whose last launch (`last_launch`: key -> when) was within
    throttle.BUSY_S of `now`."""
    return [k for k, t in last_launch.items() if now - t <= BUSY_S]


def _others(key: Key, active_keys: Iterable[Key]) -> list[Key]:
    """The other groups' keys among `active_keys` on key's device."""
    return [a for a in active_keys if a[1] == key[1] and a[0] != key[0]]


def beside_others(key: Key, active_keys: Iterable[Key]) -> bool:
    """Whether another group is among `active_keys` on key's device."""
    return bool(_others(key, active_keys))


def shared(keys: Iterable[Key], active_keys: Iterable[Key]) -> frozenset:
    """Those of `keys` beside another group among `active_keys`."""
    active_keys = list(active_keys)
    return frozenset(k for k in keys if beside_others(k, active_keys))


def uncapped_beside(key: Key, caps: Mapping[Key, float], active_keys: Iterable[Key]) -> bool:
    """Whether key has neighbours among `active_keys` on its device and none
    of them is capped (in `caps`). Uncapped groups take no turns and are
    promised nothing: beside them only, a capped group's speed is measured
    as where it runs alone (they run through its samples and its paced
    seconds alike)."""
    others = _others(key, active_keys)
    return bool(others) and not any(a in caps for a in others)


def spare_time(caps: Mapping[Key, float], active_keys: Iterable[Key]) -> dict[int, float]:
    """Per device, the share of its time (percent) no cap claims: 100 less the
    caps of the capped groups among `active_keys`. An uncapped group claims
    none: it is promised nothing and takes what the capped ones leave, so a
    capped group held for its cap may be given back what being held costs it
    out of that time, as it is where it runs alone."""
    claimed: dict[int, float] = collections.defaultdict(float)
    for key in active_keys:
        claimed[key[1]] += caps.get(key, 0.0)
    return {dev: max(0.0, 100.0 - c) for dev, c in claimed.items()}
