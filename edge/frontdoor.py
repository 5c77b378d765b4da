"""What every front door (gRPC, OpenAI HTTP) of the router and the worker shares.

One request path, several front doors: a front end object (the router's ``Frontend``, the
worker's servicer logic) validates, tokenizes, routes and relays, and raises a
:class:`ServiceError` when it must refuse. Each error class carries the gRPC status code
and the HTTP status it maps to (like h11's ``error_status_hint``), so each shell has one
mapping instead of a handler per method::

    ServiceError              grpc code            HTTP  OpenAI error type
    ├── BadRequest            INVALID_ARGUMENT     400   invalid_request_error
    ├── Unauthenticated       UNAUTHENTICATED      401   authentication_error
    ├── PermissionDenied      PERMISSION_DENIED    403   permission_error
    ├── NotFound              NOT_FOUND            404   not_found_error
    ├── Overloaded            RESOURCE_EXHAUSTED   429   rate_limit_error
    ├── Unavailable           UNAVAILABLE          503   service_unavailable
    ├── DeadlineExceeded      DEADLINE_EXCEEDED    504   timeout
    └── Internal              INTERNAL             500   internal_error

This module imports neither grpc nor an HTTP stack: codes are grpc.StatusCode *names*.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kvroute_proto import kvroute_pb2 as pb


class ServiceError(Exception):
    """A request refused on purpose. ``message`` names the field and the limit."""

    grpc_code: ClassVar[str] = "INTERNAL"
    http_status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after_s: float | None = None
    ):
        super().__init__(message)
        self.message = message
        self.param = param  # the offending field, when there is one (OpenAI's "param")
        self.retry_after_s = retry_after_s  # a hint for 429/503 (HTTP Retry-After)


class BadRequest(ServiceError):
    grpc_code = "INVALID_ARGUMENT"
    http_status = 400
    error_type = "invalid_request_error"


class Unauthenticated(ServiceError):
    grpc_code = "UNAUTHENTICATED"
    http_status = 401
    error_type = "authentication_error"


class PermissionDenied(ServiceError):
    grpc_code = "PERMISSION_DENIED"
    http_status = 403
    error_type = "permission_error"


class NotFound(ServiceError):
    grpc_code = "NOT_FOUND"
    http_status = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    """The request names a model this server does not serve (OpenAI: 404 model_not_found)."""

    code = "model_not_found"


class Overloaded(ServiceError):
    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429
    error_type = "rate_limit_error"


class Unavailable(ServiceError):
    grpc_code = "UNAVAILABLE"
    http_status = 503
    error_type = "service_unavailable"


class DeadlineExceeded(ServiceError):
    grpc_code = "DEADLINE_EXCEEDED"
    http_status = 504
    error_type = "timeout"


class Internal(ServiceError):
    grpc_code = "INTERNAL"
    http_status = 500
    error_type = "internal_error"


_BY_GRPC_CODE: dict[str, type[ServiceError]] = {
    cls.grpc_code: cls
    for cls in (
        BadRequest,
        Unauthenticated,
        PermissionDenied,
        NotFound,
        Overloaded,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}


def error_for_grpc_code(code_name: str, message: str) -> ServiceError:
    """The ServiceError for a gRPC status code name (an upstream's answer passed on)."""
    return _BY_GRPC_CODE.get(code_name, Internal)(message)


@dataclass(frozen=True, slots=True)
class CallInfo:
    """What a front door knows about the call, protocol-neutral.

    ``metadata``: lower-case header/metadata pairs (tenancy, W3C trace context, auth);
    ``timeout_s``: the client's remaining time, None when it set none;
    ``tenant_id``: the tenant the shell's authentication established (an API key's), None
    when the call was not authenticated (edge.auth).
    """

    metadata: tuple[tuple[str, str], ...] = ()
    timeout_s: float | None = None
    tenant_id: str | None = None

    @classmethod
    def from_mapping(
        cls,
        headers: Mapping[str, str],
        timeout_s: float | None = None,
        tenant_id: str | None = None,
    ) -> CallInfo:
        return cls(tuple((k.lower(), v) for k, v in headers.items()), timeout_s, tenant_id)


class GenerationBackend(Protocol):
    """A front end the HTTP (and gRPC) shells adapt: the router's Frontend, a worker.

    ``generate`` yields the same messages the gRPC Generate stream carries (chunks, then one
    Finished) and raises ServiceError to refuse. Closing the iterator early (a client
    disconnect) aborts the request wherever it runs.
    """

    @property
    def model_name(self) -> str: ...

    def generate(
        self, request: pb.GenerateRequest, call: CallInfo
    ) -> AsyncGenerator[pb.GenerateResponse, None]: ...
