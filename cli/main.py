"""`hami-bpf` entry point: a click group whose subcommands load on demand.

Subcommand modules are imported only when that command runs (or its help is
shown), so `hami-bpf --help` and the query commands never pull in bcc or the
daemon.
"""
from __future__ import annotations

import importlib

import click

from hami_bpf import __version__

from .common import CliError

# name -> "module:attribute"; order here is the order in --help.
COMMANDS = {
    "run": "hami_bpf.cli.run:run",
    "ps": "hami_bpf.cli.ps:ps",
    "slots": "hami_bpf.cli.slots:slots",
    "usage": "hami_bpf.cli.usage:usage",
    "events": "hami_bpf.cli.events:events",
    "top": "hami_bpf.cli.top:top",
    "doctor": "hami_bpf.cli.doctor:doctor",
}


class LazyGroup(click.Group):
    """click.Group that imports "module:attr" subcommands on first use.

    It also turns every click error into one stderr line
    ("hami-bpf: error: ...", exit 2) instead of click's usage block.
    """

    def __init__(self, *args, lazy_subcommands: dict[str, str] | None = None, **kw):
        super().__init__(*args, **kw)
        self.lazy_subcommands = dict(lazy_subcommands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        eager = [n for n in super().list_commands(ctx) if n not in self.lazy_subcommands]
        return list(self.lazy_subcommands) + sorted(eager)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy_subcommands:
            return self._load(name)
        return super().get_command(ctx, name)

    def _load(self, name: str) -> click.Command:
        module, _, attr = self.lazy_subcommands[name].partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{module}:{attr} is not a click command")
        return cmd

    def make_context(self, *args, **kw) -> click.Context:
        try:
            return super().make_context(*args, **kw)
        except click.ClickException as e:
            raise _one_line(e) from None

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except click.ClickException as e:
            raise _one_line(e) from None


def _one_line(e: click.ClickException) -> CliError:
    if isinstance(e, CliError):
        return e
    msg = " ".join(e.format_message().split())
    if isinstance(e, click.UsageError) and e.ctx is not None:
        msg += f" (see `{e.ctx.command_path} --help`)"
    return CliError(msg, exit_code=e.exit_code)


@click.group(cls=LazyGroup, lazy_subcommands=COMMANDS,
             context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hami-bpf")
def main() -> None:
    """GPU sharing for CUDA processes, observed and enforced with eBPF.

    `hami-bpf run` starts the daemon (root); the other commands query it
    through its control socket. Query commands accept --json.
    """
