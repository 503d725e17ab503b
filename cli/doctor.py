"""`hami-bpf doctor`: can this machine run hami-bpf, and with what features?"""
from __future__ import annotations

import json
from collections.abc import Mapping

import click

from .common import CliError, console, json_option


@click.command()
@json_option
def doctor(as_json):
    """Check kernel, BPF, libcuda and driver prerequisites (exit 1 if one fails)."""
    try:
        from hami_bpf.doctor import collect
    except ImportError as e:
        raise CliError(f"doctor is not available: {e}") from None
    report = collect()
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        from .render import render_doctor
        console().print(render_doctor(report))
    failed = [n for n, r in report.items()
              if n != "features" and isinstance(r, Mapping) and r.get("ok") is False]
    if failed:
        raise SystemExit(1)
