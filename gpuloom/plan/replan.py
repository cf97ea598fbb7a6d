"""Online re-planning (placeholder, filled in shortly)."""
from __future__ import annotations


class RateEstimator:  # pragma: no cover - replaced below
    pass


class Replanner:  # pragma: no cover
    pass


class ReplanDecision:  # pragma: no cover
    pass
