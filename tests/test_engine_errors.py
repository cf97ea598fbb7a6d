"""Bad input gets a clear error naming the expected signature; nothing is silently cast."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import gpuloom
from gpuloom.engine.compiled import default_buckets
from gpuloom.engine.dag import CaptureError
from engine_models import TwoInputs, randomize_batchnorm


@pytest.fixture(scope="module")
def cm():
    return gpuloom.compile(TwoInputs().eval(), (torch.randn(2, 16), torch.randn(2, 4, 10)), max_batch=8)


def good(batch=2):
    return torch.randn(batch, 16), torch.randn(batch, 4, 10)


def test_wrong_number_of_inputs_names_the_signature(cm):
    with pytest.raises(TypeError, match=r"expected 2 input\(s\).*float32\[B, 16\]"):
        cm(torch.randn(2, 16))


def test_wrong_rank_is_rejected(cm):
    x, y = good()
    with pytest.raises(ValueError, match=r"rank 3.*expected .*float32\[B, 16\]"):
        cm(x[:, None, :], y)


def test_wrong_shape_is_rejected(cm):
    x, y = good()
    with pytest.raises(ValueError, match=r"shape \(2, 5, 10\)"):
        cm(x, torch.randn(2, 5, 10))


def test_wrong_dtype_is_not_cast(cm):
    x, y = good()
    with pytest.raises(ValueError, match=r"dtype torch.float64.*never casts"):
        cm(x.double(), y)


def test_wrong_device_is_not_moved(cm):
    x, y = good()
    with pytest.raises(ValueError, match=r"device meta"):
        cm(x.to("meta"), y)


def test_batch_over_max_batch_is_rejected(cm):
    with pytest.raises(ValueError, match=r"batch 9 is larger than max_batch=8"):
        cm(*good(9))


def test_inputs_must_share_batch(cm):
    x, _ = good(2)
    with pytest.raises(ValueError, match="share the batch size"):
        cm(x, torch.randn(3, 4, 10))


def test_non_tensor_input_is_rejected(cm):
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        cm([1.0] * 16, torch.randn(1, 4, 10))


class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def test_data_dependent_control_flow_names_the_problem():
    with pytest.raises(CaptureError) as err:
        gpuloom.compile(DataDependent().eval(), torch.randn(2, 3))
    text = str(err.value)
    assert "torch.export stopped at" in text and "torch.fx stopped at" in text
    assert "control flow" in text


class _KeyValueCache:  # a type torch's pytree does not know, as a Hugging Face model's DynamicCache
    def __init__(self, t):
        self.t = t


class _ReturnsACache(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y, _KeyValueCache(y)


def test_an_output_type_export_cannot_carry_is_named_with_what_to_do():
    # seen with transformers' GPT-2, whose forward returns a DynamicCache unless use_cache=False: the
    # error said "data-dependent control flow", which is not what stopped it
    with pytest.raises(CaptureError) as info:
        gpuloom.compile(_ReturnsACache().eval(), torch.randn(1, 8), max_batch=2)
    msg = str(info.value)
    assert "output holds a _KeyValueCache" in msg and "return only tensors from forward()" in msg
    assert "model.config.use_cache = False" in msg  # a cache type: the Hugging Face advice too
    assert "data-dependent control flow" not in msg


def test_training_mode_is_refused():
    with pytest.raises(ValueError, match=r"model.eval\(\)"):
        gpuloom.compile(TwoInputs().train(), (torch.randn(2, 16), torch.randn(2, 4, 10)))


def test_bad_streams_option():
    with pytest.raises(ValueError, match="streams must be one of"):
        gpuloom.compile(TwoInputs().eval(), (torch.randn(2, 16), torch.randn(2, 4, 10)), streams=3)


def test_default_buckets_end_at_max_batch():
    assert default_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert default_buckets(12) == (1, 2, 4, 8, 12)
    assert default_buckets(1) == (1,)


def test_fx_fallback_when_export_fails(monkeypatch):
    import gpuloom.engine.dag as dag

    def refuse(*args, **kwargs):
        raise RuntimeError("export refused this model")

    monkeypatch.setattr(dag, "_export", refuse)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 4)).eval()
    with pytest.warns(UserWarning, match=r"Sequential: torch.export stopped at: RuntimeError: export refused this "
                                         r"model; captured with torch.fx instead.*\(asked for: fold_batchnorm\)"):
        cm = gpuloom.compile(m, torch.randn(2, 4), max_batch=4)
    assert cm.graph.method == "fx" and cm.graph.fx_because == "torch.export: RuntimeError: export refused this model"
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x))


def test_batchnorm_folds_into_convolutions():
    import torchvision

    m = randomize_batchnorm(torchvision.models.resnet18(weights=None), spread=1.0)  # so a wrong fold would show
    x = torch.randn(2, 3, 64, 64)
    folded = gpuloom.compile(m, (x,), max_batch=4)
    plain = gpuloom.compile(m, (x,), max_batch=4, fold_batchnorm=False)
    assert folded.graph.folded_batchnorms == 20
    assert len(folded.graph.ops) == len(plain.graph.ops) - 20
    assert not any("batch_norm" in str(n.target) for n in folded.graph.ops)
    x = torch.randn(3, 3, 64, 64)
    with torch.no_grad():
        want = m(x)
    torch.testing.assert_close(folded(x), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(plain(x), want, rtol=1e-4, atol=1e-5)


def _assert_equal_eager(model, cm, shapes, dtype, atol):
    """At batches 1 and 3 on fresh inputs: the compiled call and the eager run of its plan equal eager."""
    for batch in (1, 3):
        xs = tuple(torch.randn(batch, *s, dtype=dtype) for s in shapes)
        with torch.no_grad():
            want = model(*xs)
        torch.testing.assert_close(cm(*xs), want, rtol=1e-4, atol=atol)
        torch.testing.assert_close(cm.run_eager_plan(*xs), want, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "transformer_encoder"])
def test_reinplaced_graph_equals_eager(name):
    from engine_models import zoo

    model, shapes, dtype = zoo()[name]
    model = model.eval()
    xs = tuple(torch.randn(2, *s, dtype=dtype) for s in shapes)
    cm = gpuloom.compile(model, xs, max_batch=4, reinplace=True)
    inplace_ops = [n for n in cm.graph.ops if str(n.target).endswith("_.default") or str(n.target).endswith("_.Tensor")]
    if name == "resnet18":
        assert len(inplace_ops) >= 17  # every ReLU after a conv and the residual adds
    _assert_equal_eager(model, cm, shapes, dtype, atol=1e-5)


class SpatialFlatten(nn.Module):
    """Convolutions, then a flatten of the whole feature map (VGG's classifier): a view that an NHWC
    map cannot give, so channels_last must turn it into a reshape."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                      nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU())
        self.head = nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.head(self.features(x).flatten(1))


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "spatial_flatten", "transformer_encoder"])
def test_channels_last_graph_equals_eager_and_stores_conv_weights_nhwc(name):
    from engine_models import zoo

    if name == "spatial_flatten":
        model, shapes, dtype = SpatialFlatten(), [(3, 16, 16)], torch.float32
    else:
        model, shapes, dtype = zoo()[name]
    model = model.eval()
    xs = tuple(torch.randn(2, *s, dtype=dtype) for s in shapes)
    cm = gpuloom.compile(model, xs, max_batch=4, channels_last=True)
    gm = cm.graph.module
    conv_weights = [n.args[1] for n in gm.graph.nodes if n.op == "call_function" and "conv" in str(n.target)
                    and len(n.args) > 1 and getattr(n.args[1], "op", "") == "get_attr"]
    weights = [gm.get_parameter(w.target) if w.target in dict(gm.named_parameters()) else gm.get_buffer(w.target)
               for w in conv_weights]
    if name == "transformer_encoder":
        assert not weights  # no convolution: the graph is left as it is
    else:
        assert weights and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights if w.dim() == 4)
        assert not any(n.op == "call_function" and n.target is torch.ops.aten.view.default for n in gm.graph.nodes)
    _assert_equal_eager(model, cm, shapes, dtype, atol=1e-4)


class PatchTransformer(nn.Module):
    """A patch-embedding convolution, then a transformer (ViT's shape): only the flatten of the
    convolution's map needs a reshape; the transformer's views stay views (and no DAG nodes)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 16, 4, stride=4)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.block(self.patch(x).flatten(2).transpose(1, 2)).mean(1))


class ConvMap(nn.Module):
    """A model whose output is a convolution's 4-D map."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))

    def forward(self, x):
        return self.body(x)


def test_channels_last_rewrites_only_the_views_of_nhwc_maps_and_returns_eagers_strides():
    vit = PatchTransformer().eval()
    x = torch.randn(2, 3, 16, 16)
    plain = gpuloom.compile(vit, x, max_batch=4)
    cl = gpuloom.compile(vit, x, max_batch=4, channels_last=True)
    nodes = lambda cm, op: sum(n.op == "call_function" and n.target is op for n in cm.graph.module.graph.nodes)
    assert cl.graph.channels_last_weights == 1
    assert nodes(cl, torch.ops.aten.reshape.default) == 1  # the patch map's flatten
    assert nodes(cl, torch.ops.aten.view.default) == nodes(plain, torch.ops.aten.view.default) - 1 > 0
    assert len(cl.graph.ops) <= len(plain.graph.ops) + 1
    _assert_equal_eager(vit, cl, [(3, 16, 16)], torch.float32, atol=1e-4)
    conv = ConvMap().eval()
    cm = gpuloom.compile(conv, x, max_batch=4, channels_last=True)
    y = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        want = conv(y)
    got = cm(y)
    assert got.is_contiguous() and got.stride() == want.stride()  # eager's strides, not NHWC
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_channels_last_variant_shares_all_but_the_convolution_weights_and_equals_eager():
    """compile(channels_last="auto") times a second DAG with NHWC convolutions beside the first. The
    variant must leave the first graph's weights as they were, hold only the converted weights twice,
    and compute what eager does (run here without graphs: on the CPU there is nothing to time)."""
    import operator

    from gpuloom.engine.capture import InputSpec
    from gpuloom.engine.compiled import CompiledModel
    from gpuloom.engine.dag import capture_graph, channels_last_variant
    from engine_models import zoo

    model, shapes, dtype = zoo()["resnet18"]
    model = model.eval()
    x = torch.randn(2, *shapes[0], dtype=dtype)
    graph = capture_graph(model, (x,), max_batch=4)
    variant = channels_last_variant(graph)
    assert variant is not None and variant.channels_last_weights > 0 and graph.channels_last_weights == 0
    tensor = lambda g, target: operator.attrgetter(target)(g.module)
    reads = {n.target for n in graph.module.graph.nodes if n.op == "get_attr"}
    conv_weights = {n.args[1].target for n in graph.module.graph.nodes
                    if n.op == "call_function" and "conv" in str(n.target) and getattr(n.args[1], "op", "") == "get_attr"}
    assert conv_weights and conv_weights < reads
    for target in reads:
        first, second = tensor(graph, target), tensor(variant, target)
        if target in conv_weights:
            assert first.is_contiguous() and second.is_contiguous(memory_format=torch.channels_last)
            # a 1x1 kernel is already both: it is shared as it is; every other one is a copy
            assert (first.data_ptr() == second.data_ptr()) == first.is_contiguous(memory_format=torch.channels_last)
        else:
            assert first.data_ptr() == second.data_ptr()  # shared, not copied
    cm = CompiledModel(graph, [InputSpec("x", tuple(shapes[0]), dtype, x.device)], [x], max_batch=4,
                       buckets=(1, 2, 4), streams="auto", device=x.device, graph_cl=variant)
    for ex in cm._executors.values():
        ex.refresh_attrs()
    y = torch.randn(3, *shapes[0], dtype=dtype)
    with torch.no_grad():
        want = model(y)
    for streams in ("max", 1, "multi_cl", "single_cl"):
        torch.testing.assert_close(cm.run_eager_plan(y, streams=streams), want, rtol=1e-4, atol=1e-4)
    assert channels_last_variant(capture_graph(nn.Sequential(nn.Linear(4, 2)).eval(), (torch.randn(2, 4),),
                                               max_batch=4)) is None  # no convolution: no variant
    plain = CompiledModel(graph, cm.specs, [x], max_batch=4, buckets=(1, 2, 4), streams="auto", device=x.device)
    with pytest.raises(ValueError, match="channels_last='auto'.*not asked for"):
        plain.run_eager_plan(y, streams="multi_cl")
    cm.drop_channels_last()  # what compile does where no bucket kept it
    assert cm.graph_cl is None and not any(k.endswith("_cl") for k in cm._executors)
    with pytest.raises(ValueError, match="no bucket kept it"):
        cm.run_eager_plan(y, streams="single_cl")
    torch.testing.assert_close(cm.run_eager_plan(y), want, rtol=1e-4, atol=1e-4)


def test_channels_last_auto_is_a_timed_choice_and_bad_values_are_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    cm = gpuloom.compile(model, x, max_batch=4, channels_last="auto")  # CPU: nothing to time, plain DAG
    assert cm.graph_cl is None and cm.graph.channels_last_weights == 0
    _assert_equal_eager(model, cm, [(3, 8, 8)], torch.float32, atol=1e-5)
    with pytest.raises(ValueError, match="streams='auto'"):
        gpuloom.compile(model, x, max_batch=4, streams=1, channels_last="auto")
    with pytest.raises(ValueError, match="False, True or 'auto'"):
        gpuloom.compile(model, x, max_batch=4, channels_last="yes")


def test_channels_last_defaults_to_a_timed_choice_where_streams_auto_times_candidates():
    """The default: both layouts timed with streams="auto" (run 19: the faster kept on every row);
    the model's own layout where one streams choice is forced, so ``compile(model, x, streams=1)``
    still compiles instead of refusing an option its caller never gave."""
    from gpuloom.engine.compiled import resolve_channels_last

    assert resolve_channels_last(None, "auto") == "auto"
    assert resolve_channels_last(None, 1) is False and resolve_channels_last(None, "max") is False
    assert resolve_channels_last(True, 1) is True and resolve_channels_last(False, "auto") is False
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    cm = gpuloom.compile(model, x, max_batch=4, streams=1)  # the default with a forced choice
    assert cm.graph.channels_last_weights == 0 and cm.graph_cl is None
    _assert_equal_eager(model, cm, [(3, 8, 8)], torch.float32, atol=1e-5)


@pytest.mark.parametrize("bad, error, message", [
    (lambda x, y: (x.double(), y), ValueError, r"dtype torch.float64.*never casts"),
    (lambda x, y: (x, torch.randn(2, 5, 10)), ValueError, r"shape \(2, 5, 10\)"),
    (lambda x, y: (x[:, None, :], y), ValueError, r"rank 3"),
    (lambda x, y: (x.to("meta"), y), ValueError, r"device meta"),
    (lambda x, y: (x,), TypeError, r"expected 2 input\(s\)"),
    (lambda x, y: (x.tolist(), y), TypeError, "must be a torch.Tensor"),
    (lambda x, y: (x, y[:1]), ValueError, "share the batch size"),
    (lambda x, y: good(9), ValueError, r"batch 9 is larger than max_batch=8"),
    (lambda x, y: good(0), ValueError, r"batch must be at least 1"),
])
def test_bad_input_after_good_calls_still_raises(cm, bad, error, message):
    """The hot path remembers accepted input signatures; a bad call after good ones is still checked."""
    x, y = good(2)
    for _ in range(2):
        cm(x, y)
    cm(*good(8))
    with pytest.raises(error, match=message):
        cm(*bad(x, y))
    torch.testing.assert_close(cm(x, y), cm.run_eager_plan(x, y))  # and good calls still work after it


def test_bucket_lookup_matches_the_smallest_bucket_that_fits():
    m = nn.Sequential(nn.Linear(4, 4)).eval()
    for buckets in [(1, 2, 4, 8, 12), (3, 7, 20), (5,)]:
        cm = gpuloom.compile(m, torch.randn(2, 4), max_batch=buckets[-1], buckets=buckets)
        for n in range(1, buckets[-1] + 1):
            assert cm.bucket_for(n) == min(b for b in buckets if b >= n)
        with pytest.raises(ValueError, match=f"larger than max_batch={buckets[-1]}"):
            cm.bucket_for(buckets[-1] + 1)


def _with_cpu_stand_ins(gm):
    """``gm`` with each cuDNN fused convolution replaced by what it computes, in plain CPU ops: a check
    of the fusion's arguments (which tensor is z, which the bias, the order of the lists)."""
    import torch.nn.functional as F

    from gpuloom.engine import fold

    def conv_relu(x, w, b, stride, padding, dilation, groups):
        return torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups))

    def conv_add_relu(x, w, z, alpha, b, stride, padding, dilation, groups):
        return torch.relu(F.conv2d(x, w, b, stride, padding, dilation, groups) + alpha * z)

    stand_in = {fold._CONV_RELU: conv_relu, fold._CONV_ADD_RELU: conv_add_relu}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in stand_in:
            n.target = stand_in[n.target]
    gm.recompile()
    return gm


class NotFusable(nn.Module):
    """Convolutions the fusion must leave alone, beside two it must fuse."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(4, 4, 3, padding=1)  # -> ReLU: fused
        self.depthwise = nn.Conv2d(4, 4, 3, padding=1, groups=4)  # groups > 1
        self.no_bias = nn.Conv2d(4, 4, 1, bias=False)
        self.two_readers = nn.Conv2d(4, 4, 1)  # its output is read twice
        self.clamped = nn.Conv2d(4, 4, 1)  # hardtanh(-1, 1): not a ReLU6
        self.broadcast = nn.Conv2d(4, 4, 1)  # + a (1, 4, 1, 1) tensor, then ReLU: z is not its shape
        self.b = nn.Conv2d(4, 4, 3, stride=2, padding=1, dilation=1)  # + the residual, then ReLU: fused
        self.skip = nn.Conv2d(4, 4, 1, stride=2)
        self.shift = nn.Parameter(torch.randn(1, 4, 1, 1))

    def forward(self, x):
        y = torch.relu(self.a(x))
        y = torch.relu(self.depthwise(y))
        y = torch.relu(self.no_bias(y))
        t = self.two_readers(y)
        y = torch.relu(t) + t
        y = torch.nn.functional.hardtanh(self.clamped(y), -1.0, 1.0)
        y = torch.relu(self.broadcast(y) + self.shift)
        return torch.relu(self.b(y) + self.skip(y))


class MoreFusable(nn.Module):
    """F.relu6 (fused, then a clamp), an add with the convolution second (fused), and a convolution
    that is also a graph output (left alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = torch.nn.functional.relu6(self.a(x))
        y = torch.relu(x + self.b(y))
        out = self.c(y)
        return torch.relu(out), out


@pytest.mark.parametrize("name, want", [("resnet18", (9, 8)), ("mobilenet_v2", (18, 0)), ("not_fusable", (1, 1)),
                                        ("more_fusable", (1, 1))])
def test_fused_convolutions_compute_what_the_graph_did_and_only_where_they_may(name, want):
    """The fusion's rewrite, run with CPU stand-ins for cuDNN's fused ops (which have no CPU kernel),
    equals eager; it fuses each conv + ReLU / ReLU6 and conv + add + ReLU it may and nothing else."""
    import torchvision

    from gpuloom.engine import fold
    from gpuloom.engine.dag import _export

    torch.manual_seed(0)
    mine = {"not_fusable": NotFusable, "more_fusable": MoreFusable}
    model = mine[name]() if name in mine else getattr(torchvision.models, name)(weights=None)
    model = model.eval()
    channels = 4 if name in mine else 3
    gm = _export(model, (torch.randn(1, channels, 32, 32),), 4)
    fold.fold_batchnorm(gm)
    fold.restore_batchnorm(gm)
    fused = fold.fuse_convolutions(gm)
    counts = [sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is t)
              for t in (fold._CONV_RELU, fold._CONV_ADD_RELU)]
    assert (tuple(counts), fused) == (want, sum(want))
    gm = _with_cpu_stand_ins(gm)
    flat = lambda v: list(v) if isinstance(v, (tuple, list)) else [v]
    for batch in (1, 3):
        x = torch.randn(batch, channels, 32, 32)
        with torch.no_grad():
            got, want_out = flat(gm(x)), flat(model(x))
        assert len(got) == len(want_out)
        for g, w in zip(got, want_out):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_fusion_runs_before_reinplace_so_both_can_be_asked_for():
    import torchvision

    from gpuloom.engine.dag import capture_graph

    m = torchvision.models.resnet18(weights=None).eval()
    g = capture_graph(m, (torch.randn(1, 3, 32, 32),), max_batch=4, reinplace=True, fuse_convolutions=True)
    assert g.fused_convolutions == 17


def test_fused_convolutions_need_a_cuda_device_and_keep_channels_last_working():
    from gpuloom.engine import fold
    from gpuloom.engine.dag import _export

    m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    with pytest.raises(ValueError, match="fuse_convolutions=True .* need a CUDA device"):
        gpuloom.compile(m, torch.randn(1, 3, 8, 8), max_batch=2, fuse_convolutions=True)
    gm = _export(m, (torch.randn(1, 3, 8, 8),), 2)
    assert fold.fuse_convolutions(gm) == 1
    assert fold.channels_last(gm) == 1  # a fused convolution's weight is still found
    (w,) = [p for p in gm.parameters() if p.dim() == 4]
    assert w.is_contiguous(memory_format=torch.channels_last)


def test_fusing_only_the_channels_last_variant_leaves_the_first_graph_unfused_and_equals_eager():
    """compile(fuse_convolutions="channels_last") fuses the channels-last candidate alone (on the H200
    it ran 1.27-1.74x faster fused, the NCHW graph 0.90-1.12x): the first graph keeps its ops, the
    variant fuses every convolution it may, and with CPU stand-ins for cuDNN's fused ops it equals
    eager. On the CPU (no channels-last candidate) the value does nothing; an unknown one is refused."""
    import torchvision

    from gpuloom.engine import fold
    from gpuloom.engine.dag import capture_graph, channels_last_variant

    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None).eval()
    x = torch.randn(2, 3, 32, 32)
    graph = capture_graph(model, (x,), max_batch=4)
    ops = [n.target for n in graph.module.graph.nodes]
    variant = channels_last_variant(graph, fuse_convolutions=True)
    assert [n.target for n in graph.module.graph.nodes] == ops and graph.fused_convolutions == 0
    fused = lambda g: sum(1 for n in g.module.graph.nodes if n.target in (fold._CONV_RELU, fold._CONV_ADD_RELU))
    assert fused(graph) == 0 and variant.fused_convolutions == fused(variant) == 17
    assert variant.channels_last_weights > 0
    assert channels_last_variant(graph).fused_convolutions == 0  # not asked for
    gm = _with_cpu_stand_ins(variant.module)
    y = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(gm(y), model(y), rtol=1e-4, atol=1e-4)

    cm = gpuloom.compile(model, x, max_batch=2, fuse_convolutions="channels_last")
    assert cm.graph.fused_convolutions == 0 and cm.graph_cl is None
    for bad in ("yes", 1):  # 1 is not True: it used to fuse, and would now silently not
        with pytest.raises(ValueError, match="fuse_convolutions must be False, True or 'channels_last'"):
            gpuloom.compile(model, x, max_batch=2, fuse_convolutions=bad)
    # the channels_last="auto" candidate is copied after reinplace, whose in-place ops it cannot fuse
    with pytest.raises(ValueError, match="reinplace=True fuses nothing"):
        gpuloom.compile(model, x, max_batch=2, fuse_convolutions="channels_last", reinplace=True)


def test_compile_fuses_the_channels_last_graph_by_default_and_quietly_not_where_it_cannot():
    """The default since the thirty-fourth session (engine runs 102-104: the fused channels-last
    graph 1.12x the unfused one over ten models, float32 batch 1): None means "channels_last", except
    with reinplace=True and channels_last="auto", where it would fuse nothing; there a default gets
    False while the explicit request is refused (the test above). Explicit values pass through."""
    import inspect

    from gpuloom.engine.compiled import resolve_fuse_convolutions

    assert inspect.signature(gpuloom.compile).parameters["fuse_convolutions"].default is None
    for channels_last in ("auto", True, False):
        assert resolve_fuse_convolutions(None, reinplace=False, channels_last=channels_last) == "channels_last"
        for given in (False, True, "channels_last"):
            assert resolve_fuse_convolutions(given, reinplace=False, channels_last=channels_last) is given
    assert resolve_fuse_convolutions(None, reinplace=True, channels_last="auto") is False
    assert resolve_fuse_convolutions(None, reinplace=True, channels_last=True) == "channels_last"
    with pytest.raises(ValueError, match="must be False, True or 'channels_last'"):
        resolve_fuse_convolutions(0, reinplace=False, channels_last="auto")
    with pytest.raises(ValueError, match="reinplace=True fuses nothing"):  # asked for, not defaulted
        resolve_fuse_convolutions("channels_last", reinplace=True, channels_last="auto")
    # on the CPU the default is a no-op (no channels-last candidate, no fused kernels) and reinplace
    # with it compiles, where the explicit "channels_last" is refused
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval()
    x = torch.randn(2, 3, 8, 8)
    for cm in (gpuloom.compile(model, x, max_batch=2),
               gpuloom.compile(model, x, max_batch=2, reinplace=True, channels_last="auto")):
        assert cm.graph.fused_convolutions == 0 and cm.graph_cl is None
        torch.testing.assert_close(cm(x), model(x), rtol=1e-5, atol=1e-5)


def test_a_rewrite_pass_that_fails_falls_back_to_fx_and_says_which_pass(monkeypatch):
    """A model exported fine but one of gpuloom's passes raised on its graph: the model is still served
    (captured by fx, equal to eager), and the warning names the pass, not torch.export, since that is
    gpuloom's bug and every rewrite asked for is now off."""
    import gpuloom.engine.fold as fold

    def broken(gm):
        raise IndexError("pattern walked off the graph")

    monkeypatch.setattr(fold, "fuse_gates", broken)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with pytest.warns(UserWarning, match=r"gpuloom's fuse_gates pass failed on the exported graph \(IndexError: "
                                         r"pattern walked off the graph; please report it\).*fuse_gates"):
        cm = gpuloom.compile(m, torch.randn(2, 4), max_batch=4, fuse_gates=True)
    assert cm.graph.method == "fx" and cm.graph.fx_because.startswith("fuse_gates: IndexError")
    x = torch.randn(3, 4)
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x))
