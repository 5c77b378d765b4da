"""Errors of the worker package. The service maps each to a gRPC status."""


class WorkerError(Exception):
    """Base class of worker errors."""


class InvalidRequestError(WorkerError, ValueError):
    """Bad input (gRPC INVALID_ARGUMENT). The message names the field and the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class DuplicateRequestError(InvalidRequestError):
    """A request id that is already in flight (INVALID_ARGUMENT)."""


class QueueFullError(WorkerError):
    """The waiting queue is at its limit (gRPC RESOURCE_EXHAUSTED)."""


class ModelLoadError(WorkerError):
    """A model directory is missing or malformed."""
