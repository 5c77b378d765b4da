"""A router's side of one relay stream (decisions 0033, 0034), for the tests of the worker's
and the bridge's Relay: what it writes, and every batch it read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import grpc

from kvroute_proto import kvroute_pb2 as pb


class RelayClient:
    """Opens ``stub.Relay()``; ``read_until`` keeps every batch, the rest look into them."""

    def __init__(self, stub: Any, wait_s: float = 10.0) -> None:
        self.call = stub.Relay()
        self.batches: list[pb.RelayBatch] = []
        self.wait_s = wait_s

    async def open(self, stream_id: str = "s1") -> pb.RelayBatch:
        await self.call.write(pb.RelayRequest(stream_id=stream_id))
        return await self.call.read()

    async def read_until(self, done: Callable[[], Any]) -> None:
        async with asyncio.timeout(self.wait_s):
            while not done():
                batch = await self.call.read()
                assert batch is not grpc.aio.EOF
                self.batches.append(batch)

    def responses(self, rid: str) -> list[pb.GenerateResponse]:
        return [r for b in self.batches for r in b.responses if r.request_id == rid]

    def tokens(self, rid: str) -> list[int]:
        return [t for r in self.responses(rid) for t in r.chunk.token_ids]

    def ends(self, rid: str) -> list[pb.RelayEnd]:
        return [e for b in self.batches for e in b.ends if e.request_id == rid]

    def finished(self, rid: str) -> pb.Finished | None:
        fins = [r.finished for r in self.responses(rid) if r.HasField("finished")]
        return fins[0] if fins else None
