"""What an engine holds, in kvroute's terms: the bridge translator's two maps.

Sans-I/O, like :mod:`worker.bridge.translate`, which owns one :class:`HeldBlocks` and
decides what to store and remove; this module only keeps the maps, fast.

    engine hash -> Chain (partition, last, tail, end, owned): what one held engine block
                   means for ours -- our hash at the last of our block boundaries at or
                   before its end, the tokens after that boundary (packed, TOKEN_DTYPE
                   bytes), its absolute end, and our blocks whose last token it holds
    our hash    -> Ours (parent, tokens, partition, index): one of our held blocks, as a
                   snapshot announces it

Both values are plain tuples (``CHAIN_OWNED`` and ``OURS_*`` name the fields read by index),
and a reference count above one lives in a side map (``chain_refs``, ``ours_refs``), absent
for the common count of one: a run of new blocks is then entered with ``dict.update`` over
``zip``s of its columns, and a removal taken, without Python code per block, which is what
lets one bridge keep up with an engine announcing tens of thousands of blocks a second.
"""

from __future__ import annotations

from itertools import chain, repeat
from operator import itemgetter
from typing import Final, TypeAlias, TypeVar

from kvroute_proto.events import TOKEN_DTYPE, Partition
from kvroute_proto.hashing import BlockHash
from worker.bridge.engine_wire import EngineHash

# Chain = (partition id, last, tail (packed tokens), end, owned)
Chain: TypeAlias = tuple[int, BlockHash | None, bytes, int, tuple[BlockHash, ...]]
CHAIN_OWNED: Final = 4
# Ours = (parent, tokens, partition id, index)
Ours: TypeAlias = tuple[BlockHash | None, bytes, int, int]
OURS_PARENT: Final = 0
OURS_TOKENS: Final = 1
OURS_PARTITION: Final = 2
OURS_INDEX: Final = 3

_owned_of = itemgetter(CHAIN_OWNED)
MIN_PARTITIONS_COMPACTED = 4096
K = TypeVar("K")


class HeldBlocks:
    """The engine blocks held and our blocks they own, reference-counted (vLLM announces a
    block twice when two requests compute it at once)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.chains: dict[EngineHash, Chain] = {}
        self.ours: dict[BlockHash, Ours] = {}
        self.chain_refs: dict[EngineHash, int] = {}  # references beyond the first
        self.ours_refs: dict[BlockHash, int] = {}
        # Partitions by id: the maps' tuples then hold only ints, bytes and tuples of them,
        # which the garbage collector stops tracking; a Partition in each would make every
        # full collection walk every held block (decision 0041). Ids no block uses any more
        # are dropped when the table doubles (a salt per user would otherwise grow it).
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
        """Renumber the partitions some held block still names; the others go."""
        used = {c[0] for c in self.chains.values()} | {
            o[OURS_PARTITION] for o in self.ours.values()
        }
        new_id = {old: new for new, old in enumerate(sorted(used))}
        self.partitions = [self.partitions[old] for old in sorted(used)]
        self._partition_ids = {p: i for i, p in enumerate(self.partitions)}
        self.chains = {h: (new_id[c[0]], c[1], c[2], c[3], c[4]) for h, c in self.chains.items()}
        self.ours = {h: (o[0], o[1], new_id[o[OURS_PARTITION]], o[3]) for h, o in self.ours.items()}
        self._compact_at = max(MIN_PARTITIONS_COMPACTED, 2 * len(self.partitions))

    def clear(self) -> None:
        """Forget everything."""
        self.chains.clear()
        self.ours.clear()
        self.chain_refs.clear()
        self.ours_refs.clear()
        self.partitions.clear()
        self._partition_ids.clear()

    def store(
        self,
        engine: tuple[EngineHash, ...],
        engine_block_size: int,
        tail_len: int,
        ours: list[BlockHash],
        last: BlockHash | None,
        partition: Partition,
        raw: bytes,
        start: int,
    ) -> tuple[list[int], int]:
        """Hold a stored run of engine blocks (``engine``, each ``engine_block_size``
        tokens). ``raw``: the tokens from the parent's last boundary of ours (its
        ``tail_len`` tail tokens first) to the run's end, packed; ``ours`` our hashes of
        its full blocks; ``last`` our hash before them, ``start`` the absolute token
        position of the run's first engine token.

        Engine block i ends at token ``end = tail_len + (i + 1) * engine_block_size`` of
        ``raw`` and owns our blocks ``[n(i - 1), n(i))``, ``n(i) = end // block_size``.
        Returns the positions in ``ours`` that became held, and how many engine blocks
        were already held (duplicates)."""
        pid = self.partition_id(partition)
        if not (
            self.chains.keys().isdisjoint(engine)
            and self.ours.keys().isdisjoint(ours)
            and len(set(engine)) == len(engine)
            and len(set(ours)) == len(ours)
        ):
            return self._store_some_held(
                engine, engine_block_size, tail_len, ours, last, pid, raw, start
            )
        bs, ebs, k, m = self.block_size, engine_block_size, len(engine), len(ours)
        size = TOKEN_DTYPE.itemsize
        ends = range(tail_len + ebs, tail_len + (k + 1) * ebs, ebs)
        ns = [end // bs for end in ends]
        chains = zip(
            repeat(pid),
            [ours[n - 1] if n else last for n in ns],
            map(raw.__getitem__, map(slice, [n * bs * size for n in ns], [e * size for e in ends])),
            range(start + ebs, start + (k + 1) * ebs, ebs),
            map(tuple, map(ours.__getitem__, map(slice, chain((0,), ns), ns))),
        )
        self.chains.update(zip(engine, chains, strict=True))
        width = bs * size
        first_index = (start - tail_len) // bs  # chain index of ours[0]
        blocks = zip(
            chain((last,), ours),  # one more than ours: zip stops at the tokens' end
            map(
                raw.__getitem__,
                map(slice, range(0, m * width, width), range(width, m * width + 1, width)),
            ),
            repeat(pid),
            range(first_index, first_index + m),
        )
        self.ours.update(zip(ours, blocks, strict=True))
        return list(range(m)), 0

    def _store_some_held(
        self,
        engine: tuple[EngineHash, ...],
        ebs: int,
        tail_len: int,
        ours: list[BlockHash],
        last: BlockHash | None,
        pid: int,
        raw: bytes,
        start: int,
    ) -> tuple[list[int], int]:
        """:meth:`store` block by block, when some of the run is held already."""
        bs, size = self.block_size, TOKEN_DTYPE.itemsize
        width = bs * size
        first_index = (start - tail_len) // bs
        new: list[int] = []
        duplicates = 0
        done = 0  # our blocks assigned to an engine block so far
        for i, h in enumerate(engine):
            end = tail_len + (i + 1) * ebs
            num_ours = end // bs
            if h in self.chains:
                self.chain_refs[h] = self.chain_refs.get(h, 0) + 1
                duplicates += 1
                done = num_ours
                continue
            self.chains[h] = (
                pid,
                ours[num_ours - 1] if num_ours else last,
                raw[num_ours * bs * size : end * size],
                start - tail_len + end,
                tuple(ours[done:num_ours]),
            )
            for j in range(done, num_ours):
                o = ours[j]
                if o in self.ours:
                    self.ours_refs[o] = self.ours_refs.get(o, 0) + 1
                    continue
                parent = ours[j - 1] if j else last
                self.ours[o] = (
                    parent,
                    raw[j * width : (j + 1) * width],
                    pid,
                    first_index + j,
                )
                new.append(j)
            done = num_ours
        return new, duplicates

    def remove(self, engine: tuple[EngineHash, ...]) -> tuple[list[BlockHash], int]:
        """Drop one reference to each engine block; our blocks whose last reference went
        are returned (in order), with how many engine hashes were not held."""
        chains, ours = self.chains, self.ours
        if not self.chain_refs and not self.ours_refs:  # every count is one: no loop body
            popped = list(map(chains.pop, engine, repeat(None)))
            unknown = popped.count(None)
            gone = list(chain.from_iterable(map(_owned_of, filter(None, popped))))
            for o in gone:
                del ours[o]
            return gone, unknown
        gone = []
        unknown = 0
        for h in engine:
            if h not in chains:
                unknown += 1
                continue
            if _drop_ref(self.chain_refs, h):
                continue
            for o in chains.pop(h)[CHAIN_OWNED]:
                if not _drop_ref(self.ours_refs, o):
                    del ours[o]
                    gone.append(o)
        return gone, unknown

    def snapshot(self) -> list[tuple[BlockHash, Ours]]:
        """Our held blocks, parents first."""
        return sorted(self.ours.items(), key=_index_of)


def _index_of(item: tuple[BlockHash, Ours]) -> int:
    return item[1][OURS_INDEX]


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
