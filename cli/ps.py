"""`hami-bpf ps`: the tracked CUDA processes."""
from __future__ import annotations

import click

from .common import console, emit_json, fetch_snapshot, json_option, socket_option


@click.command()
@json_option
@socket_option
@click.option("--group", "group_id", metavar="G", help="Only processes of this group.")
@click.option("--pid", type=int, metavar="P", help="Only this process.")
@click.option("--device", type=click.IntRange(min=0), metavar="D",
              help="Only processes using device D (and only its column).")
def ps(as_json, socket_path, group_id, pid, device):
    """List tracked processes with their per-device memory use and limits."""
    from hami_bpf.snapshot import ps_json

    snap = fetch_snapshot(socket_path)
    procs = [p for p in snap.processes
             if (group_id is None or p.group == group_id)
             and (pid is None or p.pid == pid)
             and (device is None or device in p.devices)]
    if as_json:
        emit_json(ps_json(procs))
        return
    from .render import render_processes
    console().print(render_processes(procs, devices=None if device is None else [device]))
