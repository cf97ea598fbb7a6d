"""A policy run's name in a bench report: the variant as spelled on the command line
(``dstack:outputs=views``), with ``#2``, ``#3`` for a variant listed again (an A/B/A on order).
Plain string logic, no imports, so that readers of reports (planning from measured holds,
plots, the simulator's calibration) parse names one way."""

from __future__ import annotations

from typing import Sequence


def run_labels(specs: Sequence[str]) -> list[str]:
    """Each run's name in the report: a variant listed again (an A/B/A on order) is ``triton#2``, so
    that no run's points overwrite another's (run 67 lost its first triton run that way)."""
    seen: dict[str, int] = {}
    out = []
    for spec in specs:
        seen[spec] = seen.get(spec, 0) + 1
        out.append(spec if seen[spec] == 1 else f"{spec}#{seen[spec]}")
    return out


def spec_of(label: str) -> str:
    """The variant a run's label names, without its repeat number: ``"dstack:replan=false#2"`` ->
    ``"dstack:replan=false"``."""
    head, sep, tail = label.rpartition("#")
    return head if sep and tail.isdigit() else label


def policy_of(label: str) -> str:
    """The policy a run's label names: ``"dstack:outputs=views#2"`` -> ``"dstack"``."""
    return spec_of(label).split(":")[0]


__all__ = ["policy_of", "run_labels", "spec_of"]
