"""The OpenAPI 3.0 description of gpuloom's HTTP API (served at ``/openapi.json``; fuzzed in the tests).

Covers the KServe v2 REST routes in their JSON form. The binary tensor data extension
(``Inference-Header-Content-Length``) is described on the infer operation but cannot be expressed as
a JSON schema; tritonclient exercises it in the tests instead.
"""

from __future__ import annotations

from typing import Any

__all__ = ["openapi_document"]

_DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64"]


def _err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(desc: str, ref: str | None = None, schema: dict | None = None) -> dict[str, Any]:
    s = {"$ref": f"#/components/schemas/{ref}"} if ref else (schema or {"type": "object"})
    return {"description": desc, "content": {"application/json": {"schema": s}}}


def openapi_document() -> dict[str, Any]:
    from .. import __version__

    model = {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
    version = {"name": "version", "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
    e4 = {"400": _err("bad request: what was expected and what was found"), "404": _err("unknown model or version")}
    paths: dict[str, Any] = {
        "/v2/health/live": {"get": {"operationId": "serverLive", "responses": {"200": _json("live"), "503": _json("not live")}}},
        "/v2/health/ready": {"get": {"operationId": "serverReady", "responses": {"200": _json("ready"), "503": _json("not ready")}}},
        "/v2": {"get": {"operationId": "serverMetadata", "responses": {"200": _json("server metadata", "ServerMetadata")}}},
        "/v2/models/stats": {"get": {"operationId": "allModelStats", "responses": {"200": _json("statistics of every model")}}},
        "/v2/repository/index": {"post": {
            "operationId": "repositoryIndex",
            "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": _json("models and their states", schema={"type": "array", "items": {"$ref": "#/components/schemas/IndexEntry"}}), "400": _err("bad body")}}},
        "/v2/repository/models/{model}/load": {"post": {
            "operationId": "repositoryLoad", "parameters": [model],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": _json("loaded"), **e4}}},
        "/v2/repository/models/{model}/unload": {"post": {
            "operationId": "repositoryUnload", "parameters": [model],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {"type": "object"}}}},
            "responses": {"200": _json("unloaded"), **e4}}},
        "/metrics": {"get": {"operationId": "metrics", "responses": {"200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
    }
    for suffix, params, tag in (("", [model], ""), ("/versions/{version}", [model, version], "Version")):
        base = "/v2/models/{model}" + suffix
        paths[base] = {"get": {"operationId": f"modelMetadata{tag}", "parameters": params, "responses": {"200": _json("model metadata", "ModelMetadata"), **e4}}}
        paths[base + "/ready"] = {"get": {"operationId": f"modelReady{tag}", "parameters": params, "responses": {"200": _json("ready"), **e4}}}
        paths[base + "/config"] = {"get": {"operationId": f"modelConfig{tag}", "parameters": params, "responses": {"200": _json("Triton-style model configuration"), **e4}}}
        paths[base + "/stats"] = {"get": {"operationId": f"modelStats{tag}", "parameters": params, "responses": {"200": _json("statistics"), **e4}}}
        paths[base + "/infer"] = {"post": {
            "operationId": f"infer{tag}", "parameters": params,
            "description": "JSON tensors; or Triton's binary tensor data extension: header Inference-Header-Content-Length "
                           "gives the JSON part's length, inputs carry parameters.binary_data_size, binary data follows. "
                           "Parameter 'timeout' (microseconds) or header X-Gpuloom-Deadline-Ms sets the deadline; "
                           "the model's SLO otherwise.",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/InferRequest"}}}},
            "responses": {
                "200": _json("outputs", "InferResponse"), **e4,
                "413": _err("body over the configured limit"),
                "415": _err("unsupported Content-Encoding"),
                "429": _err("overloaded: retry after Retry-After seconds"),
                "503": _err("not ready, shutting down, or dropped"),
                "504": _err("deadline passed before the request ran"),
            }}}
    tensor = {
        "type": "object", "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string"},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": _DATATYPES},
            "parameters": {"type": "object"},
            "data": {"type": "array"},
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {"title": "gpuloom inference server (KServe v2 / Open Inference Protocol)", "version": __version__},
        "paths": paths,
        "components": {"schemas": {
            "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
            "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"], "properties": {
                "name": {"type": "string"}, "version": {"type": "string"}, "extensions": {"type": "array", "items": {"type": "string"}}}},
            "TensorMetadata": {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
                "name": {"type": "string"}, "datatype": {"type": "string"}, "shape": {"type": "array", "items": {"type": "integer"}}}},
            "ModelMetadata": {"type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"], "properties": {
                "name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}}, "platform": {"type": "string"},
                "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}},
                "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}}}},
            "InferTensor": tensor,
            "InferRequest": {"type": "object", "required": ["inputs"], "properties": {
                "id": {"type": "string"}, "parameters": {"type": "object"},
                "inputs": {"type": "array", "minItems": 1, "items": {"$ref": "#/components/schemas/InferTensor"}},
                "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string"}, "parameters": {"type": "object"}}}}}},
            "InferResponse": {"type": "object", "required": ["model_name", "outputs"], "properties": {
                "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
                "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/InferTensor"}}}},
            "IndexEntry": {"type": "object", "required": ["name", "state"], "properties": {
                "name": {"type": "string"}, "version": {"type": "string"}, "state": {"type": "string"}, "reason": {"type": "string"}}},
        }},
    }
