"""Health ``List`` and reflection ``v1`` on a real router and a real worker (127.0.0.1 port 0).

grpcio's stock servicers answer ``Health/List`` with UNIMPLEMENTED (logging a traceback per
call) and serve only ``grpc.reflection.v1alpha``; kvroute's servers answer both cleanly.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

from tests.router.service.router_harness import running_router, sim_worker

SERVING = health_pb2.HealthCheckResponse.SERVING
REFLECTION_PATHS = {
    "v1": "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "v1alpha": "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
}


@contextlib.asynccontextmanager
async def _server(kind: str) -> AsyncIterator[tuple[str, str]]:
    """(address, kvroute service name) of a running worker or router."""
    async with sim_worker("w0") as w:
        if kind == "worker":
            yield w.address, "kvroute.v1.Worker"
        else:
            async with running_router([w.address]) as r:
                await r.wait_healthy(1)
                yield r.address, "kvroute.v1.Router"


async def _reflect(
    channel: grpc.aio.Channel, version: str, request: v1alpha_pb2.ServerReflectionRequest
) -> v1alpha_pb2.ServerReflectionResponse:
    # v1 and v1alpha messages are the same on the wire; the method path picks the protocol.
    call = channel.stream_stream(
        REFLECTION_PATHS[version],
        request_serializer=v1alpha_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=v1alpha_pb2.ServerReflectionResponse.FromString,
    )(iter([request]), timeout=5)
    responses = [r async for r in call]
    assert len(responses) == 1
    return responses[0]


@pytest.mark.parametrize("kind", ["worker", "router"])
async def test_health_list_answers_every_service(kind, caplog):
    caplog.set_level(logging.WARNING)
    async with _server(kind) as (address, service), grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.List(health_pb2.HealthListRequest(), timeout=5)
        check = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert resp.statuses[""].status == SERVING
    assert resp.statuses[service].status == check.status == SERVING
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert errors == []


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
@pytest.mark.parametrize("kind", ["worker", "router"])
async def test_reflection_lists_and_describes_services(kind, version):
    async with _server(kind) as (address, service), grpc.aio.insecure_channel(address) as channel:
        listed = await _reflect(
            channel, version, v1alpha_pb2.ServerReflectionRequest(list_services="")
        )
        names = {s.name for s in listed.list_services_response.service}
        described = {}
        for symbol in (service, "grpc.reflection.v1.ServerReflection"):
            resp = await _reflect(
                channel,
                version,
                v1alpha_pb2.ServerReflectionRequest(file_containing_symbol=symbol),
            )
            assert not resp.HasField("error_response"), resp.error_response
            protos = resp.file_descriptor_response.file_descriptor_proto
            described[symbol] = [descriptor_pb2.FileDescriptorProto.FromString(p) for p in protos]
    assert {
        service,
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    assert any(f.package == "kvroute.v1" for f in described[service])
    (v1_file,) = described["grpc.reflection.v1.ServerReflection"]
    assert v1_file.package == "grpc.reflection.v1"
    assert [s.name for s in v1_file.service] == ["ServerReflection"]
