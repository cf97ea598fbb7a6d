"""Fuzz the HTTP API against its own OpenAPI document (schemathesis): no 5xx, answers match the document."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import serve_fake  # noqa: E402

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpuloom.serve.core import ServeCore  # noqa: E402
from gpuloom.serve.openapi import openapi_document  # noqa: E402
from gpuloom.serve.repository import load_repository  # noqa: E402
from gpuloom.serve.server import Server  # noqa: E402

REPO = Path(__file__).resolve().parents[1] / "examples" / "repository"
schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module", params=serve_fake.SERVER_VARIANTS, ids=serve_fake.SERVER_VARIANT_IDS)
def base_url(request):
    """The fuzzed server: HTTP parsed in the runtime's process, by two front-end workers, and in the
    runtime's process with the runtime's loop on the HTTP event loop."""
    repo = load_repository(REPO / "tiny_mlp.yaml")
    service = serve_fake.make_service()
    core = ServeCore(service, repo, max_body_bytes=1 << 20)
    core.load("tiny_mlp")
    server = Server(core, http_port=0, grpc_port=None, **serve_fake.server_variant(request.param))
    addr = server.start()
    yield f"http://{addr.http_url}"
    server.stop()


@schema.parametrize()
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_http_api_conforms_to_its_openapi_document_under_fuzzing(case, base_url):
    response = case.call(base_url=base_url, timeout=10)
    case.validate_response(
        response,
        checks=[not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance],
    )
