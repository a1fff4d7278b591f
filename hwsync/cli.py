"""The ``hwsync`` command line: a small registry of subcommands.

A module adds a subcommand with :func:`command`; the modules listed in ``COMMAND_MODULES`` and those
named by the ``hwsync.commands`` entry-point group are imported when the CLI starts, so adding a
command is one decorator plus (for in-tree modules) one line in ``COMMAND_MODULES``::

    @command("plugin-path", help="print the ms-swift plugin file")
    def plugin_path(args: argparse.Namespace) -> int:
        print(...)
        return 0

    @plugin_path.configure            # optional: add arguments
    def _(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--json", action="store_true")

Command modules must be cheap to import: heavy imports (vLLM, ms-swift) belong inside the function.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata

__all__ = ["Command", "command", "main", "COMMAND_MODULES", "ENTRY_POINT_GROUP"]

COMMAND_MODULES: tuple[str, ...] = ("hwsync.doctor", "hwsync.plugin_paths")
ENTRY_POINT_GROUP = "hwsync.commands"

Run = Callable[[argparse.Namespace], int]


@dataclass
class Command:
    """One subcommand: its name, one-line help, the function to run and an argument hook."""

    name: str
    help: str
    run: Run
    configure_parser: Callable[[argparse.ArgumentParser], None] = field(default=lambda parser: None)

    def __call__(self, args: argparse.Namespace) -> int:
        return self.run(args)

    def configure(self, fn: Callable[[argparse.ArgumentParser], None]) -> Callable[[argparse.ArgumentParser], None]:
        """Decorator: ``fn(parser)`` adds this command's arguments."""
        self.configure_parser = fn
        return fn


_COMMANDS: dict[str, Command] = {}


def command(name: str, *, help: str) -> Callable[[Run], Command]:  # noqa: A002 - argparse's word
    """Register ``fn(args) -> exit code`` as ``hwsync <name>``."""

    def register(fn: Run) -> Command:
        cmd = Command(name=name, help=help, run=fn)
        _COMMANDS[name] = cmd
        return cmd

    return register


def _load_commands() -> dict[str, str]:
    """Import command modules; returns ``{module or entry point: error}`` for those that failed."""
    broken: dict[str, str] = {}
    targets = list(COMMAND_MODULES)
    with contextlib.suppress(Exception):  # broken metadata must not disable the built-in commands
        targets += [ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)]
    for target in targets:
        try:
            importlib.import_module(target.partition(":")[0])
        except Exception as e:  # noqa: BLE001 - one broken plugin must not break `hwsync doctor`
            broken[target] = f"{type(e).__name__}: {e}"
    return broken


def build_parser() -> argparse.ArgumentParser:
    from hwsync.common.version import __version__

    parser = argparse.ArgumentParser(prog="hwsync", description="hwsync: trainer -> vLLM weight sync for MoE + LoRA")
    parser.add_argument("--version", action="version", version=f"hwsync {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in sorted(_COMMANDS):
        cmd = _COMMANDS[name]
        p = sub.add_parser(name, help=cmd.help, description=cmd.help)
        cmd.configure_parser(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hwsync`` console script and ``python -m hwsync``; returns the exit code."""
    broken = _load_commands()
    parser = build_parser()
    args = parser.parse_args(argv)
    for target, error in broken.items():
        print(f"hwsync: warning: command module {target} failed to load: {error}", file=sys.stderr)
    if args.command is None:
        parser.print_help()
        return 2
    return int(_COMMANDS[args.command](args) or 0)


@command("token", help="print a new random server-mode token (for HWSYNC_TOKEN, hwsync.serve and hwsync.connect)")
def token_command(args: argparse.Namespace) -> int:
    from hwsync.common.tokens import new_token

    print(new_token())
    return 0


if __name__ == "__main__":
    sys.exit(main())
