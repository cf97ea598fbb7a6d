"""What the commands print through: rich consoles that keep tables readable in a log."""

from __future__ import annotations

import sys


def table_console(width: int = 160):
    """A rich Console on stdout: the terminal's own width, or ``width`` columns when the output goes to
    a pipe or a log, where rich would assume 80 and cut names and headers to "dsta…" and "spee…".
    Decided by stdout itself, not rich's ``is_terminal``, which FORCE_COLOR turns on in a pipe."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=width)


__all__ = ["table_console"]
