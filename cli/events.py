"""`hami-bpf events`: recent controller events, optionally followed."""
from __future__ import annotations

import json
import sys
import time

import click

from hami_bpf.eventlog import Kind

from .common import CliError, json_option, socket_option

# Every kind the controller records (hami_bpf/eventlog.py Kind), styled on a
# terminal; a kind mapped to {} is printed plain.
KIND_STYLE = {
    Kind.REGISTER: {"fg": "green"},
    Kind.EXEC: {},
    Kind.COMPACT: {"fg": "cyan"},
    Kind.GROUP: {"fg": "cyan"},
    Kind.RECONCILE: {},
    Kind.LIMIT: {"fg": "blue"},
    Kind.DENY: {"fg": "red", "bold": True},
    Kind.DENY_IGNORED: {},
    Kind.THROTTLE: {"fg": "magenta"},
    Kind.PROBES: {"fg": "blue"},
    Kind.ADOPT: {},
    Kind.RECOVER: {"fg": "magenta"},
    Kind.STATE: {},
    Kind.CONFIG: {"fg": "yellow"},
    Kind.FALLBACK: {"fg": "yellow"},
    Kind.ERROR: {"fg": "red", "bold": True},
}


@click.command()
@click.option("-f", "--follow", is_flag=True,
              help="Keep polling for new events (Ctrl-C stops); survives a daemon restart.")
@json_option
@socket_option
@click.option("--since", type=click.IntRange(min=0), default=0, show_default=True,
              help="Only events with a sequence number above this.")
@click.option("--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True,
              help="Seconds between polls with --follow.")
def events(follow, as_json, socket_path, since, interval):
    """Print registrations, compactions (with slot moves), denials, limits,
    fallbacks, errors... one per line: TIME KIND MESSAGE (JSON lines with --json)."""
    from hami_bpf.server import ServerError, fetch_events

    from .render import event_parts

    color = not as_json and sys.stdout.isatty()
    last_ts = 0.0
    connected = False
    lost = False
    try:
        while True:
            try:
                if lost:
                    # Back after an outage. A restarted daemon numbers its
                    # events from 1 again: read them all, skip what was printed.
                    batch, since = fetch_events(socket_path, 0)
                    batch = [ev for ev in batch if ev.ts > last_ts]
                    click.echo("hami-bpf: reconnected", err=True)
                    lost = False
                else:
                    batch, since = fetch_events(socket_path, since)
                connected = True
            except ServerError as e:
                if not (follow and connected):
                    raise CliError(str(e)) from None
                if not lost:
                    click.echo(f"hami-bpf: reconnecting: {e}", err=True)
                lost = True
                time.sleep(interval)
                continue
            for ev in batch:
                last_ts = max(last_ts, ev.ts)
                if as_json:
                    click.echo(json.dumps(ev.to_json(), separators=(",", ":")))
                    continue
                ts, kind, message = event_parts(ev)
                if color:
                    kind = click.style(kind, **KIND_STYLE.get(ev.kind, {}))
                click.echo(f"{ts}  {kind}  {message}")
            if not follow:
                return
            time.sleep(interval)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how --follow ends
