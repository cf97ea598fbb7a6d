"""CPU tests of the GPU layer: layout validation, no-op partitions, clear errors, MPS helpers."""

from __future__ import annotations

import sys

import pytest

from gpuloom.gpu import (BindingsMissingError, DriverError, NoGpuError, PartitionError, Partitioner, max_blocks_per_sm,
                         sm_granularity, sm_grid, validate_layout)
from gpuloom.gpu import mps


def test_uneven_layout_within_the_device_is_accepted():
    assert validate_layout([40, 16, 24, 48], 132, 8) == (40, 16, 24, 48)


def test_last_partition_may_take_exactly_the_remainder():
    assert validate_layout([64, 68], 132, 8) == (64, 68)
    assert validate_layout([132], 132, 8) == (132,)
    assert validate_layout([128, 4], 132, 8) == (128, 4)


def test_any_one_partition_may_take_the_remainder_when_the_layout_fills_the_device():
    # the H200's leftover SMs run cuDNN convolutions slowly (run 41): the planner gives them to the
    # largest partition, which is first in its layouts
    assert validate_layout([52, 16, 16, 16, 16, 16], 132, 8) == (52, 16, 16, 16, 16, 16)
    with pytest.raises(PartitionError, match="only one may be off it"):
        validate_layout([36, 20, 16, 16, 16, 16, 12], 132, 8)
    with pytest.raises(PartitionError, match="multiples of 8"):
        validate_layout([52, 16, 16], 132, 8)  # off the granularity, and not what is left


def test_layout_over_the_device_names_the_sum_and_the_device():
    with pytest.raises(PartitionError, match=r"add up to 136 SMs, more than the device's 132"):
        validate_layout([64, 72], 132, 8)


def test_size_off_the_granularity_is_refused_with_the_granularity_in_the_message():
    with pytest.raises(PartitionError, match="multiples of 8"):
        validate_layout([12, 16], 132, 8)
    with pytest.raises(PartitionError, match="multiples of 8"):
        validate_layout([4], 132, 8)  # below the granularity and not the remainder


def test_non_integer_or_empty_layouts_are_type_or_value_errors():
    with pytest.raises(TypeError):
        validate_layout(64, 132, 8)
    with pytest.raises(TypeError):
        validate_layout([64.0], 132, 8)
    with pytest.raises(PartitionError):
        validate_layout([], 132, 8)
    with pytest.raises(PartitionError):
        validate_layout([0, 8], 132, 8)


def test_noop_partitions_have_the_requested_sizes_and_no_streams():
    with Partitioner([32, 16], mode="none") as parts:
        assert [p.sms for p in parts] == [32, 16]
        assert all(p.stream is None and not p.confined for p in parts)
        assert parts[0].stream_factory()() is None
        with parts[1].use() as s:
            assert s is None
        assert "mode=none" in repr(parts) and "cpu" in repr(parts[0])


def test_noop_partitions_still_validate_against_the_nominal_h200():
    with pytest.raises(PartitionError):
        Partitioner([128, 8], mode="none")
    assert [p.sms for p in Partitioner([20], mode="none", sm_count=40, granularity=4)] == [20]


def test_green_mode_without_a_gpu_says_a_gpu_is_needed(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(NoGpuError, match="needs a CUDA GPU"):
        Partitioner([32], mode="green")
    assert Partitioner([32], mode="auto").mode == "none"


def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(ValueError, match="auto"):
        Partitioner([32], mode="mig")


def test_missing_cuda_bindings_says_how_to_install_them(monkeypatch):
    from gpuloom.gpu import green

    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)
    with pytest.raises(BindingsMissingError, match="pip install cuda-bindings"):
        green.driver()


def test_driver_errors_name_the_call_and_the_error():
    from gpuloom.gpu import DriverError
    from gpuloom.gpu.green import _call

    class FakeCu:
        @staticmethod
        def cuThing(x):
            return (7, None)

        @staticmethod
        def cuGetErrorName(err):
            return (0, b"CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION")

    with pytest.raises(DriverError, match=r"cuThing\(3\) failed with CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION"):
        _call(FakeCu, "cuThing", 3)


def test_sm_grid_steps_by_granularity_and_ends_at_the_device():
    g = sm_grid(132, 8)
    assert g[0] == 8 and g[-1] == 132 and len(g) == 17
    assert all(b - a == 8 for a, b in zip(g[:-2], g[1:-1]))
    assert sm_grid(128, 8)[-1] == 128 and len(sm_grid(128, 8)) == 16


def test_hopper_facts_from_compute_capability():
    assert sm_granularity((9, 0)) == 8 and sm_granularity((8, 0)) == 2
    assert max_blocks_per_sm((9, 0)) == 32 and max_blocks_per_sm((8, 6)) == 16


def test_mps_percentage_covers_the_requested_sms():
    for sms in (1, 8, 33, 66, 100, 132):
        pct = mps.mps_percentage(sms, 132)
        assert 1 <= pct <= 100 and pct * 132 / 100 >= sms - 1e-9
    with pytest.raises(PartitionError):
        mps.mps_percentage(140, 132)


def test_mps_client_environment_carries_the_percentage_and_pipe():
    env = mps.mps_env(25, base={"PATH": "/bin"}, pipe_dir="/tmp/p")
    assert env == {"PATH": "/bin", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/p"}
    with pytest.raises(PartitionError):
        mps.mps_env(0)


def test_mps_daemon_without_the_control_binary_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(mps.shutil, "which", lambda name: None)
    d = mps.MpsDaemon(pipe_dir=str(tmp_path / "p"), log_dir=str(tmp_path / "l"))
    with pytest.raises(mps.GpuError, match="nvidia-cuda-mps-control"):
        d.start()
    d.stop()  # stopping a daemon that never started is a no-op


def test_mps_daemon_start_and_stop_run_the_control_commands(monkeypatch, tmp_path):
    calls = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    def fake_run(cmd, **kw):
        calls.append((cmd, kw.get("input"), kw["env"]["CUDA_MPS_PIPE_DIRECTORY"]))
        return Done()

    monkeypatch.setattr(mps.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(mps.subprocess, "run", fake_run)
    with mps.MpsDaemon(pipe_dir=str(tmp_path / "p"), log_dir=str(tmp_path / "l")) as d:
        assert d.running
    assert calls[0][0][-1] == "-d" and calls[1][1] == "quit\n"
    assert calls[0][2] == calls[1][2] == str(tmp_path / "p")


def _write_percentage(path):
    import os

    with open(path, "w") as f:
        f.write(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", ""))


def test_mps_worker_process_sees_its_percentage(tmp_path):
    out = tmp_path / "pct"
    w = mps.MpsWorker(_write_percentage, (str(out),), sms=33, sm_count=132)
    w.start()
    assert w.join(60) == 0
    assert out.read_text() == "25"


class _FakeSplitDriver:
    """Records every split: (SMs available, groups, SMs each, flags). Resources are SM counts."""

    IGNORE_COSCHEDULING = 1

    def __init__(self, sms: int) -> None:
        self.sms, self.splits, self.whole = sms, [], []

    def device_resource(self):
        return _Res(self.sms)

    def split(self, res, k, s, flags=0):
        self.splits.append((res.sm.smCount, k, s, flags))
        return [_Res(s) for _ in range(k)], _Res(res.sm.smCount - k * s)

    def create(self, res, workqueue=None):
        self.whole.append(workqueue)  # the workqueue configuration each context was made with
        return res

    def resource_of(self, ctx):
        return ctx


class _Res:
    def __init__(self, n: int) -> None:
        self.sm = type("SM", (), {"smCount": n})()


def _carve_with(sizes, split: str = "cosched", order: str = "given"):
    p = object.__new__(Partitioner)
    p._drv, p.sizes, p._holders, made = _FakeSplitDriver(132), tuple(sizes), [], []
    p.remainder_split, p.order, p.granularity = split, order, 8
    p._wq, p.workqueues, p.workqueue_error, p._balanced = None, "shared", "", 0
    p._add = lambda ctx, requested: made.append((ctx.sm.smCount, requested))
    p._carve()
    return p._drv.splits, made


def test_independent_carving_ignores_co_scheduling_on_remainders_only():
    # H200: the default split of a small remainder gave short groups (6 SMs for 8) and 8-SM partitions
    # where cuDNN could not run; the independent carving splits remainders ignoring co-scheduling.
    sizes = (48, 24, 24, 16, 8, 8)
    splits, made = _carve_with(sizes, "independent")
    assert made == [(s, s) for s in sizes]
    assert [f for *_, f in splits] == [0, 1, 1, 1]
    assert [(avail, k, s) for avail, k, s, _ in splits] == [(132, 1, 48), (84, 2, 24), (36, 1, 16), (20, 2, 8)]
    splits, made = _carve_with(sizes, "cosched")
    assert made == [(s, s) for s in sizes] and [f for *_, f in splits] == [0, 0, 0, 0]


def test_ascending_carving_splits_small_partitions_off_large_remainders_in_layout_order():
    # the failing H200 layout: its 8-SM partitions were split off a 20-SM remainder; ascending splits
    # them off the whole device, and the largest partition takes what is left (52 SMs for 48)
    splits, made = _carve_with((48, 24, 24, 16, 8, 8), order="ascending")
    assert [(avail, k, s) for avail, k, s, _ in splits] == [(132, 2, 8), (116, 1, 16), (100, 2, 24)]
    assert made == [(52, 48), (24, 24), (24, 24), (16, 16), (8, 8), (8, 8)]  # (SMs given, asked), layout order


def test_ascending_carving_keeps_a_remainder_sized_last_partition_last():
    splits, made = _carve_with((64, 68), order="ascending")  # 68 is "the rest", off the 8-SM granularity
    assert [(avail, s) for avail, _, s, _ in splits] == [(132, 64)]
    assert made == [(64, 64), (68, 68)]


def test_a_remainder_sized_partition_anywhere_in_the_layout_is_carved_last_and_takes_what_is_left():
    for order in ("given", "ascending"):
        splits, made = _carve_with((52, 24, 24, 16, 16), order=order)
        assert made == [(52, 52), (24, 24), (24, 24), (16, 16), (16, 16)]  # (SMs given, asked), layout order
        assert all(s != 52 for _, _, s, _ in splits)  # never split off: the rest once the others are
    splits, _ = _carve_with((52, 24, 24, 16, 16))
    assert [(avail, k, s) for avail, k, s, _ in splits] == [(132, 2, 24), (84, 2, 16)]


def test_unknown_carving_options_list_the_known_ones():
    with pytest.raises(ValueError, match="cosched"):
        Partitioner([8], mode="none", remainder_split="loose")
    with pytest.raises(ValueError, match="ascending"):
        Partitioner([8], mode="none", order="random")


def test_contexts_made_before_a_failing_split_are_destroyed():
    class Failing(_FakeSplitDriver):
        def split(self, res, k, s, flags=0):
            if res.sm.smCount < 100:
                return [], res  # the driver gives no group
            return super().split(res, k, s, flags)

        def destroy(self, ctx):
            self.destroyed.append(ctx.sm.smCount)

    p = object.__new__(Partitioner)
    p._drv, p.sizes, p._holders = Failing(132), (48, 24, 24), []
    p._drv.destroyed = []
    p.remainder_split, p.order, p.granularity, p.partitions = "cosched", "given", 8, []
    p._wq, p.workqueues, p.workqueue_error, p._balanced = None, "shared", "", 0
    with pytest.raises(PartitionError, match="could not split 24 SMs off 84"):
        p._carve()
    assert p._drv.destroyed == [48] and p.partitions == []  # the 48-SM context was not left behind


def test_balanced_workqueues_go_to_the_partitions_only_and_fall_back_to_shared_when_refused():
    # the driver's documentation: green contexts with disjoint SMs may still wait on each other through
    # shared workqueues; "balanced" gives each partition its own where the driver can
    wq = object()
    p = object.__new__(Partitioner)
    p._drv, p.sizes, p._holders, made = _FakeSplitDriver(132), (48, 24, 24), [], []
    p.remainder_split, p.order, p.granularity = "cosched", "given", 8
    p._wq, p.workqueues, p.workqueue_error, p._balanced = wq, "balanced", "", 0
    p._add = lambda ctx, requested: made.append(ctx.sm.smCount)
    p._carve()
    assert made == [48, 24, 24]
    # 48 and the two 24s with the configuration; the 84-SM remainder held to split further without
    assert p._drv.whole == [wq, None, wq, wq] and p.workqueues == "balanced"

    class Refusing(_FakeSplitDriver):  # a driver before CUDA 13.1 refuses the descriptor (after `ok` contexts)
        ok = 0

        def create(self, res, workqueue=None):
            if workqueue is not None and len([w for w in self.whole if w is not None]) >= self.ok:
                raise DriverError("cuDevResourceGenerateDesc(...) failed with CUDA_ERROR_INVALID_VALUE")
            return super().create(res, workqueue)

    for ok, says in ((0, "shared"), (1, "mixed")):
        drv = Refusing(132)
        drv.ok = ok
        p._drv, p._holders, p._wq, p.workqueues, p._balanced, made[:] = drv, [], wq, "balanced", 0, []
        p._carve()
        assert made == [48, 24, 24] and p.workqueues == says and "INVALID_VALUE" in p.workqueue_error


def test_a_workqueue_configuration_asks_the_driver_for_balanced_scope_and_joins_the_sm_resource():
    from types import SimpleNamespace

    from gpuloom.gpu.green import GreenDriver

    calls = []

    class Cu:
        CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_WORKQUEUE_CONFIG=2)
        CUdevWorkqueueConfigScope = SimpleNamespace(CU_WORKQUEUE_SCOPE_DEVICE_CTX=0, CU_WORKQUEUE_SCOPE_GREEN_CTX_BALANCED=1)
        CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)

        @staticmethod
        def cuDeviceGetDevResource(dev, kind):
            calls.append(("get", kind))
            return 0, SimpleNamespace(wqConfig=SimpleNamespace(sharingScope=0, wqConcurrencyLimit=32))

        @staticmethod
        def cuDevResourceGenerateDesc(resources, n):
            calls.append(("desc", list(resources), n))
            return 0, "desc"

        @staticmethod
        def cuGreenCtxCreate(desc, dev, flags):
            return 0, "ctx"

    drv = object.__new__(GreenDriver)
    drv.cu, drv.dev = Cu, 0
    wq = drv.workqueue_config("balanced", share=5)
    assert calls == [("get", 2)] and wq.wqConfig.sharingScope == 1
    assert wq.wqConfig.wqConcurrencyLimit == 6  # its part of the device's 32 connections: the five add up to 30
    assert drv.workqueue_config("balanced", share=64).wqConfig.wqConcurrencyLimit == 1
    assert drv.create("sm", wq) == "ctx" and calls[-1] == ("desc", ["sm", wq], 2)
    assert drv.create("sm") == "ctx" and calls[-1] == ("desc", ["sm"], 1)
    with pytest.raises(ValueError, match="balanced"):
        drv.workqueue_config("private")
    Cu.CUdevResourceType = SimpleNamespace()  # bindings before 13.1
    with pytest.raises(DriverError, match="no workqueue resources"):
        drv.workqueue_config("balanced")


def test_unknown_workqueue_scope_lists_the_known_ones():
    with pytest.raises(ValueError, match="balanced"):
        Partitioner([8], mode="none", workqueues="private")
