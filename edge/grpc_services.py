"""The standard gRPC services every kvroute server (router and worker) exposes beside its own:
health checking and server reflection.

- :class:`HealthServicer` is grpcio-health-checking's asyncio servicer plus ``List`` (added to
  ``grpc.health.v1`` after that servicer was written; the package's servicer still answers
  UNIMPLEMENTED and logs a traceback per call).
- :func:`enable_reflection` serves ``grpc.reflection.v1`` next to ``v1alpha``. grpcio-reflection
  implements only ``v1alpha``, and newer clients (grpcurl, Postman, grpcui) ask for ``v1`` first.
  The two protocols have the same messages with the same field numbers, so the ``v1alpha``
  servicer answers both; only the service name and the descriptor file differ. The ``v1``
  descriptor is derived from the ``v1alpha`` one (package renamed) and added to the default
  descriptor pool, so a client can also describe the ``v1`` service itself.

    health = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection((MY_SERVICE, HEALTH_SERVICE_NAME), server)
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

HEALTH_SERVICE_NAME: str = health.SERVICE_NAME  # grpc.health.v1.Health
REFLECTION_V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
REFLECTION_V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"

_V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):
    """``grpc.health.v1.Health`` with ``List``: every registered service and its status."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        # The base class keeps the statuses in _server_status (a documented-by-annotation
        # attribute it also reads in Check); a snapshot of it is the answer.
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )


def _v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: the v1alpha file with its package renamed."""
    fdp = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = _V1_FILE
    fdp.package = _V1_PACKAGE
    fdp.ClearField("options")  # v1alpha's java/go package options do not apply
    old, new = f".{_V1ALPHA_PACKAGE}.", f".{_V1_PACKAGE}."

    def rename(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
        for message in messages:
            for field in message.field:
                if field.type_name.startswith(old):
                    field.type_name = new + field.type_name[len(old) :]
            rename(message.nested_type)

    rename(fdp.message_type)
    for service in fdp.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    return fdp


def _ensure_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.AddSerializedFile(_v1_file_descriptor().SerializeToString())


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection (v1 and v1alpha) on ``server`` for ``service_names`` plus both
    reflection services themselves."""
    _ensure_v1_descriptor()
    names = (*service_names, REFLECTION_V1_SERVICE_NAME, REFLECTION_V1ALPHA_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (REFLECTION_V1_SERVICE_NAME, REFLECTION_V1ALPHA_SERVICE_NAME):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )


def worker_server_options() -> list[tuple[str, int]]:
    """gRPC server options of a service routers connect to (a kvroute worker, an engine
    bridge). No SO_REUSEPORT: a second server on a taken port must fail, not share it.
    Routers hold one long-lived event stream each and ping it every few seconds, also while
    no call is active: accept those pings instead of answering "too_many_pings"."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
        ("grpc.http2.max_ping_strikes", 0),
    ]
