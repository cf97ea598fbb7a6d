import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _graph_cache(tmp_path_factory):
    """The tests' compiles keep their decomposed graphs in a directory of this run's, not the user's
    ~/.cache: a model compiled by two tests is a miss then a hit (both checked against eager)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULOOM_GRAPH_CACHE", str(tmp_path_factory.mktemp("graph-cache")))
        yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _connections_env():
    """The command line sets CUDA_DEVICE_MAX_CONNECTIONS for the rest of the process (gpu/connections.py):
    tests that run it in-process must not leak that into the next test."""
    from gpuloom.gpu import connections

    saved = os.environ.get(connections.ENV), connections._set_value
    yield
    if saved[0] is None:
        os.environ.pop(connections.ENV, None)
    else:
        os.environ[connections.ENV] = saved[0]
    connections._set_value = saved[1]


@pytest.fixture(autouse=True)
def _services_closed():
    """Every test closes the services it starts: an open one keeps the collector's thresholds raised
    and makes a later close freeze again (test_gcpause failed after test_serve.py so). Fixtures of a
    wider scope are set up before and torn down after this one, so their services are not counted."""
    from gpuloom.runtime.gcpause import RareFullCollections

    before = RareFullCollections.holders()
    yield
    left = RareFullCollections.holders() - before
    assert left <= 0, f"the test left {left} InferenceService(s) running: close() what it starts"
