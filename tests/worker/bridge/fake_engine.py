"""A fake engine for the bridge's tests: the KV-event wire and an OpenAI completions API
(or, ``kind="sglang"``, SGLang's ``/generate`` and its metric names).

* Events: a ZMQ PUB (bound, or connected to a bridge that binds) publishing
  ``[topic, seq (8 bytes big-endian), msgpack [ts, events, dp_rank]]`` with tagged-map
  events, numbered 0, 1, 2, ... as vLLM does; a ROUTER replay socket answering
  ``[b"", start_seq]`` with every kept batch from there and the seq -1 end marker.
* HTTP: ``/v1/models``, ``/metrics`` (vLLM's names) and ``/v1/completions`` streaming one
  token per event (``token_ids``), then a usage event with ``cached_tokens``. A completion
  caches its prompt's full engine blocks and publishes BlockStored for the new ones, as an
  engine does after prefill; ``evict()`` publishes BlockRemoved.

Engine hashes are the first 8 bytes of blake2b over (parent, tokens): opaque to the bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from aiohttp import web

TOPIC = b"kv@fake@tiny"


def engine_hash(parent: int | None, tokens: Sequence[int]) -> int:
    data = repr((parent, tuple(tokens))).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


@dataclass
class FakeEngine:
    """Start with ``await start()``; ``events_bind=None`` binds the PUB on a free port
    (``pub_endpoint``), else the PUB connects to that endpoint (a bridge that binds)."""

    block_size: int = 32
    token_delay_s: float = 0.0
    events_connect: str | None = None
    model: str = "tiny"
    seq: int = 0
    kept: list[tuple[int, bytes]] = field(default_factory=list)
    cached: dict[int, int | None] = field(default_factory=dict)  # engine hash -> parent
    completions: int = 0
    disconnects: int = 0  # streams whose client went away before the end
    bodies: list[dict[str, Any]] = field(default_factory=list)
    kind: str = "vllm"  # "sglang": /generate and sglang:* metrics instead
    incremental: bool = False  # SGLang's --incremental-streaming-output
    fail_status: int = 0  # /v1/completions answers this status (0: it streams)
    cut_after: int = 0  # /v1/completions ends its stream after this many tokens (0: never)
    done_to_end_s: float = 0.0  # /v1/completions: from [DONE] to the body's end
    peers: list[tuple[str, int]] = field(default_factory=list)  # each completion's client

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self.pub = self._ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if self.events_connect is None:
            port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            self.pub_endpoint = f"tcp://127.0.0.1:{port}"
        else:
            self.pub.connect(self.events_connect)
            self.pub_endpoint = self.events_connect
        self.router = self._ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        rport = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self._replay_task = asyncio.create_task(self._serve_replay())
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/generate", self._generate)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay_task
        await self._runner.cleanup()
        self.pub.close(0)
        self.router.close(0)
        self._ctx.term()

    # ---- events -----------------------------------------------------------------------

    async def publish(self, events: list[dict[str, Any]], *, live: bool = True) -> int:
        """One batch with the next seq (kept for replay; ``live=False``: lost on the PUB)."""
        seq = self.seq
        self.seq += 1
        payload = msgspec.msgpack.encode([time.time(), events, 0])
        self.kept.append((seq, payload))
        if live:
            await self.pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def store_events(self, prompt: Sequence[int]) -> tuple[list[dict[str, Any]], int]:
        """BlockStored for the prompt's full blocks not cached yet, and the cached prefix
        length in tokens before them."""
        bs = self.block_size
        parent: int | None = None
        cached_tokens = 0
        new_hashes: list[int] = []
        new_parent: int | None = None
        first_new = None
        for i in range(len(prompt) // bs):
            h = engine_hash(parent, prompt[i * bs : (i + 1) * bs])
            if h in self.cached and first_new is None:
                cached_tokens += bs
            else:
                if first_new is None:
                    first_new, new_parent = i, parent
                new_hashes.append(h)
                self.cached[h] = parent
            parent = h
        if not new_hashes:
            return [], cached_tokens
        assert first_new is not None
        tokens = list(prompt[first_new * bs : (first_new + len(new_hashes)) * bs])
        event = {
            "type": "BlockStored",
            "block_hashes": new_hashes,
            "parent_block_hash": new_parent,
            "token_ids": tokens,
            "block_size": bs,
            "lora_id": None,
            "medium": "GPU",
        }
        return [event], cached_tokens

    async def evict_all(self) -> None:
        hashes = list(self.cached)
        self.cached.clear()
        await self.publish([{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}])

    async def _serve_replay(self) -> None:
        while True:
            ident, _, raw = await self.router.recv_multipart()
            start = int.from_bytes(raw, "big", signed=True)
            for seq, payload in list(self.kept):
                if seq >= start:
                    await self.router.send_multipart(
                        [ident, b"", TOPIC, seq.to_bytes(8, "big"), payload]
                    )
            await self.router.send_multipart(
                [ident, b"", TOPIC, (-1).to_bytes(8, "big", signed=True), b""]
            )

    # ---- HTTP -------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model, "max_model_len": 1024}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.kind == "sglang":
            labels = f'{{model_name="{self.model}",tp_rank="0"}}'
            text = (
                f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{labels} 1.0\n"
                f"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{labels} 2.0\n"
                f"# TYPE sglang:token_usage gauge\nsglang:token_usage{labels} 0.5\n"
                "# TYPE sglang:max_total_num_tokens gauge\n"
                f"sglang:max_total_num_tokens{labels} 4096.0\n"
            )
            return web.Response(text=text, content_type="text/plain")
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{self.model}"}} 0.0\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{self.model}"}} 0.0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{self.model}"}} 0.25\n'
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",num_gpu_blocks="64"}} 1.0\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt:
            return web.json_response({"error": {"message": "prompt must be token ids"}}, status=400)
        if self.fail_status:
            return web.json_response({"error": {"message": "refused"}}, status=self.fail_status)
        self.completions += 1
        events, cached = self.store_events(prompt)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int(body.get("max_tokens") or 4)
        try:
            if events:
                await self.publish(events)  # after "prefill"
            for i in range(n):
                if i == self.cut_after > 0:
                    return resp  # no finish reason, no usage, no [DONE]
                chunk = {"choices": [{"index": 0, "text": "", "token_ids": [prompt[-1] + i + 1]}]}
                if i == n - 1:
                    chunk["choices"][0]["finish_reason"] = "length"
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.token_delay_s)
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": cached},
            }
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(self.done_to_end_s)
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        """SGLang's /generate: output_ids and text cumulative (or, ``incremental``, only the
        new part), meta_info's completion_tokens the running total, finish_reason a map on
        the last event."""
        body = await request.json()
        self.bodies.append(body)
        ids = body.get("input_ids")
        if not isinstance(ids, list) or not ids:
            return web.json_response({"error": {"message": "input_ids required"}}, status=400)
        self.completions += 1
        events, cached = self.store_events(ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = int((body.get("sampling_params") or {}).get("max_new_tokens") or 4)
        out: list[int] = []
        try:
            if events:
                await self.publish(events)
            for i in range(n):
                out.append(ids[-1] + i + 1)
                meta = {
                    "prompt_tokens": len(ids),
                    "completion_tokens": i + 1,
                    "cached_tokens": cached,
                    "finish_reason": {"type": "length", "length": n} if i == n - 1 else None,
                }
                chunk = {
                    "text": f"t{i}" if self.incremental else "".join(f"t{j}" for j in range(i + 1)),
                    "output_ids": out[-1:] if self.incremental else list(out),
                    "meta_info": meta,
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.token_delay_s)
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnects += 1
            raise
        return resp
