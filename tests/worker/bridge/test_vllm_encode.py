"""kvroute's events in vLLM's wire (``encode_vllm_batch``), read back the way a vLLM
consumer reads them: decoded as vLLM frames and translated by the bridge into our blocks.

Random histories of a radix cache's events (chains with shared prefixes, two partitions,
stores that continue a held prefix, leaf removals, clears) are encoded frame by frame; after
each frame the blocks the bridge announces equal the blocks the history holds."""

from __future__ import annotations

import random

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute_proto.events import AllCleared, BlockRemoved, BlockStored, KvEvent, Partition
from kvroute_proto.hashing import block_hash_list
from tests.worker.bridge.recorded import Announced
from worker.bridge.engine_wire import decode_frames, encode_vllm_batch
from worker.bridge.translate import EventTranslator, TranslatorConfig

B = 4
PARTITIONS = [Partition(), Partition(cache_salt="tenant-a")]

# an op: ("store", chain, blocks) | ("remove", pick) | ("clear",)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("remove"), st.integers(0, 1_000)),
        st.tuples(st.just("clear")),
    ),
    max_size=40,
)


class History:
    """A radix cache's held blocks and the events that got it there."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        trunk = [rng.randrange(3) for _ in range(6 * B)]
        self.chains = []
        for c in range(8):  # shared prefixes: chain c keeps the first c * 2 tokens of trunk
            tokens = trunk[: (c * 2) % len(trunk)] + [rng.randrange(3) for _ in range(6 * B)]
            partition = PARTITIONS[c % 2]
            self.chains.append((partition, block_hash_list(tokens, B, partition.seed), tokens))
        self.held: dict[int, int | None] = {}  # block -> its parent (None: first block)

    def events(self, op: tuple) -> list[KvEvent]:
        match op:
            case ("store", c, n):
                partition, hashes, tokens = self.chains[c]
                k = 0
                while k < min(n, len(hashes)) and hashes[k] in self.held:
                    k += 1
                new = hashes[k:n]
                if not new:
                    return []
                parent = hashes[k - 1] if k else None
                for i, h in enumerate(new):
                    self.held[h] = parent if i == 0 else new[i - 1]
                toks = tokens[k * B : (k + len(new)) * B]
                return [BlockStored(tuple(new), parent, toks, partition)]
            case ("remove", pick):
                parents = set(self.held.values())
                leaves = sorted(h for h in self.held if h not in parents)
                if not leaves:
                    return []
                victim = leaves[pick % len(leaves)]
                del self.held[victim]
                return [BlockRemoved((victim,))]
            case _:
                self.held.clear()
                return [AllCleared()]


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**16), history=ops)
def test_a_vllm_consumer_holds_what_the_worker_holds(seed: int, history: list[tuple]) -> None:
    model = History(seed)
    translator = EventTranslator(TranslatorConfig("w", block_size=B), random.Random(0))
    seen = Announced()
    for seq, op in enumerate(history):
        payload = encode_vllm_batch(model.events(op), B, ts=1.0 + seq)
        batch = decode_frames([b"kv@w@m", seq.to_bytes(8, "big"), payload])
        assert translator.feed(batch) is None  # no gap: nothing to replay
        seen.apply(translator.take_batches())
        assert seen.blocks == set(model.held)


def test_the_frame_is_what_vllm_publishes() -> None:
    """The fields and their order of vLLM's tagged map events, ints for hashes, the salt
    as the chain's first extra key, and the batch as [ts, events, dp_rank]."""
    salted = Partition(cache_salt="tenant-a")
    hashes = block_hash_list(list(range(8)), B, salted.seed)
    payload = encode_vllm_batch(
        [
            BlockStored(tuple(hashes), None, list(range(8)), salted),
            BlockRemoved((hashes[1],)),
            AllCleared(),
        ],
        B,
        ts=12.5,
    )
    ts, events, dp_rank = msgspec.msgpack.decode(payload)
    assert (ts, dp_rank) == (12.5, 0)
    stored, removed, cleared = events
    assert list(stored) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ]
    assert stored["block_hashes"] == [int(h) for h in hashes]
    assert stored["parent_block_hash"] is None and stored["token_ids"] == list(range(8))
    assert stored["extra_keys"] == [["tenant-a"], None] and stored["medium"] == "GPU"
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [int(hashes[1])],
        "medium": "GPU",
        "group_idx": 0,
    }
    assert cleared == {"type": "AllBlocksCleared"}
