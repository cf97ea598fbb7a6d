"""The policy contract and the registry that picks a policy by name.

A policy sees queues, a clock and profiles, and returns dispatch decisions. The same object runs
against the simulated backend and the GPU backend (DESIGN.md: "one policy code path, two worlds"),
so a policy must never look at the backend: everything it needs arrives through these calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

from ..profile.store import Profile
from .types import Completion, Decision, Drop, Layout, Partition, Request

Queues = Mapping[str, "deque[Request]"]  # model -> its queue (read only for policies): in arrival order, or
# with Policy.deadline_queues earliest deadline first (ties in arrival order). The two agree while every
# request has its model's SLO; a client's own timeout (or an HTTP worker's wait) makes them differ.
Action = Decision | Drop


class PolicyError(RuntimeError):
    """A policy returned something the runtime cannot execute (a bug in the policy)."""


@dataclass(frozen=True)
class ModelInfo:
    """What a policy may know about one model before the run."""

    name: str  # profile name; the key in queues and decisions
    profile: Profile
    slo_ms: float  # latency objective per request, ms
    weight: float = 1.0  # fairness weight / priority
    rate: float = 0.0  # expected mean arrival rate, requests/s (0 = unknown)


@dataclass(frozen=True)
class PolicyContext:
    """Handed to :meth:`Policy.setup` once: the models, the device and the world we run in."""

    models: Mapping[str, ModelInfo]  # in the workload's order
    gpu_sms: int  # SMs of the device
    granularity: int  # partition sizes must be multiples of this (or the whole GPU)
    simulated: bool = True  # False on a real GPU (simulation-only policies refuse to run there)
    knee_eps: float = 0.1  # knee definition shared with the simulator's contention model
    # the simulated device's hold beyond each batch's GPU work: fixed ms, and ms per GPU ms (its
    # ContentionModel's batch_overhead_ms and hold_per_ms; 0 on a real GPU), for the oracle (ideal)
    sim_hold_ms: float = 0.0
    sim_hold_per_ms: float = 0.0
    # ... and its per-model fixed holds in place of sim_hold_ms (model_overhead_ms), and ms per request
    # of the batch (hold_per_request_ms)
    sim_model_hold_ms: Mapping[str, float] = field(default_factory=dict)
    sim_hold_per_request_ms: float = 0.0
    options: Mapping[str, object] = field(default_factory=dict)  # policy options, by name


class Policy(ABC):
    """An online scheduling policy.

    Who calls what, and when (the runtime, from one thread, in this order):

    * :meth:`carry_over` before :meth:`setup` when this policy replaces another in a running
      runtime (a model loaded or unloaded, ``retune``): with the one it replaces.
    * :meth:`setup` once before the first event; returns the partition layout the policy wants.
    * :meth:`on_arrival` after each request is appended to its model's queue.
    * :meth:`on_completion` after a batch finished and its requests were recorded; before it, with
      :attr:`wants_outcomes`, :meth:`on_outcomes` (also after a ``"deadline"`` drop).
    * :meth:`on_refused` for requests refused at submission (:attr:`admit_rps`; in the service, with
      the next arrivals).
    * :meth:`on_free` when a partition running a batch takes the next one early (launch-ahead:
      ``Runtime.lookahead_ms``); a completion frees a partition without it.
    * :meth:`decide` after all events of one instant were handled, when at least one partition is
      free and at least one request is queued (and before the run's dispatch horizon). Returns decisions (each on a distinct free
      partition, requests taken from the head region of their queue) and drops.
    * :meth:`layout_change` right after :meth:`decide`: a new layout to switch to, or ``None``.
      A policy with ``defers_layout_change`` goes on deciding for its current layout until the
      runtime calls :meth:`adopt_layout` (the new layout is set up: at once in the simulator, once
      its graphs are captured on a GPU, which keeps serving the old one meanwhile) or
      :meth:`layout_failed` (it could not be set up: the old layout goes on). Without it, the
      policy's decisions name the new layout's partitions at once, and the runtime dispatches
      nothing until that layout is set up.
    * :meth:`next_wakeup` after that (or after an event when no partition was free):
      the time at which :meth:`decide` must be called again even if nothing else happens (a
      batcher's timeout, the start of a slot). ``None`` = only on events.

    Policies must not mutate the queues; the runtime removes what decisions and drops name.
    """

    #: registry name, e.g. "triton"
    name: ClassVar[str] = ""
    #: True for bounds that cannot run on a GPU (``ideal``)
    simulation_only: ClassVar[bool] = False
    #: True: a layout from :meth:`layout_change` takes effect at :meth:`adopt_layout` (class docstring)
    defers_layout_change: ClassVar[bool] = False
    #: Per model, the requests per second the policy admits where that is less than the model's
    #: demand (dstack: what its plan serves, or what the model delivers on time with ``adapt``).
    #: The service refuses that model's requests beyond it at submission
    #: (``Overloaded``, HTTP 429), which costs the host next to nothing, instead of queueing them to
    #: miss their deadline. Replaced (never mutated) when the plan changes: client threads read it.
    #: Empty: admit everything.
    admit_rps: Mapping[str, float] = {}
    #: True: the runtime keeps each model's queue in deadline order, earliest first (ties in arrival
    #: order), so that the head is the most urgent request even where clients give their own
    #: timeouts; False: in arrival order, as the FIFO batchers the baselines model do (Triton's
    #: dynamic batcher, Clipper). For the policies that drop hopeless heads and size a batch by its
    #: first request's slack (dstack, nexus, ideal: ``scripts/sim_mixed_deadlines.py``).
    deadline_queues: ClassVar[bool] = False
    #: True: the runtime reports what became of each batch's and each drop's requests
    #: (:meth:`on_outcomes`); off by default, as it costs a look at every request's deadline
    wants_outcomes: bool = False

    def carry_over(self, previous: Policy) -> None:
        """Before :meth:`setup`: take from ``previous``, the policy this one replaces on the same host
        and GPU, what it measured that outlives its plan (dstack: the holds and slowdowns it learned).
        Default: nothing."""

    def setup(self, ctx: PolicyContext) -> Layout:
        """Remember ``ctx`` and return the layout to start with."""
        self.ctx = ctx
        if self.simulation_only and not ctx.simulated:
            raise ValueError(f"policy {self.name!r} is a simulation-only bound; it cannot run on a GPU")
        return self.layout(ctx)

    @abstractmethod
    def layout(self, ctx: PolicyContext) -> Layout:
        """The partitions this policy runs on (called by :meth:`setup`)."""

    def on_arrival(self, request: Request, now_ms: float) -> None:
        """A request was queued. Default: nothing."""

    def on_completion(self, completion: Completion, now_ms: float) -> None:
        """A batch finished. Default: nothing."""

    def on_outcomes(self, model: str, on_time: int, missed: int, now_ms: float) -> None:
        """With :attr:`wants_outcomes`: ``on_time`` requests of ``model`` were served by their deadline
        and ``missed`` were served after it or dropped at it (a finished batch, or a ``"deadline"``
        drop). Default: nothing."""

    def on_refused(self, model: str, n: int, now_ms: float) -> None:
        """``n`` requests of ``model`` were refused at submission (:attr:`admit_rps`): they are
        demand all the same. Default: nothing."""

    def on_free(self, partition: int, now_ms: float) -> None:
        """``partition`` takes a batch again although its running batch has not finished: the
        runtime's launch-ahead (the next batch queues behind it on the device). Default: nothing."""

    @abstractmethod
    def decide(self, now_ms: float, queues: Queues, free: Sequence[Partition]) -> list[Action]:
        """Dispatch decisions and drops for ``now_ms`` given the free partitions."""

    def next_wakeup(self, now_ms: float) -> float | None:
        """When :meth:`decide` must run again without an event. Default: never."""
        return None

    def layout_change(self) -> Layout | None:
        """A new layout to switch to (dstack re-planning). Default: never."""
        return None

    def adopt_layout(self, layout: Layout, now_ms: float) -> None:
        """``layout``, proposed by :meth:`layout_change`, is set up: decide for it from now on (only
        with ``defers_layout_change``). Default: nothing."""

    def layout_failed(self, layout: Layout) -> None:
        """``layout``, proposed by :meth:`layout_change`, could not be set up; the current one goes on
        (only with ``defers_layout_change``). Default: nothing."""

    def describe(self) -> dict:
        """Plain-data summary of the policy's configuration, for reports."""
        return {"name": self.name}


# -- registry -----------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make ``cls`` available as ``make_policy(cls.name)``."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a non-empty class attribute `name` to be registered")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise TypeError(f"policy name {cls.name!r} is already taken by {_REGISTRY[cls.name].__name__}")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Registered policy names, in registration order."""
    return list(_REGISTRY)


QUEUE_ORDERS = ("deadline", "arrival")


def make_policy(name: str, **options) -> Policy:
    """A new policy object by registry name; ``options`` go to its constructor.

    One option every policy takes: ``queues="deadline"`` or ``"arrival"`` overrides the order the
    runtime keeps its queues in (:attr:`Policy.deadline_queues`), to measure what the order is worth
    (``gpuloom bench --policy dstack:queues=arrival``).

    >>> make_policy("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown policy 'nope'; known policies: ...
    >>> make_policy("triton", queues="deadline").deadline_queues
    True
    """
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(_REGISTRY)}")
    queues = options.pop("queues", None)
    if queues is not None and queues not in QUEUE_ORDERS:
        raise ValueError(f"policy {name!r}: queues={queues!r}; expected one of {', '.join(QUEUE_ORDERS)}")
    try:
        policy = cls(**options)
    except TypeError as e:
        raise TypeError(f"policy {name!r}: bad options {options}: {e}") from e
    if queues is not None:
        policy.deadline_queues = queues == "deadline"  # an instance attribute: the class keeps its own
    return policy


# -- helpers shared by policies ----------------------------------------------------------------
def slo_batch_cap(profile: Profile, sms: float, budget_ms: float) -> int:
    """Largest profile bucket whose latency on ``sms`` SMs is within ``budget_ms`` (at least 1)."""
    best = profile.batches[0]
    for b in profile.batches:
        if profile.latency(b, sms) <= budget_ms:
            best = b
    return best


def take(queue: "deque[Request]", n: int) -> tuple[int, ...]:
    """Ids of the ``n`` requests at the head of ``queue`` (the oldest; with ``deadline_queues`` the
    most urgent)."""
    n = min(n, len(queue))
    if n == len(queue):
        return tuple(r.id for r in queue)
    return tuple(queue[i].id for i in range(n))


def bucket_for(profile: Profile, n: int) -> int:
    """Batch size ``n`` requests run as (profile bucket; ``n`` capped at the largest bucket first)."""
    return profile.bucket(min(n, profile.max_batch))


def hopeless(queue: "deque[Request]", now_ms: float, min_latency_ms: float) -> tuple[int, ...]:
    """Ids at the head of ``queue`` that cannot finish by their deadline even if started now (for a
    policy with ``deadline_queues``: in arrival order a hopeless request behind a hopeful one stays)."""
    out = []
    for r in queue:
        if now_ms + min_latency_ms > r.deadline_ms:
            out.append(r.id)
        else:
            break  # a policy calling this keeps deadline_queues: the rest are due later
    return tuple(out)
