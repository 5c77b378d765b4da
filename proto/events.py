"""KV event value types: what a worker tells the router about its cache.

Pure and synchronous; imports neither asyncio, grpc nor a clock. Only ``codec`` touches the
generated protobuf classes.

Contract (docs/ARCHITECTURE.md): each worker process has an ``epoch`` (new on every start) and a
per-epoch ``seq`` that increases by one per :class:`EventBatch`. A block is "held" while all
of its ``block_size`` tokens are in the worker's radix tree. :class:`BlockStored` announces a
run of consecutive blocks of one chain (parent first); :class:`BlockRemoved` withdraws blocks;
:class:`AllCleared` says the worker holds nothing. A :class:`Snapshot` lists every held block
as of (epoch, seq).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvroute_proto.hashing import BlockHash, as_token_array, partition_seed

TOKEN_DTYPE = np.dtype("<u4")
"""Token ids on the wire and in :class:`BlockStored`: little-endian uint32."""


def pack_token_ids(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (validated: 0 <= id < 2**32)."""
    return as_token_array(token_ids).astype(TOKEN_DTYPE).tobytes()


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
    so the router can verify or rebuild the chain. It is kept packed, as little-endian uint32
    bytes -- the wire form -- so decoding and building events never loops over tokens in
    Python; any sequence of ints (or an integer array) given here is packed on construction.
    :attr:`token_array` views it as a numpy array.
    """

    block_hashes: Sequence[BlockHash]  # a tuple, or decoded: kvroute_proto.codec.PackedHashes
    parent_hash: BlockHash | None
    token_ids: bytes
    partition: Partition = DEFAULT_PARTITION

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, bytes):
            object.__setattr__(self, "token_ids", pack_token_ids(self.token_ids))

    @property
    def token_array(self) -> np.ndarray:
        """The token ids as a read-only uint32 array (no copy)."""
        return np.frombuffer(self.token_ids, dtype=TOKEN_DTYPE)

    @property
    def block_size(self) -> int:
        return len(self.token_ids) // (4 * len(self.block_hashes)) if self.block_hashes else 0


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """These blocks are no longer held."""

    block_hashes: Sequence[BlockHash]  # a tuple, or decoded: kvroute_proto.codec.PackedHashes


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
