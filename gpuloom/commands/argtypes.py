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
