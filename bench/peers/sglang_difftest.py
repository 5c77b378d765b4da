"""SGLang's own RadixCache (sglang 0.5.23) under the radix cache differential test.

Runs with the python of the venv that bench/peers/install_sglang.sh makes (the project never
imports SGLang); bench/radix_difftest.py starts it and drives it::

    .peers/sglang-radix/bin/python -W ignore bench/peers/sglang_difftest.py [--clock op|real]

It first prints one JSON line ``{"peer", "version", "clock"}``, then reads one trace per stdin
line (a JSON dict of bench/radix_difftrace.py) and answers each with one JSON line: the
observations of ``radix_difftrace.replay`` on SGLang's RadixCache (LRU, its own CPU token
allocator), with the same adapter contract as our side.

Clock. SGLang stamps recency with ``time.monotonic()``, read anew for every node. ``--clock
op`` (the default) replaces the radix cache module's ``time`` with a clock that reads the op's
index, as our side's clock does, and breaks LRU ties by node id (creation order), as our
eviction heap does: stock SGLang leaves equal-time leaves in heap order, which follows set
iteration, i.e. memory addresses. Within one op, the real clock orders nodes the same way
(a split's lower half is stamped before the new leaf is created), so ``--clock real`` (stock
SGLang, nothing patched) should agree too; it is there to show that the patch decides no
outcome.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))  # sglang_radix (its stubs and make_cache)
sys.path.insert(1, str(_HERE.parents[1]))  # the repository root: bench.radix_difftrace

import sglang_radix  # noqa: E402  (imports SGLang with sglang_radix's stubs in place)

from bench.radix_difftrace import replay  # noqa: E402

# Imported by sglang_radix, stubs in place; its module-level ``time`` is what --clock op swaps.
sglang_rc = importlib.import_module("sglang.srt.mem_cache.radix_cache")


class _OpClock:
    """Stands in for the ``time`` module inside SGLang's radix_cache: monotonic() is the op."""

    def __init__(self) -> None:
        self.now = 0.0
        self.module = types.SimpleNamespace(
            monotonic=lambda: self.now, perf_counter=time.perf_counter
        )


class SGLangAdapter:
    """radix_difftrace.Adapter over SGLang's RadixCache and TokenToKVPoolAllocator."""

    def __init__(self, page: int, pool: int, clock: _OpClock | None) -> None:
        self.clock = clock
        self.pool = pool
        self.cache, self.alloc = sglang_radix.make_cache(pool, page_size=page)
        if clock is not None:
            # LRU ties (equal op time) go to the older node, as in our heap.
            self.cache.eviction_strategy.get_priority = lambda n: (n.last_access_time, n.id)
        self.root = self.cache.root_node

    def set_clock(self, now: int) -> None:
        if self.clock is not None:
            self.clock.now = float(now)

    def insert(self, seq: list[int]) -> tuple[int, list[int]]:
        slots = self.alloc.alloc(len(seq))
        assert slots is not None, "pool too small"
        key = sglang_radix.radix_key(_tokens(seq))
        cached = self.cache.insert(sglang_radix.InsertParams(key=key, value=slots)).prefix_len
        if cached:
            self.alloc.free(slots[:cached].clone())  # the tree kept its own slots for these
        return int(cached), slots.tolist()

    def match(self, seq: list[int]) -> tuple[list[int], Any]:
        key = sglang_radix.radix_key(_tokens(seq))
        result = self.cache.match_prefix(sglang_radix.MatchPrefixParams(key=key))
        node = result.last_device_node
        slots = self.cache.path_device_indices(node).tolist()
        assert len(slots) == result.device_prefix_len
        return slots, node

    def lock(self, node: Any) -> None:
        self.cache.inc_lock_ref(node)

    def unlock(self, node: Any) -> None:
        self.cache.dec_lock_ref(node)

    def evict(self, k: int) -> int:
        freed = self.cache.evict(sglang_radix.EvictParams(num_tokens=k)).num_tokens_evicted
        return int(freed)

    def sizes(self) -> tuple[int, int, int, int]:
        c = self.cache
        used = self.pool - self.alloc.available_size()
        return c.evictable_size(), c.protected_size(), c.total_size(), used

    def children(self, node: Any) -> list[Any]:
        return [c for c in node.children.values() if not c.evicted]

    def edge(self, node: Any) -> bytes:
        return bytes(node.key.raw_token_ids().tobytes())


def _tokens(seq: list[int]) -> np.ndarray:
    return np.asarray(seq, dtype=np.int64)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="sglang_difftest", description="SGLang RadixCache under the differential test."
    )
    parser.add_argument(
        "--clock",
        choices=("op", "real"),
        default="op",
        help="op: the op index as time, LRU ties by node id (default); real: stock SGLang",
    )
    args = parser.parse_args(argv)
    clock = _OpClock() if args.clock == "op" else None
    if clock is not None:
        sglang_rc.time = clock.module  # type: ignore[attr-defined]
    out = sys.stdout
    out.write(
        json.dumps({"peer": "sglang", "version": sglang_radix.SG["version"], "clock": args.clock})
        + "\n"
    )
    out.flush()
    for line in sys.stdin:
        trace = json.loads(line)
        adapter = SGLangAdapter(trace["page"], trace["pool"], clock)
        out.write(json.dumps(replay(adapter, trace), separators=(",", ":")) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
