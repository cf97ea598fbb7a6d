"""Layer 6: the network face of gpuloom: model repository, KServe v2 / Triton HTTP and gRPC, metrics.

- :mod:`.repository`: read a repository (YAML file or directory) and build its modules safely;
- :mod:`.protocol`: KServe v2 tensors (JSON and Triton's binary data extension), pure numpy;
- :mod:`.core`: validation, submission to the runtime's ``InferenceService``, outcome books;
- :mod:`.http_server` (aiohttp), :mod:`.grpc_server` (tritonclient's generated stubs), :mod:`.server`;
- :mod:`.metrics` (Prometheus), :mod:`.openapi` (the HTTP API's description).

The server adds nothing to scheduling: batching, deadlines and placement are the runtime's.
Submodules are imported on use so ``import gpuloom.serve`` stays light.
"""

#: where the runtime's loop runs: its own thread, the server's HTTP event loop, or the event loop
#: where it can run there and every model's batches are short (Server.runtime_on)
RUNTIME_ON = ("thread", "http", "auto")

#: ``runtime_on="auto"`` hosts the runtime's loop on the HTTP event loop while every loaded model's
#: largest batch takes at most this long (ms). While a batch runs there, everything else the server
#: does waits: a health check behind a 40 ms CPU batch waited 47-197 ms at p99 against 4.5-6 ms on
#: the runtime's own thread (twenty-sixth session, ``docs/reports/serving.md``); 2 ms keeps that wait
#: within the threaded server's own tail. A tiny model gains: one thread hand-off less each way.
AUTO_HOST_MAX_BATCH_MS = 2.0
#: ``gpuloom serve --client-timeout``'s default, seconds: a connection whose client keeps the server
#: waiting this long is closed (``client_timeout.py``; nginx closes an idle keep-alive connection
#: after 75 s and waits 60 s for a request's headers or the next piece of its body)
DEFAULT_CLIENT_TIMEOUT_S = 60.0


def check_client_timeout(seconds: object) -> float:
    """``seconds`` as a client timeout (a finite number > 0), or ValueError saying what was expected."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise ValueError(f"client timeout: expected seconds > 0, got {seconds!r}")
    return float(seconds)


__all__ = ["AUTO_HOST_MAX_BATCH_MS", "DEFAULT_CLIENT_TIMEOUT_S", "RUNTIME_ON", "check_client_timeout", "repository", "protocol", "core",
           "http_server", "grpc_server", "server", "metrics", "openapi"]
