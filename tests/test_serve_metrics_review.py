"""Faults of the ``/metrics`` exposition found by a review (sixty-ninth session): the ``_unknown``
pseudo-model shown as a model, ``gpuloom_batch_size`` bounds that moved with the data, the compute
histogram's help saying "per batch", and a Content-Type naming a format the body is not in. Each
runs on ``Books`` and ``build_registry`` with a stub stats function; the route's test serves a stub
core, no runtime."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from gpuloom.serve.metrics import Books, build_registry, render


def _families(books: Books, stats: dict, names: list[str]) -> dict:
    """One scrape, parsed by prometheus-client's own text parser: {family name: Metric}."""
    text = render(build_registry(books, lambda: stats, lambda: names)).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def _bounds(family, model: str) -> list[str]:
    return [s.labels["le"] for s in family.samples if s.name.endswith("_bucket") and s.labels["model"] == model]


def test_the_unknown_pseudo_model_is_only_in_gpuloom_request_rejected():
    """It was in every per-model family (success, failure, count, duration, pending, accepted), at 0."""
    books = Books()
    books.accept("m")
    books.finish("m", "success", rows=1, us=10.0)
    books.reject("_unknown", "unknown_model")
    books.reject("_unknown", "unknown_model")
    fams = _families(books, {"models": {"m": {"batch_size": {"1": 1}}}}, ["m"])
    where = sorted({name for name, f in fams.items() for s in f.samples if s.labels.get("model") == "_unknown"})
    assert where == ["gpuloom_request_rejected"]
    rejected = {(s.labels["model"], s.labels["reason"]): s.value for s in fams["gpuloom_request_rejected"].samples}
    assert rejected == {("_unknown", "unknown_model"): 2.0}
    assert any(s.labels["model"] == "m" for s in fams["nv_inference_request_success"].samples)


def test_batch_size_buckets_stay_the_same_when_a_new_size_is_seen():
    """Its bounds were the sizes seen so far: ``le="4.0"`` appeared mid-run, breaking rate()."""
    sizes = {"1": 3}
    stats = {"models": {"m": {"batch_size": sizes}}}
    before = _families(Books(), stats, ["m"])["gpuloom_batch_size"]
    sizes["4"] = 2  # two requests ran in a batch of 4 rows
    after = _families(Books(), stats, ["m"])["gpuloom_batch_size"]
    assert _bounds(before, "m") == _bounds(after, "m")
    assert _bounds(after, "m")[:4] == ["1.0", "2.0", "4.0", "8.0"] and _bounds(after, "m")[-1] == "+Inf"
    cum = {s.labels["le"]: s.value for s in after.samples if s.name == "gpuloom_batch_size_bucket"}
    assert (cum["1.0"], cum["2.0"], cum["4.0"], cum["+Inf"]) == (3.0, 3.0, 5.0, 5.0)
    totals = {s.name: s.value for s in after.samples if not s.name.endswith("_bucket")}
    assert totals == {"gpuloom_batch_size_count": 5.0, "gpuloom_batch_size_sum": 11.0}


def test_compute_duration_help_says_it_is_per_request_not_per_batch():
    """The runtime observes compute_ms once per successful request (InferenceService._settle)."""
    stats = {"models": {"m": {"compute_ms": {"bounds": [1.0], "counts": [1, 0], "sum": 0.5, "count": 1}}}}
    doc = _families(Books(), stats, ["m"])["gpuloom_compute_duration_ms"].documentation
    assert "per batch" not in doc and "request" in doc


def test_the_metrics_route_declares_the_text_format_0_0_4_its_body_is_written_in():
    """It declared prometheus-client's CONTENT_TYPE_LATEST (1.0.0 since 0.2x) over a 0.0.4 body."""
    from aiohttp.test_utils import TestClient, TestServer
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

    from gpuloom.serve.http_server import build_app

    books = Books()
    books.accept("m")
    books.finish("m", "success", rows=2, us=40.0)
    stats = {"models": {"m": {"batch_size": {"2": 1},
                              "queue_ms": {"bounds": [1.0], "counts": [1, 0], "sum": 0.2, "count": 1}}}}
    core = SimpleNamespace(registry=build_registry(books, lambda: stats, lambda: ["m"]), closing=False,
                           max_body_bytes=1 << 20, max_bodies_bytes=1 << 24, refused=lambda *a: None)

    async def scrape():
        async with TestClient(TestServer(build_app(core))) as client:
            resp = await client.get("/metrics")
            return resp.status, resp.headers["Content-Type"], await resp.text()

    status, content_type, body = asyncio.run(scrape())
    assert status == 200 and content_type == CONTENT_TYPE_PLAIN_0_0_4
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    assert fams["nv_inference_count"].type == "counter" and fams["gpuloom_queue_duration_ms"].type == "histogram"
    assert [s.value for s in fams["nv_inference_count"].samples] == [2.0]


def test_the_repository_index_is_read_off_the_event_loop():
    """It re-reads the repository from disk (300 YAML files: 105 ms a call) on the event loop, where a
    CPU server's runtime loop runs too (a review, sixty-ninth session)."""
    import threading

    from aiohttp.test_utils import TestClient, TestServer

    from gpuloom.serve.http_server import build_app

    threads = []

    def index(ready_only=False):
        threads.append(threading.current_thread())
        return [{"name": "m", "version": "1", "state": "READY"}]

    core = SimpleNamespace(registry=build_registry(Books(), lambda: {}, lambda: []), closing=False,
                           max_body_bytes=1 << 20, max_bodies_bytes=1 << 24, refused=lambda *a: None,
                           repository_index=index)

    async def ask():
        async with TestClient(TestServer(build_app(core))) as client:
            resp = await client.post("/v2/repository/index", data=b"{}")
            return resp.status, await resp.json(), threading.current_thread()

    status, body, loop_thread = asyncio.run(ask())
    assert status == 200 and body == [{"name": "m", "version": "1", "state": "READY"}]
    assert threads and threads[0] is not loop_thread
