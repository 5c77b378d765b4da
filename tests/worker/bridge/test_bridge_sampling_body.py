"""What the bridge forwards of a request's sampling to the engine's completions API."""

from __future__ import annotations

import pytest

from edge.frontdoor import BadRequest
from kvroute_proto import kvroute_pb2 as pb
from worker.bridge.service.engine_http import completion_body


def _request() -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id="r")
    req.prompt_token_ids.ids.extend([1, 2, 3])
    return req


def test_stops_penalties_and_bias_are_forwarded() -> None:
    req = _request()
    s = req.sampling
    s.stop.extend(["\n\n", "###"])
    s.presence_penalty, s.frequency_penalty = 0.5, -1.0
    s.logit_bias[7] = 3.0
    body = completion_body(req, "m")
    assert body["stop"] == ["\n\n", "###"]
    assert (body["presence_penalty"], body["frequency_penalty"]) == (0.5, -1.0)
    assert body["logit_bias"] == {"7": 3.0}
    # max_new_tokens 0: an explicit null, what is left of the context (not vLLM's 16)
    assert body["max_tokens"] is None
    plain = completion_body(_request(), "m")
    assert not {"stop", "presence_penalty", "logit_bias"} & plain.keys()


def test_logprobs_are_refused_not_dropped() -> None:
    req = _request()
    req.sampling.logprobs = True
    with pytest.raises(BadRequest) as info:
        completion_body(req, "m")
    assert info.value.param == "logprobs"
