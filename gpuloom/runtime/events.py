"""A discrete-event loop: a heap of (time, priority, sequence, callback), after SimPy's core.

The sequence number makes simultaneous events deterministic: at equal time and priority, events run
in the order they were scheduled. :class:`EventLoop` keeps a simulated clock that jumps to the next
event; a wall-clock loop for the GPU backend overrides :meth:`EventLoop._advance` (wait until the
event's time, or until a completion is posted) -- the same split as SimPy's ``Environment`` and
``RealtimeEnvironment``.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable

# Priorities at equal times: completions free partitions before arrivals are queued, and both
# happen before policy wake-ups, so a policy decides on the fullest picture of "now".
COMPLETION = 0
ARRIVAL = 1
WAKEUP = 2


class EventLoop:
    """Simulated-time event loop. ``now`` is in ms.

    Who calls what: backends and the runtime call :meth:`schedule`; only the runtime calls
    :meth:`step`.
    """

    def __init__(self, start_ms: float = 0.0) -> None:
        self.now: float = float(start_ms)
        self._heap: list[tuple[float, int, int, Callable[..., Any], tuple]] = []
        self._seq = 0

    def schedule(self, time_ms: float, priority: int, callback: Callable[..., Any], *args: Any) -> None:
        """Run ``callback(*args)`` at ``time_ms`` (not before ``now``)."""
        if time_ms < self.now:
            assert self.now - time_ms < 1e-6, f"event scheduled in the past: {time_ms} < {self.now}"
            time_ms = self.now
        heapq.heappush(self._heap, (time_ms, priority, self._seq, callback, args))
        self._seq += 1

    def peek(self) -> float:
        """Time of the next event, or +inf when there is none."""
        return self._heap[0][0] if self._heap else float("inf")

    def step(self) -> bool:
        """Advance to the next event and run it. Returns False when no event is left."""
        if not self._heap:
            return False
        time_ms, _, _, cb, args = heapq.heappop(self._heap)
        self._advance(time_ms)
        cb(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)

    def _advance(self, time_ms: float) -> None:
        """Move the clock to ``time_ms``. Simulated: jump. A real-time loop waits here."""
        self.now = time_ms
