"""Random op traces for the radix cache differential test, and the replay that observes them.

bench/radix_difftest.py replays every trace on our worker's RadixCache; the peer
(bench/peers/sglang_difftest.py, SGLang's RadixCache in its own virtualenv) replays the very
same ops, sent to it over a pipe. Both sides observe through ``replay`` below, behind a small
adapter, so an observation means the same thing on both sides. This module therefore needs
numpy and the standard library only (never worker/, torch or sglang).

A trace (a JSON-able dict) is ``{"id", "page", "pool", "ops"}``; each op is a list:

    ["insert", seq]        allocate len(seq) fresh slots, insert, free the duplicates
    ["match", seq]         match_prefix (refreshes recency; may split an edge)
    ["lock", seq, id]      match_prefix, then inc_lock_ref of the node it returned
    ["unlock", id]         dec_lock_ref of the node lock ``id`` took
    ["evict", k]           evict(k)

Sequences share prefixes at several depths: three stems, and every new sequence branches off
a stem or an earlier sequence at a random point, so matches end inside edges (splits) at all
depths. Inserted sequences are page-aligned (our insert refuses a partial page); probes are
not (match_prefix rounds down). ``pool`` is the sum of insert lengths: allocation never fails.

Per op, ``replay`` records (keys of one observation dict):

    n        match/lock: tokens matched; insert: tokens already cached; evict: tokens freed
    org      match/lock: digest of *whose* KV each matched slot holds (the insert op and
             position that wrote it) -- slot numbers differ between allocators, origins don't
    ev pr tot   evictable, protected and total tokens after the op (the cache's own figures)
    vic      evict: the nodes it removed, each "start+len:hash of its root path"
    tree     evict (and the final "end" record): digest of every node of the tree
    inv      self-check failures, if any (slots in use != total, ev + pr != total, the walked
             tree != total): compared by neither side, reported as such
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

EVICT_ALL = 1 << 40  # an evict op that asks for more than any trace holds


@dataclass(frozen=True, slots=True)
class DiffSpec:
    traces: int = 400
    ops: int = 300  # ops per trace
    pages: tuple[int, ...] = (1, 16)  # trace i runs at page size pages[i % len(pages)]
    vocab: int = 8  # small, so unrelated tails still share short prefixes
    seed: int = 0


def make_trace(spec: DiffSpec, index: int) -> dict[str, Any]:
    """Trace ``index`` of ``spec`` (a pure function of both)."""
    page = spec.pages[index % len(spec.pages)]
    rng = np.random.default_rng([spec.seed, index])

    def tokens(n: int) -> list[int]:
        return [int(t) for t in rng.integers(0, spec.vocab, size=n)]

    def pick(seqs: list[list[int]]) -> list[int]:
        return seqs[int(rng.integers(len(seqs)))]

    stems = [tokens(int(rng.integers(1, 49))) for _ in range(3)]
    seqs: list[list[int]] = []  # every sequence inserted so far

    def length() -> int:
        r = rng.random()
        return int(rng.integers(1, 65 if r < 0.6 else 161 if r < 0.9 else 321))

    def branch() -> list[int]:
        """A new sequence: a random prefix of a stem or earlier sequence, then fresh tokens."""
        base = pick(stems) if not seqs or rng.random() < 0.25 else pick(seqs)
        n = length()
        keep = min(int(rng.integers(0, len(base) + 1)), n)
        return base[:keep] + tokens(n - keep)

    def probe() -> list[int]:
        r = rng.random()
        if not seqs or r < 0.25:
            return branch()
        seq = pick(seqs)
        if r < 0.5:
            return list(seq)  # exactly a cached sequence (if still cached)
        if r < 0.75:
            return seq[: int(rng.integers(1, len(seq) + 1))]  # ends inside an edge
        cut = int(rng.integers(0, len(seq) + 1))
        return seq[:cut] + tokens(int(rng.integers(1, 41)))  # diverges from it

    ops: list[list[Any]] = []
    held: list[int] = []
    pool = 1
    for i in range(spec.ops):
        r = rng.random()
        if r < 0.35:
            seq = pick(seqs) if seqs and rng.random() < 0.25 else branch()
            seq = seq + tokens(page - len(seq)) if len(seq) < page else seq
            seq = seq[: len(seq) - len(seq) % page]
            seqs.append(seq)
            pool += len(seq)
            ops.append(["insert", seq])
        elif r < 0.6:
            ops.append(["match", probe()])
        elif r < 0.7:
            s = rng.random()
            hi = 17 if s < 0.5 else 129 if s < 0.85 else 513
            ops.append(["evict", EVICT_ALL if s >= 0.97 else int(rng.integers(1, hi))])
        elif r < 0.86 or not held:
            ops.append(["lock", probe(), i])
            held.append(i)
        else:
            ops.append(["unlock", held.pop(int(rng.integers(len(held))))])
    return {"id": index, "page": page, "pool": pool, "ops": ops}


class Adapter(Protocol):
    """One cache implementation, as ``replay`` drives it. Token sequences are lists of ints;
    slot lists are the slots the cache handed out / holds."""

    root: Any

    def set_clock(self, now: int) -> None:
        """The time stamp of the next op (the op's index + 1)."""

    def insert(self, seq: list[int]) -> tuple[int, list[int]]:
        """Allocate len(seq) fresh slots, insert, free the already-cached ones' duplicates;
        returns (tokens already cached, the fresh slots)."""
        ...

    def match(self, seq: list[int]) -> tuple[list[int], Any]:
        """match_prefix: (the matched slots, the last matched node)."""
        ...

    def lock(self, node: Any) -> None: ...

    def unlock(self, node: Any) -> None: ...

    def evict(self, k: int) -> int: ...

    def sizes(self) -> tuple[int, int, int, int]:
        """(evictable, protected, total, slots in use)."""
        ...

    def children(self, node: Any) -> list[Any]: ...

    def edge(self, node: Any) -> bytes:
        """The node's edge tokens as little-endian int64 bytes."""
        ...


def tree_nodes(adapter: Adapter) -> list[str]:
    """Every node but the root as "start+len:hash" (hash of the tokens root..node's end), so
    two trees give equal lists exactly when they hold the same edges."""
    out: list[str] = []
    stack: list[tuple[Any, int, bytes]] = [(adapter.root, 0, b"")]
    while stack:
        node, start, h = stack.pop()
        for child in adapter.children(node):
            kb = adapter.edge(child)
            ch = hashlib.blake2b(h + kb, digest_size=8).digest()
            n = len(kb) >> 3
            out.append(f"{start}+{n}:{ch.hex()}")
            stack.append((child, start + n, ch))
    return out


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _tree_digest(nodes: list[str]) -> str:
    return _digest("\n".join(sorted(nodes)).encode())


def _walked_tokens(nodes: list[str]) -> int:
    return sum(int(n.split("+", 1)[1].split(":", 1)[0]) for n in nodes)


def replay(adapter: Adapter, trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Run ``trace``'s ops on ``adapter``: one observation per op, then an "end" record."""
    origin: dict[int, int] = {}  # slot -> (insert op index << 20) | position it was written at
    locks: dict[int, Any] = {}
    out: list[dict[str, Any]] = []
    for i, op in enumerate(trace["ops"]):
        adapter.set_clock(i + 1)
        kind = op[0]
        obs: dict[str, Any] = {"op": kind}
        inv: list[str] = []
        if kind == "insert":
            seq = op[1]
            cached, fresh = adapter.insert(seq)
            for pos in range(cached, len(seq)):
                origin[fresh[pos]] = (i << 20) | pos
            obs["n"] = cached
        elif kind in ("match", "lock"):
            slots, node = adapter.match(op[1])
            obs["n"] = len(slots)
            who = np.array([origin.get(s, -1) for s in slots], dtype=np.int64)
            obs["org"] = _digest(who.tobytes())
            if kind == "lock":
                adapter.lock(node)
                locks[op[2]] = node
        elif kind == "unlock":
            adapter.unlock(locks.pop(op[1]))
        elif kind == "evict":
            before = tree_nodes(adapter)
            obs["n"] = adapter.evict(op[1])
            after = tree_nodes(adapter)
            obs["vic"] = sorted(set(before) - set(after))
            obs["tree"] = _tree_digest(after)
            if _walked_tokens(after) != adapter.sizes()[2]:
                inv.append(f"walked tree {_walked_tokens(after)} != total")
        else:
            raise ValueError(f"unknown op {kind!r}")
        ev, pr, tot, used = adapter.sizes()
        obs.update(ev=ev, pr=pr, tot=tot)
        if ev + pr != tot:
            inv.append(f"evictable {ev} + protected {pr} != total {tot}")
        if used != tot:
            inv.append(f"slots in use {used} != total {tot}")
        if inv:
            obs["inv"] = inv
        out.append(obs)
    nodes = tree_nodes(adapter)
    out.append({"op": "end", "tree": _tree_digest(nodes), "nodes": len(nodes)})
    return out
