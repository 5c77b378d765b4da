"""Router errors: one small hierarchy for the whole router package.

Misuse and bad input are ``ValueError`` subclasses whose message names the field and the
limit. The service maps them to gRPC status codes:

- :class:`NoWorkerAvailable` -> UNAVAILABLE (no healthy, non-excluded worker can serve)
- :class:`BlockSizeMismatchError` -> the worker is refused (one block size for the fleet)
- :class:`UnknownWorkerError` -> a bug in the shell (a message for a worker never added)
- :class:`InvalidRouteRequestError` -> INVALID_ARGUMENT
"""

from __future__ import annotations


class RouterError(Exception):
    """Base of every error the router core raises on purpose."""


class NoWorkerAvailable(RouterError):
    """No healthy worker outside the request's exclude set can take the request."""

    def __init__(self, request_id: str, num_workers: int, num_healthy: int, num_excluded: int):
        self.request_id = request_id
        self.num_workers = num_workers
        self.num_healthy = num_healthy
        self.num_excluded = num_excluded
        super().__init__(
            f"no worker available for request {request_id!r}: {num_workers} registered, "
            f"{num_healthy} healthy, {num_excluded} excluded"
        )


class InvalidRouteRequestError(RouterError, ValueError):
    """A route request with a bad field (the message names it and its limit)."""

    def __init__(self, field: str, msg: str):
        self.field = field
        super().__init__(f"{field}: {msg}")


class BlockSizeMismatchError(RouterError, ValueError):
    """A worker announced a block size other than the fleet's (first worker sets it)."""

    def __init__(self, worker_id: str, announced: int, fleet: int):
        self.worker_id = worker_id
        self.announced = announced
        self.fleet = fleet
        super().__init__(
            f"worker {worker_id!r} announced block_size={announced} but the fleet uses "
            f"block_size={fleet}; every worker must use the same block size"
        )


class UnknownWorkerError(RouterError, KeyError):
    """A call named a worker that was never added (or was removed)."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        super().__init__(f"unknown worker {worker_id!r}; call add_worker first")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class DuplicateWorkerError(RouterError, ValueError):
    """add_worker was called twice with the same id."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        super().__init__(f"worker {worker_id!r} is already registered")
