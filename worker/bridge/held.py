"""What an engine holds, in kvroute's terms: the bridge translator's two maps.

Sans-I/O, like :mod:`worker.bridge.translate`, which owns one :class:`HeldBlocks` and
decides what to store and remove; this module only keeps the maps, fast.

A stored run of engine blocks (one BlockStored event) is kept once, as a :class:`Run`: its
partition, our hash before it, its tokens packed (the parent's tail first), its absolute
start and our hashes of its full blocks. The two maps name a block by an int code, the
run's id and the block's position in it (``run_id << RUN_BITS | position``)::

    engine hash -> code of engine block i: what it means for ours (:meth:`chain`) -- our
                   hash at the last of our block boundaries at or before its end, the
                   tokens after that boundary, its absolute end -- and our blocks whose
                   last token it holds (:meth:`Run.owned`)
    our hash    -> code of our block j: its parent, tokens, partition and chain index
                   (:meth:`our_block`), as a snapshot announces it

Both maps are :class:`~worker.bridge.hash_table.HashCodes`: compiled open-addressing
tables of the 64-bit hashes (decision 0046), which steady churn never rebuilds, holding no
Python object per block, so a collection never walks them (decision 0042). A run of new
blocks goes in, and a removed run comes out, with one call per map (arrays in, arrays out),
with no Python code per block. A reference count above one lives in a side map
(``chain_refs``, ``ours_refs``), absent for the common count of one.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Final, TypeAlias, TypeVar

import numpy as np

from kvroute_proto.events import TOKEN_DTYPE, Partition
from kvroute_proto.hashing import BlockHash
from worker.bridge.engine_wire import EngineHash
from worker.bridge.hash_table import HashCodes

# Chain = (partition id, last, tail (packed tokens), end)
Chain: TypeAlias = tuple[int, BlockHash | None, bytes, int]
# Ours = (parent, tokens, partition id, index)
Ours: TypeAlias = tuple[BlockHash | None, bytes, int, int]
OURS_PARENT: Final = 0
OURS_TOKENS: Final = 1
OURS_PARTITION: Final = 2
OURS_INDEX: Final = 3

RUN_BITS: Final = 32  # a run's blocks are numbered below 2**32
MAX_RUN_ID = 2**31 - 1
_POSITION: Final = (1 << RUN_BITS) - 1
_SIZE: Final = TOKEN_DTYPE.itemsize
MIN_PARTITIONS_COMPACTED = 4096
MIN_REMOVED_AS_ARRAY = 16  # fewer blocks of ours gone at once: a loop finds them cheaper
K = TypeVar("K")


class Run:
    """One stored run: engine block i ends at token ``end = tail_len + (i + 1) * ebs`` of
    ``raw`` and owns our blocks ``[n(i - 1), n(i))``, ``n(i) = end // block_size``;
    ``ours``: our hashes of its full blocks (uint64); ``refs``: the map entries that name
    it."""

    __slots__ = ("block_size", "ebs", "last", "ours", "pid", "raw", "refs", "start", "tail_len")

    def __init__(
        self,
        block_size: int,
        ebs: int,
        tail_len: int,
        ours: np.ndarray,
        last: BlockHash | None,
        pid: int,
        raw: bytes,
        start: int,
    ) -> None:
        self.block_size, self.ebs, self.tail_len = block_size, ebs, tail_len
        self.ours, self.last, self.pid, self.raw, self.start = ours, last, pid, raw, start
        self.refs = 0

    def boundary(self, i: int) -> int:
        """How many of the run's blocks of ours end at or before engine block i's end
        (``n(i)``; 0 for i = -1, the tail being shorter than a block)."""
        return (self.tail_len + (i + 1) * self.ebs) // self.block_size

    def owned(self, i: int) -> list[BlockHash]:
        """Our blocks whose last token engine block i holds."""
        held: list[BlockHash] = self.ours[self.boundary(i - 1) : self.boundary(i)].tolist()
        return held

    def chain(self, i: int) -> Chain:
        end = self.tail_len + (i + 1) * self.ebs
        n = end // self.block_size
        last = int(self.ours[n - 1]) if n else self.last
        tail = self.raw[n * self.block_size * _SIZE : end * _SIZE]
        return self.pid, last, tail, self.start + (i + 1) * self.ebs

    def our_block(self, j: int) -> Ours:
        width = self.block_size * _SIZE
        first_index = (self.start - self.tail_len) // self.block_size
        parent = int(self.ours[j - 1]) if j else self.last
        return parent, self.raw[j * width : (j + 1) * width], self.pid, first_index + j


class HeldBlocks:
    """The engine blocks held and our blocks they own, reference-counted (vLLM announces a
    block twice when two requests compute it at once)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chains: HashCodes[EngineHash] = HashCodes()  # engine hash -> code of its run and place
        self.ours: HashCodes[BlockHash] = HashCodes()  # our hash -> code
        self.runs: dict[int, Run] = {}
        self._next_run = 1  # codes are never 0
        self.chain_refs: dict[EngineHash, int] = {}  # references beyond the first
        self.ours_refs: dict[BlockHash, int] = {}
        # Partitions by id (a run holds its id); ids no run uses any more are dropped when
        # the table doubles (a salt per user would otherwise grow it).
        self.partitions: list[Partition] = []
        self._partition_ids: dict[Partition, int] = {}
        self._compact_at = MIN_PARTITIONS_COMPACTED

    def partition_id(self, partition: Partition) -> int:
        pid = self._partition_ids.get(partition)
        if pid is None:
            if len(self.partitions) >= self._compact_at:
                self._compact_partitions()
            pid = self._partition_ids[partition] = len(self.partitions)
            self.partitions.append(partition)
        return pid

    def _compact_partitions(self) -> None:
        """Renumber the partitions some held run still names; the others go."""
        used = sorted({run.pid for run in self.runs.values()})
        new_id = {old: new for new, old in enumerate(used)}
        self.partitions = [self.partitions[old] for old in used]
        self._partition_ids = {p: i for i, p in enumerate(self.partitions)}
        for run in self.runs.values():
            run.pid = new_id[run.pid]
        self._compact_at = max(MIN_PARTITIONS_COMPACTED, 2 * len(self.partitions))

    def clear(self) -> None:
        """Forget everything."""
        self.chains.clear()
        self.ours.clear()
        self.runs.clear()
        self.chain_refs.clear()
        self.ours_refs.clear()
        self.partitions.clear()
        self._partition_ids.clear()

    # ---- views ----------------------------------------------------------------------------

    def chain(self, engine_hash: EngineHash) -> Chain | None:
        """What a held engine block means for ours, or None when it is not held."""
        code = self.chains.get(engine_hash)
        if code is None:
            return None
        return self.runs[code >> RUN_BITS].chain(code & _POSITION)

    def our_block(self, h: BlockHash) -> Ours:
        code = self.ours[h]
        return self.runs[code >> RUN_BITS].our_block(code & _POSITION)

    def snapshot(self) -> list[tuple[BlockHash, Ours]]:
        """Our held blocks, parents first (by index; at one index, as they were stored)."""
        runs = self.runs
        by_code = sorted(self.ours.items(), key=_code_of)
        held = [(h, runs[c >> RUN_BITS].our_block(c & _POSITION)) for h, c in by_code]
        return sorted(held, key=_index_of)  # type: ignore[misc]

    # ---- changes --------------------------------------------------------------------------

    def store(
        self,
        engine: tuple[EngineHash, ...],
        engine_block_size: int,
        tail_len: int,
        ours: Sequence[BlockHash] | np.ndarray,
        last: BlockHash | None,
        partition: Partition,
        raw: bytes,
        start: int,
    ) -> tuple[list[int], int]:
        """Hold a stored run of engine blocks (``engine``, each ``engine_block_size``
        tokens). ``raw``: the tokens from the parent's last boundary of ours (its
        ``tail_len`` tail tokens first) to the run's end, packed; ``ours`` our hashes of
        its full blocks; ``last`` our hash before them, ``start`` the absolute token
        position of the run's first engine token. Returns the positions in ``ours`` that
        became held, and how many engine blocks were already held (duplicates)."""
        run = Run(
            self.block_size,
            engine_block_size,
            tail_len,
            np.ascontiguousarray(ours, dtype=np.uint64),
            last,
            self.partition_id(partition),
            raw,
            start,
        )
        rid = self._new_run_id()
        base = rid << RUN_BITS
        # all new, and no two equal (the common case): a call per map
        if self.chains.put_run(engine, base):
            if self.ours.put_run(run.ours, base):
                m = len(run.ours)
                run.refs = len(engine) + m
                new, duplicates = list(range(m)), 0
            else:
                self.chains.pop_run(engine)
                new, duplicates = self._store_some_held(engine, run, base)
        else:
            new, duplicates = self._store_some_held(engine, run, base)
        if run.refs:
            self.runs[rid] = run
        return new, duplicates

    def _new_run_id(self) -> int:
        """The next id no held run has, from 1 to MAX_RUN_ID and round again: codes stay
        below 2**63 however long the bridge runs."""
        rid = self._next_run
        while rid in self.runs:  # a run stored one round ago still held
            rid = rid % MAX_RUN_ID + 1
        self._next_run = rid % MAX_RUN_ID + 1
        return rid

    def _store_some_held(
        self, engine: tuple[EngineHash, ...], run: Run, base: int
    ) -> tuple[list[int], int]:
        """:meth:`store` block by block, when some of the run is held already."""
        new: list[int] = []
        duplicates = 0
        ours: list[BlockHash] = run.ours.tolist()
        for i, h in enumerate(engine):
            if not self.chains.put(h, base | i):
                self.chain_refs[h] = self.chain_refs.get(h, 0) + 1
                duplicates += 1
                continue
            run.refs += 1
            for j in range(run.boundary(i - 1), run.boundary(i)):
                o = ours[j]
                if not self.ours.put(o, base | j):
                    self.ours_refs[o] = self.ours_refs.get(o, 0) + 1
                    continue
                run.refs += 1
                new.append(j)
        return new, duplicates

    def remove(self, engine: tuple[EngineHash, ...]) -> tuple[list[BlockHash], int]:
        """Drop one reference to each engine block; our blocks whose last reference went
        are returned (in order), with how many engine hashes were not held."""
        chains, ours = self.chains, self.ours
        chain_refs, ours_refs = self.chain_refs, self.ours_refs
        if not chain_refs and not ours_refs:  # every count is one: a call per map
            codes = chains.pop_run(engine)
            held = codes[codes != 0]
            if not len(held):
                return [], len(codes)
            gone = self._owned_by(held)
            self._release(held)
            self._release(ours.pop_run(gone))
            return gone.tolist(), len(codes) - len(held)
        gone_list: list[BlockHash] = []
        unknown = 0
        for h in engine:
            code = chains.get(h)
            if code is None:
                unknown += 1
                continue
            if chain_refs and _drop_ref(chain_refs, h):
                continue
            chains.pop(h)
            for o in self.runs[code >> RUN_BITS].owned(code & _POSITION):
                if ours_refs and _drop_ref(ours_refs, o):
                    continue
                ours_code = ours.pop(o)
                assert ours_code is not None
                self._unref(ours_code)
                gone_list.append(o)
            self._unref(code)
        return gone_list, unknown

    def _owned_by(self, codes: np.ndarray) -> np.ndarray:
        """Our blocks (uint64) that the engine blocks ``codes`` own, in order."""
        if len(codes) < MIN_REMOVED_AS_ARRAY:  # a few: a loop is cheaper than numpy's calls
            gone: list[BlockHash] = []
            for code in codes.tolist():
                gone += self.runs[code >> RUN_BITS].owned(code & _POSITION)
            return np.array(gone, dtype=np.uint64)
        rids = codes >> RUN_BITS
        positions = (codes & _POSITION).astype(np.int64)
        cuts = [0, *(np.flatnonzero(rids[1:] != rids[:-1]) + 1).tolist(), len(codes)]
        parts: list[np.ndarray] = []  # a run's at a time
        for lo, hi in pairwise(cuts):
            run = self.runs[int(rids[lo])]
            at = positions[lo:hi] * run.ebs + run.tail_len
            first = at // run.block_size
            counts = (at + run.ebs) // run.block_size - first
            if not (counts == 1).all():  # our blocks [first, first + count) of each
                first = np.repeat(first - (np.cumsum(counts) - counts), counts)
                first += np.arange(len(first))
            parts.append(run.ours[first])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _release(self, codes: np.ndarray) -> None:
        """Map entries no longer name these codes' runs (uint64, none 0); a run goes with
        its last."""
        if not len(codes):
            return
        rids = codes >> RUN_BITS
        cuts = [0, *(np.flatnonzero(rids[1:] != rids[:-1]) + 1).tolist(), len(codes)]
        for lo, hi in pairwise(cuts):  # a run's codes come together, mostly
            rid = int(rids[lo])
            run = self.runs[rid]
            run.refs -= hi - lo
            if not run.refs:
                del self.runs[rid]

    def _unref(self, code: int) -> None:
        """A map entry no longer names ``code``'s run; the run goes with the last."""
        rid = code >> RUN_BITS
        run = self.runs[rid]
        run.refs -= 1
        if not run.refs:
            del self.runs[rid]


def _index_of(item: tuple[BlockHash, Ours]) -> int:
    return item[1][OURS_INDEX]


def _code_of(item: tuple[object, int]) -> int:
    return item[1]


def _drop_ref(extra: dict[K, int], key: K) -> bool:
    """Drop a reference beyond the first, if ``key`` has one (True), else False."""
    n = extra.get(key)
    if not n:
        return False
    if n == 1:
        del extra[key]
    else:
        extra[key] = n - 1
    return True
