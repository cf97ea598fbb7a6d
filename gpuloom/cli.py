"""The ``gpuloom`` command line.

Each subcommand lives in its own module under ``gpuloom/commands/`` exposing ``NAME``, ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int``. Modules are imported only when listed here, and
their heavy imports (torch) happen inside ``run`` so that ``gpuloom --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules, in the order ``--help`` lists them. The first is the default job.
COMMANDS = ["demo", "profile", "plan", "simulate", "bench", "serve", "load", "cache"]


def _load(name: str):
    return importlib.import_module(f"gpuloom.commands.{name}")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="gpuloom", description="Serve many deep-learning models on one GPU.")
    parser.add_argument("--version", action="version", version=f"gpuloom {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = _load(name)
        except ModuleNotFoundError as e:
            if e.name == f"gpuloom.commands.{name}":
                continue  # not built yet
            raise
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from .gpu.connections import prefer_all_connections

    # before any command starts CUDA: all 32 hardware workqueues (gpu/connections.py)
    warning = prefer_all_connections().warning
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the main job on its embedded defaults
        args = parser.parse_args(["demo", *(argv or [])])
    try:
        rc = int(args._run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: one line, not a stack
        print("\ninterrupted", file=sys.stderr)
        rc = INTERRUPTED
    if rc == INTERRUPTED and argv is None:  # the console script, not a caller in this process
        _exit_now(rc)
    return rc


#: a command's exit status after Ctrl-C (128 + SIGINT, as a shell reports it)
INTERRUPTED = 130


def _exit_now(rc: int) -> None:
    """End the process without the interpreter's teardown. Why: Ctrl-C during a model's compile
    leaves the builder thread inside torch, and tearing the interpreter down under it aborted the
    process (``terminate called without an active exception``, SIGABRT, 2 of 8 tries on the CPU);
    after an interrupt nothing is left to write."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(main())
