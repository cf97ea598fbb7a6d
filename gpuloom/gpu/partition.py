"""Disjoint SM partitions of one GPU, with torch streams confined to them.

``Partitioner(sizes)`` carves the device into disjoint partitions of ``sizes`` SMs with CUDA green
contexts (``mode="green"``), or, on a machine without a GPU, hands out no-op partitions
(``mode="none"``) so the same code runs on CPU. ``mode="auto"`` picks green with a GPU, none
without. For process isolation use ``gpuloom.gpu.mps`` instead.

Why not ``torch.cuda.green_contexts.GreenContext.create(n)``: it splits the *whole* device on every
call, so two of its contexts overlap. Here the device is split once into groups + remainder, and an
uneven layout is carved by making a green context from the remainder, reading its resource back and
splitting again (a split's outputs cannot be recombined into one descriptor on driver 580). The
first split, off the whole device, uses the driver's default (co-scheduled) grouping, as the profiler
does. Splits of a remainder follow ``remainder_split``: ``"cosched"`` (the default grouping) or
``"independent"`` (ignore co-scheduling); ``order="ascending"`` carves the smallest partitions first.
On the H200 cuDNN failed on partitions split off a small remainder (8 SMs off 20 or 12, co-scheduled:
short groups of 6 SMs, or 8 SMs that fail; a remainder split independently ran eagerly but failed
while capturing) and on a 24-SM partition split independently off 84, while every partition split
co-scheduled off 36 SMs or more ran (see ``green.py`` and ``docs/reports/runtime.md``). The runtime
tries the layout as given, then ascending (small partitions off large remainders), then independent.

Confinement follows the *capture* stream: a CUDA graph captured on a partition's stream runs its
kernels on that partition's SMs wherever it is replayed; captured on a normal stream it uses every
SM. So capture per (model, batch, partition), inside ``with partition.use():`` or with
``partition.stream_factory()``.

Example (GPU)::

    with Partitioner([40, 16, 24, 48]) as parts:
        p = parts[0]                    # p.sms == 40, p.stream is a torch stream on those SMs
        g = p.capture_graph(lambda: model(x))
        g.replay()                      # asynchronous, on p.stream

Lifetime: streams and green contexts are destroyed by ``close()`` (or leaving the ``with``), after
synchronizing them. Graphs captured in a partition must be dropped before it is closed; a graph
keeps its model's weights and its inputs alive only if you keep references to them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

from .device import DeviceFacts
from .errors import NoGpuError, PartitionError

# A plan made for an H200 validates the same on CPU: no-op partitions check against these.
#: Partitioner(workqueues=...): the device's hardware workqueues, or each partition its own share
WORKQUEUES = ("shared", "balanced")


def check_workqueues(workqueues: str) -> str:
    """``workqueues`` unchanged, or ValueError unless it is one of :data:`WORKQUEUES`."""
    if workqueues not in WORKQUEUES:
        raise ValueError(f"workqueues: expected one of {WORKQUEUES}, got {workqueues!r}")
    return workqueues


NOMINAL_SM_COUNT = 132
NOMINAL_GRANULARITY = 8


def carve_order(sizes: Sequence[int], granularity: int, order: str = "given") -> list[int]:
    """The indices of ``sizes`` in the order ``Partitioner`` carves them: "given" keeps the layout's
    order, "ascending" takes small partitions first (off the whole device or a large remainder) and
    the largest last, from what is left; either way a size off the granularity takes what is left, so
    it comes last wherever it is in the layout.

    >>> carve_order([36, 24, 24, 16], 8), carve_order([36, 24, 24, 16], 8, "ascending")
    ([1, 2, 3, 0], [3, 1, 2, 0])
    """
    body = [i for i in range(len(sizes)) if sizes[i] % granularity == 0]
    rest = [i for i in range(len(sizes)) if sizes[i] % granularity]
    if order == "ascending":
        body = sorted(body, key=lambda i: sizes[i])
    return body + rest


def validate_layout(sizes: Sequence[int], sm_count: int, granularity: int) -> tuple[int, ...]:
    """Check that ``sizes`` can be carved out of ``sm_count`` SMs; return them as a tuple of ints.

    Each size is a positive multiple of ``granularity``, except that when the sizes add up to the
    whole device *one* of them may be off it: that partition is carved last and takes the SMs left
    over (e.g. 20 = 16 + the 4 left after 128 on a 132-SM device, or 132 alone: the whole device).
    The sizes must not add up to more than the device.

    >>> validate_layout([40, 16, 24, 48], 132, 8)
    (40, 16, 24, 48)
    >>> validate_layout([64, 68], 132, 8)
    (64, 68)
    >>> validate_layout([52, 16, 16, 16, 16, 16], 132, 8)
    (52, 16, 16, 16, 16, 16)
    """
    if isinstance(sizes, (int, str)) or not isinstance(sizes, Sequence):
        raise TypeError(f"partition sizes: expected a sequence of SM counts, got {sizes!r}")
    if not sizes:
        raise PartitionError("partition sizes: expected at least one partition, got none")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"partition sizes: expected integer SM counts, got {s!r} in {list(sizes)}")
        out.append(int(s))
    total = sum(out)
    if total > sm_count:
        raise PartitionError(
            f"partition sizes {out} add up to {total} SMs, more than the device's {sm_count}"
        )
    off = []
    for s in out:
        if s <= 0:
            raise PartitionError(f"partition sizes: expected positive SM counts, got {s} in {out}")
        if s % granularity:
            off.append(s)
    if off and (total != sm_count or len(off) > 1):
        s = off[-1] if total == sm_count else off[0]
        hint = (f"; one partition may take exactly the {sm_count - total + s} SMs left" if total != sm_count
                else f"; only one may be off it (the one that takes the {sm_count % granularity} SMs left over)")
        raise PartitionError(
            f"partition of {s} SMs: sizes must be multiples of {granularity} on this device "
            f"(got {out}{hint})"
        )
    return tuple(out)


class Partition:
    """One partition: its SMs, its streams, and a way to capture graphs confined to it.

    ``sms`` is the SM count the driver reports for the partition's resource (green mode) or the
    requested size (no-op mode, where nothing is confined). ``stream`` is the partition's main
    torch stream (``None`` on CPU).
    """

    def __init__(self, index: int, sms: int, requested: int, mode: str, device: int,
                 ctx: Any = None, owner: "Partitioner | None" = None) -> None:
        self.index = index  # position in the layout
        self.sms = sms  # SMs the driver gave (green) or the requested count (none)
        self.requested = requested  # SMs asked for
        self.mode = mode  # "green" | "none"
        self.device = device  # CUDA ordinal
        self._ctx = ctx  # CUgreenCtx (green mode)
        self._owner = owner
        self._raw_streams: list[Any] = []  # CUstream handles, destroyed on close
        self._streams: list[Any] = []  # torch.cuda.ExternalStream wrappers, same order
        self.closed = False
        if mode == "green":
            self.new_stream()

    @property
    def confined(self) -> bool:
        """True when kernels captured here really run on ``sms`` SMs only."""
        return self.mode == "green"

    @property
    def stream(self) -> Any:
        """The main torch stream of this partition (``None`` in no-op mode)."""
        self._check_open()
        return self._streams[0] if self._streams else None

    def new_stream(self) -> Any:
        """Create another torch stream confined to this partition (destroyed with the partition)."""
        self._check_open()
        if self.mode != "green":
            return None
        import torch

        raw = self._owner._drv.stream(self._ctx)
        s = torch.cuda.ExternalStream(int(raw), device=torch.device("cuda", self.device))
        self._raw_streams.append(raw)
        self._streams.append(s)
        return s

    def stream_factory(self) -> Callable[[], Any]:
        """A callable handing out this partition's streams: the main one first, then more.

        Each factory starts again from the main stream and creates streams only when it needs more
        than exist, so repeated captures (one per batch bucket) reuse the same few streams. Pass it
        to the engine (``cm.capture(stream_factory=...)``) to confine every stream of a multi-stream
        graph to this partition. In no-op mode it returns ``None`` (the caller's default stream).
        """
        counter = [0]

        def factory() -> Any:
            if self.mode != "green":
                return None
            k = counter[0]
            counter[0] += 1
            while len(self._streams) <= k:
                self.new_stream()
            return self._streams[k]

        return factory

    @contextlib.contextmanager
    def use(self) -> Iterator[Any]:
        """Make this partition's main stream current (no-op on CPU); yields the stream."""
        self._check_open()
        if self.mode != "green":
            yield None
            return
        import torch

        with torch.cuda.stream(self.stream):
            yield self.stream

    def capture_graph(self, fn: Callable[[], Any], *, warmup: int = 1, pool: Any = None) -> Any:
        """Capture ``fn()`` into a ``torch.cuda.CUDAGraph`` confined to this partition.

        Runs ``fn`` ``warmup`` times eagerly on the partition's stream first (lazy library
        handles/workspaces), then captures on the same stream. Returns the graph; ``graph.replay()``
        enqueues on the current stream, but its kernels run on this partition's SMs regardless.
        Tensors ``fn`` reads or writes must stay alive as long as the graph.
        """
        self._check_open()
        if self.mode != "green":
            raise NoGpuError("capture_graph: CUDA graphs need a GPU partition (this one is a no-op)")
        import torch

        from ..engine.capture import cublas_workspaces_in_pool

        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(warmup):
                fn()
            g = torch.cuda.CUDAGraph()
            rng = torch.cuda.default_generators[self.device]
            rng_before = rng.clone_state()
            try:
                with cublas_workspaces_in_pool():  # the graph's matmuls' workspaces in its own pool
                    g.capture_begin(pool=pool)
                    try:
                        fn()
                    finally:
                        g.capture_end()
            except BaseException:  # a failed capture leaves the RNG "capturing" (see
                rng.graphsafe_set_state(rng_before)  # engine.capture.rng_restored_if_capture_fails)
                raise
        return g

    def synchronize(self) -> None:
        """Wait for all work queued on this partition's streams."""
        for s in self._streams:
            s.synchronize()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self!r} is closed; its streams and green context are gone")

    def _close(self) -> None:
        if self.closed:
            return
        drv = self._owner._drv if self._owner is not None else None
        if drv is not None:
            for raw in self._raw_streams:
                drv.sync_stream(raw)
            for raw in self._raw_streams:
                drv.destroy_stream(raw)
            if self._ctx is not None:
                drv.destroy(self._ctx)
        self._raw_streams.clear()
        self._streams.clear()
        self._ctx = None
        self.closed = True

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"streams={len(self._streams)}"
        dev = f"cuda:{self.device}" if self.mode == "green" else "cpu"
        return f"Partition(#{self.index}, sms={self.sms}, mode={self.mode}, device={dev}, {state})"


class Partitioner:
    """Carves one device into disjoint SM partitions of the given sizes.

    ``Partitioner([40, 16, 24, 48])`` on an H200 gives four partitions with 40, 16, 24 and 48 SMs;
    index it (``parts[0]``) or iterate. Use it as a context manager or call ``close()``.

    Raises ``PartitionError`` for impossible layouts (sum over the device, a size off the 8-SM
    granularity), ``NoGpuError`` when ``mode="green"`` is asked for without a GPU,
    ``BindingsMissingError`` without ``cuda.bindings``, ``DriverError`` when the driver refuses.

    ``workqueues="balanced"`` creates the partitions with workqueues of their own where the driver
    can (CUDA 13.1+; :meth:`GreenDriver.workqueue_config`), so one partition's work does not queue
    behind another's in a shared hardware queue; each asks for its share of the device's connections
    (``CUDA_DEVICE_MAX_CONNECTIONS``: 8 unless set, at most 32). Where the driver cannot, the
    partitions share the device's workqueues as by default, and ``workqueue_error`` says why.
    """

    MODES = ("auto", "green", "none")
    REMAINDER_SPLITS = ("cosched", "independent")
    ORDERS = ("given", "ascending")

    def __init__(self, sizes: Sequence[int], *, mode: str = "auto", device: int = 0,
                 sm_count: int | None = None, granularity: int | None = None,
                 remainder_split: str = "cosched", order: str = "given", workqueues: str = "shared") -> None:
        if mode not in self.MODES:
            raise ValueError(f"Partitioner mode: expected one of {self.MODES}, got {mode!r}")
        self.workqueues = check_workqueues(workqueues)  # what the partitions got: "shared" (or "mixed") where "balanced" was refused
        self.workqueue_error = ""
        self._wq = None  # the workqueue configuration partitions are created with (None: the default)
        self._balanced = 0  # partitions created with it
        if order not in self.ORDERS:
            raise ValueError(f"Partitioner order: expected one of {self.ORDERS}, got {order!r}")
        self.order = order
        if remainder_split not in self.REMAINDER_SPLITS:
            raise ValueError(f"Partitioner remainder_split: expected one of {self.REMAINDER_SPLITS}, "
                             f"got {remainder_split!r}")
        self.remainder_split = remainder_split
        self.device = device
        self._drv = None
        self._holders: list[Any] = []  # remainder green contexts kept to split further
        self.partitions: list[Partition] = []
        if mode == "auto":
            mode = "green" if _cuda_available() else "none"
        self.mode = mode
        if mode == "none":
            n = sm_count or NOMINAL_SM_COUNT
            g = granularity or NOMINAL_GRANULARITY
            self.sizes = validate_layout(sizes, n, g)
            self.granularity = g
            self.sm_count = n
            self.partitions = [Partition(i, s, s, "none", device) for i, s in enumerate(self.sizes)]
            return
        if not _cuda_available():
            raise NoGpuError("Partitioner(mode='green') needs a CUDA GPU; torch.cuda.is_available() is False. "
                             "Use mode='none' (or 'auto') for no-op partitions on CPU.")
        from .device import device_facts

        facts: DeviceFacts = device_facts(device)
        self.facts = facts
        self.sm_count = facts.sm_count
        self.granularity = granularity or facts.sm_granularity
        self.sizes = validate_layout(sizes, facts.sm_count, self.granularity)
        import torch

        torch.cuda.init()
        torch.cuda.current_stream(device)  # the primary context must exist before green contexts
        from .green import GreenDriver

        self._drv = GreenDriver(device)
        if workqueues == "balanced":
            self._wq = self._balanced_workqueues()
        try:
            self._carve()
        except BaseException:
            self.close()
            raise

    def _balanced_workqueues(self) -> Any:
        """The driver's balanced workqueue configuration, or None (shared, the reason kept) where it has none."""
        from .errors import DriverError

        try:
            return self._drv.workqueue_config("balanced", share=len(self.sizes))
        except DriverError as e:
            self.workqueues, self.workqueue_error = "shared", str(e)
            return None

    def _create_partition(self, res: Any) -> Any:
        """A partition's green context, with the balanced workqueues if asked for and the driver takes
        them (else, from then on, as by default: ``workqueues`` says "shared", or "mixed" when earlier
        partitions got them)."""
        if self._wq is not None:
            from .errors import DriverError

            try:
                ctx = self._drv.create(res, self._wq)
                self._balanced += 1
                return ctx
            except DriverError as e:
                self._wq, self.workqueue_error = None, str(e)
                self.workqueues = "mixed" if self._balanced else "shared"
        return self._drv.create(res)

    def _carve(self) -> None:
        drv, sizes = self._drv, self.sizes
        order = carve_order(sizes, self.granularity, self.order)
        made: dict[int, Any] = {}  # layout index -> green context, made into partitions in layout order
        try:
            self._carve_into(made, order)
            for i in range(len(sizes)):
                self._add(made.pop(i), sizes[i])
        except BaseException:
            for ctx in made.values():  # not partitions yet: close() would not see them
                try:
                    drv.destroy(ctx)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    pass
            raise

    def _carve_into(self, made: dict[int, Any], order: list[int]) -> None:
        drv, sizes = self._drv, self.sizes
        res = drv.device_resource()
        flags = 0  # the whole device: default, co-scheduled groups
        j = 0
        while j < len(order):
            s = sizes[order[j]]
            avail = int(res.sm.smCount)
            last = j == len(order) - 1
            if s == avail or (last and self.order == "ascending" and avail - s < self.granularity):
                # the whole of what is left (ascending: the largest takes the few SMs a split would leave)
                made[order[j]] = self._create_partition(res)
                j += 1
                continue
            k = 1
            while j + k < len(order) and sizes[order[j + k]] == s:
                k += 1
            groups, rem = drv.split(res, k, s, flags)
            if not groups:
                raise PartitionError(f"the driver could not split {s} SMs off {avail} (layout {list(sizes)})")
            for g in groups:
                made[order[j]] = self._create_partition(g)
                j += 1
            if j < len(order):
                holder = drv.create(rem)  # only held to split further: no workqueues of its own
                self._holders.append(holder)
                res = drv.resource_of(holder)
                if self.remainder_split == "independent":
                    flags = drv.IGNORE_COSCHEDULING

    def _add(self, ctx: Any, requested: int) -> None:
        sms = self._drv.sm_count_of(ctx)
        p = Partition(len(self.partitions), sms, requested, "green", self.device, ctx=ctx, owner=self)
        self.partitions.append(p)

    def close(self) -> None:
        """Synchronize and destroy every stream and green context (idempotent)."""
        errors = []
        for p in self.partitions:
            try:
                p._close()
            except Exception as e:  # noqa: BLE001 - keep closing the rest, then report
                errors.append(e)
        if self._drv is not None:
            for h in self._holders:
                try:
                    self._drv.destroy(h)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)
        self._holders.clear()
        if errors:
            raise errors[0]

    def __enter__(self) -> "Partitioner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getitem__(self, i: int) -> Partition:
        return self.partitions[i]

    def __iter__(self) -> Iterator[Partition]:
        return iter(self.partitions)

    def __len__(self) -> int:
        return len(self.partitions)

    def __repr__(self) -> str:
        dev = f"cuda:{self.device}" if self.mode == "green" else "cpu"
        return f"Partitioner(mode={self.mode}, device={dev}, sms={[p.sms for p in self.partitions]})"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())
