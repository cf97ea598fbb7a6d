"""The profile store: interpolation, knee, JSON round trip, lookups, shipped H200 profiles."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuloom.profile.store import GpuInfo, Profile, ProfileError, ProfileStore, model_key
from gpuloom.profile.synthetic import synthetic_profile, zoo

GPU = GpuInfo(name="fake", sm_count=32, sm_granularity=8)


def _profile(rows, batches=(1, 2, 4), sms=(8, 16, 24, 32), name="toy"):
    return Profile(model=name, input_shapes=((3, 8, 8),), dtype="float32", gpu=GPU,
                   batches=batches, sms=sms, latency_ms=rows)


latencies = st.lists(st.lists(st.floats(0.01, 100.0), min_size=4, max_size=4), min_size=3, max_size=3)


@settings(max_examples=60, deadline=None)
@given(latencies, st.floats(8, 40), st.floats(8, 40), st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3, 4]))
def test_latency_is_monotone_in_sms_and_batch(rows, s1, s2, b1, b2):
    p = _profile(rows)
    lo, hi = sorted((s1, s2))
    assert p.latency(b1, hi) <= p.latency(b1, lo) + 1e-9  # more SMs never slower
    small, big = sorted((b1, b2))
    assert p.latency(small, lo) <= p.latency(big, lo) + 1e-9  # a bigger batch never faster


def test_interpolates_linearly_between_measured_sms_and_pads_batches_to_buckets():
    p = _profile(((4.0, 2.0, 1.5, 1.0), (6.0, 3.0, 2.0, 1.5), (9.0, 5.0, 4.0, 3.0)))
    assert p.latency(1, 12) == pytest.approx(3.0)
    assert p.latency(3, 32) == p.latency(4, 32) == 3.0  # batch 3 runs as bucket 4
    assert p.bucket(3) == 4
    assert p.full_latency(2) == 1.5
    assert p.knee(1, eps=0.1) == 32 and p.knee(1, eps=0.5) == 24 and p.knee(1, eps=1.0) == 16
    assert p.throughput(4, 32) == pytest.approx(4000 / 3.0)


def test_noisy_measurements_are_flattened_not_trusted():
    p = _profile(((4.0, 2.0, 2.5, 1.0), (3.0, 3.0, 2.0, 1.5), (9.0, 5.0, 4.0, 3.0)))
    assert p.latency(1, 24) == 2.0  # 24 SMs measured slower than 16: flattened
    assert p.latency(2, 8) == 4.0  # batch 2 measured faster than batch 1: raised


def test_queries_outside_the_measurement_are_errors():
    p = _profile(((4.0, 2.0, 1.5, 1.0),) * 3)
    with pytest.raises(ProfileError, match="batch 5 outside the measured 1..4"):
        p.latency(5, 16)
    with pytest.raises(ProfileError, match="below the smallest measured 8"):
        p.latency(1, 4)


@pytest.mark.parametrize("rows, message", [
    (((1.0, 1.0, 1.0),) * 3, "3 rows x 4 columns"),
    (((1.0, 1.0, 1.0, -1.0),) * 3, "positive"),
])
def test_malformed_profiles_are_rejected(rows, message):
    with pytest.raises(ProfileError, match=message):
        _profile(rows)


def test_json_round_trip_and_schema_check(tmp_path):
    p = synthetic_profile("m", per_item_sm_ms=10.0)
    assert Profile.from_json(json.loads(json.dumps(p.to_json()))) == p
    bad = p.to_json() | {"schema": "gpuloom.profile/0"}
    with pytest.raises(ProfileError, match="schema"):
        Profile.from_json(bad)
    store = ProfileStore(tmp_path / "store")
    path = store.put(p)
    assert path.exists()
    again = ProfileStore(tmp_path / "store")
    assert again.get("m") == p and again.get(model_key("m", ((3, 224, 224),), "float32")) == p


def test_lookup_by_name_is_unambiguous_or_says_which():
    a = synthetic_profile("m", per_item_sm_ms=10.0)
    b = synthetic_profile("m", per_item_sm_ms=10.0, dtype="float16")
    store = ProfileStore(profiles=[a, b, *zoo()])
    with pytest.raises(ProfileError, match="ambiguous"):
        store.get("m")
    with pytest.raises(ProfileError, match="no profile for 'nope'"):
        store.get("nope")
    assert "resnet50" in store and "nope" not in store


def test_shipped_h200_profiles_cover_the_zoo():
    store = ProfileStore.builtin("h200")
    names = {p.model for p in store}
    assert {"resnet50", "resnet101", "inception_v3", "googlenet", "mobilenet_v2", "efficientnet_b0",
            "densenet121", "vgg16", "bert_base"} <= names
    for p in store:
        assert p.gpu.sm_count == 132 and p.sms[-1] == 132 and p.batches[0] == 1
        assert p.source == "measured" and p.runner in ("engine", "graph")
        assert 8 <= p.knee(1) <= 132
    with pytest.raises(ProfileError, match="no shipped profiles for GPU 'a100'"):
        ProfileStore.builtin("a100")
