"""`hami-bpf usage PID`: one process in detail."""
from __future__ import annotations

import click

from .common import CliError, console, emit_json, fetch_snapshot, json_option, socket_option


@click.command()
@click.argument("pid", type=click.IntRange(min=1))
@json_option
@socket_option
def usage(pid, as_json, socket_path):
    """Show one process's memory use and limits per device (and its group's)."""
    from hami_bpf.snapshot import usage_json

    snap = fetch_snapshot(socket_path)
    proc = snap.process(pid)
    if proc is None:
        # Exit 1, not 2: the question was fine, the answer is "not tracked".
        raise CliError(f"pid {pid} is not a tracked CUDA process", exit_code=1)
    group = snap.group(proc.group)
    if as_json:
        emit_json(usage_json(proc, group))
        return
    from .render import render_usage
    console().print(render_usage(proc, group))
