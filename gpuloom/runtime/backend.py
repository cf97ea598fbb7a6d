"""The contract between the runtime and whatever executes batches: simulated or a real GPU.

The runtime owns the queues and the policy; a backend owns the clock (its :class:`EventLoop`) and
the partitions. One runtime loop drives both worlds (DESIGN.md: "one policy code path, two worlds").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Sequence

from .events import EventLoop
from ..policy.types import Completion, Decision, Layout, Partition, Request


class Backend(ABC):
    """Executes batches on partitions and reports completions through the event loop.

    Call order, all from the runtime's thread:

    1. :meth:`start` once, with the runtime's completion handler;
    2. :meth:`configure` with the policy's layout (again whenever the policy asks for a new one);
    3. :meth:`submit` for every validated decision -- it returns at once (asynchronous); when the
       batch finishes the backend schedules ``on_completion(Completion)`` on :attr:`loop` at the
       completion time (a GPU backend posts it from its completion watcher);
    4. :meth:`close` at the end.

    A backend queues at most one batch per partition: the runtime submits to a partition when it is
    free, or -- with :attr:`lookahead_ms` > 0, on an exclusive partition -- when its one running
    batch is about to end; the backend then runs the two in submission order.
    """

    #: launch-ahead the runtime may use (ms); 0 = submit only to idle partitions (simulated backends:
    #: their host costs nothing, so there is nothing to hide)
    lookahead_ms: float = 0.0
    #: whether :meth:`submit` returns only once the batch has run (a CPU batch launched inline). The
    #: runtime then answers a completed batch's requests before it decides again, since a decision may
    #: run a whole batch; otherwise it decides first, so that the answers (an HTTP reply each) do not
    #: keep the freed partition idle (:class:`~gpuloom.runtime.core.Runtime`)
    submit_blocks: bool = False

    #: the clock and event heap; simulated backends jump it, GPU backends follow the wall clock
    loop: EventLoop
    #: SMs of the device
    gpu_sms: int
    #: partition sizes are multiples of this
    granularity: int

    def now(self) -> float:
        """The backend's current time in ms."""
        return self.loop.now

    @abstractmethod
    def start(self, on_completion: Callable[[Completion], None]) -> None:
        """Remember the runtime's completion handler; prepare the device."""

    @abstractmethod
    def configure(self, layout: Layout) -> float:
        """Set up ``layout``'s partitions (replacing the previous layout) and return the time in ms
        from which they can run work. Batches already running finish where they are; the runtime does
        not submit to the new partitions before that time and before those batches drain.
        """

    @abstractmethod
    def partitions(self) -> Sequence[Partition]:
        """The partitions of the current layout, by index."""

    @abstractmethod
    def submit(self, decision: Decision, requests: Sequence[Request]) -> None:
        """Start ``decision`` (its ``requests``, in queue order) now on its partition. Asynchronous."""

    @abstractmethod
    def busy_sm_ms(self) -> float:
        """SM-milliseconds of useful work so far: SMs a batch can use (at most its knee) x time."""

    def close(self) -> None:
        """Release the device. Default: nothing to release."""

    # -- online serving (the real backends); simulated backends keep the defaults ----------------
    #: whether the current layout may keep running work while :meth:`prepare` builds the next one.
    #: Then a reconfigure (a model loaded or unloaded) keeps the old policy dispatching on the old
    #: layout until the new one is built, and switches both at once; else nothing is dispatched
    #: during the build (the CUDA layer's captures wait for the device to be quiet).
    builds_while_serving: bool = False

    def prepare(self, layout: Layout, ready: Callable[[], None]) -> bool:
        """Start building what ``layout`` needs (partitions, captured graphs) in the background.

        Called by the runtime, from its thread, before :meth:`configure`. Return ``False`` when there
        is nothing to build (the runtime configures at once: the simulator's case). Return ``True`` to
        make the runtime keep the current layout running and call :meth:`configure` only after
        ``ready()`` was called (from any thread) -- the atomic swap of a re-plan. If the build fails,
        call ``ready()`` anyway and raise the error from :meth:`configure`.
        """
        return False

    def note_arrival(self) -> None:
        """A request entered the runtime (after admission). Default: nothing; the simulator may charge
        its one host for it (``ContentionModel.host_arrival_ms``)."""

    def note_drops(self, n: int) -> None:
        """A decision dropped ``n`` requests (after its batches were launched). Default: nothing; the
        simulator may charge its one host for answering them (``ContentionModel.host_drop_ms``)."""

    def completion_due(self) -> bool:
        """Runtime's thread, between chunks of answers: whether a batch has finished that the loop
        has not booked yet (its completion is, or is about to be, posted). Never blocks. Default:
        False (a simulated batch completes only as an event of the loop)."""
        return False

    def attach(self, request_id: int, payload: object) -> None:
        """Online mode: the input data of request ``request_id`` (called from the submitting
        thread, before the request is queued). Default: ignored (the simulator has no data)."""

    def take_output(self, request_id: int) -> object:
        """Online mode: the output of a finished request, once (``None`` when there is none). The
        runtime calls it for every answered request (served or not), so a backend frees the request's
        input data here too."""
        return None
