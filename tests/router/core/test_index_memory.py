"""Removing blocks gives the memory back: node count and traced bytes return to baseline.

Dynamo's radix index leaked ~1 GB/h by leaving dead nodes attached; ours deletes a block
from every structure once nobody holds it and compacts its dicts when they shrink.
"""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np

from kvroute_proto.events import BlockRemoved, BlockStored
from kvroute_proto.hashing import block_hash_list

B = 16
NUM_SEQS = 200
SEQ_TOKENS = 1600  # 100 blocks each: a shared 50-block prefix + 50 own blocks


def make_chains() -> list[list[int]]:
    rng = np.random.default_rng(7)
    prefix = rng.integers(0, 50_000, 800).tolist()
    return [
        block_hash_list(prefix + rng.integers(0, 50_000, SEQ_TOKENS - 800).tolist(), B)
        for _ in range(NUM_SEQS)
    ]


def traced() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def test_memory_returns_to_baseline_after_all_blocks_are_removed() -> None:
    from router.core.index import PrefixIndex

    chains = make_chains()
    stored = [BlockStored(tuple(c), None, (0,) * (B * len(c))) for c in chains]
    removed = [BlockRemoved(tuple(c)) for c in chains]
    index = PrefixIndex()
    tracemalloc.start()
    try:
        baseline = traced()
        for rnd in range(3):
            for i, ev in enumerate(stored):
                index.apply(i % 4, ev)
                index.apply((i + 1) % 4, BlockStored(ev.block_hashes[:50], None, ev.token_ids))
            index.predict(3, [h + 1 for h in chains[0]], deadline=float(rnd))
            assert index.size() == NUM_SEQS * 50 + 50
            assert index.num_predicted == 100 // 4
            grown = traced() - baseline
            assert grown > 300_000  # ~10k blocks (their key ints were made before tracing)
            for i, ev in enumerate(removed):
                index.apply(i % 4, ev)
                index.apply((i + 1) % 4, BlockRemoved(ev.block_hashes[:50]))
            index.expire(float(rnd))
            assert index.size() == 0 and index.num_entries == 0
            assert index.num_predicted == 0
            assert traced() - baseline < 20_000, f"round {rnd}: leaked"
    finally:
        tracemalloc.stop()


def test_memory_returns_to_baseline_after_remove_worker() -> None:
    from router.core.index import PrefixIndex

    chains = make_chains()
    index = PrefixIndex()
    tracemalloc.start()
    try:
        baseline = traced()
        for rnd in range(2):
            for i, c in enumerate(chains):
                index.apply(i % 3, BlockStored(tuple(c), None, (0,) * (B * len(c))))
            for w in range(3):
                index.remove_worker(w)
            assert index.size() == 0
            assert traced() - baseline < 20_000, f"round {rnd}: leaked"
    finally:
        tracemalloc.stop()
