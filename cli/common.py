"""Shared CLI plumbing: errors, output, socket option, snapshot fetching."""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

DEFAULT_SOCKET = "/run/hami-bpf/hami-bpf.sock"  # same as hami_bpf.config.DEFAULT_SOCKET


class CliError(click.ClickException):
    """One stderr line, "hami-bpf: error: ...", then exit_code (2 = bad input/environment)."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file=None) -> None:
        click.echo(f"hami-bpf: error: {self.format_message()}", file=file or sys.stderr)


def socket_option(f):
    return click.option("--socket", "socket_path", default=DEFAULT_SOCKET, show_default=True,
                        envvar="HAMI_BPF_SOCKET", metavar="PATH",
                        help="Control socket of `hami-bpf run`.")(f)


def json_option(f):
    return click.option("--json", "as_json", is_flag=True,
                        help="Print JSON (schema in docs/cli.md) instead of a table.")(f)


def fetch_snapshot(socket_path: str):
    from hami_bpf.server import ServerError, fetch_snapshot as _fetch
    try:
        return _fetch(socket_path)
    except ServerError as e:
        raise CliError(str(e)) from None


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=False))


def console():
    """A rich Console on stdout; wide when piped so tables are not squeezed to 80."""
    from rich.console import Console
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=160)
