"""`hami-bpf slots`: each group's slot table."""
from __future__ import annotations

import click

from .common import console, emit_json, fetch_snapshot, json_option, socket_option


@click.command()
@json_option
@socket_option
@click.option("--group", "group_id", metavar="G", help="Only this group.")
def slots(as_json, socket_path, group_id):
    """Show slot tables: which process holds which slot, per group."""
    from hami_bpf.snapshot import slots_json

    snap = fetch_snapshot(socket_path)
    groups = [g for g in snap.groups if group_id is None or g.id == group_id]
    if as_json:
        emit_json(slots_json(groups))
        return
    from .render import render_slots
    console().print(render_slots(groups))
