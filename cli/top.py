"""`hami-bpf top`: live view (a minimal frame for now; the TUI comes later)."""
from __future__ import annotations

import click

from .common import console, fetch_snapshot, socket_option


@click.command()
@socket_option
@click.option("--once", is_flag=True, help="Print one frame and exit.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=0.25, show_default=True,
              help="Seconds between refreshes.")
def top(socket_path, once, interval):
    """Live device, process and group view."""
    from .render import render_top

    out = console()
    if once:
        out.print(render_top(fetch_snapshot(socket_path)))
        return
    import time

    from rich.live import Live
    try:
        with Live(render_top(fetch_snapshot(socket_path)), console=out, screen=False,
                  auto_refresh=False) as live:
            while True:
                time.sleep(interval)
                live.update(render_top(fetch_snapshot(socket_path)), refresh=True)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how top ends
