"""Pure snapshot -> rich renderable functions, shared by the commands and `top`.

Nothing here does I/O, so tests (and the TUI) can render to a string with
to_text(). Unknown values (None) become "N/A" here and only here.
"""
from __future__ import annotations

import datetime as _dt
import io
from typing import Iterable, Mapping, Sequence

from rich import box
from rich.console import Console, Group, RenderableType
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


def format_event(e: EventRecord) -> str:
    return f"{fmt_ts(e.ts)} {e.kind:<10} {e.message}"


def render_events(events: Sequence[EventRecord]) -> RenderableType:
    return Text("\n".join(format_event(e) for e in events) or "no events")


def render_devices(devices) -> Table:
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, header_style="bold")
    for name, j in (("GPU", "right"), ("NAME", "left"), ("USED", "right"), ("TOTAL", "right"),
                    ("UTIL", "right")):
        t.add_column(name, justify=j)
    for d in devices:
        name = f"{d.name} (simulated)" if d.simulated else d.name
        util = NA if d.utilization is None else f"{d.utilization:.0f}%"
        t.add_row(str(d.index), name, fmt_bytes(d.used_bytes), fmt_bytes(d.total_bytes), util)
    return t


def render_top(snap: Snapshot) -> RenderableType:
    """One frame of `top` (placeholder for the full TUI)."""
    mech = ", ".join(f"{k}={v}" for k, v in snap.mechanisms.items()) or NA
    counters = "  ".join(f"{k} {v}" for k, v in snap.counters.items())
    head = Text.assemble(("hami-bpf", "bold"), f"  {fmt_ts(snap.taken_at)}  ",
                         ("SIMULATED  " if snap.simulated else "", "yellow"),
                         f"mechanisms: {mech}  {counters}")
    return Group(head, render_devices(snap.devices), render_processes(snap.processes))


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
