"""Model pools end to end (decision 0036): one router process in front of sim worker
processes of two served models (and one of a third it does not serve), through the OpenAI
HTTP front (the official client) and gRPC. Each model is routed by its own index: a
repeated prompt goes to the worker of that model holding it, by an event-confirmed match,
as Explain shows."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import openai
import pytest
from e2e_procs import procs, until, wait_healthy

from kvroute_proto import kvroute_pb2 as pb
from kvroute_proto import kvroute_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = "Pools keep one prefix index per model. " * 6  # byte tokenizer: 234 tokens


async def _explain(stub: pb_grpc.RouterStub, model: str, prompt: str) -> pb.ExplainResponse:
    request = pb.GenerateRequest(prompt_text=prompt, model=model)
    return await stub.Explain(pb.ExplainRequest(request=request), timeout=10)


async def _generate(stub: pb_grpc.RouterStub, model: str, prompt: str) -> pb.Finished:
    request = pb.GenerateRequest(prompt_text=prompt, model=model)
    request.sampling.max_new_tokens = 2
    async for msg in stub.Generate(request, timeout=30):
        if msg.HasField("finished"):
            return msg.finished
    raise AssertionError("no Finished message")


async def _confirmed_on(stub: pb_grpc.RouterStub, model: str, prompt: str, worker: str) -> bool:
    """Whether Explain picks ``worker`` for ``prompt`` in ``model``'s pool by a match its KV
    events confirmed (not only the router's prediction)."""
    expl = await _explain(stub, model, prompt)
    score = next(w for w in expl.workers if w.worker_id == worker)
    return expl.chosen_worker_id == worker and score.event_matched_tokens >= len(prompt) - 4


async def _grpc_checks(address: str, holders: dict[str, str]) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RouterStub(channel)
        for model, holder in holders.items():
            # the pool's workers only, each tagged with its model
            expl = await _explain(stub, model, PROMPT)
            assert expl.model == model and list(expl.models) == ["alpha", "beta"]
            assert {w.model for w in expl.workers} == {model}
            assert {w.worker_id[0] for w in expl.workers} == {model[0]}
            await until(
                lambda m=model, h=holder: _confirmed_on(stub, m, PROMPT, h),
                f"{model}: the prompt confirmed on {holder}",
            )
            finished = await _generate(stub, model, PROMPT)
            assert finished.worker_id == holder
            assert finished.usage.cached_prompt_tokens >= len(PROMPT) - 4
        # a request without a model, on a router serving two: refused, naming them
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(stub, "", "hi")
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model is required: this server serves 'alpha', 'beta'" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _generate(stub, "gamma", "hi")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # Explain without a model: every pool's workers (the fleet view of kvroute status)
        fleet = await _explain(stub, "", "x")
        assert fleet.model == "" and fleet.chosen_worker_id == ""
        assert sorted((w.model, w.worker_id) for w in fleet.workers) == [
            ("alpha", "a0"),
            ("alpha", "a1"),
            ("beta", "b0"),
            ("beta", "b1"),
        ]


def test_a_router_serves_two_models_each_by_its_own_index(tmp_path: Path) -> None:
    with procs() as p:
        workers = []
        for wid, model in (("a0", "alpha"), ("a1", "alpha"), ("b0", "beta"), ("b1", "beta")):
            workers.append(p.worker(wid, "--served-model-name", model).address)
        gamma = p.worker("g0", "--served-model-name", "gamma").address
        log = tmp_path / "router.log"
        router = p.start(
            "router",
            [
                "router", "--port", "0", "--http-port", "0", "--log-level", "INFO",
                "--served-model-name", "alpha", "--served-model-name", "beta",
                *(a for w in [*workers, gamma] for a in ("--worker", w)),
            ],
            log=log,
            marker="http listening on",  # printed after the gRPC line: wait for it
        )  # fmt: skip
        http = router.address  # the HTTP front's (the marker's line)
        grpc_address = next(x for x in router.lines if x.startswith("listening on ")).split()[-1]
        url = f"http://{http}" if not http.startswith("http") else http
        wait_healthy(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        try:
            assert [m.id for m in client.models.list().data] == ["alpha", "beta"]
            holders = {}
            for model in ("alpha", "beta"):
                first = client.completions.with_raw_response.create(
                    model=model, prompt=PROMPT, max_tokens=2
                )
                holders[model] = first.headers["x-kvroute-worker-id"]
                assert holders[model][0] == model[0]  # a worker of that model
                assert first.parse().model == model
            with pytest.raises(openai.NotFoundError) as err:
                client.completions.create(model="gamma", prompt="x", max_tokens=1)
            assert err.value.code == "model_not_found"
            assert "this server serves 'alpha', 'beta'" in err.value.message
            chat = client.chat.completions.create(
                model="beta", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == "beta"
        finally:
            client.close()
        asyncio.run(_grpc_checks(grpc_address, holders))
        refusals = [x for x in log.read_text().splitlines() if "which this router does not" in x]
        assert refusals and all("g0" in x and "'gamma'" in x for x in refusals)
        assert len({x.split("WARNING", 1)[-1] for x in refusals}) == 1  # logged once
