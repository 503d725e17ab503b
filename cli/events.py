"""`hami-bpf events`: recent controller events, optionally followed."""
from __future__ import annotations

import json
import time

import click

from .common import CliError, json_option, socket_option


@click.command()
@click.option("-f", "--follow", is_flag=True, help="Keep polling for new events (Ctrl-C stops).")
@json_option
@socket_option
@click.option("--since", type=click.IntRange(min=0), default=0, show_default=True,
              help="Only events with a sequence number above this.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between polls with --follow.")
def events(follow, as_json, socket_path, since, interval):
    """Print registrations, exits, compactions, denials... (JSON lines with --json)."""
    from hami_bpf.server import ServerError, fetch_events

    from .render import format_event

    try:
        while True:
            try:
                batch, since = fetch_events(socket_path, since)
            except ServerError as e:
                raise CliError(str(e)) from None
            for ev in batch:
                click.echo(json.dumps(ev.to_json(), separators=(",", ":")) if as_json
                           else format_event(ev))
            if not follow:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how --follow ends
