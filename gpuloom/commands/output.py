"""What the commands print through: rich consoles that keep tables readable in a log."""

from __future__ import annotations

import sys


def table_console(width: int = 160):
    """A rich Console on stdout: the terminal's own width, or ``width`` columns when the output goes to
    a pipe or a log, where rich would assume 80 and cut names and headers to "dsta…" and "spee…".
    Decided by stdout itself, not rich's ``is_terminal``, which FORCE_COLOR turns on in a pipe."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=width)


def plain_warnings() -> None:
    """Print gpuloom's own warnings as one ``warning: ...`` line on stderr, as the commands' other
    messages are, instead of Python's ``file:line: UserWarning:`` and the source line that raised it
    (a served model without a profile used to print both). Other packages' warnings keep the default
    format, which says where they come from."""
    import os
    import warnings

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the gpuloom package
    default = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(here + os.sep):
            print(f"warning: {message}", file=sys.stderr, flush=True)
        else:
            default(message, category, filename, lineno, file, line)

    warnings.showwarning = show


__all__ = ["plain_warnings", "table_console"]
