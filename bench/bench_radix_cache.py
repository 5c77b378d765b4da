"""Radix cache micro-benchmark: our worker's RadixCache, and SGLang's on the same op traces.

    python -m bench.bench_radix_cache --json radix.json          # ours only (~1 minute)
    python -m bench.bench_radix_cache --quick --json radix.json  # smoke run (seconds)
    bench/peers/install_sglang.sh                                # once: SGLang in .peers/
    python -m bench.bench_radix_cache --peer-python .peers/sglang-radix/bin/python \\
        --json radix.json                                # both, same sitting (~10 minutes)

The traces (bench/radix_trace.py, seeded) are built by both sides from the same code; the
peer (bench/peers/sglang_radix.py, run by the given python) proves it with a digest of every
token. Each round runs every case on ours, then on SGLang, so both see the same machine
load; each figure is the median of ``--rounds`` rounds, timed with the cyclic GC paused.

Metrics (keys of the "kvroute" / "sglang" objects in the JSON):
  insert_seq_s          a worker step per sequence (match, allocate the miss, insert, free
                        duplicate slots), page_size 1; 2,000 sequences of 2,000 tokens
                        sharing a 512-token prefix -- sequences/s
  match_full_q_s        match_prefix of every stored sequence -- queries/s
  match_split_q_s       match_prefix of each sequence's first 1,256 tokens + fresh tokens, so
                        every query splits a node -- queries/s
  insert_events_seq_s   insert_seq_s at page_size 16 with KV events on, drained every step
  evict_us_per_call_flat_{N}k
                        a cache of N thousand 3-token leaves under the root; calls that each
                        ask for 1 token (one leaf) -- microseconds per call (the easy case
                        for a persistent heap, the worst one for a heap rebuilt per call)
  evict_us_per_call_tree_k{K}
                        a realistic cache (tenants -> system prompts -> conversations ->
                        turns, ~7,200 sequences, ~2.9M tokens, nodes at several depths, the
                        64 latest conversations locked as running requests); calls that each
                        ask for K tokens, as a scheduler admitting a request does; a fresh
                        tree per K and round -- microseconds per call

"ours_over_sglang" is kvroute / SGLang per key: above 1 on a rate means we are faster,
below 1 on a microseconds key means we are faster.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.radix_trace import (
    QUICK,
    RATE_KEYS,
    Side,
    TraceSpec,
    TreeTrace,
    flat_leaf,
    make_trace,
    make_tree_trace,
    metric_keys,
    split_queries,
    timed,
    trace_digest,
)
from worker.cache.allocator import SlotAllocator
from worker.cache.base import CacheConfig
from worker.cache.radix_cache import RadixCache

PEER_SCRIPT = Path(__file__).resolve().parent / "peers" / "sglang_radix.py"


def worker_step(cache: RadixCache, alloc: SlotAllocator, tokens: np.ndarray) -> None:
    """What the scheduler does per sequence: match, allocate the miss, insert, free dups."""
    m = cache.match_prefix(tokens)
    new = alloc.alloc(len(tokens) - m.num_matched)
    if new is None:
        raise RuntimeError("benchmark pool too small")
    slots = np.concatenate((m.slots, new))
    prefix_len = cache.insert(tokens, slots)
    if prefix_len > m.num_matched:
        alloc.free(slots[m.num_matched : prefix_len])


class OurSide(Side):
    """One side of the comparison: runs one round of every case on our RadixCache. The flat
    eviction caches live across rounds (the evicted leaves are put back, untimed)."""

    def __init__(self, spec: TraceSpec) -> None:
        self.spec = spec
        self.trace = make_trace(spec)
        self.rows = list(self.trace)
        self.queries = split_queries(self.trace, spec)
        self.tree = make_tree_trace(spec)
        self._flat: dict[int, tuple[RadixCache, SlotAllocator]] = {}
        self._next_leaf: dict[int, int] = {}
        self.freed_per_call: dict[str, float] = {}
        self._warm_up()

    def _warm_up(self) -> None:
        """Run each path once before any clock runs (as the peer does for its one-time costs)."""
        alloc = SlotAllocator(self.trace.size)
        cache = RadixCache(CacheConfig(page_size=16, block_size=16), alloc)
        for row in self.rows[:2]:
            worker_step(cache, alloc, row)
        cache.take_events()
        cache.match_prefix(self.queries[0])
        cache.evict(16)

    def _insert_match(self) -> dict[str, float]:
        rows, queries = self.rows, self.queries
        alloc = SlotAllocator(self.trace.size)
        cache = RadixCache(CacheConfig(page_size=1), alloc)

        def insert_all() -> None:
            for row in rows:
                worker_step(cache, alloc, row)

        def match_all() -> None:
            for row in rows:
                cache.match_prefix(row)

        def split_all() -> None:
            for q in queries:
                cache.match_prefix(q)

        result = {
            "insert_seq_s": len(rows) / timed(insert_all),
            "match_full_q_s": len(rows) / timed(match_all),
            "match_split_q_s": len(queries) / timed(split_all),
        }
        assert cache.match_prefix(queries[-1]).num_matched == self.spec.split_at
        return result

    def _insert_events(self) -> float:
        rows = self.rows
        alloc = SlotAllocator(self.trace.size)
        cache = RadixCache(CacheConfig(page_size=16, block_size=16), alloc)
        events: list = []

        def insert_all() -> None:
            for row in rows:
                worker_step(cache, alloc, row)
                events.extend(cache.take_events())

        rate = len(rows) / timed(insert_all)
        assert len(events) == len(rows)
        return rate

    def _evict_flat(self, num_leaves: int, calls: int) -> float:
        """Microseconds per evict(1) call on a cache of ``num_leaves`` 3-token leaves."""
        if num_leaves not in self._flat:
            alloc = SlotAllocator(3 * (num_leaves + calls))
            self._flat[num_leaves] = (RadixCache(CacheConfig(page_size=1), alloc), alloc)
            self._next_leaf[num_leaves] = 0
            self._add_leaves(num_leaves, num_leaves)
        cache, _ = self._flat[num_leaves]

        def evict_some() -> None:
            for _ in range(calls):
                cache.evict(1)

        seconds = timed(evict_some)
        assert cache.num_evictable_leaves == num_leaves - calls
        self._add_leaves(num_leaves, calls)
        return seconds / calls * 1e6

    def _add_leaves(self, num_leaves: int, n: int) -> None:
        cache, alloc = self._flat[num_leaves]
        first = self._next_leaf[num_leaves]
        for i in range(first, first + n):
            slots = alloc.alloc(3)
            assert slots is not None
            cache.insert(flat_leaf(i), slots)
        self._next_leaf[num_leaves] = first + n

    def _evict_tree(self, k: int) -> float:
        """Microseconds per evict(k) call on a freshly built realistic tree."""
        cache = build_tree(self.tree)
        calls = self.spec.tree_evict_calls
        freed: list[int] = []

        def evict_some() -> None:
            for _ in range(calls):
                freed.append(cache.evict(k))

        seconds = timed(evict_some)
        assert min(freed) >= k, "the tree ran out of evictable tokens"
        self.freed_per_call[f"k{k}"] = sum(freed) / calls
        return seconds / calls * 1e6


def build_tree(tree: TreeTrace) -> RadixCache:
    """The realistic cache: every sequence inserted by a worker step, in arrival order, then
    the running conversations' latest nodes locked."""
    alloc = SlotAllocator(tree.pool_slots)
    cache = RadixCache(CacheConfig(page_size=1), alloc)
    for seq in tree.seqs:
        worker_step(cache, alloc, seq)
    for i in tree.locked:
        cache.inc_lock_ref(cache.match_prefix(tree.seqs[i]).last_node)
    return cache


class PeerSide:
    """SGLang's side: bench/peers/sglang_radix.py in another interpreter, one round per line
    written to its stdin, one JSON line back per round."""

    def __init__(self, python: str, quick: bool, spec: TraceSpec) -> None:
        cmd = [python, "-W", "ignore", str(PEER_SCRIPT), "--serve"]
        if quick:
            cmd.append("--quick")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self._read()
        expected = trace_digest(spec)
        if hello.get("trace_digest") != expected:
            self.close()
            raise RuntimeError(
                f"peer replays another trace: digest {hello.get('trace_digest')!r}, "
                f"ours {expected!r}"
            )
        self.version: str = hello.get("version", "?")
        self.freed_per_call: dict[str, float] = {}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait()
            raise RuntimeError(f"peer {PEER_SCRIPT.name} exited ({rc}) without an answer")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def round(self) -> dict[str, float]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("round\n")
        self.proc.stdin.flush()
        reply = self._read()
        self.freed_per_call = reply.pop("freed_per_call", {})
        return {key: float(value) for key, value in reply.items()}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def medians(rounds: list[dict[str, float]], keys: tuple[str, ...]) -> dict[str, float]:
    return {key: statistics.median(r[key] for r in rounds) for key in keys}


def run(spec: TraceSpec, peer_python: str | None = None, quick: bool = False) -> dict[str, Any]:
    """Alternate rounds (ours, then SGLang's) and return the report: medians per side, the
    ratios, and what each side freed per tree eviction call."""
    keys = metric_keys(spec)
    ours = OurSide(spec)
    peer = None if peer_python is None else PeerSide(peer_python, quick, spec)
    our_rounds: list[dict[str, float]] = []
    peer_rounds: list[dict[str, float]] = []
    try:
        for _ in range(spec.rounds):
            our_rounds.append(ours.round())
            if peer is not None:
                peer_rounds.append(peer.round())
    finally:
        if peer is not None:
            peer.close()
    report: dict[str, Any] = {"kvroute": medians(our_rounds, keys)}
    freed: dict[str, Any] = {"kvroute": ours.freed_per_call}
    if peer is not None:
        report["sglang"] = medians(peer_rounds, keys)
        report["ours_over_sglang"] = {
            key: report["kvroute"][key] / report["sglang"][key] for key in keys
        }
        report["sglang_version"] = peer.version
        freed["sglang"] = peer.freed_per_call
    report["tree_freed_tokens_per_call"] = freed
    report["rounds"] = spec.rounds
    return report


def _who_wins(key: str, ratio: float) -> str:
    faster = ratio if key in RATE_KEYS else 1 / ratio
    return f"kvroute {faster:.1f}x" if faster >= 1 else f"SGLang {1 / faster:.1f}x"


def format_table(report: dict[str, Any], spec: TraceSpec) -> str:
    ours = report["kvroute"]
    peer = report.get("sglang")
    head = f"{'metric':<30}{'kvroute':>14}"
    if peer is not None:
        head += f"{'SGLang':>14}{'ours/SGLang':>13}  faster"
    lines = [head]
    for key in metric_keys(spec):
        line = f"{key:<30}{ours[key]:>14,.1f}"
        if peer is not None:
            ratio = report["ours_over_sglang"][key]
            line += f"{peer[key]:>14,.1f}{ratio:>13.3g}  {_who_wins(key, ratio)}"
        lines.append(line)
    tree = make_tree_trace(spec)
    lines.append(
        f"trace: {spec.num_seqs} seqs x {spec.seq_len} tokens, shared prefix {spec.prefix_len}; "
        f"flat leaves {spec.evict_leaves} with {spec.evict_calls} calls per round; "
        f"tree: {len(tree.seqs)} seqs of {tree.num_convs} conversations, "
        f"{tree.num_tokens:,} tokens, {len(tree.locked)} locked, "
        f"{spec.tree_evict_calls} calls per K per round"
    )
    for side, freed in report["tree_freed_tokens_per_call"].items():
        shown = ", ".join(f"{k}: {v:,.0f}" for k, v in freed.items())
        lines.append(f"tokens freed per tree call, {side}: {shown}")
    order = " (ours, then SGLang's, alternating)" if peer is not None else ""
    lines.append(f"median of {report['rounds']} rounds{order}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench_radix_cache", description="Radix KV cache micro-benchmark (vs SGLang)."
    )
    parser.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT")
    parser.add_argument("--quick", action="store_true", help="small smoke run (seconds)")
    parser.add_argument("--rounds", type=int, help="rounds per side (default 5; quick 1)")
    parser.add_argument(
        "--peer-python",
        metavar="PATH",
        help="python of the SGLang venv (bench/peers/install_sglang.sh): run SGLang's "
        "RadixCache on the same traces, alternating rounds with ours",
    )
    args = parser.parse_args(argv)
    spec = QUICK if args.quick else TraceSpec()
    if args.rounds is not None:
        if args.rounds < 1:
            parser.error("--rounds must be >= 1")
        spec = dataclasses.replace(spec, rounds=args.rounds)
    report = run(spec, args.peer_python, args.quick)
    print(format_table(report, spec))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
