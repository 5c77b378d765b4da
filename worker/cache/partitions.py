"""Partition ids for the radix cache: Partition <-> small int kept in child keys.

Pure: imports neither asyncio, grpc, torch nor a clock.

Every node of a partition hangs below a child of the root in that partition, so the table
counts the root's children per id. An id whose count is zero is used by no node and no lock;
such ids are recycled once they outnumber the live ones, so clients that send a new cache
salt or extra key with every request cannot grow the table without bound.
"""

from __future__ import annotations

from kvroute_proto.events import Partition

_SLACK = 64  # dead ids tolerated before a sweep (amortises the sweep to O(1) per id)


class PartitionTable:
    """Partition <-> id, with root-children counts and recycling of dead ids."""

    __slots__ = ("_free", "_ids", "_partitions", "root_children")

    def __init__(self) -> None:
        self._ids: dict[Partition, int] = {}
        self._partitions: list[Partition | None] = []
        self._free: list[int] = []
        self.root_children: dict[int, int] = {}  # id -> children of the root in it

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, pid: int) -> Partition:
        """The partition of a live id (block events, error messages, debug)."""
        partition = self._partitions[pid]
        assert partition is not None, f"partition id {pid} is not in use"
        return partition

    def lookup(self, partition: Partition) -> int | None:
        """The id of a known partition, None otherwise (registers nothing)."""
        pid = self._ids.get(partition)
        if pid is None and not isinstance(partition, Partition):
            raise TypeError(f"partition must be a Partition, got {type(partition).__name__}")
        return pid

    def register(self, partition: Partition) -> int:
        """The id of ``partition``, assigning one (a recycled one when possible)."""
        pid = self.lookup(partition)
        if pid is not None:
            return pid
        if len(self._ids) > 2 * len(self.root_children) + _SLACK:
            self._recycle()
        if self._free:
            pid = self._free.pop()
            self._partitions[pid] = partition
        else:
            pid = len(self._partitions)
            self._partitions.append(partition)
        self._ids[partition] = pid
        return pid

    def add_root_child(self, pid: int) -> None:
        self.root_children[pid] = self.root_children.get(pid, 0) + 1

    def remove_root_child(self, pid: int) -> None:
        left = self.root_children[pid] - 1
        if left:
            self.root_children[pid] = left
        else:
            del self.root_children[pid]

    def recount(self, root_child_pids: list[int]) -> None:
        """Reset the counts from the root's current children (after a reset)."""
        self.root_children = {}
        for pid in root_child_pids:
            self.add_root_child(pid)

    def check(self, root_child_pids: list[int]) -> None:
        """Assert the counts and the two-way mapping (used by check_invariants)."""
        counts: dict[int, int] = {}
        for pid in root_child_pids:
            counts[pid] = counts.get(pid, 0) + 1
        assert counts == self.root_children, "root children per partition miscounted"
        for partition, pid in self._ids.items():
            assert self._partitions[pid] == partition, f"partition id {pid} maps back wrongly"
        assert set(counts) <= set(self._ids.values()), "a node uses a recycled id"

    def _recycle(self) -> None:
        for partition, pid in list(self._ids.items()):
            if pid not in self.root_children:
                del self._ids[partition]
                self._partitions[pid] = None
                self._free.append(pid)
