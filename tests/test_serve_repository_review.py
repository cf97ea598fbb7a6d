"""The model repository's faults found by review (sixty-ninth session): user code that exits, numbers and
names that passed the parse and failed at load, weights' errors, and gpuloom serve's flags."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402,F401  (provides gpuloom.runtime.service until the runtime lands)

import torch  # noqa: E402

from gpuloom.serve.repository import RepositoryError, load_weights, parse_model  # noqa: E402

INPUTS = [{"name": "x", "shape": [4], "dtype": "float32"}]


def _entry(tmp_path, text: str, factory: str = "make", **fields):
    """A model whose source is ``tmp_path/net.py:factory``, ``net.py`` holding ``text``."""
    (tmp_path / "net.py").write_text(text)
    return parse_model({"name": "m", "source": f"net.py:{factory}", "inputs": INPUTS, **fields}, tmp_path / "m.yaml")


def _parse_error(**fields) -> str:
    with pytest.raises(RepositoryError) as e:
        parse_model({"name": "m", "source": "x:y", "inputs": INPUTS, **fields}, Path("/repo/m.yaml"))
    return str(e.value)


# -- user code that calls sys.exit -------------------------------------------------------------------
def test_a_factory_that_calls_sys_exit_is_a_repository_error_naming_it_and_the_process_lives(tmp_path):
    """(Before: SystemExit passed every ``except Exception`` and took the server down.) Ctrl-C still
    stops the process."""
    entry = _entry(tmp_path, "import sys\ndef make():\n    sys.exit(3)\n")
    with pytest.raises(RepositoryError) as e:
        entry.build()
    msg = str(e.value)
    assert "model 'm': factory 'net.py:make' failed: it called sys.exit(3)" in msg, msg
    assert entry.raised_at(e.value) == f"{tmp_path / 'net.py'}:3"  # the log line names where
    with pytest.raises(KeyboardInterrupt):
        _entry(tmp_path, "def make():\n    raise KeyboardInterrupt\n").build()


def test_a_model_file_that_calls_sys_exit_at_import_is_a_repository_error_and_leaves_no_module(tmp_path):
    """argparse at the top of the user's file exits with 2 on an unknown option."""
    before = set(sys.modules)
    entry = _entry(tmp_path, "import argparse, torch\nargparse.ArgumentParser().parse_args(['--nope'])\n"
                             "def make():\n    return torch.nn.Linear(4, 2)\n")
    with pytest.raises(RepositoryError) as e:
        entry.build()
    assert f"running {tmp_path / 'net.py'} failed: it called sys.exit(2)" in str(e.value), str(e.value)
    assert set(sys.modules) - before == set()
    with pytest.raises(KeyboardInterrupt):  # Ctrl-C at start still stops the process
        _entry(tmp_path, "raise KeyboardInterrupt\n").build()


# -- the parse: each of these passed it and failed at load, naming neither field nor file ------------
def test_the_quoted_exponent_hint_is_given_only_for_a_string_that_reads_as_a_number():
    assert "YAML reads 1.0e308 as a string" not in _parse_error(max_batch="eight")
    assert "write 1.0e+308" in _parse_error(rate_hint="1.0e308")
    assert "without quotes" in _parse_error(slo_ms="50")


@pytest.mark.parametrize("fields, needle", [
    ({"seed": 2**70}, "seed must be an integer from 0 to 2**64 - 1"),
    ({"rate_hint": 1.0e308}, "rate_hint must be at most 1000000000 requests/s, found 1e+308"),
    ({"inputs": [{"name": "", "shape": [4], "dtype": "float32"}]}, "inputs[0]: expected a mapping with a non-empty string"),
    ({"outputs": [{"name": "", "shape": [2], "dtype": "float32"}]}, "outputs[0]: expected a mapping with a non-empty"),
])
def test_a_value_that_would_fail_at_load_is_refused_at_parse_naming_file_model_and_field(fields, needle):
    msg = _parse_error(**fields)
    assert msg.startswith("/repo/m.yaml: model 'm': ") and needle in msg, msg


def test_a_seed_is_bounded_to_what_torch_manual_seed_takes(tmp_path):
    assert "seed must be an integer from 0 to 2**64 - 1 (torch.manual_seed's range), found 18446744073709551616" \
        in _parse_error(seed=2**64)
    entry = _entry(tmp_path, "import torch\ndef make():\n    return torch.nn.Linear(4, 2)\n", seed=2**64 - 1)
    assert entry.build()[0].max_batch == 32  # torch.manual_seed(2**64 - 1) runs


def test_a_tensor_without_a_shape_is_an_error_and_one_number_per_sample_is_written_as_an_empty_shape():
    """(Before: a missing shape was taken as one number per sample, and the load failed in torch.)"""
    for fields, where in (({"inputs": [{"name": "x", "dtype": "float32"}]}, "inputs[0] 'x'"),
                          ({"outputs": [{"name": "y"}]}, "outputs[0] 'y'")):
        msg = _parse_error(**fields)
        assert f"/repo/m.yaml: model 'm': {where}: 'shape' is required" in msg and "[] for one number" in msg, msg
    scalar = parse_model({"name": "s", "source": "x:y", "inputs": [{"name": "x", "shape": []}]}, None)
    assert scalar.inputs[0].shape == ()


# -- weights -------------------------------------------------------------------------------------------
def test_a_state_dict_with_keys_that_are_not_names_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "int_keys.pt"
    torch.save({1: torch.zeros(2)}, path)
    with pytest.raises(RepositoryError) as e:
        load_weights(path)
    assert str(e.value) == (f"weights {path}: a state dict's keys must be parameter names (strings), found 1 (int)")


class _Pickled:  # any class: torch.save pickles it by reference, torch.load(weights_only=True) refuses it
    pass


def test_a_refused_pickle_is_one_line_of_ours_that_never_suggests_weights_only_false(tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"w": torch.zeros(2), "extra": _Pickled()}, path)
    with pytest.raises(RepositoryError) as e:
        load_weights(path)
    msg = str(e.value)
    assert "\n" not in msg and "False" not in msg and "Re-running" not in msg, msg
    assert msg.startswith(f"weights {path}: the file holds Python objects beyond tensors (it names ")
    assert "_Pickled" in msg and "does not load (it never runs a pickle" in msg and "safetensors" in msg


# -- sibling modules -------------------------------------------------------------------------------------
def test_a_model_file_imports_a_module_beside_it_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.delitem(sys.modules, "review69_helper", raising=False)
    (tmp_path / "review69_helper.py").write_text("import torch\ndef block():\n    return torch.nn.Linear(4, 2)\n")
    path_before = list(sys.path)
    try:
        config, module = _entry(tmp_path, "from review69_helper import block\ndef make():\n    return block()\n").build()
    finally:
        sys.modules.pop("review69_helper", None)
    assert isinstance(module, torch.nn.Linear) and sys.path == path_before


# -- gpuloom serve's flags ------------------------------------------------------------------------------
@pytest.fixture
def serve_parser():
    from gpuloom.commands import serve

    p = argparse.ArgumentParser(prog="gpuloom serve")
    serve.add_arguments(p)
    return p


@pytest.mark.parametrize("argv, needle", [
    (["--models", "a,a"], "names a more than once in 'a,a'"),
    (["--models", ","], "expected one or more model names"),
    (["--models", ""], "expected one or more model names"),
    (["--drain-timeout", "-5"], "argument --drain-timeout: expected seconds to drain (0: stop without draining): a finite number >= 0"),
    (["--drain-timeout", "nan"], "argument --drain-timeout: expected seconds to drain (0: stop without draining): a finite number >= 0"),
    (["--switch-interval-ms", "-5"], "argument --switch-interval-ms: expected a number of ms in (0, 100]"),
    (["--profiles", "/nonexistent/review69"], "argument --profiles: '/nonexistent/review69' does not exist"),
])
def test_a_flag_that_cannot_be_served_is_an_argparse_error(serve_parser, capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        serve_parser.parse_args(["repo", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_the_models_flag_gives_the_names_and_a_drain_timeout_of_zero_is_allowed(serve_parser, tmp_path):
    args = serve_parser.parse_args(["repo", "--models", " a, b ,", "--drain-timeout", "0", "--profiles", str(tmp_path)])
    assert args.models == ["a", "b"] and args.drain_timeout == 0.0 and args.profiles == str(tmp_path)


def test_a_dtype_may_be_written_as_triton_names_it():
    """``FP32`` and ``TYPE_FP32`` (what the server's own metadata and config report) were refused as
    unknown dtypes (a user's walkthrough, sixty-ninth session)."""
    from gpuloom.serve.repository import _tensors

    got = _tensors([{"name": "x", "shape": [4], "dtype": "FP32"}, {"name": "y", "shape": [], "dtype": "TYPE_INT64"},
                    {"name": "z", "shape": [2], "dtype": "bool"}], "model.yaml inputs")
    assert [t.dtype for t in got] == ["float32", "int64", "bool"]


def test_a_training_checkpoint_is_named_as_one_with_how_to_save_its_weights(tmp_path):
    import torch

    from gpuloom.serve.repository import RepositoryError, load_weights

    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, path)
    with pytest.raises(RepositoryError, match=r"a training checkpoint .*torch.save\(checkpoint\['state_dict'\], PATH\)"):
        load_weights(path)


def test_a_sample_run_to_find_the_outputs_that_fails_names_the_shapes_without_the_batch(tmp_path):
    """With the outputs left out, a batch dimension written into ``shape`` failed without the hint that
    the declared outputs' path gives (a user's walkthrough, sixty-ninth session)."""
    from gpuloom.serve.repository import RepositoryError, load_repository

    (tmp_path / "net.py").write_text("import torch\n\n\ndef make():\n    return torch.nn.Conv2d(3, 4, 3)\n")
    (tmp_path / "cnn.yaml").write_text("name: cnn\nsource: net.py:make\ninputs: [{name: x, shape: [1, 3, 16, 16]}]\n")
    with pytest.raises(RepositoryError, match=r"one zero sample of its inputs \(x \[1, 3, 16, 16\] float32, without "
                                              r"the batch\)"):
        load_repository(tmp_path).models["cnn"].build()
