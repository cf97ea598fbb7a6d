"""Reading the runtime's stats into Prometheus families; the books' invariant."""

from __future__ import annotations

from gpuloom.serve.metrics import Books, _histogram_parts, batches_from_sizes, build_registry, render


def test_batches_are_requests_per_size_divided_by_size():
    assert batches_from_sizes({"1": 5, "4": 8}) == 7.0  # 5 batches of 1, 2 batches of 4
    assert batches_from_sizes({"bounds": [1], "counts": [1, 0]}) is None and batches_from_sizes(None) is None


def test_runtime_histograms_become_cumulative_buckets():
    buckets, total, n = _histogram_parts({"bounds": [1.0, 10.0], "counts": [2, 3, 1], "sum": 40.0, "count": 6})
    assert buckets == [(1.0, 2.0), (10.0, 5.0)] and total == 40.0 and n == 6.0


def test_books_balance_and_exposition_uses_triton_counter_names():
    books = Books()
    for outcome in ("success", "failure", "dropped"):
        books.accept("m")
        books.finish("m", outcome, reason="deadline", rows=2)
    books.accept("m")
    books.reject("m", "overloaded")
    b = books.snapshot()["m"]
    assert b.balanced() and b.in_flight == 1 and b.inferences == 2
    stats = {"models": {"m": {"batch_size": {"2": 4}, "queue_ms": {"bounds": [1.0], "counts": [1, 1], "sum": 3.0, "count": 2},
                              "goodput_rps": 5.0, "slo_attainment": 0.5}},
             "partitions": [{"index": 0, "label": "p0", "sms": 64, "busy_ratio": 0.25}]}
    text = render(build_registry(books, lambda: stats, lambda: ["m"])).decode()
    assert "# TYPE nv_inference_request_success counter" in text
    assert 'nv_inference_request_success{model="m",version="1"} 1.0' in text
    assert 'nv_inference_request_failure{model="m",reason="deadline",version="1"} 1.0' in text
    assert 'nv_inference_exec_count{model="m",version="1"} 2.0' in text
    assert 'nv_inference_queue_duration_us{model="m",version="1"} 3000.0' in text
    assert 'gpuloom_request_rejected{model="m",reason="overloaded"} 1.0' in text
    assert 'gpuloom_partition_sms{partition="p0"} 64.0' in text and 'gpuloom_slo_attainment{model="m"} 0.5' in text


def test_a_failing_stats_call_does_not_break_the_scrape():
    def boom():
        raise RuntimeError("closing")

    assert b"nv_inference_request_success" in render(build_registry(Books(), boom, lambda: []))


def test_the_garbage_collectors_pauses_are_exposed():
    stats = {"models": {}, "gc": {"collections": [120, 11, 2], "total_ms": 345.5, "max_ms": 301.25}}
    text = render(build_registry(Books(), lambda: stats, lambda: [])).decode()
    assert 'gpuloom_gc_collections{generation="2"} 2.0' in text
    assert 'gpuloom_gc_collections{generation="0"} 120.0' in text
    assert "gpuloom_gc_pause_ms 345.5" in text and "gpuloom_gc_pause_max_ms 301.25" in text
    assert "# TYPE gpuloom_gc_collections counter" in text


def test_the_books_keep_when_a_model_last_took_a_request_in_epoch_milliseconds():
    import time

    books = Books()
    before = time.time_ns() // 1_000_000
    books.accept("m")
    after = time.time_ns() // 1_000_000
    assert before <= books.snapshot()["m"].last_inference_ms <= after
