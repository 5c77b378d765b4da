"""Dynamo's Rust KV-router ``RadixTree`` on bench_index's comparable workload, as JSON.

Runs in its own virtualenv (the project never imports Dynamo)::

    python3 -m venv .peers/dynamo && .peers/dynamo/bin/pip install ai-dynamo-runtime==1.6.1
    .peers/dynamo/bin/python bench/peers/dynamo_index.py [--repeats 3] [--quick]

The workload is bench/bench_index.py's comparable section: 2,000 sequences of 2,000 tokens
sharing a 512-token prefix, block 16 (125 blocks each), sequence i stored on worker i % 16
(each worker's first sequence whole, later ones as their suffix after the shared prefix,
chained by ``parent_hash``); then every sequence's suffix removed. Dynamo takes events as
JSON and parses them in Rust (``RadixTree.apply_event``); the JSON is built before the clock
starts, so its figures leave out the encoding that ours include (we time decoding wire
bytes). ``RadixTree`` applies events on its own thread: each timed phase ends with a
``find_matches`` that waits for the queue to drain. Each figure is the best of
``--repeats`` runs (on a fresh tree for ingest and remove). Keys as bench_index:

ingest_blocks_s, find_full_q_s, find_partial_q_s, remove_blocks_s, hash_seq_s
(``compute_block_hash_for_seq`` of a 2,000-token sequence given as a list of ints).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from dynamo._core import RadixTree, compute_block_hash_for_seq

_MASK = (1 << 64) - 1


def _chain(local: list[int]) -> list[int]:
    """Sequence (chained) block hashes from Dynamo's per-block local hashes: any
    deterministic function of the prefix names the prefix."""
    out = []
    h = 0
    for x in local:
        h = hash((h, x)) & _MASK
        out.append(h)
    return out


def _stored(eid: int, parent: int | None, ext: list[int], loc: list[int]) -> bytes:
    blocks = [{"block_hash": b, "tokens_hash": t} for b, t in zip(ext, loc, strict=True)]
    data = {"stored": {"parent_hash": parent, "blocks": blocks}}
    return json.dumps({"event_id": eid, "dp_rank": 0, "data": data}).encode()


def _removed(eid: int, ext: list[int]) -> bytes:
    data = {"removed": {"block_hashes": ext}}
    return json.dumps({"event_id": eid, "dp_rank": 0, "data": data}).encode()


def rates(
    num_seqs: int = 2000,
    seq_tokens: int = 2000,
    prefix_tokens: int = 512,
    block: int = 16,
    workers: int = 16,
    repeats: int = 3,
) -> dict[str, float]:
    rng = random.Random(0)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_tokens)]
    seqs = [
        prefix + [rng.randrange(1, 32000) for _ in range(seq_tokens - prefix_tokens)]
        for _ in range(num_seqs)
    ]
    locs = [compute_block_hash_for_seq(s, block) for s in seqs]
    pb = prefix_tokens // block
    exts = [_chain(x) for x in locs]
    stored, removed, seen, num_stored = [], [], set(), 0
    for i in range(num_seqs):
        w = i % workers
        if w not in seen:
            seen.add(w)
            stored.append((w, _stored(i, None, exts[i], locs[i])))
            num_stored += len(exts[i])
        else:
            stored.append((w, _stored(i, exts[i][pb - 1], exts[i][pb:], locs[i][pb:])))
            num_stored += len(exts[i]) - pb
        removed.append((w, _removed(num_seqs + i, exts[i][pb:])))
    num_removed = sum(len(x) - pb for x in exts)
    extra = prefix_tokens + 64
    probes = [
        compute_block_hash_for_seq(
            s[:extra] + [rng.randrange(1, 32000) for _ in range(seq_tokens - extra)], block
        )
        for s in seqs
    ]

    def ingest() -> tuple[float, RadixTree]:
        tree = RadixTree()
        t0 = time.perf_counter()
        for w, ev in stored:
            tree.apply_event(w, ev)
        tree.find_matches(locs[0][:1])  # waits for the tree's thread
        return time.perf_counter() - t0, tree

    def find(tree: RadixTree, queries: list[list[int]]) -> float:
        t0 = time.perf_counter()
        for q in queries:
            _ = tree.find_matches(q).scores  # the scores dict is built lazily: count it
        return time.perf_counter() - t0

    def remove() -> float:
        _, tree = ingest()
        t0 = time.perf_counter()
        for w, ev in removed:
            tree.apply_event(w, ev)
        left = tree.find_matches(locs[0]).scores
        elapsed = time.perf_counter() - t0
        assert all(v == pb for v in left.values()), left
        return elapsed

    best_ingest, tree = min((ingest() for _ in range(repeats)), key=lambda x: x[0])
    full = tree.find_matches(locs[5]).scores
    assert full[(5 % workers, 0)] == len(locs[5]) and len(full) == workers, full
    seq = seqs[0]
    n_hash = 2000 if num_seqs >= 100 else 200

    def hashing() -> float:
        t0 = time.perf_counter()
        for _ in range(n_hash):
            compute_block_hash_for_seq(seq, block)
        return time.perf_counter() - t0

    return {
        "ingest_blocks_s": num_stored / best_ingest,
        "find_full_q_s": num_seqs / min(find(tree, locs) for _ in range(repeats)),
        "find_partial_q_s": num_seqs / min(find(tree, probes) for _ in range(repeats)),
        "remove_blocks_s": num_removed / min(remove() for _ in range(repeats)),
        "hash_seq_s": n_hash / min(hashing() for _ in range(repeats)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="dynamo_index.py",
        description="Dynamo's RadixTree on bench_index's comparable workload (JSON on stdout).",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="best of this many runs (default: 3)"
    )
    parser.add_argument("--quick", action="store_true", help="64 sequences: a smoke run")
    args = parser.parse_args(argv)
    num_seqs = 64 if args.quick else 2000
    result = rates(num_seqs=num_seqs, repeats=args.repeats)
    print(json.dumps({k: round(v, 1) for k, v in result.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
