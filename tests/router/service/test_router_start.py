"""A router whose start fails gives back the port it had bound (a real bind on 127.0.0.1)."""

from __future__ import annotations

import socket

import pytest
from router_harness import router_config

from edge.http_front import HttpFrontConfig
from router.service.server import RouterServer


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _bindable(port: int) -> bool:
    with socket.socket() as again:
        try:
            again.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_a_failed_http_bind_frees_the_grpc_port() -> None:
    grpc_port = _free_port()
    with socket.socket() as taken:  # the HTTP port is someone else's
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        http = HttpFrontConfig(port=taken.getsockname()[1])
        server = RouterServer(router_config([], port=grpc_port, http=http))
        with pytest.raises(OSError, match="could not bind HTTP"):
            await server.start()
    assert _bindable(grpc_port)
