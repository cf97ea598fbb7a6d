"""Workload files, validation, and deterministic arrival generation."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from gpuloom.bench.workload import (
    Arrival,
    ModelSpec,
    Workload,
    WorkloadError,
    arrival_times,
    load_workload,
    resolve_profiles,
    validate,
    workload_from_dict,
)
from gpuloom.profile.store import ProfileStore
from gpuloom.profile.synthetic import zoo

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(scope="module")
def store() -> ProfileStore:
    return ProfileStore(profiles=zoo())


def _wl(*models: ModelSpec, duration_s: float = 20.0, seed: int = 0) -> Workload:
    return Workload(models=models, duration_s=duration_s, seed=seed)


# -- reading ----------------------------------------------------------------------------------
def test_yaml_file_loads_with_every_arrival_kind(tmp_path: Path) -> None:
    (tmp_path / "ts.txt").write_text("# seconds\n0.0\n0.1\n0.25\n0.5\n")
    (tmp_path / "w.yaml").write_text(
        """
duration_s: 10
seed: 7
models:
  - {name: resnet50, slo_ms: 25, rate: 100}
  - {name: vgg16, slo_ms: 100, weight: 2, arrival: {kind: onoff, rate: 50, on_s: 1, off_s: 3}}
  - {name: bert_base, slo_ms: 60, arrival: {kind: piecewise, segments: [[0, 10], [5, 30]]}}
  - {name: mobilenet_v2, slo_ms: 10, arrival: {kind: trace, trace: ts.txt}}
"""
    )
    w = load_workload(tmp_path / "w.yaml")
    assert w.seed == 7 and w.duration_s == 10
    assert w.spec("resnet50").arrival == Arrival("poisson", rate=100)
    assert w.spec("vgg16").weight == 2
    assert w.spec("bert_base").arrival.segments == ((0.0, 10.0), (5.0, 30.0))
    assert Path(w.spec("mobilenet_v2").arrival.trace) == tmp_path / "ts.txt"  # resolved against the file


def test_json_file_and_to_dict_round_trip(tmp_path: Path) -> None:
    w = _wl(
        ModelSpec("resnet50", 25, arrival=Arrival("poisson", rate=100)),
        ModelSpec("vgg16", 100, 3.0, Arrival("piecewise", segments=((0, 5), (2, 9)))),
    )
    (tmp_path / "w.json").write_text(json.dumps(w.to_dict()))
    assert load_workload(tmp_path / "w.json") == w
    assert workload_from_dict(w.to_dict()) == w


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"duration_s": 10, "models": []}, "at least one model"),
        ({"models": [{"name": "a", "slo_ms": 5, "rate": 1}]}, "duration_s"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "rate": -3}]}, "rate must be > 0"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "rate": 0}]}, "rate must be > 0"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": -5, "rate": 1}]}, "slo_ms"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "rate": 1, "weight": 0}]}, "weight"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "arrival": {"kind": "gamma"}}]}, "one of"),
        (
            {"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "arrival": {"kind": "piecewise", "segments": [[1, 5]]}}]},
            "ascend strictly from 0",
        ),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "rate": 1}, {"name": "a", "slo_ms": 9, "rate": 1}]}, "repeated"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5, "rate": 1, "sla": 3}]}, "unknown keys"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": 5}]}, "needs 'arrival'"),
        ({"duration_s": 0, "models": [{"name": "a", "slo_ms": 5, "rate": 1}]}, "duration_s"),
        ({"duration_s": 10, "models": [{"name": "a", "slo_ms": "fast", "rate": 1}]}, "slo_ms must be a number"),
    ],
)
def test_malformed_workloads_raise_workload_error_naming_the_problem(data: dict, needle: str) -> None:
    with pytest.raises(WorkloadError, match=needle):
        workload_from_dict(data)


def test_missing_file_and_bad_yaml_raise_workload_error(tmp_path: Path) -> None:
    with pytest.raises(WorkloadError, match="does not exist"):
        load_workload(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("models: [unclosed\n")
    with pytest.raises(WorkloadError, match="not valid YAML"):
        load_workload(tmp_path / "bad.yaml")


# -- validation against profiles ---------------------------------------------------------------
def test_validate_rejects_unknown_model_listing_known(store: ProfileStore) -> None:
    w = _wl(ModelSpec("resnet5O", 25, arrival=Arrival("poisson", rate=10)))
    with pytest.raises(WorkloadError, match="resnet5O.*known"):
        validate(w, store)


def test_validate_rejects_slo_below_fastest_latency(store: ProfileStore) -> None:
    fastest = store.get("vgg16").min_latency()
    w = _wl(ModelSpec("vgg16", fastest * 0.9, arrival=Arrival("poisson", rate=10)))
    with pytest.raises(WorkloadError, match="below its fastest possible latency"):
        validate(w, store)
    validate(_wl(ModelSpec("vgg16", fastest * 1.1, arrival=Arrival("poisson", rate=10))), store)


def test_validate_reports_every_problem_at_once(store: ProfileStore, tmp_path: Path) -> None:
    w = _wl(
        ModelSpec("nosuch", 25, arrival=Arrival("poisson", rate=10)),
        ModelSpec("vgg16", 0.01, arrival=Arrival("poisson", rate=10)),
        ModelSpec("resnet50", 25, arrival=Arrival("trace", trace=str(tmp_path / "missing.txt"))),
        ModelSpec("bert_base", 60, arrival=Arrival("piecewise", segments=((0, 0), (50, 10)))),  # nothing in 20 s
    )
    with pytest.raises(WorkloadError) as e:
        validate(w, store)
    msg = str(e.value)
    assert "nosuch" in msg and "vgg16" in msg and "missing.txt" in msg and "no requests arrive" in msg


def test_examples_load_and_validate_against_the_synthetic_zoo(store: ProfileStore) -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert {f.stem for f in files} >= {"mix6", "light3", "overload", "bursty", "shift"}
    for f in files:
        validate(load_workload(f), store)
    mix = load_workload(EXAMPLES / "mix6.yaml")
    assert {m.name for m in mix.models} == {p.model for p in zoo()}
    assert all(10 <= m.slo_ms <= 100 for m in mix.models)


def test_resolve_profiles_falls_back_to_synthetic_with_a_warning() -> None:
    w = load_workload(EXAMPLES / "mix6.yaml")
    store, warnings = resolve_profiles(w, gpu="no-such-gpu")
    assert all(m.name in store for m in w.models)
    assert warnings and "SYNTHETIC" in warnings[0]
    _, warnings = resolve_profiles(w, synthetic=True)
    assert "SYNTHETIC" in warnings[0]


# -- arrivals -----------------------------------------------------------------------------------
def test_arrivals_are_deterministic_per_seed_and_per_model() -> None:
    a = ModelSpec("resnet50", 25, arrival=Arrival("poisson", rate=200))
    b = ModelSpec("vgg16", 100, arrival=Arrival("onoff", rate=100, on_s=1, off_s=1))
    t1 = arrival_times(_wl(a, b, seed=3))
    assert t1 == arrival_times(_wl(a, b, seed=3))
    assert t1["resnet50"] != arrival_times(_wl(a, b, seed=4))["resnet50"]
    # adding or removing another model does not change this model's arrivals
    assert arrival_times(_wl(a, seed=3))["resnet50"] == t1["resnet50"]


@pytest.mark.parametrize(
    "arrival",
    [
        Arrival("poisson", rate=500),
        Arrival("onoff", rate=800, on_s=0.5, off_s=1.5),
        Arrival("piecewise", segments=((0, 100), (10, 900), (15, 0))),
    ],
)
def test_arrivals_are_sorted_in_range_and_match_the_mean_rate(arrival: Arrival) -> None:
    w = _wl(ModelSpec("m", 50, arrival=arrival), duration_s=20.0, seed=11)
    ts = arrival_times(w)["m"]
    assert ts == sorted(ts) and ts[0] >= 0 and ts[-1] < 20.0
    expected = w.mean_rate("m") * 20.0
    assert abs(len(ts) - expected) <= 4 * math.sqrt(expected)  # Poisson count: 4 sigma


def test_onoff_is_silent_when_off_and_piecewise_follows_segments() -> None:
    w = _wl(
        ModelSpec("on", 50, arrival=Arrival("onoff", rate=400, on_s=1, off_s=3)),
        ModelSpec("pw", 50, arrival=Arrival("piecewise", segments=((0, 50), (10, 1000)))),
        duration_s=20.0,
    )
    t = arrival_times(w)
    assert all((x % 4.0) < 1.0 for x in t["on"])
    assert w.mean_rate("on") == pytest.approx(100.0)
    early = sum(1 for x in t["pw"] if x < 10)
    late = len(t["pw"]) - early
    assert early < 800 and late > 8000  # 500 vs 10000 expected
    assert w.mean_rate("pw") == pytest.approx((50 * 10 + 1000 * 10) / 20)


def test_trace_replays_scaled_and_repeats(tmp_path: Path) -> None:
    (tmp_path / "ts.txt").write_text("\n".join(str(x) for x in (0.0, 0.5, 1.0, 1.5)))
    w = _wl(ModelSpec("m", 50, arrival=Arrival("trace", trace=str(tmp_path / "ts.txt"))), duration_s=6.0)
    ts = arrival_times(w)["m"]
    assert ts == [0.5 * i for i in range(12)]  # period 2 s (last stamp + mean gap), tiled
    fast = arrival_times(w.scaled(2.0))["m"]
    assert fast == [0.25 * i for i in range(24)]
    assert w.scaled(2.0).mean_rate("m") == pytest.approx(2 * w.mean_rate("m"))


def test_a_trace_of_timestamps_all_zero_repeats_every_second_instead_of_hanging(tmp_path: Path) -> None:
    """Its period was 0 s (last stamp plus a mean gap of 0), and tiling it never reached the run's end:
    `gpuloom plan` and `simulate` hung (a review, sixty-fourth session)."""
    (tmp_path / "ts.txt").write_text("0\n0\n0\n")
    w = _wl(ModelSpec("m", 50, arrival=Arrival("trace", trace=str(tmp_path / "ts.txt"))), duration_s=3.0)
    assert arrival_times(w)["m"] == [0.0] * 3 + [1.0] * 3 + [2.0] * 3


def test_scaled_multiplies_every_mean_rate() -> None:
    w = load_workload(EXAMPLES / "bursty.yaml")
    s = w.scaled(1.5)
    for m in w.models:
        assert s.mean_rate(m.name) == pytest.approx(1.5 * w.mean_rate(m.name))
    with pytest.raises(WorkloadError):
        w.scaled(0)


def test_demands_carry_slo_weight_and_mean_or_peak_rate() -> None:
    w = load_workload(EXAMPLES / "bursty.yaml")
    mean = {d.model: d for d in w.demands()}
    peak = {d.model: d for d in w.demands(peak=True)}
    assert mean["resnet50"].rate == pytest.approx(450.0) and peak["resnet50"].rate == 1800.0
    assert mean["resnet50"].slo_ms == w.spec("resnet50").slo_ms


def test_model_spec_requires_an_arrival() -> None:
    with pytest.raises(WorkloadError, match="arrival must be an Arrival"):
        ModelSpec("resnet50", 25.0)


# -- clients' own deadlines ---------------------------------------------------------------------
def test_deadline_factors_give_each_request_its_own_deadline_without_moving_the_arrivals():
    import dataclasses
    from collections import Counter

    from gpuloom.bench.experiment import make_requests
    from gpuloom.bench.workload import deadlines_ms, workload_from_dict

    data = {"duration_s": 20, "seed": 1, "models": [
        {"name": "resnet50", "slo_ms": 40, "rate": 200, "deadline_factors": [0.25, 1, 4]},
        {"name": "bert_base", "slo_ms": 80, "rate": 50}]}
    wl = workload_from_dict(data)
    assert wl.models[0].deadline_factors == (0.25, 1.0, 4.0) and wl.models[1].deadline_factors == ()
    assert workload_from_dict(wl.to_dict()) == wl  # round trip; a model without factors writes none
    assert "deadline_factors" not in wl.to_dict()["models"][1]
    plain = dataclasses.replace(wl, models=(dataclasses.replace(wl.models[0], deadline_factors=()), wl.models[1]))
    reqs, before = make_requests(wl), make_requests(plain)
    assert [(r.model, r.arrival_ms) for r in reqs] == [(r.model, r.arrival_ms) for r in before]  # same arrivals
    due = Counter(round(r.deadline_ms - r.arrival_ms, 6) for r in reqs if r.model == "resnet50")
    assert set(due) == {10.0, 40.0, 160.0} and min(due.values()) > 0.28 * sum(due.values())  # about a third each
    assert {round(r.deadline_ms - r.arrival_ms, 6) for r in reqs if r.model == "bert_base"} == {80.0}
    times = {"resnet50": [0.0] * 5, "bert_base": [0.0] * 2}
    assert deadlines_ms(wl, times) == deadlines_ms(wl, times)  # deterministic for the seed
    assert deadlines_ms(wl, times)["bert_base"] == [80.0, 80.0]


@pytest.mark.parametrize("bad", [[0], [-1.0], ["x"], 2.0, [True]])
def test_bad_deadline_factors_are_refused(bad):
    from gpuloom.bench.workload import workload_from_dict

    data = {"duration_s": 1, "models": [{"name": "resnet50", "slo_ms": 40, "rate": 10, "deadline_factors": bad}]}
    with pytest.raises(WorkloadError, match="deadline_factors"):
        workload_from_dict(data)


def test_simulated_dstack_serves_nothing_late_under_clients_own_deadlines():
    import dataclasses

    from gpuloom.bench.experiment import simulate
    from gpuloom.bench.workload import load_workload, resolve_profiles

    wl = load_workload("examples/mix6.yaml")
    wl = dataclasses.replace(wl, duration_s=2.0, models=tuple(
        dataclasses.replace(m, deadline_factors=(0.25, 1.0, 4.0)) for m in wl.models))
    profiles, _ = resolve_profiles(wl, profiles_dir=None, synthetic=False)
    run = simulate(wl, profiles, "dstack")
    served = [r for r in run.record.results if r.status.name == "SERVED"]
    assert served and all(r.finish_ms <= r.request.deadline_ms + 1e-9 for r in served)
