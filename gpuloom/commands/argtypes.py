"""argparse types the commands share (stdlib only: ``gpuloom --help`` imports every command)."""

from __future__ import annotations

import argparse
import math
from typing import Callable


def positive_number(unit: str) -> Callable[[str], float]:
    """An argparse type: a positive, finite number of ``unit`` (``--slo-ms -5`` made every answer miss
    its SLO unsaid; ``--sweep-duration 0`` ended in a traceback)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not 0 < v < math.inf:
            raise argparse.ArgumentTypeError(f"expected a positive number of {unit}, found {text!r}")
        return v

    parse.__name__ = f"positive number of {unit}"  # (argparse names the type in some errors)
    return parse


def int_between(lo: int, hi: int | None = None, what: str = "integer") -> Callable[[str], int]:
    """An argparse type: an integer from ``lo`` to ``hi`` (no bound above where None), checked before
    the command does anything (``plan --cycles 0`` wrote its JSON, then a traceback from the Gantt
    chart; ``--cycles 100000`` drew for minutes; ``demo --iters 0`` fell back to the default unsaid)."""
    bounds = f"from {lo} to {hi}" if hi is not None else f">= {lo}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = None
        if v is None or v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what} {bounds}, found {text!r}")
        return v

    parse.__name__ = f"{what} {bounds}"
    return parse


def nonnegative_number(what: str) -> Callable[[str], float]:
    """An argparse type: a finite number >= 0 (``plan --headroom nan`` and ``inf`` ended in tracebacks)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not 0 <= v < math.inf:
            raise argparse.ArgumentTypeError(f"expected {what}: a finite number >= 0, found {text!r}")
        return v

    parse.__name__ = f"{what} (a finite number >= 0)"
    return parse
