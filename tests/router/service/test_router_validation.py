"""The router's field checks of a GenerateRequest: each names the field and its limit."""

from __future__ import annotations

import pytest

from edge.limits import RequestLimits
from kvroute_proto import kvroute_pb2 as pb
from router.service.validation import RequestError, check_request


def _request(**sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id="r", prompt_text="hello")
    for name, value in sampling.items():
        field = getattr(req.sampling, name)
        field.extend(value)
    return req


@pytest.mark.parametrize(
    ("stop", "needle"),
    [
        (["a"] * 5, "at most 4 strings, got 5"),
        (["x" * 257], "1..256 characters, got 257"),
        ([""], "1..256 characters, got 0"),
    ],
)
def test_stop_strings_are_bounded(stop, needle) -> None:
    with pytest.raises(RequestError, match="stop") as info:
        check_request(_request(stop=stop), RequestLimits())
    assert needle in str(info.value)


def test_multi_token_stop_strings_pass() -> None:
    check_request(_request(stop=["\n\n", "###", "x" * 256]), RequestLimits())
