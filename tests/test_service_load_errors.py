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
