"""The op traces of the radix cache benchmark, shared by both sides of the comparison.

bench/bench_radix_cache.py runs them on our worker's RadixCache; bench/peers/sglang_radix.py
runs the very same arrays on SGLang's RadixCache in its own virtualenv. So this module needs
numpy and the standard library only (never worker/, torch or sglang). Every trace is a pure
function of a TraceSpec (seeded): same spec, same tokens, same order, on both sides.

Three traces:

* ``make_trace``: num_seqs sequences of seq_len tokens sharing a prefix_len-token prefix
  (insert, full match, split match, insert with events).
* ``flat_leaf``: leaf i of the flat eviction case, 3 tokens [i, i, i] hung off the root.
* ``make_tree_trace``: a realistic cache -- tenants -> system prompts -> conversations ->
  turns, arriving interleaved over time, the most recent conversations still running (their
  last node locked), as a scheduler leaves the tree when it must evict to admit a request.
"""

from __future__ import annotations

import gc
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# Metric keys whose value is a rate (higher is better); every other key is microseconds
# per call (lower is better).
RATE_KEYS = ("insert_seq_s", "match_full_q_s", "match_split_q_s", "insert_events_seq_s")


@dataclass(frozen=True, slots=True)
class TraceSpec:
    # Shared-prefix trace (insert / match / events).
    num_seqs: int = 2000
    seq_len: int = 2000
    prefix_len: int = 512
    split_at: int = 1256  # split-match queries keep this many tokens, then go fresh
    vocab: int = 32_000
    seed: int = 0
    # Flat eviction case: leaves of 3 tokens under the root; calls that each free 1 token
    # (one leaf), evict_calls[i] of them per round on the cache of evict_leaves[i] leaves.
    # Fewer calls on the big caches only to bound SGLang's time: it rebuilds a heap of every
    # leaf on each call, so its per-call cost does not depend on how many calls are made.
    evict_leaves: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    evict_calls: tuple[int, ...] = (100, 20, 5)
    # Tree eviction case (make_tree_trace): shape, running requests, and the k tokens that
    # each eviction call must free (what admitting one request asks for).
    tree_tenants: int = 8
    tree_prompts: int = 4  # system prompts per tenant
    tree_convs: int = 64  # conversations per system prompt
    tree_max_turns: int = 6  # each conversation has 1..tree_max_turns turns
    tree_locked: int = 64  # conversations in flight: their latest node stays locked
    tree_evict_k: tuple[int, ...] = (16, 256, 4096)
    tree_evict_calls: int = 50
    rounds: int = 5  # every figure is the median of this many rounds


QUICK = TraceSpec(
    num_seqs=200,
    evict_leaves=(1_000, 2_000, 5_000),
    evict_calls=(20, 10, 5),
    tree_tenants=2,
    tree_prompts=2,
    tree_convs=16,
    tree_locked=8,
    tree_evict_calls=10,
    rounds=1,
)


def flat_keys(spec: TraceSpec) -> tuple[str, ...]:
    return tuple(f"evict_us_per_call_flat_{n // 1000}k" for n in spec.evict_leaves)


def tree_keys(spec: TraceSpec) -> tuple[str, ...]:
    return tuple(f"evict_us_per_call_tree_k{k}" for k in spec.tree_evict_k)


def metric_keys(spec: TraceSpec) -> tuple[str, ...]:
    """Every metric key, in table order, for this spec."""
    return RATE_KEYS + flat_keys(spec) + tree_keys(spec)


# ---------------------------------------------------------------- shared-prefix trace


def make_trace(spec: TraceSpec) -> np.ndarray:
    """(num_seqs, seq_len) int64 token ids; every row starts with the same prefix."""
    rng = np.random.default_rng(spec.seed)
    trace = rng.integers(0, spec.vocab, size=(spec.num_seqs, spec.seq_len), dtype=np.int64)
    trace[:, : spec.prefix_len] = trace[0, : spec.prefix_len]
    return trace


def split_queries(trace: np.ndarray, spec: TraceSpec) -> list[np.ndarray]:
    """Each row's first split_at tokens then tokens outside the vocabulary, so the match of
    every query ends inside a stored edge (and splits it)."""
    fresh = np.arange(spec.seq_len - spec.split_at, dtype=np.int64) + spec.vocab
    return [np.concatenate((row[: spec.split_at], fresh)) for row in trace]


# ---------------------------------------------------------------- flat eviction case


def flat_leaf(i: int) -> np.ndarray:
    """Leaf i of the flat case: 3 tokens, distinct first token, so every leaf is a root child."""
    return np.full(3, i, dtype=np.int64)


# ---------------------------------------------------------------- tree eviction case


@dataclass(frozen=True, slots=True)
class TreeTrace:
    """The realistic eviction case: insert ``seqs`` in order (a scheduler's worker step
    each), then lock the node that ``seqs[i]`` ends at for every i in ``locked``."""

    seqs: list[np.ndarray]  # in arrival order; a turn's sequence extends its previous turn
    locked: list[int]  # indices into seqs: the latest turn of each running conversation
    num_convs: int
    num_tokens: int  # tokens the inserts bring (at most what the tree holds at page_size 1)

    @property
    def pool_slots(self) -> int:
        """KV slots both sides allocate for this case (the tree fits with room to spare)."""
        return self.num_tokens + max(len(s) for s in self.seqs)


def make_tree_trace(spec: TraceSpec) -> TreeTrace:
    """Tenant prefixes (64-511 tokens) -> system prompts (256-2047) -> conversations whose
    turns (user + assistant, 32-767 tokens each) extend the previous turn. Each conversation
    starts at a random time and its turns follow at random gaps, so conversations interleave
    and the tree's recency order is mixed across tenants and depths; the ``tree_locked``
    conversations with the latest activity are the ones still running."""
    rng = np.random.default_rng(spec.seed + 1)

    def tokens(lo: int, hi: int) -> np.ndarray:
        return rng.integers(0, spec.vocab, size=int(rng.integers(lo, hi)), dtype=np.int64)

    convs: list[list[np.ndarray]] = []  # per conversation: its sequences, turn by turn
    num_tokens = 0
    for _ in range(spec.tree_tenants):
        tenant = tokens(64, 512)
        num_tokens += len(tenant)
        for _ in range(spec.tree_prompts):
            system = np.concatenate((tenant, tokens(256, 2048)))
            num_tokens += len(system) - len(tenant)
            for _ in range(spec.tree_convs):
                seq = system
                turns = []
                for _ in range(int(rng.integers(1, spec.tree_max_turns + 1))):
                    turn = tokens(32, 768)
                    num_tokens += len(turn)
                    seq = np.concatenate((seq, turn))
                    turns.append(seq)
                convs.append(turns)
    # Arrival times: a conversation starts uniformly in [0, 1); turns follow at exponential
    # gaps (mean 0.05). Sorting by time interleaves the conversations.
    events: list[tuple[float, int, int]] = []
    for c, turns in enumerate(convs):
        t = float(rng.random())
        for j in range(len(turns)):
            events.append((t, c, j))
            t += float(rng.exponential(0.05))
    events.sort()
    seqs = [convs[c][j] for _, c, j in events]
    locked: list[int] = []
    seen: set[int] = set()
    for i in range(len(events) - 1, -1, -1):
        c = events[i][1]
        if c not in seen:
            seen.add(c)
            locked.append(i)
            if len(locked) == spec.tree_locked:
                break
    locked.reverse()
    return TreeTrace(seqs, locked, len(convs), num_tokens)


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, with the cyclic GC paused (as timeit does): both sides of a
    comparison time their cases with it."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


class Side:
    """One side of the radix-cache comparison (ours, or a peer's in its own venv): a round
    runs every case of ``spec`` once, in the same order on both sides."""

    spec: TraceSpec

    def round(self) -> dict[str, float]:
        result = self._insert_match()
        result["insert_events_seq_s"] = self._insert_events()
        for key, leaves, calls in zip(
            flat_keys(self.spec), self.spec.evict_leaves, self.spec.evict_calls, strict=True
        ):
            result[key] = self._evict_flat(leaves, calls)
        for key, k in zip(tree_keys(self.spec), self.spec.tree_evict_k, strict=True):
            result[key] = self._evict_tree(k)
        return result

    def _insert_match(self) -> dict[str, float]:
        raise NotImplementedError

    def _insert_events(self) -> float:
        raise NotImplementedError

    def _evict_flat(self, leaves: int, calls: int) -> float:
        raise NotImplementedError

    def _evict_tree(self, k: int) -> float:
        raise NotImplementedError


def trace_digest(spec: TraceSpec) -> str:
    """A short hash of every token and index the traces of ``spec`` hold: both sides of the
    comparison print it, so a run proves they replayed the same ops."""
    h = hashlib.blake2b(digest_size=8)
    h.update(make_trace(spec).tobytes())
    tree = make_tree_trace(spec)
    for seq in tree.seqs:
        h.update(len(seq).to_bytes(4, "little"))
        h.update(seq.tobytes())
    h.update(np.asarray(tree.locked, dtype=np.int64).tobytes())
    h.update(repr((spec.evict_leaves, spec.evict_calls, spec.tree_evict_k)).encode())
    h.update(repr((spec.tree_evict_calls, spec.split_at, spec.vocab)).encode())
    return h.hexdigest()
