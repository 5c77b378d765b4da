"""Health, reflection and graceful shutdown of a real worker server."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from svc_harness import WorkerSetup, running_worker, token_request

from kvroute_proto import kvroute_pb2 as pb
from worker.engine.sim_executor import SimCostModel
from worker.service.engine_runner import RunnerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def check(channel: grpc.aio.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_health_is_serving_then_not_serving_on_shutdown() -> None:
    async with running_worker() as w:
        assert await check(w.channel) == SERVING
        assert await check(w.channel, "kvroute.v1.Worker") == SERVING
        watch = health_pb2_grpc.HealthStub(w.channel).Watch(
            health_pb2.HealthCheckRequest(service="kvroute.v1.Worker")
        )
        assert (await watch.read()).status == SERVING
        await w.server.begin_shutdown()
        assert (await watch.read()).status == NOT_SERVING
        assert await check(w.channel) == NOT_SERVING
        watch.cancel()


async def test_get_load_is_refused_while_draining() -> None:
    # routers (re)identify a worker with GetLoad: a draining one must not look adoptable
    async with running_worker() as w:
        stub = w.stub
        assert (await stub.GetLoad(pb.GetLoadRequest())).worker_id
        await w.server.begin_shutdown()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetLoad(pb.GetLoadRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in (err.value.details() or "")


async def test_reflection_lists_the_services() -> None:
    async with running_worker() as w:
        stub = reflection_pb2_grpc.ServerReflectionStub(w.channel)

        async def requests():
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol="kvroute.v1.Worker")

        responses = [r async for r in stub.ServerReflectionInfo(requests())]
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"kvroute.v1.Worker", "grpc.health.v1.Health"} <= names
        assert responses[1].file_descriptor_response.file_descriptor_proto  # grpcurl describe


async def test_graceful_stop_lets_in_flight_requests_finish() -> None:
    paced = WorkerSetup(cost=SimCostModel(), runner=RunnerConfig(pace_speedup=1, load_interval_s=0))
    async with running_worker(paced) as w:
        # ~40 paced decode steps of ~8 ms: well inside the grace period.
        call = w.stub.Generate(token_request([1, 2, 3], request_id="inflight", max_new_tokens=40))
        assert (await call.read()).WhichOneof("kind") == "chunk"
        await w.server.stop(grace_s=10.0)
        rest = []
        while (msg := await call.read()) is not grpc.aio.EOF:  # bounded: 40 tokens
            rest.append(msg)
        assert rest[-1].finished.reason == pb.FINISH_REASON_LENGTH
        assert rest[-1].finished.usage.completion_tokens == 40
        assert await call.code() == grpc.StatusCode.OK


async def test_requests_past_the_grace_period_are_cancelled_and_freed() -> None:
    paced = WorkerSetup(cost=SimCostModel(), runner=RunnerConfig(pace_speedup=1, load_interval_s=0))
    async with running_worker(paced) as w:
        call = w.stub.Generate(token_request([1, 2, 3], request_id="long", max_new_tokens=400))
        assert (await call.read()).WhichOneof("kind") == "chunk"
        await w.server.stop(grace_s=0.1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while await call.read() is not grpc.aio.EOF:  # bounded: the server has stopped
                pass
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        s = w.engine.stats()  # the engine thread is released: safe to read here
        assert (s.num_running, s.num_waiting, s.num_protected_kv_tokens) == (0, 0, 0)
        assert s.num_aborted == 1


async def test_new_requests_are_refused_once_stopped() -> None:
    async with running_worker() as w:
        await w.server.stop(grace_s=0)
        try:
            await w.generate(token_request([1]))
        except grpc.aio.AioRpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
        else:
            raise AssertionError("a stopped worker served a request")


async def test_a_crashed_engine_loop_fails_requests_and_reports_not_serving() -> None:
    async with running_worker() as w:

        def broken_step() -> list:
            raise RuntimeError("executor exploded")

        w.engine.step = broken_step  # type: ignore[method-assign]
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await w.generate(token_request([1, 2, 3]))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "executor exploded" in info.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await w.stub.GetLoad(pb.GetLoadRequest())
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert await check(w.channel) == NOT_SERVING
