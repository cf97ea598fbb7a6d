"""CPU tests of the profiler's plumbing: errors without a GPU, outputs, store round trip, models."""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from gpuloom.gpu import NoGpuError
from gpuloom.profile.knee import KernelRecord, OccupancyLimits
from gpuloom.profile.profiler import (ModelSpec, ProfileRun, load_model, predict_all, profile_model,
                                      write_outputs)
from gpuloom.profile.store import Profile, ProfileStore
from gpuloom.profile.synthetic import synthetic_profile


def _run() -> ProfileRun:
    p = synthetic_profile("toy", per_item_sm_ms=20.0, knee1=32, batches=(1, 4, 16))
    kernels = {b: [KernelRecord("conv", 10.0 * b, (32 * b, 1, 1), (256, 1, 1), 64, 0)] for b in p.batches}
    pred = predict_all(kernels, p.sms, OccupancyLimits())
    p = Profile(model=p.model, input_shapes=p.input_shapes, dtype=p.dtype, gpu=p.gpu, batches=p.batches, sms=p.sms,
                latency_ms=p.latency_ms, source="measured", predicted_knee=pred["latency"])
    return ProfileRun(profile=p, runner="graph", seconds=1.0, setup_seconds=0.5, kernels=kernels, predicted=pred)


def test_profiling_without_a_gpu_says_a_gpu_is_needed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = ModelSpec("lin", torch.nn.Linear(4, 4).eval(), ((4,),), (torch.float32,))
    with pytest.raises(NoGpuError, match="needs a CUDA GPU"):
        profile_model(spec, batches=(1,), progress=False)


def test_profile_command_on_cpu_exits_nonzero_with_a_clear_message(monkeypatch, capsys):
    from gpuloom.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["profile", "resnet50", "--batch", "1,2"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_a_channels_last_profile_compiles_so_and_says_so_in_its_runner():
    """A model served with channels_last needs a profile timed that way: the engine runner compiles
    with the option and names it (the profile's ``runner``); a plain graph cannot apply it."""
    from gpuloom.profile.profiler import EngineRunner, make_runner

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    spec = ModelSpec("conv", conv, ((3, 8, 8),), (torch.float32,))
    runner = EngineRunner(spec, (1, 2), device="cpu", channels_last=True)
    assert runner.cm.graph.channels_last_weights == 1 and runner.kind == "engine:channels_last=true"
    assert EngineRunner(spec, (1, 2), device="cpu").kind == "engine"
    with pytest.raises(ValueError, match="needs runner 'engine' or 'auto'"):
        make_runner(spec, (1, 2), runner="graph", device="cpu", channels_last=True)


def test_a_fused_profile_compiles_so_says_so_and_is_not_compiles_default(monkeypatch):
    """A model served with fuse_convolutions needs a profile timed that way, as with channels_last:
    the engine runner passes the option to gpuloom.compile and names it in the profile's runner.
    Without it the runner compiles unfused, as the service does by default, though compile's own
    default fuses the channels-last candidate."""
    import gpuloom
    from gpuloom.profile.profiler import EngineRunner, make_runner

    seen = []
    real = gpuloom.compile
    monkeypatch.setattr(gpuloom, "compile", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    spec = ModelSpec("conv", conv, ((3, 8, 8),), (torch.float32,))
    assert EngineRunner(spec, (1, 2), device="cpu").kind == "engine"
    runner = EngineRunner(spec, (1, 2), device="cpu", channels_last=True, fuse_convolutions="channels_last")
    # the runner names what changed the graph, as the service names the model it serves: on the CPU
    # the layout, not the fusion (cuDNN's fused convolutions are the GPU's)
    assert runner.kind == "engine:channels_last=true" and not runner.cm.rewrites.get("fused_convolutions")
    assert EngineRunner(spec, (1,), device="cpu", fuse_convolutions="channels_last").kind == "engine"  # no NHWC graph
    assert [kw["fuse_convolutions"] for kw in seen] == [False, "channels_last", "channels_last"]
    with pytest.raises(ValueError, match="need a CUDA device"):  # compile's own refusal reaches the user
        EngineRunner(spec, (1,), device="cpu", fuse_convolutions=True)
    with pytest.raises(ValueError, match="fuse_convolutions is gpuloom.compile's option"):
        make_runner(spec, (1, 2), runner="graph", device="cpu", fuse_convolutions="channels_last")


def test_a_split_gemm_profile_says_so_and_the_default_compiles_without():
    """split_gemms, like the fusion: named in the profile's runner (a model served with it needs a
    profile timed so); the runner compiles without it by default, as the service does, though
    compile's own default is on for CUDA; on the CPU compile refuses it (nothing to time)."""
    from gpuloom.profile.profiler import EngineRunner, engine_kind, make_runner

    lin = torch.nn.Sequential(torch.nn.Linear(128, 64)).eval()
    spec = ModelSpec("lin", lin, ((128,),), (torch.float32,))
    assert engine_kind(split_gemms=True) == "engine:split_gemms=true"
    assert engine_kind("auto", "channels_last", True) == "engine:channels_last=auto,fuse_convolutions=channels_last,split_gemms=true"
    assert EngineRunner(spec, (1, 2), device="cpu").cm.split_linears == 0
    with pytest.raises(ValueError, match="split_gemms=True times its GEMMs on the GPU"):
        EngineRunner(spec, (1,), device="cpu", split_gemms=True)
    with pytest.raises(ValueError, match="split_gemms is gpuloom.compile's option"):
        make_runner(spec, (1, 2), runner="graph", device="cpu", split_gemms=True)


def test_a_fused_epilogue_profile_says_so_and_the_default_compiles_without():
    """fuse_epilogues, like split GEMMs: named in the profile's runner; the runner compiles without it
    by default, as the service does, though compile's own default is on for CUDA (on the CPU asking
    for it runs the rewritten graph with eager's ops)."""
    from gpuloom.profile.profiler import EngineRunner, engine_kind, make_runner

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.SiLU()).eval()
    spec = ModelSpec("net", net, ((3, 8, 8),), (torch.float32,))
    assert engine_kind(fuse_epilogues=True) == "engine:fuse_epilogues=true"
    assert engine_kind(False, False, True, True) == "engine:split_gemms=true,fuse_epilogues=true"
    assert EngineRunner(spec, (1, 2), device="cpu").cm.fused_epilogues == 0
    fused = EngineRunner(spec, (1, 2), device="cpu", fuse_epilogues=True)
    assert fused.cm.fused_epilogues == 1 and fused.kind == "engine:fuse_epilogues=true"
    # an option with nothing to change leaves the plain graph, and the profile says so (as the service
    # names the model served with it: a profile made with the default options plans it)
    relu = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    unchanged = EngineRunner(ModelSpec("relu", relu, ((3, 8, 8),), (torch.float32,)), (1, 2), device="cpu",
                             fuse_epilogues=True)
    assert unchanged.cm.fused_epilogues == 0 and unchanged.kind == "engine"
    from engine_models import TinySqueezeExcite

    gated = TinySqueezeExcite().eval()
    gated_spec = ModelSpec("gated", gated, ((3, 8, 8),), (torch.float32,))
    assert EngineRunner(gated_spec, (1, 2), device="cpu").cm.fused_gates == 0
    assert EngineRunner(gated_spec, (1, 2), device="cpu", fuse_epilogues=True).cm.fused_gates == 1  # both kernels
    with pytest.raises(ValueError, match="fuse_epilogues is gpuloom.compile's option"):
        make_runner(spec, (1, 2), runner="graph", device="cpu", fuse_epilogues=True)


def test_profile_command_rejects_a_bad_batch_list(capsys):
    from gpuloom.cli import main

    with pytest.raises(SystemExit):
        main(["profile", "resnet50", "--batch", "1,x"])
    assert "comma-separated integers" in capsys.readouterr().err


def test_run_json_round_trips_through_the_profile_store(tmp_path):
    run = _run()
    paths = write_outputs(run, str(tmp_path / "out"), png=False)
    data = json.loads(open(paths["json"]).read())
    back = Profile.from_json(data["profile"])
    assert back == run.profile and back.predicted_knee == run.profile.predicted_knee
    store = ProfileStore(tmp_path / "store")
    store.put(back)
    again = ProfileStore(tmp_path / "store").get("toy")
    assert again.latency(4, 40) == pytest.approx(run.profile.latency(4, 40))
    assert set(data["predicted_by_method"]) >= {"latency", "latency_sat0.5", "mean", "median", "q75"}
    assert [r["batch"] for r in data["knees"]] == [1, 4, 16]
    assert data["kernels"]["4"][0][2] == [128, 1, 1]
    assert len(data["throughput_per_sm"]["1"]) == len(run.profile.sms)


def test_knee_rows_agree_with_the_profile():
    run = _run()
    for r in run.knee_rows(0.1):
        assert r["knee_measured"] == run.profile.knee(r["batch"], 0.1)
        assert r["latency_full_ms"] <= r["latency_knee_ms"] <= 1.1 * r["latency_full_ms"] + 1e-3
        assert r["knee_predicted"] == run.profile.predicted_knee[r["batch"]]


def test_plot_is_written_as_png(tmp_path):
    paths = write_outputs(_run(), str(tmp_path), png=True)
    with open(paths["png"], "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_unknown_model_name_is_a_value_error_naming_the_sources():
    with pytest.raises(ValueError, match="torchvision or timm"):
        load_model("no_such_net_xyz", device="cpu")


def test_module_factory_models_load_with_their_input_shape(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        def tiny():
            return torch.nn.Linear(16, 4), (16,)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_model("mymodels:tiny", device="cpu")
    assert spec.name == "tiny" and spec.input_shapes == ((16,),)
    x = spec.make_inputs(3, "cpu")
    assert x[0].shape == (3, 16) and x[0].abs().sum() > 0  # random, not zeros
    with pytest.raises(ValueError, match="module:factory"):
        load_model("mymodels:missing", device="cpu")


def test_bert_base_is_a_12_layer_768_wide_encoder_on_sequence_128():
    spec = load_model("bert_base", device="cpu")
    assert spec.input_shapes == ((128, 768),)
    enc = spec.module.encoder
    assert len(enc.layers) == 12 and enc.layers[0].linear1.out_features == 3072
    assert enc.layers[0].self_attn.num_heads == 12


def test_profile_command_options_reach_the_profiler_as_compile_takes_them():
    """--channels-last and --fuse-convolutions: "false" / "true" become bools (a "false" string would
    be truthy, and not False to the runner's checks), the named values stay as written."""
    from gpuloom.commands.profile import _option

    assert _option("false") is False and _option("true") is True
    assert _option("auto") == "auto" and _option("channels_last") == "channels_last"


def test_sm_counts_a_device_cannot_carve_alone_are_refused_naming_them_and_the_default_grid():
    from gpuloom.gpu import PartitionError
    from gpuloom.profile.profiler import check_sm_counts

    check_sm_counts((8, 16, 64, 128, 132), 132, 8)  # multiples of 8, and the whole device
    with pytest.raises(PartitionError, match=r"SM counts \[66\].*multiple of 8 up to 128.*\(132\).*8,16,24"):
        check_sm_counts((32, 66, 132), 132, 8)
    with pytest.raises(PartitionError, match=r"\[0, 136\]"):
        check_sm_counts((0, 8, 136), 132, 8)


def _fake_gpu(monkeypatch):
    """A 132-SM device with an 8-SM granularity, as far as the profile command's checks look."""
    import types

    import gpuloom.gpu
    import gpuloom.profile.profiler as profiler

    facts = types.SimpleNamespace(sm_count=132, sm_granularity=8, grid=lambda: (8, 16, 132))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpuloom.gpu, "device_facts", lambda device=0: facts)
    monkeypatch.setattr(profiler, "device_facts", lambda device=0: facts)
    return profiler


def test_a_bad_sm_count_stops_the_profile_command_before_any_model_is_built(monkeypatch, capsys):
    """Engine run 108 (thirty-sixth session): --sms 66 compiled resnet50 for a minute, then died with
    a PartitionError traceback. Now the sizes are checked first and the error is one line."""
    from gpuloom.cli import main

    profiler = _fake_gpu(monkeypatch)
    monkeypatch.setattr(profiler, "load_model", lambda *a, **kw: pytest.fail("a model was built"))
    assert main(["profile", "resnet50", "--sms", "32,66,132"]) == 2
    out = capsys.readouterr().out
    assert "error: --sms: SM counts [66]" in out and "Traceback" not in out, out


def test_an_unknown_model_is_a_one_line_error_of_the_profile_command(monkeypatch, capsys):
    from gpuloom.cli import main

    _fake_gpu(monkeypatch)
    assert main(["profile", "no_such_model_xyz"]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error:") and "no_such_model_xyz" in out and "Traceback" not in out, out


def test_profile_model_checks_the_sm_counts_before_it_builds_a_runner(monkeypatch):
    from gpuloom.gpu import PartitionError

    profiler = _fake_gpu(monkeypatch)
    monkeypatch.setattr(profiler, "make_runner", lambda *a, **kw: pytest.fail("a runner was built"))
    spec = ModelSpec("lin", torch.nn.Linear(4, 4).eval(), ((4,),), (torch.float32,))
    with pytest.raises(PartitionError, match=r"\[66\]"):
        profile_model(spec, batches=(1,), sms=(66, 132), device=0)


def test_the_progress_bar_goes_to_stderr_so_stdout_stays_the_commands_output(capsys):
    from gpuloom.profile.profiler import _progress

    with _progress(True, "resnet-ish", 3) as advance:
        for _ in range(3):
            advance()
    out, err = capsys.readouterr()
    assert out == "" and "resnet-ish" in err and "3/3" in err


def test_the_profile_commands_kernels_follow_the_served_default():
    """``gpuloom profile`` times a model as the service serves it by default: with gpuloom's epilogue
    and gate kernels (ModelConfig.fuse_epilogues), except a plain graph of the eager model, which has
    none to turn on; ``--fuse-epilogues`` says otherwise."""
    import argparse

    from gpuloom.commands import profile

    p = argparse.ArgumentParser()
    profile.add_arguments(p)
    assert profile.fuse_epilogues(p.parse_args(["m"])) is True
    assert profile.fuse_epilogues(p.parse_args(["m", "--runner", "graph"])) is False
    assert profile.fuse_epilogues(p.parse_args(["m", "--fuse-epilogues", "false"])) is False
    assert profile.fuse_epilogues(p.parse_args(["m", "--runner", "graph", "--fuse-epilogues", "true"])) is True


def test_the_profile_commands_engine_flags_default_to_a_served_models():
    """Left alone, ``gpuloom profile``'s engine flags time the graph a model configured with none of
    its repository keys is served with (ENGINE_DEFAULTS, the one place those defaults live)."""
    import argparse

    from gpuloom.commands import profile
    from gpuloom.engine.options import ENGINE_DEFAULTS

    p = argparse.ArgumentParser()
    profile.add_arguments(p)
    args = p.parse_args(["m"])
    got = {k: profile._option(getattr(args, k)) for k in ("channels_last", "fuse_convolutions", "split_gemms")}
    got["fuse_epilogues"] = profile.fuse_epilogues(args)
    assert got == ENGINE_DEFAULTS
