"""The errors the inference service raises or fails a request's future with.

Each names what happened to one request; the server maps them to HTTP / gRPC statuses (unknown model
404, invalid input 400, overload 429 or 503 with Retry-After, deadline 504, ...).
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the service raises or fails a future with."""


class UnknownModel(ServiceError, KeyError):
    """No model of that name is loaded."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelNotReady(ServiceError):
    """The model is loading or unloading, or the service is not running."""


class InvalidInput(ServiceError, ValueError):
    """Wrong input names, shapes or dtypes; the message says what was expected."""


class Overloaded(ServiceError):
    """The model's queue is full; retry after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Shed(Overloaded):
    """The model is over its planned share of an overloaded GPU or host (the policy's ``admit_rps``:
    dstack's plan, or with ``adapt`` what the model delivers on time): refused at once rather than
    queued to miss its deadline; retry after ``retry_after_s`` seconds."""


class DeadlineExceeded(ServiceError):
    """The request could not be answered by its deadline."""


class Expired(DeadlineExceeded):
    """The runtime had not answered the request ``expiry_grace_s`` after its deadline: the service
    answered it instead (a safety net; each one is logged as an error, it means a runtime bug)."""


class Dropped(ServiceError):
    """The scheduler dropped the request; ``reason`` says why (e.g. "shutdown", "model unloaded")."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"request dropped: {reason}")
        self.reason = reason


class ModelFailed(ServiceError):
    """The model's execution failed for this request's batch; the message carries the error."""


__all__ = [
    "DeadlineExceeded", "Dropped", "Expired", "InvalidInput", "ModelFailed", "ModelNotReady", "Overloaded",
    "ServiceError", "Shed", "UnknownModel",
]
