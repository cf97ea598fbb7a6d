"""Server-side books and the ``/metrics`` Prometheus exposition.

:class:`Books` counts every request the server saw, per model, by outcome. The invariant the tests check::

    accepted == success + failure + dropped        (once nothing is in flight)

``rejected`` requests (refused before the runtime took them: bad input, overload, not ready) are never
accepted. The Prometheus registry is per server (no global state), with Triton's ``nv_inference_*``
names where Triton has one and ``gpuloom_*`` for the rest. Latency histograms, batch sizes, goodput,
SLO attainment and partitions come from the runtime's ``InferenceService.stats()`` at scrape time, so
the server never keeps a second copy of what the runtime measures.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

from ..runtime.model_config import MAX_BATCH

__all__ = ["BATCH_SIZE_BOUNDS", "CONTENT_TYPE", "UNKNOWN_MODEL", "Books", "ModelBooks", "build_registry", "render"]

#: the pseudo-model under which refusals for a model not served are booked (``ServeCore.refused``,
#: ``ServeCore.submit``), so that client-chosen names never become labels; it has rejections only, so
#: it appears in ``gpuloom_request_rejected`` and in no other family (a review, sixty-ninth session: it
#: showed as a model with 0 successes, failures, inferences and pending requests)
UNKNOWN_MODEL = "_unknown"
#: upper bounds of ``gpuloom_batch_size``'s buckets (rows): powers of two up to the largest max_batch a
#: model may have. Fixed, because rate() and histogram_quantile() need the same ``le`` set in every
#: scrape; they were the sizes seen so far, and a new ``le="4.0"`` appeared mid-run (a review,
#: sixty-ninth session). The registry is not told a model's max_batch, hence one ladder for all.
BATCH_SIZE_BOUNDS = tuple(float(2**i) for i in range(MAX_BATCH.bit_length()))
#: the media type of :func:`render`'s text: Prometheus text format 0.0.4 (``CONTENT_TYPE_LATEST`` of
#: prometheus-client 0.2x is 1.0.0, which the body is not written in)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class ModelBooks:
    accepted: int = 0  # requests the runtime took (submit returned a future)
    in_flight: int = 0
    success: int = 0
    failure: int = 0  # the model raised (ModelFailed) or another runtime error
    dropped: Counter = field(default_factory=Counter)  # reason -> n (deadline, shutdown, overload, ...)
    # reason -> n: invalid_request (not parsed), too_large, invalid_input (not the model's tensors),
    # unknown_model (under "_unknown"), not_ready, overloaded, shed, shutting_down
    rejected: Counter = field(default_factory=Counter)
    inferences: int = 0  # samples (rows) served successfully
    request_us: float = 0.0  # summed end-to-end time of successful requests, microseconds
    last_inference_ms: int = 0  # when the last request was accepted, ms since the epoch (Triton's last_inference)

    def balanced(self) -> bool:
        return self.accepted == self.success + self.failure + sum(self.dropped.values()) + self.in_flight

    def as_dict(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "in_flight": self.in_flight,
            "success": self.success,
            "failure": self.failure,
            "dropped": dict(self.dropped),
            "rejected": dict(self.rejected),
            "inferences": self.inferences,
        }


class Books:
    """Thread-safe per-model outcome counts (the HTTP and gRPC front ends share one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._models: dict[str, ModelBooks] = defaultdict(ModelBooks)

    def reject(self, model: str, reason: str) -> None:
        with self._lock:
            self._models[model].rejected[reason] += 1

    def accept(self, model: str) -> None:
        with self._lock:
            b = self._models[model]
            b.accepted += 1
            b.in_flight += 1
            b.last_inference_ms = time.time_ns() // 1_000_000

    def finish(self, model: str, outcome: str, *, reason: str = "", rows: int = 0, us: float = 0.0) -> None:
        """outcome: 'success' | 'failure' | 'dropped' (with reason)."""
        with self._lock:
            b = self._models[model]
            b.in_flight -= 1
            if outcome == "success":
                b.success += 1
                b.inferences += rows
                b.request_us += us
            elif outcome == "failure":
                b.failure += 1
            else:
                b.dropped[reason or "unknown"] += 1

    def snapshot(self) -> dict[str, ModelBooks]:
        with self._lock:
            return {
                k: ModelBooks(v.accepted, v.in_flight, v.success, v.failure, Counter(v.dropped), Counter(v.rejected),
                              v.inferences, v.request_us, v.last_inference_ms)
                for k, v in self._models.items()
            }

    def in_flight(self) -> int:
        with self._lock:
            return sum(b.in_flight for b in self._models.values())


def _num(d: Any, *keys: str, default: float | None = None) -> float | None:
    """The first numeric value among ``keys`` of mapping ``d`` (the runtime's stats are read leniently)."""
    if not isinstance(d, dict):
        return default
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return default


def _histogram_parts(h: Any) -> tuple[list[tuple[float, float]], float, float] | None:
    """A runtime histogram -> (cumulative [(le, count)], sum, count).

    Accepts the runtime's ``{"bounds": [...], "counts": [... one more for +inf], "sum", "count"}``, a
    value -> count mapping (batch sizes: ``{"1": 40, "8": 3}``), or a plain list of observations.
    """
    if isinstance(h, (list, tuple)) and all(isinstance(x, (int, float)) for x in h):
        obs = sorted(float(x) for x in h)
        bounds = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000]
        return [(b, float(sum(1 for x in obs if x <= b))) for b in bounds], float(sum(obs)), float(len(obs))
    if not isinstance(h, dict):
        return None
    if isinstance(h.get("bounds"), list) and isinstance(h.get("counts"), list):
        acc, cum = 0.0, []
        for le, c in zip(h["bounds"], h["counts"]):
            acc += float(c)
            cum.append((float(le), acc))
        total_n = float(h.get("count", sum(h["counts"])))
        return cum, float(h.get("sum", 0.0)), total_n
    try:
        items = sorted((float(k), float(v)) for k, v in h.items())
    except (TypeError, ValueError):
        return None
    acc, cum, total = 0.0, [], 0.0
    for value, n in items:
        acc += n
        total += value * n
        cum.append((value, acc))
    return cum, total, acc


def _batch_size_parts(sizes: Any) -> tuple[list[tuple[float, float]], float, float] | None:
    """The runtime's ``batch_size`` map (rows of a batch -> requests that ran in one of that size) ->
    (cumulative [(le, count)] over :data:`BATCH_SIZE_BOUNDS`, sum, count). The bounds never depend on
    the data (see there); a runtime histogram or a list of observations is read as
    :func:`_histogram_parts` reads it, whose bounds are fixed already."""
    if not isinstance(sizes, dict) or "bounds" in sizes:
        return _histogram_parts(sizes)
    try:
        items = [(float(k), float(v)) for k, v in sizes.items()]
    except (TypeError, ValueError):
        return None
    cum = [(le, sum(n for size, n in items if size <= le)) for le in BATCH_SIZE_BOUNDS]
    return cum, sum(size * n for size, n in items), sum(n for _, n in items)


def batches_from_sizes(sizes: Any) -> float | None:
    """Batches executed, from the runtime's ``batch_size`` map (size -> requests that ran in a batch of
    that size): a batch of size k holds k single-row requests, so batches = sum(n_k / k)."""
    if not isinstance(sizes, dict) or "bounds" in sizes:
        return None
    total = 0.0
    for k, v in sizes.items():
        try:
            total += float(v) / max(1.0, float(k))
        except (TypeError, ValueError):
            return None
    return float(round(total))


def build_registry(books: Books, stats: Callable[[], dict], model_names: Callable[[], list[str]]):
    """A fresh prometheus CollectorRegistry exposing ``books`` and ``stats()`` at scrape time."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

    class CounterMetricFamily(Metric):
        """A counter exposed under its exact name (Triton's ``nv_inference_*`` have no ``_total`` suffix)."""

        def __init__(self, name: str, documentation: str, labels: list[str]):
            super().__init__(name, documentation, "counter")
            self._labels = labels

        def add_metric(self, values: list[str], value: float) -> None:
            self.add_sample(self.name, dict(zip(self._labels, values)), float(value))

    class _Collector:
        def collect(self):
            snap = books.snapshot()
            try:
                st = stats() or {}
            except Exception:  # a scrape must never fail because the runtime is shutting down
                st = {}
            st_models = st.get("models", {}) if isinstance(st.get("models"), dict) else {}
            names = sorted((set(snap) | set(model_names()) | set(st_models)) - {UNKNOWN_MODEL})
            succ = CounterMetricFamily("nv_inference_request_success", "Number of successful inference requests", labels=["model", "version"])
            fail = CounterMetricFamily("nv_inference_request_failure", "Number of failed inference requests (model errors, drops, timeouts)", labels=["model", "version", "reason"])
            count = CounterMetricFamily("nv_inference_count", "Number of inferences performed (samples, not requests)", labels=["model", "version"])
            execc = CounterMetricFamily("nv_inference_exec_count", "Number of model executions (batches) performed", labels=["model", "version"])
            req_us = CounterMetricFamily("nv_inference_request_duration_us", "Cumulative end-to-end time of successful requests, microseconds", labels=["model", "version"])
            q_us = CounterMetricFamily("nv_inference_queue_duration_us", "Cumulative time requests waited in queue, microseconds", labels=["model", "version"])
            c_us = CounterMetricFamily("nv_inference_compute_infer_duration_us", "Cumulative compute time, microseconds", labels=["model", "version"])
            pend = GaugeMetricFamily("nv_inference_pending_request_count", "Requests accepted and not yet answered", labels=["model", "version"])
            acc = CounterMetricFamily("gpuloom_request_accepted", "Requests the runtime accepted (success + failure + dropped + pending)", labels=["model"])
            drop = CounterMetricFamily("gpuloom_request_dropped", "Accepted requests answered without a result, by reason", labels=["model", "reason"])
            rej = CounterMetricFamily("gpuloom_request_rejected", "Requests refused before the runtime took them, by reason", labels=["model", "reason"])
            good = GaugeMetricFamily("gpuloom_goodput", "Requests per second served within their deadline", labels=["model"])
            slo = GaugeMetricFamily("gpuloom_slo_attainment", "Fraction of the requests offered (answered, or refused for overload) served within their deadline", labels=["model"])
            # observed once per successful request, the largest over its rows (InferenceService._book_row)
            qh = HistogramMetricFamily("gpuloom_queue_duration_ms", "Time each successful request waited "
                                       "before its batch started, ms (its longest-waiting row)", labels=["model"])
            ch = HistogramMetricFamily("gpuloom_compute_duration_ms", "Compute time of each successful request, "
                                       "ms: the run of the batch it was in (the longest, if its rows were in "
                                       "several)", labels=["model"])
            bh = HistogramMetricFamily("gpuloom_batch_size", "Rows in the batch each successful request ran "
                                       "in (the largest, if its rows were in several)", labels=["model"])
            for m in names:
                b = snap.get(m)
                sm = st_models.get(m, {}) if isinstance(st_models.get(m), dict) else {}
                if b is not None:
                    succ.add_metric([m, "1"], b.success)
                    fail.add_metric([m, "1", "model_error"], b.failure)
                    for r, n in b.dropped.items():
                        fail.add_metric([m, "1", r], n)
                        drop.add_metric([m, r], n)
                    for r, n in b.rejected.items():
                        rej.add_metric([m, r], n)
                    count.add_metric([m, "1"], b.inferences)
                    req_us.add_metric([m, "1"], b.request_us)
                    acc.add_metric([m], b.accepted)
                    pend.add_metric([m, "1"], b.in_flight)
                batch_hist = sm.get("batch_size", sm.get("batch_sizes"))
                ex = _num(sm, "exec_count", "batches")
                if ex is None:
                    ex = batches_from_sizes(batch_hist)
                if ex is not None:
                    execc.add_metric([m, "1"], ex)
                for fam, key, hist in ((q_us, "queue_ms", qh), (c_us, "compute_ms", ch)):
                    parts = _histogram_parts(sm.get(key))
                    if parts is not None:
                        buckets, total, n = parts
                        fam.add_metric([m, "1"], total * 1000.0)
                        hist.add_metric([m], [(str(le), c) for le, c in buckets] + [("+Inf", n)], total)
                bparts = _batch_size_parts(batch_hist)
                if bparts is not None:
                    buckets, total, n = bparts
                    bh.add_metric([m], [(str(le), c) for le, c in buckets] + [("+Inf", n)], total)
                g = _num(sm, "goodput", "goodput_rps")
                if g is not None:
                    good.add_metric([m], g)
                a = _num(sm, "slo_attainment", "attainment")
                if a is not None:
                    slo.add_metric([m], a)
            if UNKNOWN_MODEL in snap:  # not a model: its refusals alone (see UNKNOWN_MODEL)
                for r, n in snap[UNKNOWN_MODEL].rejected.items():
                    rej.add_metric([UNKNOWN_MODEL, r], n)
            yield from (succ, fail, count, execc, req_us, q_us, c_us, pend, acc, drop, rej, good, slo, qh, ch, bh)
            sms = GaugeMetricFamily("gpuloom_partition_sms", "SMs in each partition", labels=["partition"])
            busy = GaugeMetricFamily("gpuloom_partition_busy_ratio", "Fraction of time each partition was busy", labels=["partition"])
            parts = st.get("partitions", {})
            items = parts.items() if isinstance(parts, dict) else enumerate(parts if isinstance(parts, list) else [])
            for pid, p in items:
                if isinstance(p, dict):
                    pid = str(p.get("label") or p.get("id", p.get("index", pid)))
                v = _num(p, "sms")
                if v is not None:
                    sms.add_metric([pid], v)
                v = _num(p, "busy_ratio")
                if v is not None:
                    busy.add_metric([pid], v)
            yield sms
            yield busy
            gc_stats = st.get("gc")
            if isinstance(gc_stats, dict):  # the runtime process's collector pauses (runtime.gcpause.GcMonitor)
                runs = CounterMetricFamily("gpuloom_gc_collections", "Garbage-collector runs in the runtime's "
                                           "process, by generation (2: a full one, which stops every thread)",
                                           labels=["generation"])
                for gen, n in enumerate(gc_stats.get("collections", [])):
                    runs.add_metric([str(gen)], n)
                paused = CounterMetricFamily("gpuloom_gc_pause_ms", "Cumulative time the garbage collector "
                                             "stopped the runtime's process, ms", labels=[])
                paused.add_metric([], gc_stats.get("total_ms", 0.0))
                yield runs
                yield paused
                yield GaugeMetricFamily("gpuloom_gc_pause_max_ms", "Longest garbage-collector pause so far, ms",
                                        value=gc_stats.get("max_ms", 0.0))

    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Collector())
    return reg


def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def render(registry) -> bytes:
    """Prometheus text format 0.0.4 (served as :data:`CONTENT_TYPE`), with counter names as given
    (prometheus-client's own writer would append ``_total`` to the TYPE line, which Triton's
    ``nv_inference_*`` counters do not have)."""
    from prometheus_client.utils import floatToGoString

    lines: list[str] = []
    for metric in registry.collect():
        mtype = {"unknown": "untyped"}.get(metric.type, metric.type)
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        lines.append(f"# HELP {metric.name} {doc}")
        lines.append(f"# TYPE {metric.name} {mtype}")
        for s in metric.samples:
            labels = ",".join(f'{k}="{_escape(str(v))}"' for k, v in sorted(s.labels.items()))
            lines.append(f"{s.name}{{{labels}}} {floatToGoString(s.value)}" if labels else f"{s.name} {floatToGoString(s.value)}")
    return ("\n".join(lines) + "\n").encode()
