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


def print_error(console, text, *, label: str = "error", style: str = "red") -> None:
    """Print ``error: text`` on ``console`` (a rich Console), on one line however long, ``text`` taken
    literally: as markup, a message holding ``[start_s, rate]`` lost that text as a tag, and a model
    named ``[/bold]`` ended in rich's MarkupError."""
    from rich.text import Text

    console.print(Text.assemble((f"{label}:", style), " ", str(text)), soft_wrap=True)


def print_warning(console, text) -> None:
    """:func:`print_error`'s ``warning: text``."""
    print_error(console, text, label="warning", style="yellow")


def out_dir_error(path, flag: str = "--out") -> str | None:
    """Why ``--out PATH`` (or ``flag``) cannot be the directory a command writes into (a file is there: that was a
    FileExistsError traceback, after the work), or None. Checked before the work."""
    from pathlib import Path

    for p in (Path(path), *Path(path).parents):
        if p.exists():
            return None if p.is_dir() else f"{flag} {path}: expected a directory, found the file {p}"
    return None


def open_profiles(workload, *, profiles_dir=None, gpu=None, synthetic: bool = False):
    """``gpuloom.bench.workload.resolve_profiles``, with a ``--profiles`` directory whose JSON files do
    not all load as profiles (a ProfileError traceback, that named no file) turned into a WorkloadError
    naming the first file that does not, and why."""
    import json
    from pathlib import Path

    from gpuloom.bench.workload import WorkloadError, resolve_profiles
    from gpuloom.profile.store import Profile

    try:
        return resolve_profiles(workload, profiles_dir=profiles_dir, gpu=gpu, synthetic=synthetic)
    except WorkloadError:
        raise
    except (ValueError, OSError, AttributeError) as e:  # ProfileError, bad JSON, unreadable, JSON not an object
        if profiles_dir is None:
            raise
        for path in sorted(Path(profiles_dir).glob("*.json")):
            try:
                with open(path) as f:
                    Profile.from_json(json.load(f))
            except (ValueError, OSError, AttributeError) as bad:
                raise WorkloadError(f"--profiles {profiles_dir}: {path} is not a gpuloom profile: {bad}") from None
        raise WorkloadError(f"--profiles {profiles_dir}: {e}") from None


def finite_json(data, **dumps_kwargs) -> str:
    """``data`` as JSON with null for each NaN and infinity: ``json.dumps`` writes them as ``NaN`` and
    ``Infinity``, which no JSON parser but Python's reads (a latency percentile of a run that served
    nothing is NaN). What JSON has no type for is written as its ``str()``."""
    import json

    from gpuloom.bench.metrics import finite_values

    return json.dumps(finite_values(data), allow_nan=False, default=str, **dumps_kwargs)


__all__ = ["finite_json", "open_profiles", "out_dir_error", "plain_warnings", "print_error", "print_warning", "table_console"]
