"""The shared-memory arena between HTTP front-end workers and the runtime's process. CPU only."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402

from gpuloom.serve import arena, ring  # noqa: E402
from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402

pytestmark = pytest.mark.skipif(not arena.supported(), reason="no memfd_create on this platform")
REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"


def test_first_fit_allocation_reuses_and_coalesces_freed_blocks():
    a = arena.Arena(1 << 12)  # 4096 bytes = 64 blocks of 64
    try:
        x = a.alloc(100)  # rounds up to 128
        y = a.alloc(1000)  # 1024
        z = a.alloc(64)
        assert (x, y, z) == (0, 128, 1152) and a.in_use == 128 + 1024 + 64
        assert a.alloc(4096) is None  # bigger than what is free: the caller sends inline
        a.free(y)
        assert a.alloc(900) == 128  # first fit takes the freed block's start
        a.free(128)
        a.free(x)
        a.free(z)  # everything free again merges into one range
        assert a.in_use == 0 and a.alloc(4096) == 0
        with pytest.raises(KeyError):
            a.free(64)  # never allocated
    finally:
        a.close()


def test_the_runtime_side_sees_what_the_worker_wrote():
    import os

    a = arena.Arena(1 << 16)
    try:
        off = a.alloc(12)
        a.view(off, 12)[:] = np.arange(3, dtype="<f4").tobytes()
        mapped = arena.attach(os.dup(a.fd), a.size)
        got = np.frombuffer(memoryview(mapped)[off:off + 12], dtype="<f4")
        np.testing.assert_array_equal(got, [0, 1, 2])
        with pytest.raises(ValueError, match="bytes"):
            arena.attach(os.dup(a.fd), a.size * 2)  # the worker claimed more than there is
    finally:
        a.close()


def _infer(url: str, x: np.ndarray, deadline_ms: float | None = None, binary: bool = False) -> np.ndarray:
    """``binary``: the tensor as binary data after the JSON (``Inference-Header-Content-Length``), else
    as JSON numbers."""
    if binary:
        head = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "parameters": {"binary_data_size": x.nbytes}}]}).encode()
        body = head + x.astype("<f4").tobytes()
        headers = {"Content-Type": "application/octet-stream", "Inference-Header-Content-Length": str(len(head))}
    else:
        body = json.dumps({"inputs": [{"name": "x", "shape": list(x.shape), "datatype": "FP32",
                                       "data": x.ravel().tolist()}]}).encode()
        headers = {"Content-Type": "application/json"}
    if deadline_ms is not None:
        headers["X-Gpuloom-Deadline-Ms"] = str(deadline_ms)
    req = urllib.request.Request(f"http://{url}/v2/models/tiny_mlp/infer", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=30) as r:
        out = json.loads(r.read())["outputs"][0]
    return np.asarray(out["data"], np.float32).reshape(out["shape"])


@pytest.fixture
def slow_safety_net(monkeypatch):
    """The drain thread takes a ring request only after it waited through two looks: 2 s apart here,
    so on a busy test machine the loop, not the drain thread, takes every request while it runs."""
    from gpuloom.serve import bridge as bridge_mod

    monkeypatch.setattr(bridge_mod, "_SAFETY_S", 2.0)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("arena_mb, ring_kb", [("16", 8192), ("16", 0), ("0", 8192)], ids=["rings", "arena", "inline"])
def test_requests_through_the_arena_or_inline_give_eager_outputs(arena_mb, ring_kb, binary, slow_safety_net):
    """Tensors as JSON numbers and as binary data (``Inference-Header-Content-Length``) alike."""
    import torch

    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=int(arena_mb),
                    worker_ring_kb=ring_kb)
    addr = server.start()
    try:
        module = repo.models["tiny_mlp"].build()[1]
        rng = np.random.default_rng(1)
        for n in (1, 3, 16, 2, 7) * 4:  # blocks of different sizes, freed and reused
            x = rng.standard_normal((n, 16)).astype(np.float32)
            with torch.no_grad():
                want = module(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(_infer(addr.http_url, x, binary=binary), want, rtol=1e-5, atol=1e-6)
        bridge = server._bridge
        if arena_mb == "0":  # no arena: no rings either (a ring frame carries no tensors)
            assert bridge.arena_requests == 0 and bridge.inline_requests == 20 and bridge.ring_requests == 0
        else:
            assert bridge.arena_requests == 20 and bridge.inline_requests == 0
            rings = ring_kb and ring.supported()
            assert (bridge.ring_requests, bridge.ring_replies) == ((20, 20) if rings else (0, 0))
            # the service's loop takes them (a drain thread only while the loop does not run)
            assert bridge.loop_requests == (20 if rings else 0)
    finally:
        server.stop()


def test_concurrent_requests_each_get_the_output_of_their_own_input(monkeypatch):
    """Blocks are reused only after their request's reply: 200 overlapping requests with distinct
    inputs through one worker's arena each get their own eager output back."""
    monkeypatch.setenv("GPULOOM_WORKER_ARENA_MB", "1")  # small, so blocks are reused many times over (the
    # workers read the variable at start: the default when Server(worker_arena_mb=...) is not given)
    monkeypatch.setenv("GPULOOM_WORKER_RING_KB", "16")  # rings of 4 and 12 KiB: frames of ~300 B wrap
    # around them many times (a request that finds the request ring full goes over the socket)
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1)
    addr = server.start()
    try:
        module = repo.models["tiny_mlp"].build()[1]
        xs = [np.full((1 + i % 16, 16), i, np.float32) for i in range(200)]
        _each_gets_its_own_output(addr.http_url, module, xs, clients=16)
        bridge = server._bridge
        assert bridge.arena_requests == 200
        if ring.supported():  # over 20 frames of ~300 B through a 4 KiB ring: it wrapped around
            assert bridge.ring_requests > 20 and bridge.ring_replies > 20
    finally:
        server.stop()


def _each_gets_its_own_output(url: str, module, xs: list[np.ndarray], clients: int) -> None:
    """``xs`` sent by ``clients`` threads at once: each answer is eager's output of its own input.
    What is tested is whose output comes back, not latency: a deadline far from the model's 50 ms
    SLO, which 16 clients at once overran on a slow 2-core VM (a 504, eleventh session)."""
    from concurrent.futures import ThreadPoolExecutor

    import torch

    with ThreadPoolExecutor(clients) as pool:
        outs = list(pool.map(lambda x: _infer(url, x, deadline_ms=10_000), xs))
    for x, got in zip(xs, outs):
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not ring.supported(), reason="the intake window is the rings' (x86-64 Linux)")
def test_with_an_intake_window_overlapping_requests_go_in_bursts_and_each_gets_its_own_output(slow_safety_net):
    """``intake_window_ms``: the runtime's loop takes the workers' requests at most once per window,
    so requests that overlap go in together (fewer takes than requests) and the workers, told the
    loop looks anyway, skip its wake-ups meanwhile; every answer is still its own request's."""
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=2, intake_window_ms=5.0)
    addr = server.start()
    try:
        module = repo.models["tiny_mlp"].build()[1]
        xs = [np.full((1 + i % 4, 16), i, np.float32) for i in range(120)]
        _each_gets_its_own_output(addr.http_url, module, xs, clients=12)
        bridge = server._bridge
        if service._waker.share_fd is not None:  # the loop takes them (else drain threads do, no window)
            assert bridge.loop_requests == 120 and bridge.loop_takes < 100, (bridge.loop_takes, bridge.loop_requests)
            assert bridge.loop_deferred > 0
    finally:
        server.stop()


class _PinningCpuLayer:
    """A CPU device layer that stages rows (as CUDA does) and can "page-lock" host memory: shows
    which requests were copied at submit and which were launched from the worker's arena."""

    @staticmethod
    def make():
        from gpuloom.runtime.host_device import CpuDeviceLayer

        class Layer(CpuDeviceLayer):
            stages = True

            def __init__(self):
                super().__init__()
                self.staged_rows = 0
                self.registered: list[int] = []
                self.unregistered: list[int] = []

            def stage(self, row):
                self.staged_rows += 1
                return [np.array(a, copy=True) for a in row]

            def register_host(self, address, nbytes):
                self.registered.append(address)
                self._add_pinned(address, nbytes)
                return True

            def unregister_host(self, address):
                self.unregistered.append(address)
                self._drop_pinned(address)

        return Layer()


def test_a_page_locked_arena_sends_rows_to_the_device_without_a_copy_and_is_unlocked_at_the_end():
    import torch

    from gpuloom.runtime.service import InferenceService

    repo = load_repository(REPO / "tiny_mlp.yaml")
    layer = _PinningCpuLayer.make()
    service = InferenceService(policy="dstack", device_layer=layer)
    service.start()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=16)
    addr = server.start()
    try:
        module = repo.models["tiny_mlp"].build()[1]
        rng = np.random.default_rng(2)
        for n in (1, 4, 2, 7):
            x = rng.standard_normal((n, 16)).astype(np.float32)
            with torch.no_grad():
                want = module(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(_infer(addr.http_url, x), want, rtol=1e-5, atol=1e-6)
        assert len(layer.registered) == 1 and server._bridge.pinned_arenas == 1
        assert layer.staged_rows == 0  # every row went to the device from the arena itself
        x = rng.standard_normal((3, 16)).astype(np.float32)  # a request from elsewhere is still copied
        service.infer("tiny_mlp", {"x": x}, timeout_s=30)
        assert layer.staged_rows == 3
    finally:
        server.stop()
        service.close()
    assert layer.unregistered == layer.registered and not layer._pinned


def test_is_pinned_needs_every_array_wholly_inside_one_registered_span():
    from gpuloom.runtime.host_device import FakeDeviceLayer

    layer = FakeDeviceLayer()
    buf = np.zeros(1024, np.uint8)
    base = buf.__array_interface__["data"][0]
    assert not layer.is_pinned([buf[:10]])
    layer._add_pinned(base + 64, 512)
    assert layer.is_pinned([buf[64:576], buf[100:200]])
    assert not layer.is_pinned([buf[64:577]])  # runs past the end
    assert not layer.is_pinned([buf[63:100]])  # starts before
    assert not layer.is_pinned([buf[100:200], buf[600:700]])  # one in, one out
    layer._drop_pinned(base + 64)
    assert not layer.is_pinned([buf[100:200]])


def test_front_end_workers_run_on_the_cpus_they_are_given_and_still_serve():
    """``Server(worker_cpus=...)`` (``gpuloom serve --cpus`` gives the workers the CPUs the runtime's
    process does not use): the worker processes are pinned there, not on their parent's CPUs."""
    import os

    cpu = max(os.sched_getaffinity(0))
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_cpus={cpu})
    addr = server.start()
    try:
        (worker,) = server._workers
        assert os.sched_getaffinity(worker.pid) == {cpu}
        assert _infer(addr.http_url, np.ones((2, 16), np.float32)).shape == (2, 4)
    finally:
        server.stop()


def test_memory_from_pinned_empty_stays_known_while_any_array_onto_it_lives():
    """The CUDA layer's ``pinned_empty`` returns ``tensor.numpy()``; the span must outlive the
    tensor's Python object (the array keeps the memory through its own alias of the tensor) and
    go once the array and its views are gone. Tied to the tensor, it went at once: the H200 run of
    the ninth session staged (copied) every "pinned" bench input on the client's thread."""
    import gc

    import torch

    from gpuloom.runtime.host_device import FakeDeviceLayer

    layer = FakeDeviceLayer()
    a = layer._track_pinned(torch.zeros(4, 8))
    gc.collect()
    assert layer.is_pinned([a]) and layer.is_pinned([a[1:3]])
    view = a[2:]
    del a
    gc.collect()
    assert layer.is_pinned([view])
    del view
    gc.collect()
    assert not layer._pinned


@pytest.mark.skipif(not ring.supported(), reason="shared rings need x86-64 Linux")
def test_ring_requests_are_answered_while_no_model_runs_and_taken_by_the_new_loop_after_a_load(slow_safety_net):
    """The runtime's loop takes the rings' requests; with the last model unloaded no loop runs, and
    the drain thread answers them (404); after a load the new runtime's loop takes them again."""
    import urllib.error

    import torch

    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=16, worker_ring_kb=256)
    addr = server.start()
    try:
        x = np.ones((2, 16), np.float32)
        _infer(addr.http_url, x)
        bridge = server._bridge
        assert bridge.loop_requests == 1
        core.unload("tiny_mlp")
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            _infer(addr.http_url, x)
        assert e.value.code == 404 and time.monotonic() - t0 < 10.0  # two looks of the drain thread
        assert bridge.loop_requests == 1 and bridge.ring_requests == 2  # the drain thread took it
        core.load("tiny_mlp")
        module = repo.models["tiny_mlp"].build()[1]
        with torch.no_grad():
            want = module(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(_infer(addr.http_url, x), want, rtol=1e-5, atol=1e-6)
        assert bridge.loop_requests == 2  # the new loop has the ring too
    finally:
        server.stop()


def test_front_end_workers_run_at_the_cpu_priority_asked_for():
    """``worker_nice``: how much lower the workers' priority is than the runtime's (frontend.WORKER_NICE
    by default): a worker woken for its reply then need not preempt the runtime's thread."""
    import os

    from gpuloom.serve.frontend import WORKER_NICE

    ours = os.getpriority(os.PRIO_PROCESS, 0)
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo)
    core.load("tiny_mlp")
    for kwargs, want in (({}, min(ours + WORKER_NICE, 19)), ({"worker_nice": 10}, min(ours + 10, 19)),
                         ({"worker_nice": 0}, ours)):
        server = Server(core, http_port=0, grpc_port=None, http_workers=1, worker_arena_mb=16,
                        close_service=False, **kwargs)
        server.start()
        try:
            x = np.ones((2, 16), np.float32)
            assert _infer(server.address.http_url, x).shape == (2, 4)
            assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in server.worker_pids()] == [want]
        finally:
            server.stop()
        core = ServeCore(service, repo)  # a stopped server's core stays closing
    try:
        for bad in (-1, 20, 2.5, True):
            with pytest.raises(ValueError, match="worker_nice: expected an int from 0 to 19"):
                Server(core, http_workers=1, worker_nice=bad)
        with pytest.raises(ValueError, match="worker_wakeups: expected one of"):
            Server(core, http_workers=1, worker_wakeups="sometimes")
    finally:
        service.close()
