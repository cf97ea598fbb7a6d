"""The books' outcomes where the server and the runtime used to disagree (a review of the metrics,
sixty-ninth session): SLO attainment over the requests offered, a cancelled request that ran, the
reason of a request the service expired, and the label of a request refused at a stop."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_fake  # noqa: E402

from gpuloom.runtime.host_device import FakeDeviceLayer, FakeModel  # noqa: E402
from gpuloom.runtime.service import Expired, InferenceService, ModelConfig, Overloaded, TensorSpec  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.protocol import ProtocolError  # noqa: E402

X4 = (TensorSpec("x", (4,), "float32"),)
Y4 = (TensorSpec("y", (4,), "float32"),)


def test_slo_attainment_counts_the_requests_refused_for_overload():
    """It was on time over answered: 1.0 while most requests were refused 429."""
    svc = InferenceService(policy="triton", device_layer=FakeDeviceLayer(), queue_limit=2)
    svc.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            svc.load(ModelConfig("slow", X4, Y4, max_batch=1, slo_ms=5000), FakeModel(lambda xs: [xs[0]], 50.0))
        futs, refused = [], 0
        for _ in range(10):
            try:
                futs.append(svc.submit("slow", {"x": np.ones((1, 4), np.float32)}))
            except Overloaded:
                refused += 1
        for f in futs:
            f.result(10)
        st = svc.stats()["models"]["slow"]
        assert refused > 0 and st["rejected"] == refused and st["on_time"] == len(futs)
        assert st["slo_attainment"] == pytest.approx(len(futs) / 10)
    finally:
        svc.close()


@pytest.fixture
def core():
    service = serve_fake.FakeService()
    service.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        service.load(*serve_fake.slow_net(0.0))
    yield ServeCore(service)
    service.close()


def test_a_request_the_service_expired_is_booked_expired_not_deadline(core):
    with pytest.raises(ProtocolError) as e:
        core.settle("slow", None, Expired("not answered within 5 s of its deadline"), time.perf_counter(), 1)
    assert e.value.status == 504
    assert dict(core.books.snapshot()["slow"].dropped) == {"expired": 1}


def test_a_request_refused_at_a_stop_is_booked_under_its_model_only_where_one_is_served(core):
    core.closing = True
    for name in ("slow", "no-such-model-1", "no-such-model-2"):
        with pytest.raises(ProtocolError) as e:
            core.submit(name, None, {"x": np.ones((1, 4), np.float32)}, None)
        assert e.value.status == 503
    books = core.books.snapshot()
    assert sorted(books) == ["_unknown", "slow"]  # (client-chosen names made labels before)
    assert dict(books["_unknown"].rejected) == {"shutting_down": 2} and dict(books["slow"].rejected) == {"shutting_down": 1}
