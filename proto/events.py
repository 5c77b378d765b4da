"""KV event value types: what a worker tells the router about its cache.

Pure and synchronous; imports neither asyncio, grpc nor a clock. Only ``codec`` touches the
generated protobuf classes.

Contract (see DESIGN.md): each worker process has an ``epoch`` (new on every start) and a
per-epoch ``seq`` that increases by one per :class:`EventBatch`. A block is "held" while all
of its ``block_size`` tokens are in the worker's radix tree. :class:`BlockStored` announces a
run of consecutive blocks of one chain (parent first); :class:`BlockRemoved` withdraws blocks;
:class:`AllCleared` says the worker holds nothing. A :class:`Snapshot` lists every held block
as of (epoch, seq).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvroute_proto.hashing import BlockHash, partition_seed


@dataclass(frozen=True, slots=True)
class Partition:
    """A cache partition: identical tokens in different partitions never share KV."""

    cache_salt: str = ""
    extra_key: str = ""

    @property
    def seed(self) -> int:
        """The block-hash chain seed of this partition."""
        return partition_seed(self.cache_salt, self.extra_key)


DEFAULT_PARTITION = Partition()


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one chain became held, parent first.

    ``parent_hash`` is the hash of the block just before ``block_hashes[0]`` (None when the
    first block starts at token position 0). ``token_ids`` holds ``block_size`` ids per block
    so the router can verify or rebuild the chain.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    partition: Partition = DEFAULT_PARTITION

    @property
    def block_size(self) -> int:
        return len(self.token_ids) // len(self.block_hashes) if self.block_hashes else 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks are no longer held."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The worker dropped its whole cache."""


KvEvent = BlockStored | BlockRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class LoadReport:
    """A worker's own view of its load, sent on the event stream at a steady interval."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued_prefill_tokens: int = 0
    num_free_kv_tokens: int = 0
    num_evictable_kv_tokens: int = 0
    num_total_kv_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One numbered message of a worker's event stream."""

    worker_id: str
    epoch: int
    seq: int
    block_size: int
    events: tuple[KvEvent, ...] = ()
    load: LoadReport | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every block a worker holds as of (epoch, seq): live batches seq+1, ... follow it."""

    worker_id: str
    epoch: int
    seq: int
    block_size: int
    blocks: tuple[BlockStored, ...] = field(default=())
