"""The snapshot: what the server, the metrics and the region files read,
built on the loop's thread from each owner's data and swapped by reference."""
from __future__ import annotations

import collections
import time

from .snapshot import (SCHEMA_VERSION, DeviceUsage, GroupInfo, ProcessInfo, SlotInfo,
                       Snapshot)


def build_snapshot(*, registry, sm, memory, probes, devices, mechanisms: dict,
                   simulated: bool, counters) -> Snapshot:
    table = registry.table
    counting = probes is not None and probes.launch_probes_attached() > 0
    launches = probes.launches() if counting else {}
    denied_by_group: dict[int, int] = collections.Counter()
    if probes:
        for (gidx, _dev), (_used, denied) in probes.group_mem().items():
            denied_by_group[gidx] += denied
    ndev = devices.count if devices is not None else 0
    procs = []
    now = time.monotonic()
    for p in table.processes():
        limits = table.limits(p.group)
        devs = {d: DeviceUsage(u, limits.get(d)) for d, u in p.used.items()}
        info = registry.info.get(p.key.pid)
        procs.append(ProcessInfo(
            pid=p.key.pid, start_time=p.key.start_time, comm=p.comm, group=p.group, slot=p.slot,
            devices=devs,
            launches=launches.get(p.key.pid, 0) if counting else None,
            state="throttled" if sm.shown_throttled(p.group, p.key.pid, now) else "running",
            sm_share=sm.group_share(p.group_index),
            visible_devices={phys: vis for vis, phys in enumerate(info.phys[:ndev])
                             if phys != vis} if info else {},
            denied=memory.denied(p.key.pid),
            ns_pid=info.ns_pid if info else None,
            labels=info.labels if info else {}))
    groups = []
    for g in table.groups():
        devs = {d: DeviceUsage(g.used.get(d, 0), g.limits.get(d))
                for d in sorted(set(g.used) | {d for d, v in g.limits.items() if v is not None})}
        groups.append(GroupInfo(id=g.name, index=g.index, proc_num=g.proc_num,
                                slots=tuple(SlotInfo(i, k.pid, k.start_time)
                                            for i, k in enumerate(g.slots)),
                                devices=devs, denied=denied_by_group.get(g.index, 0),
                                **sm.group_view(g.name, g.index)))
    out = dict(table.stats)
    out.update(counters)
    if probes:
        out.update(probes.stats())
    out["launch_probes"] = probes.launch_probes_attached() if probes else 0
    return Snapshot(SCHEMA_VERSION, time.time(), simulated, mechanisms,
                    devices.infos() if devices is not None else (),
                    tuple(procs), tuple(groups), out)
