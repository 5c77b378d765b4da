"""Recorded engine frames (tests/worker/bridge/frames, see its README) and the helpers the
bridge tests share: decode a session, apply our batches to a plain set, and what a
session's producer held after each batch in our block hashes."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, EventBatch, Partition
from kvroute_proto.hashing import block_hash_list, chain_block_hash
from worker.bridge.engine_wire import EngineBatch, EngineReplayEnd, decode_frames

FRAMES = Path(__file__).parent / "frames"
B = 16  # our block size in these tests


def load(name: str) -> dict[str, Any]:
    return json.loads((FRAMES / f"{name}.json").read_text())


def raw_frames(doc: dict[str, Any], channel: str) -> list[list[bytes]]:
    out = []
    for f in doc["frames"]:
        if f["channel"] != channel:
            continue
        parts = [bytes.fromhex(f["seq"]), base64.b64decode(f["payload_b64"])]
        if f["topic"] is not None:
            parts.insert(0, f["topic"].encode())
        out.append(parts)
    return out


def batches(doc: dict[str, Any], channel: str = "live") -> list[EngineBatch]:
    out = []
    for parts in raw_frames(doc, channel):
        decoded = decode_frames(parts)
        if isinstance(decoded, EngineReplayEnd):
            continue
        out.append(decoded)
    return out


def expected_vllm(doc: dict[str, Any], i: int) -> set[int]:
    """Our blocks for what vLLM's pool held after live batch i (nameable requests only)."""
    ebs = doc["engine_block_size"]
    out: set[int] = set()
    for _h, name, n in doc["held_after"][i]:
        req = doc["requests"][name]
        if not req["nameable"]:
            continue
        seed = Partition(cache_salt=req["cache_salt"] or "").seed
        hashes = block_hash_list(req["token_ids"][:n], B, seed)
        out.update(hashes[(n - ebs) // B : n // B])  # the blocks whose last token it holds
    return out


def expected_sglang(doc: dict[str, Any], i: int) -> set[int]:
    """Our blocks for every root-to-leaf path of SGLang's tree after live batch i."""
    out: set[int] = set()
    for salt, tokens in doc["held_after"][i]:
        out.update(block_hash_list(tokens, B, Partition(cache_salt=salt or "").seed))
    return out


@dataclass
class Announced:
    """Our batches applied to a plain set, strictly: seqs contiguous per epoch, no store of
    a held block, no removal of one not held, every stored chain verifiable."""

    epoch: int = 0
    seq: int = 0
    blocks: set[int] = field(default_factory=set)

    def apply(self, out: list[EventBatch]) -> None:
        for batch in out:
            if batch.epoch != self.epoch:
                self.epoch, self.seq = batch.epoch, 0
                self.blocks = set()
            assert batch.seq == self.seq + 1, (batch.seq, self.seq)
            self.seq = batch.seq
            for ev in batch.events:
                match ev:
                    case BlockStored():
                        self._check_chain(ev)
                        for h in ev.block_hashes:
                            assert h not in self.blocks, f"stored twice: {h}"
                            self.blocks.add(h)
                    case BlockRemoved():
                        for h in ev.block_hashes:
                            assert h in self.blocks, f"removed but not held: {h}"
                            self.blocks.remove(h)
                    case AllCleared():
                        self.blocks = set()

    @staticmethod
    def _check_chain(ev: BlockStored) -> None:
        parent = ev.parent_hash
        toks = ev.token_array.tolist()
        bs = ev.block_size
        for i, h in enumerate(ev.block_hashes):
            assert chain_block_hash(parent, toks[i * bs : (i + 1) * bs], ev.partition.seed) == h
            parent = h
