"""`hami-bpf top`: live full-screen view of devices, groups and their slot tables.

The frame itself is cli.render.render_top (pure); this module only fetches
snapshots, reads keys and drives rich's Live on the alternate screen.

Keys are read from stdin in cbreak mode (termios/tty + select, no extra
dependency): Ctrl-C still interrupts and the terminal is restored on every
way out.
"""
from __future__ import annotations

import os
import sys
import time

import click

from .common import CliError, console, socket_option

RETRY_MAX = 1.0   # seconds between reconnection attempts at most
FETCH_TIMEOUT = 2.0


class _Keys:
    """stdin in cbreak mode, when it is a terminal; otherwise no keys."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self._saved = None

    def __enter__(self) -> "_Keys":
        try:
            fd = sys.stdin.fileno()
        except (AttributeError, ValueError, OSError):
            return self
        if not os.isatty(fd):
            return self
        import termios
        import tty
        self._saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
        self.fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self.fd is not None and self._saved is not None:
            import termios
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def wait(self, timeout: float) -> str:
        """Keys typed within `timeout` seconds ("" if none)."""
        import select
        timeout = max(0.0, timeout)
        if self.fd is None:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return ""
        try:
            data = os.read(self.fd, 64)
        except OSError:
            return ""
        if not data:            # EOF on the terminal: nothing more will come
            self.fd = None
            return ""
        return data.decode(errors="ignore")


def _live(socket_path: str, interval: float) -> None:
    from rich.live import Live

    from hami_bpf.server import ServerError, fetch_snapshot

    from .render import LaunchRates, TopView, next_view, render_top

    snap = fetch_snapshot(socket_path, timeout=FETCH_TIMEOUT)  # the caller turns errors into one line
    view = TopView()
    rates = LaunchRates()
    rates.update(snap)
    status: str | None = None
    retry = interval
    # The screen is the terminal's size, also after a resize: a COLUMNS or
    # LINES left in the environment would pin rich to a stale size.
    for var in ("COLUMNS", "LINES"):
        os.environ.pop(var, None)
    out = console()
    with _Keys() as keys, Live(render_top(snap, view, rates), console=out, screen=True,
                               auto_refresh=False, redirect_stdout=False,
                               redirect_stderr=False) as live:
        next_fetch = time.monotonic() + interval
        while True:
            typed = keys.wait(next_fetch - time.monotonic())
            for key in typed:
                new = next_view(view, key, [g.id for g in snap.groups])
                if new is None:
                    return
                view = new
            if time.monotonic() >= next_fetch:
                try:
                    fresh = fetch_snapshot(socket_path, timeout=FETCH_TIMEOUT)
                    if status is not None:     # the daemon is back: counts restarted
                        rates.reset()
                    snap, status, retry = fresh, None, interval
                    rates.update(snap)
                except ServerError as e:
                    status = f"reconnecting… ({e})"
                    retry = min(RETRY_MAX, retry * 2)
                next_fetch = time.monotonic() + (interval if status is None else retry)
            elif not typed:
                continue
            live.update(render_top(snap, view, rates, status), refresh=True)


@click.command()
@socket_option
@click.option("--once", is_flag=True,
              help="Print one frame (no alternate screen) and exit, for scripts and tests.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.25,
              show_default=True, help="Seconds between refreshes.")
def top(socket_path, once, interval):
    """Live view: devices, then one panel per group with its slots.

    Keys: s cycles the sort (memory, launches, pid), f cycles the group filter,
    d toggles one row per device, q quits. If the daemon goes away the screen
    says "reconnecting…" and recovers when it is back.
    """
    from hami_bpf.server import ServerError, fetch_snapshot

    from .render import LaunchRates, render_top

    if once:
        try:
            snap = fetch_snapshot(socket_path, timeout=FETCH_TIMEOUT)
            rates = LaunchRates()
            rates.update(snap)
            if any(p.launches is not None for p in snap.processes):
                # launches/s needs two snapshots; one interval apart.
                time.sleep(interval)
                snap = fetch_snapshot(socket_path, timeout=FETCH_TIMEOUT)
                rates.update(snap)
        except ServerError as e:
            raise CliError(str(e)) from None
        console().print(render_top(snap, rates=rates))
        return
    try:
        _live(socket_path, interval)
    except ServerError as e:
        raise CliError(str(e)) from None
    except KeyboardInterrupt:
        pass  # Ctrl-C is as good as q
