"""Reloading a served model through the repository (``ServeCore.load`` of a loaded name): the old
version serves until the new one is compiled, and a new version that fails leaves it serving
(a review, sixty-ninth session: before, a reload unloaded first, so every reload answered 404 for
the whole compile and one that failed lost the model). CPU, the real service."""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_fake  # noqa: E402

from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.protocol import ProtocolError  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "repository"


@pytest.fixture
def served(tmp_path):
    if not serve_fake.real_service_available():
        pytest.skip("the runtime's InferenceService is not available")
    for f in ("tiny_mlp.yaml", "tiny_mlp.safetensors", "nets.py"):
        shutil.copy(EXAMPLES / f, tmp_path / f)
    service = serve_fake.make_service()
    core = ServeCore(service, load_repository(tmp_path))
    core.load("tiny_mlp")
    yield core, tmp_path / "tiny_mlp.yaml"
    service.close(drain=False)


def _infer(core, x):
    fut, _ = core.submit("tiny_mlp", None, {"x": x}, 30_000.0)
    return fut.result(30)["y"]


def test_a_new_version_that_fails_to_compile_leaves_the_old_one_serving(served):
    core, yaml = served
    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    before = _infer(core, x)
    yaml.write_text(yaml.read_text().replace("shape: [16]", "shape: [17]"))  # the module takes 16 features
    with pytest.raises(ProtocolError) as e:
        core.load("tiny_mlp")
    assert e.value.status == 400 and "tiny_mlp" in str(e.value)
    np.testing.assert_array_equal(_infer(core, x), before)  # still the old version, serving
    assert [m["state"] for m in core.repository_index() if m["name"] == "tiny_mlp"] == ["READY"]


def test_a_reload_refuses_no_request_as_unknown_while_the_new_version_compiles(served):
    core, yaml = served
    x = np.ones((1, 16), np.float32)
    statuses, stop = [], threading.Event()

    def client():
        while not stop.is_set():
            try:
                _infer(core, x)
                statuses.append(200)
            except ProtocolError as e:
                statuses.append(e.status)
            time.sleep(0.002)

    t = threading.Thread(target=client)
    t.start()
    try:
        time.sleep(0.2)
        core.load("tiny_mlp")  # the same entry again: compiled while the old one serves
        time.sleep(0.2)
    finally:
        stop.set()
        t.join(30)
    assert 404 not in statuses and set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) > 10 and statuses[-1] == 200
    b = core.books.snapshot()["tiny_mlp"]
    assert b.balanced() and sum(b.rejected.values()) == statuses.count(503)


def test_a_stop_answers_a_load_under_way_503_at_once_and_refuses_later_ones(tmp_path):
    """A load takes as long as its factory (minutes on a GPU; a hung one forever): a stop used to wait
    for it (a 45 s factory held a SIGTERM 44.6 s), and loads queued behind it ran after the stop had
    begun. Now the stop answers the load's request 503 at once and the load runs on in a daemon
    thread that holds no exit."""
    import http.client
    import json

    from gpuloom.serve.server import Server

    if not serve_fake.real_service_available():
        pytest.skip("the runtime's InferenceService is not available")
    (tmp_path / "slow.py").write_text("import time\nimport torch\n\n\ndef make():\n    time.sleep(20)\n"
                                      "    return torch.nn.Linear(4, 4)\n")
    (tmp_path / "slow.yaml").write_text("name: slow\nsource: slow.py:make\ninputs: [{name: x, shape: [4]}]\n")
    service = serve_fake.make_service()
    core = ServeCore(service, load_repository(tmp_path))
    server = Server(core, http_port=0, grpc_port=None)
    addr = server.start()
    answers = []

    def load():
        c = http.client.HTTPConnection(addr.host, addr.http_port, timeout=60)
        c.request("POST", "/v2/repository/models/slow/load", body=b"{}")
        r = c.getresponse()
        answers.append((r.status, json.loads(r.read())))

    t = threading.Thread(target=load)
    t.start()
    deadline = time.monotonic() + 10
    while not [m for m in core.repository_index() if m["state"] == "LOADING"] and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    server.stop()
    took = time.monotonic() - t0
    t.join(30)
    assert took < 10, took
    assert answers and answers[0][0] == 503 and "shutting down" in answers[0][1]["error"], answers
    with pytest.raises(ProtocolError) as e:
        core.load("slow")
    assert e.value.status == 503


def test_a_model_whose_forward_calls_sys_exit_is_a_load_error_and_the_rest_serve_on(served):
    """The service's own sample run (the YAML declares the outputs) ran ``forward`` outside the
    repository's guard: a ``sys.exit`` there ended the server (a review, sixty-ninth session)."""
    core, yaml = served
    nets = yaml.parent / "nets.py"
    nets.write_text(nets.read_text() + "\n\ndef exits(**kwargs):\n    import sys\n\n    import torch\n\n"
                    "    class Exits(torch.nn.Module):\n        def forward(self, x):\n            sys.exit(3)\n\n"
                    "    return Exits()\n")
    (yaml.parent / "exits.yaml").write_text("name: exits\nsource: nets.py:exits\ninputs: [{name: x, shape: [4]}]\n"
                                            "outputs: [{name: y, shape: [4]}]\n")
    with pytest.raises(ProtocolError) as e:
        core.load("exits")
    assert e.value.status == 400 and "SystemExit" in str(e.value), e.value
    assert _infer(core, np.ones((1, 16), np.float32)).shape == (1, 4)


def test_repository_calls_waiting_at_once_are_bounded_and_past_the_bound_answered_503():
    """A hung load left one blocked thread per later load or unload, each run long after its client
    had gone (a review, sixty-ninth session): at most MAX_ADMIN_THREADS now, then 503 at once."""
    import asyncio

    from gpuloom.serve.core import MAX_ADMIN_THREADS

    core = ServeCore(serve_fake.FakeService())
    release = threading.Event()

    async def main():
        waits = [asyncio.ensure_future(core.in_own_thread(release.wait, 30)) for _ in range(MAX_ADMIN_THREADS)]
        await asyncio.sleep(0.05)
        with pytest.raises(ProtocolError) as e:
            await core.in_own_thread(release.wait, 30)
        release.set()
        assert await asyncio.gather(*waits) == [True] * MAX_ADMIN_THREADS
        return e.value

    refused = asyncio.run(main())
    assert refused.status == 503 and "at most" in str(refused)
    assert asyncio.run(_once(core)) == "done"  # the threads gave their places back


async def _once(core):
    return await core.in_own_thread(lambda: "done")


def test_a_cancelled_wait_for_a_request_already_answered_is_booked_as_answered(monkeypatch):
    """A gRPC handler cancelled after the runtime had answered its request: booked "cancelled" by the
    server and success by the runtime before; now as the runtime booked it."""
    import asyncio

    from gpuloom.serve import core as core_module

    service = serve_fake.FakeService()
    service.start()
    try:
        service.load(*serve_fake.slow_net(0.0))
        core = ServeCore(service)

        async def answered_then_cancelled(fut):
            while not fut.done():
                await asyncio.sleep(0.001)
            raise asyncio.CancelledError

        monkeypatch.setattr(core_module, "until_done", answered_then_cancelled)
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(core.infer("slow", None, {"x": np.ones((1, 4), np.float32)}, None))
        b = core.books.snapshot()["slow"]
        assert (b.success, dict(b.dropped)) == (1, {}) and b.balanced()
    finally:
        service.close()
