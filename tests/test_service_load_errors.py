"""A model whose config does not fit it fails to load with an error that names the declared inputs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_inputs_the_model_cannot_take_are_a_value_error_naming_them_before_any_compile(monkeypatch):
    import gpuloom
    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    monkeypatch.setattr(gpuloom, "compile", lambda *a, **kw: pytest.fail("compiled a model its inputs do not fit"))
    svc = InferenceService(device="cpu")
    svc.start()
    try:
        config = ModelConfig("mlp", (TensorSpec("x", (15,), "float32"),), max_batch=4)
        with pytest.raises(ValueError, match=r"model 'mlp' does not run on one sample of the inputs its config "
                                             r"declares \(x \[15\] float32, without the batch\): RuntimeError: "
                                             r"mat1 and mat2 shapes cannot be multiplied"):
            svc.load(config, torch.nn.Linear(16, 4))
        assert svc.models() == []
    finally:
        svc.close()


def test_a_load_whose_plan_fails_fails_alone_and_the_loaded_models_keep_serving(monkeypatch):
    """A model whose set could not be planned (a ``rate_hint: .inf`` in the repository did it: the
    planner's PlanError) crashed the runtime's loop, and every loaded model with it ("the runtime is
    stopped") for good (a review, sixty-fourth session). Now the load fails and the rest go on."""
    import numpy as np

    from gpuloom.policy.dstack import DStackPolicy
    from gpuloom.runtime.service import InferenceService, ModelConfig, ModelNotReady, TensorSpec

    setup = DStackPolicy.setup

    def refuses_b(self, ctx):
        if "b" in ctx.models:
            raise ValueError("no plan for b (as a PlanError would say)")
        return setup(self, ctx)

    monkeypatch.setattr(DStackPolicy, "setup", refuses_b)
    svc = InferenceService(device="cpu")
    svc.start()
    try:
        torch.manual_seed(0)
        a = torch.nn.Linear(16, 4).eval()
        svc.load(ModelConfig("a", (TensorSpec("x", (16,), "float32"),), max_batch=4, slo_ms=1000), a)
        with pytest.raises(ModelNotReady, match="no plan for b"):
            svc.load(ModelConfig("b", (TensorSpec("x", (16,), "float32"),), max_batch=4, slo_ms=1000),
                     torch.nn.Linear(16, 4).eval())
        assert [c.name for c in svc.models()] == ["a"]
        x = np.random.default_rng(1).standard_normal((1, 16)).astype(np.float32)
        got = svc.submit("a", {"x": x}).result(30)
        with torch.no_grad():
            want = a(torch.from_numpy(x)).numpy()
        np.testing.assert_allclose(next(iter(got.values())), want, rtol=1e-5, atol=1e-6)
    finally:
        svc.close()


def test_an_infinite_rate_hint_or_an_slo_past_an_hour_is_refused_in_the_config():
    from gpuloom.runtime.service import ModelConfig, TensorSpec

    x = (TensorSpec("x", (16,), "float32"),)
    with pytest.raises(ValueError, match="rate_hint must be a finite number"):
        ModelConfig("m", x, rate_hint=float("inf"))
    with pytest.raises(ValueError, match=r"slo_ms must be at most 3600000 \(an hour\)"):
        ModelConfig("m", x, slo_ms=1e12)


def test_a_max_batch_past_the_bound_is_refused_in_the_config():
    """max_batch 1e8 of a 16-float MLP took 28 s and 9.3 GB at load (example inputs and a bucket
    table of that many rows) before it served: bounded now, at the config."""
    from gpuloom.runtime.service import ModelConfig, TensorSpec

    x = (TensorSpec("x", (16,), "float32"),)
    assert ModelConfig("m", x, max_batch=65536).max_batch == 65536
    with pytest.raises(ValueError, match=r"model 'm': max_batch must be at most 65536 rows, got 100000000"):
        ModelConfig("m", x, max_batch=100_000_000)


def test_inputs_named_as_forwards_arguments_but_listed_in_another_order_are_refused():
    """They were passed by position: ``[b, a]`` for ``forward(a, b)`` served ``b - 2a`` for ``a - 2b``."""
    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    class Sub(torch.nn.Module):
        def forward(self, a, b):
            return a - 2 * b

    spec = {n: TensorSpec(n, (4,), "float32") for n in ("a", "b", "x", "y")}
    svc = InferenceService(device="cpu")
    svc.start()
    try:
        with pytest.raises(ValueError, match=r"'b' is input 0 but forward's argument 1; 'a' is input 1 but "
                                             r"forward's argument 0; list the inputs in forward's order"):
            svc.load(ModelConfig("swapped", (spec["b"], spec["a"]), max_batch=2), Sub())
        svc.load(ModelConfig("named", (spec["a"], spec["b"]), max_batch=2), Sub())  # forward's order
        svc.load(ModelConfig("by_position", (spec["x"], spec["y"]), max_batch=2), Sub())  # other names: by position
        import numpy as np

        a, b = np.arange(4, dtype=np.float32)[None], np.ones((1, 4), np.float32)
        assert svc.infer("named", {"a": a, "b": b}, timeout_s=30)["output0"].tolist() == (a - 2 * b).tolist()
        assert sorted(c.name for c in svc.models()) == ["by_position", "named"]
    finally:
        svc.close()


def test_a_submodule_named_as_a_graph_modules_attribute_is_refused_by_name(monkeypatch):
    """``self.meta = nn.Linear(...)`` broke torch.export's graph, reported as an internal error hinting
    at data-dependent control flow (a user's walkthrough, sixty-ninth session)."""
    import gpuloom
    from gpuloom.runtime.service import InferenceService, ModelConfig, TensorSpec

    class Meta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.meta = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.meta(x)

    monkeypatch.setattr(gpuloom, "compile", lambda *a, **kw: pytest.fail("compiled a model export cannot trace"))
    svc = InferenceService(device="cpu")
    svc.start()
    try:
        with pytest.raises(ValueError, match=r"model 'm': its attribute \['meta'\] shares a name with "
                                             r"torch.fx.GraphModule's.*rename it"):
            svc.load(ModelConfig("m", (TensorSpec("x", (4,), "float32"),), max_batch=2), Meta())
    finally:
        svc.close()
