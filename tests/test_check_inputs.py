"""protocol.check_inputs: its fast path (one look per input, for requests that match exactly) agrees
with the full check on every request: both accept, or both refuse with the same message."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.serve.protocol import ProtocolError, _check_inputs_fully, check_inputs

DTYPES = ["float32", "float16", "int64", "uint8"]


def _spec(name, shape, dtype):
    return SimpleNamespace(name=name, shape=tuple(shape), dtype=dtype)


@st.composite
def _case(draw):
    n_in = draw(st.integers(0, 3))
    specs = [_spec(f"x{draw(st.integers(0, 3)) if draw(st.integers(0, 9)) == 0 else i}",  # now and then a repeated name
                   draw(st.lists(st.sampled_from([-1, 1, 2, 3]), max_size=2)), draw(st.sampled_from(DTYPES)))
             for i in range(n_in)]
    config = SimpleNamespace(name="m", inputs=tuple(specs), max_batch=draw(st.integers(1, 4)))
    inputs = {}
    for s in specs:
        if draw(st.integers(0, 9)) == 0:
            continue  # a missing input
        shape = [draw(st.integers(0, 5))] + [d if d > 0 and draw(st.integers(0, 7)) else draw(st.integers(1, 3))
                                             for d in s.shape]
        if draw(st.integers(0, 9)) == 0:
            shape = shape[:-1] if draw(st.booleans()) else shape + [1]  # a wrong rank (a 0-d array among them)
        dtype = s.dtype if draw(st.integers(0, 7)) else draw(st.sampled_from(DTYPES))
        inputs[s.name] = np.zeros(shape, dtype=dtype)
    if draw(st.integers(0, 9)) == 0:
        inputs["extra"] = np.zeros((1,), np.float32)
    return config, inputs


def _verdict(check, config, inputs):
    try:
        check(config, inputs)
        return None
    except ProtocolError as e:
        return (e.status, str(e))


@settings(max_examples=600, deadline=None)
@given(_case())
def test_the_fast_path_agrees_with_the_full_check(case):
    config, inputs = case
    assert _verdict(check_inputs, config, inputs) == _verdict(_check_inputs_fully, config, inputs)


def test_exact_requests_pass_and_each_rule_still_refuses_with_what_was_expected():
    config = SimpleNamespace(name="m", inputs=(_spec("a", (3, 2), "float32"), _spec("b", (), "int64")), max_batch=4)
    ok = {"a": np.zeros((2, 3, 2), np.float32), "b": np.zeros((2,), np.int64)}
    check_inputs(config, ok)
    bad = {
        "datatype FP32": {**ok, "a": np.zeros((2, 3, 2), np.float64)},
        "shape ['b', 3, 2]": {**ok, "a": np.zeros((2, 3, 3), np.float32)},
        "batch 5 outside 1..4": {"a": np.zeros((5, 3, 2), np.float32), "b": np.zeros((5,), np.int64)},
        "disagree on the batch size": {**ok, "b": np.zeros((1,), np.int64)},
        "missing ['b']": {"a": ok["a"]},
    }
    for expected, inputs in bad.items():
        with pytest.raises(ProtocolError, match=expected.replace("[", r"\[").replace("]", r"\]")):
            check_inputs(config, inputs)


def test_specs_that_repeat_a_name_take_the_full_check():
    """Only a config built by hand can repeat a name (ModelConfig refuses to): two specs named "a" must
    not let an unexpected input through because each of them finds "a"."""
    config = SimpleNamespace(name="m", inputs=(_spec("a", (2,), "float32"), _spec("a", (2,), "float32")), max_batch=4)
    inputs = {"a": np.zeros((1, 2), np.float32), "extra": np.zeros((1, 2), np.float32)}
    with pytest.raises(ProtocolError, match=r"unexpected \['extra'\]"):
        check_inputs(config, inputs)


def test_only_an_exact_match_says_so():
    """True tells the runtime it need not check again: never for a request that passed by a wildcard."""
    exact = SimpleNamespace(name="m", inputs=(_spec("a", (3,), "float32"),), max_batch=4)
    wild = SimpleNamespace(name="m", inputs=(_spec("a", (-1,), "float32"),), max_batch=4)
    x = np.zeros((2, 3), np.float32)
    assert check_inputs(exact, {"a": x}) is True
    assert check_inputs(wild, {"a": x}) is False


@settings(max_examples=300, deadline=None)
@given(_case())
def test_a_request_said_to_match_exactly_has_each_specs_dtype_and_shape(case):
    config, inputs = case
    try:
        exact = check_inputs(config, inputs)
    except ProtocolError:
        return
    if exact:
        batch = {a.shape[0] for a in inputs.values()}
        assert len(batch) == 1 and 1 <= batch.pop() <= config.max_batch
        assert set(inputs) == {s.name for s in config.inputs} and len(inputs) == len(config.inputs)
        for s in config.inputs:
            assert inputs[s.name].dtype == np.dtype(s.dtype) and inputs[s.name].shape[1:] == tuple(s.shape)
