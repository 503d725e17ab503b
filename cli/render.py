"""Pure snapshot -> rich renderable functions, shared by the commands and `top`.

Nothing here does I/O, so tests (and the TUI) can render to a string with
to_text(). Unknown values (None) become "N/A" here and only here.
"""
from __future__ import annotations

import datetime as _dt
import io
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable, Mapping, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from hami_bpf.snapshot import DeviceUsage, EventRecord, GroupInfo, ProcessInfo, Snapshot

NA = "N/A"
_STATE_STYLE = {"running": "green", "throttled": "yellow", "stopped": "red"}


def fmt_bytes(n: int | None) -> str:
    """Binary units, 3 significant-ish digits: 512 B, 1.5 KiB, 2.0 GiB."""
    if n is None:
        return NA
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_limit(n: int | None) -> str:
    return "unlimited" if n is None else fmt_bytes(n)


def fmt_usage(u: DeviceUsage | None) -> str:
    if u is None:
        return "-"
    return f"{fmt_bytes(u.used_bytes)} / {fmt_limit(u.limit_bytes)}"


def fmt_opt(v) -> str:
    return NA if v is None else str(v)


def fmt_ts(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%H:%M:%S")


def _device_columns(items: Iterable[Mapping[int, DeviceUsage]]) -> list[int]:
    return sorted({d for devs in items for d in devs})


def render_processes(processes: Sequence[ProcessInfo], devices: Sequence[int] | None = None,
                     title: str | None = None) -> Table:
    """The `ps` table; one "GPUn used/limit" column per device any row uses."""
    cols = list(devices) if devices is not None else _device_columns(p.devices for p in processes)
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    for name in ("PID", "COMM", "GROUP", "SLOT"):
        t.add_column(name, justify="right" if name in ("PID", "SLOT") else "left")
    for d in cols:
        t.add_column(f"GPU{d} USED/LIMIT", justify="right")
    for name in ("LAUNCHES", "STATE", "DENIED"):
        t.add_column(name, justify="left" if name == "STATE" else "right")
    for p in processes:
        t.add_row(str(p.pid), p.comm, p.group, str(p.slot),
                  *(fmt_usage(p.devices.get(d)) for d in cols),
                  fmt_opt(p.launches), Text(p.state, style=_STATE_STYLE.get(p.state, "")),
                  str(p.denied))
    return t


def render_group(g: GroupInfo) -> RenderableType:
    """Header lines (not a table title: titles wrap to the narrow table width)."""
    extra = f", sm_limit {g.sm_limit}%" if g.sm_limit is not None else ""
    if g.sm_lending:
        extra += f" (lending: above it on GPU{','.join(map(str, g.sm_lending))})"
    if g.sm_turns:
        extra += f" (taking turns on GPU{','.join(map(str, g.sm_turns))})"
    if g.priority != 1:
        extra += f", priority {g.priority}"
    denied = f", denied {g.denied}" if g.denied else ""
    head = Text(f"group {g.id} (index {g.index}): proc_num {g.proc_num}{extra}{denied}",
                style="bold")
    devs = Text("  ".join(f"GPU{d} {fmt_usage(u)}" for d, u in g.devices.items())
                or "no device use")
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    t.add_column("INDEX", justify="right")
    t.add_column("PID", justify="right")
    t.add_column("START_TIME", justify="right")
    for s in g.slots:
        t.add_row(str(s.index), str(s.pid), str(s.start_time))
    return Group(head, devs, t)


def render_slots(groups: Sequence[GroupInfo]) -> RenderableType:
    if not groups:
        return Text("no groups")
    return Group(*(render_group(g) for g in groups))


def render_usage(p: ProcessInfo, g: GroupInfo | None = None) -> Table:
    t = Table(box=box.SIMPLE, show_header=False)
    t.add_column("key", style="bold")
    t.add_column("value")
    rows = [("pid", str(p.pid)), ("ns_pid", fmt_opt(p.ns_pid)), ("start_time", str(p.start_time)),
            ("comm", p.comm), ("group", p.group), ("slot", str(p.slot)), ("state", p.state),
            ("launches", fmt_opt(p.launches)), ("denied", str(p.denied))]
    rows += [(k, v) for k, v in p.labels.items()]
    for d, u in p.devices.items():
        rows.append((f"GPU{d} used/limit", fmt_usage(u)))
    if g is not None:
        for d, u in g.devices.items():
            rows.append((f"group GPU{d} used/limit", fmt_usage(u)))
    for k, v in rows:
        t.add_row(k, v)
    return t


def event_parts(e: EventRecord) -> tuple[str, str, str]:
    """(time with milliseconds, kind padded to a column, message)."""
    ts = _dt.datetime.fromtimestamp(e.ts)
    return ts.strftime("%H:%M:%S.") + f"{ts.microsecond // 1000:03d}", f"{e.kind:<8}", e.message


def format_event(e: EventRecord) -> str:
    """One human line: `HH:MM:SS.mmm  kind      message`."""
    return "  ".join(event_parts(e))


def render_events(events: Sequence[EventRecord]) -> RenderableType:
    return Text("\n".join(format_event(e) for e in events) or "no events")


def render_devices(devices) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    for name, j in (("GPU", "right"), ("NAME", "left"), ("USED", "right"), ("TOTAL", "right"),
                    ("UTIL", "right")):
        t.add_column(name, justify=j)
    for d in devices:
        name = f"{d.name} (simulated)" if d.simulated else (d.name if d.name is not None else NA)
        util = NA if d.utilization is None else f"{d.utilization:.0f}%"
        t.add_row(str(d.index), name, fmt_bytes(d.used_bytes), fmt_bytes(d.total_bytes), util)
    return t


# ----------------------------------------------------------------------- top
#
# `top` keeps a TopView (what the user chose with the keys) and a LaunchRates
# (launches/s from successive snapshots); a frame is render_top(snapshot,
# view, rates, status), a pure function, so tests render frames to text.

SORTS = ("memory", "launches", "pid")
KEYS_HELP = "s sort · f filter · d per-device · q quit"
BAR_WIDTH = 12


@dataclass(frozen=True)
class TopView:
    sort: str = "memory"          # one of SORTS
    group: str | None = None      # show only this group; None = all
    per_device: bool = False      # one row per (process, device) instead of per process


def next_view(view: TopView, key: str, groups: Sequence[str]) -> TopView | None:
    """The key state machine: the view after `key`, or None for quit.

    `s` cycles the sort (memory -> launches -> pid), `f` cycles the filter
    (all -> each group of `groups` in order -> all), `d` toggles the
    per-device view, `q`/`Q` quits; other keys change nothing. A filter on a
    group that has disappeared moves on to the first group."""
    if key in ("q", "Q"):
        return None
    if key == "s":
        return replace(view, sort=SORTS[(SORTS.index(view.sort) + 1) % len(SORTS)]
                       if view.sort in SORTS else SORTS[0])
    if key == "f":
        order: list[str | None] = [None, *groups]
        i = order.index(view.group) if view.group in order else 0
        return replace(view, group=order[(i + 1) % len(order)])
    if key == "d":
        return replace(view, per_device=not view.per_device)
    return view


ProcKey = tuple  # (pid, start_time)


class LaunchRates:
    """Launches per second per process, derived from the `launches` counts of
    successive snapshots (their `taken_at`, not our clock).

    The rate is taken over at least `window` seconds when that much history
    exists, so a 4 Hz refresh does not jitter. A count that went down (the
    daemon restarted) or a process seen only once gives None (N/A)."""

    def __init__(self, window: float = 1.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, dict[ProcKey, int]]] = deque()
        self.rates: dict[ProcKey, float | None] = {}

    def reset(self) -> None:
        self._samples.clear()
        self.rates = {}

    def update(self, snap: Snapshot) -> dict[ProcKey, float | None]:
        if self._samples and snap.taken_at <= self._samples[-1][0]:
            return self.rates          # the same (or an older) snapshot again
        cur = {(p.pid, p.start_time): p.launches for p in snap.processes
               if p.launches is not None}
        self._samples.append((snap.taken_at, cur))
        while len(self._samples) >= 2 and snap.taken_at - self._samples[1][0] >= self.window:
            self._samples.popleft()
        rates: dict[ProcKey, float | None] = {}
        for key, n in cur.items():
            rates[key] = None
            for t, counts in self._samples:
                if key in counts and t < snap.taken_at:
                    rates[key] = (n - counts[key]) / (snap.taken_at - t) \
                        if n >= counts[key] else None
                    break
        self.rates = rates
        return rates

    def get(self, p: ProcessInfo) -> float | None:
        return self.rates.get((p.pid, p.start_time))


def fmt_rate(r: float | None) -> str:
    if r is None:
        return NA
    if r >= 10_000:
        return f"{r / 1000:.0f}k"
    return f"{r:.0f}" if r >= 10 else f"{r:.1f}"


def fmt_pct(v: float | int | None) -> str:
    return NA if v is None else f"{v:.0f}%"


def usage_bar(used: int | None, limit: int | None, width: int = BAR_WIDTH) -> Text:
    """`████░░░░ 1.0 GiB / 2.0 GiB`; no bar when the limit is unknown/unlimited."""
    if used is None:
        return Text(NA)
    label = f" {fmt_bytes(used)} / {fmt_limit(limit)}"
    if not limit:
        return Text.assemble(("╌" * width, "grey50"), label)
    ratio = min(1.0, used / limit)
    full = round(ratio * width)
    style = "red" if ratio >= 0.9 else "yellow" if ratio >= 0.7 else "green"
    return Text.assemble(("█" * full, style), ("░" * (width - full), "grey50"), label)


def _state_text(state: str) -> Text:
    label = "stopped-by-us" if state == "stopped" else state
    return Text(label, style=_STATE_STYLE.get(state, ""))


def _total(p: ProcessInfo) -> tuple[int, int | None]:
    """(used, limit) summed over the process's devices; limit None if any is unlimited."""
    used = sum(u.used_bytes for u in p.devices.values())
    limits = [u.limit_bytes for u in p.devices.values()]
    return used, (sum(limits) if limits and None not in limits else None)


def _sort_key(sort: str, rates: LaunchRates | None):
    if sort == "pid":
        return lambda p: (p.pid,)
    if sort == "launches":
        def key(p):
            r = rates.get(p) if rates is not None else None
            return (r is None, -(r or 0.0), -(p.launches or 0), p.pid)
        return key
    return lambda p: (-_total(p)[0], p.pid)


def _group_title(g: GroupInfo, members: Sequence[ProcessInfo]) -> Text:
    shares = [p.sm_share for p in members if p.sm_share is not None]
    achieved = sum(shares) if shares else None
    t = Text.assemble(("group ", "bold"), (g.id, "bold cyan"),
                      f"  slots {g.proc_num}  SM cap {fmt_pct(g.sm_limit)}"
                      f" achieved {fmt_pct(achieved)}  denied ")
    t.append(str(g.denied), style="red" if g.denied else "")
    return t


def render_group_panel(g: GroupInfo, members: Sequence[ProcessInfo], view: TopView,
                       rates: LaunchRates | None = None) -> RenderableType:
    """One group: its slot table's processes, sorted as the view says."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold", pad_edge=False)
    t.add_column("SLOT", justify="right", width=4)
    t.add_column("PID", justify="right", width=8)
    t.add_column("COMM", max_width=16, no_wrap=True)
    t.add_column("GPU", justify="left", no_wrap=True)
    t.add_column("USED / LIMIT", no_wrap=True, min_width=BAR_WIDTH + 24)
    t.add_column("LAUNCH/S", justify="right")
    t.add_column("SM", justify="right")
    t.add_column("STATE", no_wrap=True)
    t.add_column("DENIED", justify="right")
    for p in sorted(members, key=_sort_key(view.sort, rates)):
        rate = fmt_rate(rates.get(p)) if rates is not None and p.launches is not None else NA
        common = (fmt_pct(p.sm_share), _state_text(p.state),
                  Text(str(p.denied), style="red" if p.denied else ""))
        if view.per_device and p.devices:
            for i, (d, u) in enumerate(p.devices.items()):
                first = i == 0
                t.add_row(str(p.slot) if first else "", str(p.pid) if first else "",
                          p.comm if first else "", str(d), usage_bar(u.used_bytes, u.limit_bytes),
                          rate if first else "", *(common if first else ("", "", "")))
        else:
            used, limit = _total(p)
            devs = ",".join(str(d) for d in p.devices) or "-"
            t.add_row(str(p.slot), str(p.pid), p.comm, devs, usage_bar(used, limit), rate,
                      *common)
    gdevs = Text("  ").join(Text.assemble((f"GPU{d} ", "bold"), usage_bar(u.used_bytes,
                                                                             u.limit_bytes))
                            for d, u in g.devices.items()) if g.devices else Text("no device use")
    return Panel(Group(gdevs, t), title=_group_title(g, members), title_align="left",
                 box=box.ROUNDED, padding=(0, 1))


# Names from hami_bpf.counters (tests check each one is produced somewhere).
_COUNTER_ORDER = ("events", "denials", "compactions", "ringbuf_drops", "throttle_episodes",
                  "reaped", "handler_errors", "enforce_errors")
_COUNTERS_BAD = ("ringbuf_drops", "handler_errors", "enforce_errors")   # shown red when non-zero
_COUNTERS_HIDDEN = ("exit_latency_",)   # prefixes of a histogram's parts, not shown


def render_counters(counters: Mapping[str, int]) -> Text:
    """The well-known counters always (when present), the others only when non-zero."""
    keys = [k for k in _COUNTER_ORDER if k in counters]
    keys += sorted(k for k, v in counters.items() if k not in keys and v
                   and not k.startswith(_COUNTERS_HIDDEN))
    t = Text()
    t.append("counters: ", style="bold")
    for i, k in enumerate(keys):
        bad = counters[k] and k in _COUNTERS_BAD
        t.append(("  " if i else "") + f"{k} ")
        t.append(str(counters[k]), style="red" if bad else "")
    return t


def render_top_devices(devices: Sequence) -> RenderableType:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold", pad_edge=False)
    for name, j in (("GPU", "right"), ("NAME", "left"), ("MEMORY USED / TOTAL", "left"),
                    ("UTIL", "right")):
        t.add_column(name, justify=j, no_wrap=True)
    for d in devices:
        name = f"{d.name} (simulated)" if d.simulated else (d.name if d.name is not None else NA)
        t.add_row(str(d.index), name, usage_bar(d.used_bytes, d.total_bytes),
                  fmt_pct(d.utilization))
    if not devices:
        return Text("no devices", style="grey50")
    return t


def render_top(snap: Snapshot, view: TopView | None = None, rates: LaunchRates | None = None,
               status: str | None = None) -> RenderableType:
    """One frame of `top`: header (devices, mechanisms, counters), one panel per group."""
    view = view or TopView()
    head = Text.assemble(("hami-bpf top", "bold"), f"  {fmt_ts(snap.taken_at)}  ",
                         ("SIMULATED DEVICES  " if snap.simulated else "", "bold yellow"),
                         f"sort: {view.sort}  filter: {view.group or 'all'}  "
                         f"view: {'per-device' if view.per_device else 'per-process'}  ",
                         (f"[{KEYS_HELP}]", "grey50"))
    parts: list[RenderableType] = [head]
    if status:
        parts.append(Text(status, style="bold white on red"))
    parts.append(render_top_devices(snap.devices))
    mech = "  ".join(f"{k}={v}" for k, v in snap.mechanisms.items()) or NA
    parts.append(Text.assemble(("mechanisms: ", "bold"), mech))
    parts.append(render_counters(snap.counters))
    groups = [g for g in snap.groups if view.group is None or g.id == view.group]
    if not groups:
        parts.append(Text("no CUDA processes tracked" if view.group is None
                          else f"group {view.group!r}: no processes", style="grey50"))
    by_group: dict[str, list[ProcessInfo]] = {}
    for p in snap.processes:
        by_group.setdefault(p.group, []).append(p)
    for g in groups:
        parts.append(render_group_panel(g, by_group.get(g.id, ()), view, rates))
    return Group(*parts)


def _check_mark(ok) -> Text:
    if ok is True:
        return Text("✓", style="green")
    if ok is False:
        return Text("✗", style="red")
    return Text("?", style="yellow")


def render_doctor(report: Mapping) -> RenderableType:
    """Rows of name -> {"ok", "value", "detail"}; an optional "features" mapping."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    for name in ("", "CHECK", "VALUE", "DETAIL"):
        t.add_column(name)
    for name, row in report.items():
        if name in ("features", "mechanisms") or not isinstance(row, Mapping):
            continue
        value = row.get("value")
        t.add_row(_check_mark(row.get("ok")), name, NA if value is None else str(value),
                  str(row.get("detail") or ""))
    features = report.get("features")
    if not isinstance(features, Mapping) or not features:
        return t
    f = Table(title="features", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    f.add_column("")
    f.add_column("FEATURE")
    f.add_column("VALUE")
    f.add_column("WHY")
    errors = features.get("errors") if isinstance(features.get("errors"), Mapping) else {}
    for name, value in features.items():
        if name == "errors":
            continue
        if isinstance(value, Mapping):  # tolerate the same shape as checks
            f.add_row(_check_mark(value.get("ok")), name, fmt_opt(value.get("value")))
        elif isinstance(value, bool):
            f.add_row(_check_mark(value), name, "yes" if value else "no", str(errors.get(name, "")))
        else:
            f.add_row(_check_mark(None if value is None else True), name, fmt_opt(value))
    mech = report.get("mechanisms")
    if not isinstance(mech, Mapping) or "error" in mech:
        return Group(t, f)
    m = Table(title="mechanisms chosen (auto)", title_justify="left", box=box.SIMPLE_HEAD,
              show_edge=False, header_style="bold")
    m.add_column("WHAT")
    m.add_column("MECHANISM")
    for name, value in mech.items():
        m.add_row(name, fmt_opt(value))
    return Group(t, f, m)


def to_text(renderable: RenderableType, width: int = 160) -> str:
    """Render without colour to a string (tests, logs)."""
    buf = io.StringIO()
    Console(width=width, color_system=None, file=buf).print(renderable)
    return buf.getvalue()
