"""Immutable controller state that every view reads (CLI, TUI, metrics, socket).

The controller builds a new Snapshot whenever it wants to publish state; views
never see a half-updated slot table because nothing here can be mutated:
dataclasses are frozen, sequences are tuples and mappings are read-only proxies
over private copies.

JSON shapes (``to_json``) are the wire format of the control socket and of the
``--json`` CLI output, versioned by SCHEMA_VERSION (see docs/cli.md and
hami_bpf/schemas/). Device ordinals are JSON object keys, hence strings there
and ints here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .eventtext import render as render_event

SCHEMA_VERSION = 1

PROCESS_STATES = ("running", "throttled", "stopped")

# Well-known keys of Snapshot.counters (monotonic totals since the daemon
# started). metrics.py exports these; absent keys are simply not exported.
COUNTER_DENIALS = "denials"
COUNTER_COMPACTIONS = "compactions"
COUNTER_RINGBUF_DROPS = "ringbuf_drops"
COUNTER_EVENTS = "events"



def _freeze(value: Any) -> Any:
    """Deep-freeze JSON-like data: dicts -> read-only proxies, lists -> tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    """Inverse of _freeze, for json.dumps."""
    if isinstance(value, Mapping):
        return {str(k): _thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_thaw(v) for v in value]
    return value


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # only used from __post_init__


def _freeze_devices(obj: Any) -> None:
    devs = {int(k): (v if isinstance(v, DeviceUsage) else DeviceUsage.from_json(v))
            for k, v in dict(obj.devices).items()}
    _set(obj, "devices", MappingProxyType(dict(sorted(devs.items()))))


def _devices_json(devices: Mapping[int, "DeviceUsage"]) -> dict:
    return {str(k): v.to_json() for k, v in sorted(devices.items())}


def _devices_from_json(d: Mapping) -> dict:
    return {int(k): DeviceUsage.from_json(v) for k, v in d.items()}


@dataclass(frozen=True)
class DeviceUsage:
    used_bytes: int
    limit_bytes: int | None  # None = no limit

    def to_json(self) -> dict:
        return {"used_bytes": self.used_bytes, "limit_bytes": self.limit_bytes}

    @classmethod
    def from_json(cls, d: Mapping) -> "DeviceUsage":
        return cls(used_bytes=int(d["used_bytes"]),
                   limit_bytes=None if d.get("limit_bytes") is None else int(d["limit_bytes"]))


@dataclass(frozen=True)
class ProcessInfo:
    pid: int                      # host pid
    start_time: int               # /proc/PID/stat starttime (ticks); (pid, start_time) is unique
    comm: str
    group: str                    # GroupInfo.id
    slot: int                     # index in its group's slot table
    devices: Mapping[int, DeviceUsage]
    launches: int | None          # None when launch counting is off
    state: str = "running"        # one of PROCESS_STATES
    denied: int = 0               # allocations refused so far
    ns_pid: int | None = None     # pid inside its own pid namespace, when different/known
    # Orchestrator metadata when known, with HAMi's label names:
    # "namespace", "pod", "container". Empty outside Kubernetes.
    labels: Mapping[str, str] = field(default_factory=dict)
    # Achieved SM share in percent of the device over the controller's last
    # measuring interval; None when not measured (no SM limiting, no NVML).
    sm_share: float | None = None
    # Physical device ordinal (the keys of `devices`) -> the ordinal the
    # process sees through CUDA_VISIBLE_DEVICES. Empty = the same ordinals.
    visible_devices: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _freeze_devices(self)
        _set(self, "labels", MappingProxyType({str(k): str(v) for k, v in dict(self.labels).items()}))
        _set(self, "visible_devices", MappingProxyType(
            {int(k): int(v) for k, v in dict(self.visible_devices or {}).items()}))

    def visible_index(self, device: int) -> int:
        """The ordinal this process uses for physical `device`."""
        return self.visible_devices.get(device, device)

    def to_json(self) -> dict:
        return {
            "pid": self.pid, "start_time": self.start_time, "comm": self.comm,
            "group": self.group, "slot": self.slot, "devices": _devices_json(self.devices),
            "launches": self.launches, "state": self.state, "denied": self.denied,
            "ns_pid": self.ns_pid, "labels": dict(self.labels), "sm_share": self.sm_share,
            "visible_devices": {str(k): v for k, v in sorted(self.visible_devices.items())},
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "ProcessInfo":
        return cls(pid=int(d["pid"]), start_time=int(d["start_time"]), comm=str(d["comm"]),
                   group=str(d["group"]), slot=int(d["slot"]),
                   devices=_devices_from_json(d.get("devices", {})),
                   launches=d.get("launches"), state=d.get("state", "running"),
                   denied=int(d.get("denied", 0)), ns_pid=d.get("ns_pid"),
                   labels=d.get("labels") or {},
                   sm_share=None if d.get("sm_share") is None else float(d["sm_share"]),
                   visible_devices={int(k): int(v)
                                    for k, v in (d.get("visible_devices") or {}).items()})


@dataclass(frozen=True)
class SlotInfo:
    index: int
    pid: int
    start_time: int

    def to_json(self) -> dict:
        return {"index": self.index, "pid": self.pid, "start_time": self.start_time}

    @classmethod
    def from_json(cls, d: Mapping) -> "SlotInfo":
        return cls(index=int(d["index"]), pid=int(d["pid"]), start_time=int(d["start_time"]))


@dataclass(frozen=True)
class GroupInfo:
    id: str
    index: int                    # the group's row in the BPF maps
    proc_num: int                 # slots in use
    slots: tuple[SlotInfo, ...]
    devices: Mapping[int, DeviceUsage]  # group totals and group limits
    denied: int = 0
    sm_limit: int | None = None   # percent, None = unlimited
    priority: int = 1             # HAMi's CUDA_TASK_PRIORITY: smaller is higher
    sm_lending: tuple[int, ...] = ()   # devices where it may now exceed its SM cap
    sm_turns: tuple[int, ...] = ()     # devices where it takes turns with other capped groups

    def __post_init__(self) -> None:
        _set(self, "slots", tuple(self.slots))
        _set(self, "sm_lending", tuple(self.sm_lending))
        _set(self, "sm_turns", tuple(self.sm_turns))
        _freeze_devices(self)

    def to_json(self) -> dict:
        return {
            "id": self.id, "index": self.index, "proc_num": self.proc_num,
            "slots": [s.to_json() for s in self.slots],
            "devices": _devices_json(self.devices),
            "denied": self.denied, "sm_limit": self.sm_limit,
            "priority": self.priority, "sm_lending": list(self.sm_lending),
            "sm_turns": list(self.sm_turns),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "GroupInfo":
        return cls(id=str(d["id"]), index=int(d.get("index", 0)), proc_num=int(d["proc_num"]),
                   slots=tuple(SlotInfo.from_json(s) for s in d.get("slots", ())),
                   devices=_devices_from_json(d.get("devices", {})),
                   denied=int(d.get("denied", 0)), sm_limit=d.get("sm_limit"),
                   priority=int(d.get("priority", 1)),
                   sm_lending=tuple(int(x) for x in d.get("sm_lending", ())),
                   sm_turns=tuple(int(x) for x in d.get("sm_turns", ())))


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str | None              # None when NVML could not tell
    total_bytes: int | None       # None when NVML could not tell
    used_bytes: int | None
    utilization: float | None     # percent
    simulated: bool
    uuid: str | None = None       # NVML's "GPU-..." UUID when known

    def to_json(self) -> dict:
        return {"index": self.index, "name": self.name, "total_bytes": self.total_bytes,
                "used_bytes": self.used_bytes, "utilization": self.utilization,
                "simulated": self.simulated, "uuid": self.uuid}

    @classmethod
    def from_json(cls, d: Mapping) -> "DeviceInfo":
        return cls(index=int(d["index"]), name=None if d.get("name") is None else str(d["name"]), total_bytes=d.get("total_bytes"),
                   used_bytes=d.get("used_bytes"), utilization=d.get("utilization"),
                   simulated=bool(d.get("simulated", False)), uuid=d.get("uuid"))


@dataclass(frozen=True)
class EventRecord:
    ts: float                     # time.time()
    kind: str                     # "register", "compact", "deny", ... (eventtext.Kind)
    what: str                     # its type within the kind (eventtext.TYPES)
    data: Mapping                 # the type's payload, JSON-able (e.g. compaction moves)
    # Monotonic sequence number assigned by the controller, starting at 1.
    # The "events" op returns records with seq > since, so followers resume
    # exactly where they left off even when the log drops old records.
    seq: int = 0

    def __post_init__(self) -> None:
        _set(self, "data", _freeze(self.data or {}))

    @property
    def message(self) -> str:
        """One human line, rendered from the payload (never raises)."""
        return render_event(self.kind, self.what, _thaw(self.data))

    def to_json(self) -> dict:
        return {"version": SCHEMA_VERSION, "seq": self.seq, "ts": self.ts, "kind": self.kind,
                "what": self.what, "message": self.message, "data": _thaw(self.data)}

    @classmethod
    def from_json(cls, d: Mapping) -> "EventRecord":
        # "message" is the sender's rendering; the reader renders its own.
        return cls(ts=float(d["ts"]), kind=str(d["kind"]), what=str(d.get("what", "")),
                   data=d.get("data") or {}, seq=int(d.get("seq", 0)))


@dataclass(frozen=True)
class Snapshot:
    version: int
    taken_at: float
    simulated: bool               # True when fed by the demo/fake driver
    mechanisms: Mapping[str, str]  # e.g. {"memory": "uprobe+override", "launch": "uprobe"}
    devices: tuple[DeviceInfo, ...]
    processes: tuple[ProcessInfo, ...]
    groups: tuple[GroupInfo, ...]
    counters: Mapping[str, int]

    def __post_init__(self) -> None:
        _set(self, "mechanisms", MappingProxyType(dict(self.mechanisms)))
        _set(self, "devices", tuple(self.devices))
        _set(self, "processes", tuple(self.processes))
        _set(self, "groups", tuple(self.groups))
        _set(self, "counters", MappingProxyType({str(k): int(v) for k, v in dict(self.counters).items()}))

    @classmethod
    def empty(cls, simulated: bool = False) -> "Snapshot":
        return cls(SCHEMA_VERSION, time.time(), simulated, {}, (), (), (), {})

    def process(self, pid: int) -> ProcessInfo | None:
        return next((p for p in self.processes if p.pid == pid), None)

    def group(self, group_id: str) -> GroupInfo | None:
        return next((g for g in self.groups if g.id == group_id), None)

    def to_json(self) -> dict:
        return {
            "version": self.version, "taken_at": self.taken_at, "simulated": self.simulated,
            "mechanisms": dict(self.mechanisms),
            "devices": [d.to_json() for d in self.devices],
            "processes": [p.to_json() for p in self.processes],
            "groups": [g.to_json() for g in self.groups],
            "counters": dict(self.counters),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> "Snapshot":
        """Parse the socket's snapshot; ValueError on a version we don't speak."""
        version = d.get("version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"snapshot version {version!r} is not supported "
                             f"(this hami-bpf understands version {SCHEMA_VERSION})")
        try:
            return cls(
                version=SCHEMA_VERSION, taken_at=float(d["taken_at"]),
                simulated=bool(d.get("simulated", False)),
                mechanisms=d.get("mechanisms") or {},
                devices=tuple(DeviceInfo.from_json(x) for x in d.get("devices", ())),
                processes=tuple(ProcessInfo.from_json(x) for x in d.get("processes", ())),
                groups=tuple(GroupInfo.from_json(x) for x in d.get("groups", ())),
                counters=d.get("counters") or {},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"malformed snapshot: {e!r}") from None


# JSON documents of the query commands (validated by hami_bpf/schemas/*).

def ps_json(processes) -> dict:
    return {"version": SCHEMA_VERSION, "processes": [p.to_json() for p in processes]}


def slots_json(groups) -> dict:
    return {"version": SCHEMA_VERSION, "groups": [g.to_json() for g in groups]}


def usage_json(process: ProcessInfo, group: GroupInfo | None) -> dict:
    return {"version": SCHEMA_VERSION, "process": process.to_json(),
            "group": None if group is None else group.to_json()}


def example_snapshot(now: float | None = None) -> Snapshot:
    """A small fixed snapshot for docs, tests and rendering previews."""
    gib = 1 << 30
    now = 1_700_000_000.0 if now is None else now
    p1 = ProcessInfo(1234, 98765, "python3", "pod-a", 0,
                     {0: DeviceUsage(512 << 20, 2 * gib)}, 4200, labels={
                         "namespace": "default", "pod": "train-0", "container": "main"})
    p2 = ProcessInfo(1240, 98800, "trainer", "pod-a", 1,
                     {0: DeviceUsage(gib, 2 * gib), 1: DeviceUsage(256 << 20, None)}, None,
                     state="throttled", denied=3, ns_pid=7)
    p3 = ProcessInfo(2001, 99000, "infer", "pod-b", 0, {1: DeviceUsage(128 << 20, None)}, 17)
    ga = GroupInfo("pod-a", 0, 2, (SlotInfo(0, 1234, 98765), SlotInfo(1, 1240, 98800)),
                   {0: DeviceUsage(1536 << 20, 2 * gib), 1: DeviceUsage(256 << 20, None)},
                   denied=3, sm_limit=50)
    gb = GroupInfo("pod-b", 1, 1, (SlotInfo(0, 2001, 99000),), {1: DeviceUsage(128 << 20, None)})
    return Snapshot(
        version=SCHEMA_VERSION, taken_at=now, simulated=True,
        mechanisms={"memory": "uprobe", "enforce": "return-oom"},
        devices=(DeviceInfo(0, "Simulated GPU", 16 * gib, 2 * gib, 35.0, True),
                 DeviceInfo(1, "Simulated GPU", 16 * gib, None, None, True)),
        processes=(p1, p2, p3), groups=(ga, gb),
        counters={COUNTER_DENIALS: 3, COUNTER_COMPACTIONS: 1, COUNTER_RINGBUF_DROPS: 0,
                  COUNTER_EVENTS: 42},
    )
