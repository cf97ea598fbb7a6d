"""Layer 6: the network face of gpuloom: model repository, KServe v2 / Triton HTTP and gRPC, metrics.

- :mod:`.repository`: read a repository (YAML file or directory) and build its modules safely;
- :mod:`.protocol`: KServe v2 tensors (JSON and Triton's binary data extension), pure numpy;
- :mod:`.core`: validation, submission to the runtime's ``InferenceService``, outcome books;
- :mod:`.http_server` (aiohttp), :mod:`.grpc_server` (tritonclient's generated stubs), :mod:`.server`;
- :mod:`.metrics` (Prometheus), :mod:`.openapi` (the HTTP API's description).

The server adds nothing to scheduling: batching, deadlines and placement are the runtime's.
Submodules are imported on use so ``import gpuloom.serve`` stays light.
"""

__all__ = ["repository", "protocol", "core", "http_server", "grpc_server", "server", "metrics", "openapi"]
