"""Stop strings on the BPE model: matched on the decoded text across token boundaries and
inside merged tokens, streamed and not, on a call of its own and started on a relay stream,
the text ending before the stop, the request finished on the worker (no slot left)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from svc_harness import WorkerSetup, running_worker
from test_service_http import post, sse_events

from bench.bpe import write_bpe_model_dir
from edge.tokenizer import load_tokenizer
from kvroute_proto import kvroute_pb2 as pb
from tests.worker.relay_client import RelayClient
from worker.service.generation import OutputText

PROMPT = "The customer asked about the refund policy for the second order."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return str(write_bpe_model_dir(tmp_path_factory.mktemp("m") / "bpe-tiny"))


@pytest.fixture(scope="module")
def bpe(model_dir):
    return load_tokenizer(model_dir)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=60)
@given(data=st.data())
def test_multi_token_stops_on_bpe_text_in_any_chunking(bpe, data) -> None:
    text = data.draw(
        st.sampled_from(
            ["First line.\n\nSecond line.", "a\n\n\nb", "café über\n\nrésumé", "no stop here\n"]
        )
    )
    stop = data.draw(st.sampled_from(["\n\n", "line", "é ü", "e."]))
    ids = bpe.encode(text, add_special_tokens=False)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(ids)), max_size=len(ids))))
    out_text = OutputText(bpe, [stop])
    bounds = [0, *cuts, len(ids)]
    got = ""
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        got += out_text.push(tuple(ids[lo:hi]), i == len(bounds) - 2)
    at = text.find(stop)
    assert got == (text[:at] if at >= 0 else text)
    assert out_text.stopped == (at >= 0)


async def test_stop_strings_across_tokens_end_the_text_and_free_the_slot(model_dir, bpe) -> None:
    setup = WorkerSetup(http=True, executor_kind="torch", model_dir=model_dir)
    async with running_worker(setup) as w:
        req = pb.GenerateRequest(request_id="free", prompt_text=PROMPT)
        req.sampling.max_new_tokens = 60
        req.sampling.ignore_eos = True
        msgs = await w.generate(req)
        ids = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
        free = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
        pieces = [bpe.decode([t]) for t in ids]
        # a stop straddling two tokens, and one inside a merged token
        k = next(i for i in range(5, len(ids) - 1) if pieces[i] and pieces[i + 1])
        across = pieces[k][-1] + pieces[k + 1][0]
        inner = next(p[1] for p in pieces[5:] if len(p) >= 3)
        body = {"prompt": PROMPT, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        for stop in (across, inner):
            expected = free[: free.index(stop)]
            status, _, out = await post(w, "/v1/completions", {**body, "stop": [stop, "zzzz"]})
            assert status == 200, out
            assert out["choices"][0]["text"] == expected
            assert out["choices"][0]["finish_reason"] == "stop"
            assert out["usage"]["completion_tokens"] < 60  # finished on the worker
            _, events = await sse_events(
                w, "/v1/completions", {**body, "stop": stop, "stream": True}
            )
            streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
            assert streamed == expected
            assert events[-2]["choices"][0]["finish_reason"] == "stop"
        # "\n\n" served: the byte token "\n" forced twice, the stop across the two
        (newline,) = bpe.encode("\n", add_special_tokens=False)
        forced = {"max_tokens": 60, "logit_bias": {str(newline): 100}, "stop": ["\n\n"]}
        _, _, out = await post(w, "/v1/completions", {**forced, "prompt": PROMPT})
        assert (out["choices"][0]["text"], out["choices"][0]["finish_reason"]) == ("", "stop")
        assert out["usage"]["completion_tokens"] < 60
        _, events = await sse_events(
            w,
            "/v1/chat/completions",
            {**forced, "messages": [{"role": "user", "content": "Hi"}], "stream": True},
        )
        assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == ""
        assert events[-2]["choices"][0]["finish_reason"] == "stop"
        await w.assert_no_leak()


async def test_a_stop_string_ends_a_request_started_on_a_relay_stream(model_dir) -> None:
    """The same stop on a relay start (its messages made in the engine's dispatch): the
    text before the stop, a Finished saying stop, the request finished on the worker."""
    setup = WorkerSetup(executor_kind="torch", model_dir=model_dir)
    async with running_worker(setup) as w:
        req = pb.GenerateRequest(request_id="free", prompt_text=PROMPT)
        req.sampling.max_new_tokens = 60
        req.sampling.ignore_eos = True
        msgs = await w.generate(req)
        free = "".join(m.chunk.text for m in msgs if m.HasField("chunk"))
        stop = free[len(free) // 2 : len(free) // 2 + 2]
        relay = RelayClient(w.stub, 30.0)
        await relay.open()
        started = pb.GenerateRequest(request_id="stopped", prompt_text=PROMPT)
        started.sampling.CopyFrom(req.sampling)
        started.sampling.stop.append(stop)
        await relay.call.write(pb.RelayRequest(starts=[pb.RelayStart(request=started)]))
        await relay.read_until(lambda: relay.finished("stopped"))
        text = "".join(r.chunk.text for r in relay.responses("stopped"))
        assert text == free[: free.index(stop)]
        finished = relay.finished("stopped")
        assert finished.reason == pb.FINISH_REASON_STOP
        assert finished.usage.completion_tokens < 60  # stopped on the worker
        assert relay.ends("stopped") == []
        relay.call.cancel()
        await w.assert_no_leak()
