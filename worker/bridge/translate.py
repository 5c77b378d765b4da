"""Turn an engine's KV events (vLLM, SGLang) into kvroute's own event stream.

Sans-I/O: engine batches in (:mod:`worker.bridge.engine_wire` values), kvroute
:class:`~kvroute_proto.events.EventBatch` values out through an outbox
(:meth:`EventTranslator.take_batches`). Imports neither asyncio, zmq, grpc, torch nor a
clock; randomness (the epoch) comes from an injected ``random.Random``.

Naming blocks. An engine names a block by its own hash (pickle-sha256 and friends, seeded
per version and process): kvroute never recomputes it. The translator keeps a map

    engine hash -> chain state (partition, our hash at the last of our block boundaries
                   at or before the engine block's end, the tokens after that boundary,
                   our blocks it owns, a reference count)

and hashes each stored engine block's token ids with kvroute's own chained hash
(:func:`kvroute_proto.hashing.block_hashes`), continuing from its parent's chain state.
Block sizes: our block j (tokens [jB, (j+1)B)) is *owned* by the engine block that holds
its last token, so an engine block of 32 owns two of our 16-token blocks, and with
SGLang's 1-token pages every 16th page owns one. Engine block sizes that are neither a
multiple nor a divisor of ours are dropped (counted).

Duplicates. vLLM caches the same prefix twice when two requests compute it in one step:
each copy is announced by BlockStored and each eviction by BlockRemoved, so engine hashes
are reference-counted; our block is stored on 0 -> 1 and removed on 1 -> 0 (our blocks are
counted too: two engine hashes may own the same block of ours). Do not enable vLLM's
``kv_cache_report_mode="full"``: it re-announces reused blocks with no matching removal.

What we cannot name is dropped and counted (:class:`TranslatorStats`): another storage
tier (``medium`` other than GPU), another KV-cache group, LoRA adapters, multimodal or
prompt-embedding extra keys, blocks whose parent we do not hold, malformed events. A
salt -- vLLM's ``("cache_salt", s)`` extra key of a chain's first block, SGLang's
``cache_salt`` -- becomes our :class:`~kvroute_proto.events.Partition` ``cache_salt``.

Sequencing. An engine numbers its batches 0, 1, 2, ... per process, with no epoch; we
number ours 1, 2, ... within a random epoch of our own::

    live   0 1 2       5 6 7                    (3 and 4 were lost)
           | | |       |
           applied     feed(5) -> ReplayFrom(3): 5 is held; feed(6), feed(7) held too
    replay                   3 4 5 6 7  END     (the shell asks the engine's replay socket)
                             | |  \\ \\ \\
                             | |   duplicates of held batches: dropped
                             feed_replay(3), feed_replay(4): applied, then 5 6 7 drain
                                                end_replay(): nothing left -> None
    live                         8              feed(8): applied (after 7)

* ``feed(batch)`` takes a live batch. The next seq is applied; an older one is a duplicate
  (dropped) unless its seq is at or below the last *live* seq seen, which means the engine
  restarted (a new process counts from 0): a new epoch begins with ``AllCleared`` and the
  state is reset. A seq past the next one is held and, once per gap, ``ReplayFrom(next)``
  is returned: the caller asks the engine for batches from that seq on.
* ``feed_replay(batch)`` takes a replayed batch: applied in order, held batches drained
  behind it. If the replay starts past the seq we need, the engine no longer has the
  missing batches: they are lost (below).
* ``end_replay()`` when the replay answer ended (its seq -1 frame) or the caller gave up
  on it. If a gap remains and this answer brought the seq forward, ``ReplayFrom`` asks
  again (a batch lost after the replay was asked for); if it brought nothing, the missing
  batches are lost.
* Lost batches (or more than ``max_held_batches`` held): what the engine holds can no
  longer be known, so a new epoch begins with ``AllCleared``, the state is reset and the
  held batches are applied after it. Our view then holds only what is announced from
  there on -- never a block the engine no longer holds.
* ``reset_engine()``: the caller knows the engine restarted (the seq alone cannot tell
  when the restarted process has already passed the old one's seq): as a restart above.

Everything is applied in engine seq order, so a live removal can never be overtaken by a
replayed store.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from kvroute_proto.events import (
    TOKEN_DTYPE,
    AllCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
    LoadReport,
    Partition,
    Snapshot,
)
from kvroute_proto.hashing import MAX_TOKEN_ID, BlockHash, block_hashes, unfmix64
from worker.bridge.engine_wire import (
    EngineAllCleared,
    EngineBatch,
    EngineBlockRemoved,
    EngineBlockStored,
    EngineHash,
    EngineUnknown,
    PackedTokenIds,
)
from worker.bridge.held import OURS_PARENT, OURS_PARTITION, OURS_TOKENS, HeldBlocks

__all__ = ["EventTranslator", "ReplayFrom", "TranslatorConfig", "TranslatorStats"]


@dataclass(frozen=True, slots=True)
class TranslatorConfig:
    """``block_size``: ours (the fleet's B). ``first_seq``: the engine seq expected first
    (0: from the engine's start; a later first batch asks for a replay from here).
    ``max_held_batches``: live batches kept behind a gap before giving up on the replay.
    ``media``: the ``medium`` values that mean the GPU cache (None always does).
    ``group_idx``: the KV-cache group followed (None always matches)."""

    worker_id: str
    block_size: int = 16
    first_seq: int = 0
    max_held_batches: int = 1024
    media: frozenset[str] = frozenset({"GPU"})
    group_idx: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.first_seq < 0:
            raise ValueError(f"first_seq must be >= 0, got {self.first_seq}")
        if self.max_held_batches < 1:
            raise ValueError(f"max_held_batches must be >= 1, got {self.max_held_batches}")


@dataclass(frozen=True, slots=True)
class ReplayFrom:
    """Ask the engine's replay endpoint for its batches from ``seq`` on."""

    seq: int


@dataclass(frozen=True, slots=True)
class TranslatorStats:
    """Counters since the translator started, and a few current sizes.

    ``dropped_*`` count engine blocks (not events) that were not translated, by reason;
    ``num_removed_unknown`` engine removals of hashes not held (dropped stores' removals,
    other tiers)."""

    epoch: int
    num_batches_applied: int = 0
    num_batches_duplicate: int = 0
    num_gaps: int = 0
    num_batches_lost: int = 0
    num_restarts: int = 0
    num_blocks_stored: int = 0
    num_blocks_removed: int = 0
    num_engine_duplicate_stores: int = 0
    num_removed_unknown: int = 0
    num_unknown_events: int = 0
    dropped_medium: int = 0
    dropped_group: int = 0
    dropped_lora: int = 0
    dropped_multimodal: int = 0
    dropped_extra_keys: int = 0
    dropped_unknown_parent: int = 0
    dropped_block_size: int = 0
    dropped_malformed: int = 0
    num_held_batches: int = 0
    num_engine_blocks: int = 0
    num_blocks: int = 0


@dataclass(slots=True)
class _Counters:
    values: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        self.values[name] = self.values.get(name, 0) + n


class EventTranslator:
    """One engine's KV-event stream (one publisher, one DP rank) in kvroute's terms."""

    def __init__(self, config: TranslatorConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self._epoch = self._new_epoch()
        self._seq = 0  # our last seq in this epoch
        self._expected = config.first_seq  # the engine seq to apply next
        self._last_live: int | None = None
        self._held: dict[int, EngineBatch] = {}
        self._awaiting: int | None = None  # the replay asked for, not yet ended
        self._held_blocks = HeldBlocks(config.block_size)
        self._outbox: list[EventBatch] = []
        self._counts = _Counters()

    # ---- the stream ---------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def feed(self, batch: EngineBatch) -> ReplayFrom | None:
        """A live batch from the engine's PUB socket (see the module docstring)."""
        if self._last_live is not None and batch.seq <= self._last_live:
            self._restart()
        self._last_live = batch.seq
        if batch.seq < self._expected:
            self._counts.add("num_batches_duplicate")
            return None
        if batch.seq == self._expected:
            self._apply(batch)
            self._drain()
            return None
        self._held.setdefault(batch.seq, batch)
        if len(self._held) > self.config.max_held_batches:
            self._lose(min(self._held))
            self._drain()
            return None
        if self._awaiting != self._expected:
            self._awaiting = self._expected
            self._counts.add("num_gaps")
            return ReplayFrom(self._expected)
        return None

    def feed_replay(self, batch: EngineBatch) -> None:
        """A batch of a replay answer (from the engine's replay socket)."""
        if batch.seq < self._expected:
            self._counts.add("num_batches_duplicate")
            return
        if batch.seq > self._expected:  # the engine no longer has the ones in between
            self._lose(batch.seq)
        self._held.pop(batch.seq, None)
        self._apply(batch)
        self._drain()

    def end_replay(self) -> ReplayFrom | None:
        """The replay answer ended, or the caller gave up on it. A gap that remains (a
        batch lost after the replay was asked for) is asked for again while each answer
        makes progress; otherwise its batches are lost."""
        asked, self._awaiting = self._awaiting, None
        if not self._held:
            return None
        if asked is not None and self._expected > asked:
            self._awaiting = self._expected
            self._counts.add("num_gaps")
            return ReplayFrom(self._expected)
        self._lose(min(self._held))
        self._drain()
        return None

    def reset_engine(self) -> None:
        """The engine restarted (the caller knows it): a new epoch, everything forgotten."""
        self._restart()
        self._last_live = None

    def publish_load(self, load: LoadReport) -> None:
        """A batch of ours carrying only ``load`` (the shell's periodic load report), with
        the next seq of the current epoch."""
        self._seq += 1
        self._outbox.append(
            EventBatch(
                self.config.worker_id, self._epoch, self._seq, self.config.block_size, (), load
            )
        )

    def take_batches(self) -> list[EventBatch]:
        """Our batches since the last call, in order (the outbox is emptied)."""
        out, self._outbox = self._outbox, []
        return out

    # ---- views --------------------------------------------------------------------------

    def held_blocks(self) -> frozenset[BlockHash]:
        """Our blocks currently announced as held."""
        return frozenset(self._held_blocks.ours)

    def held_engine_hashes(self) -> frozenset[EngineHash]:
        """The engine hashes currently held (translated ones only)."""
        return frozenset(self._held_blocks.chains)

    def snapshot(self) -> Snapshot:
        """Every block of ours held, as of our last seq (parents first)."""
        partitions = self._held_blocks.partitions
        blocks = tuple(
            BlockStored((h,), o[OURS_PARENT], o[OURS_TOKENS], partitions[o[OURS_PARTITION]])
            for h, o in self._held_blocks.snapshot()
        )
        return Snapshot(
            self.config.worker_id, self._epoch, self._seq, self.config.block_size, blocks
        )

    def stats(self) -> TranslatorStats:
        return TranslatorStats(
            epoch=self._epoch,
            num_held_batches=len(self._held),
            num_engine_blocks=len(self._held_blocks.chains),
            num_blocks=len(self._held_blocks.ours),
            **self._counts.values,
        )

    # ---- sequencing internals -----------------------------------------------------------

    def _new_epoch(self) -> int:
        return self._rng.getrandbits(63) | 1

    def _begin_epoch(self) -> None:
        """A new epoch of ours, opened by AllCleared, with all state forgotten."""
        self._epoch = self._new_epoch()
        self._seq = 0
        self._held_blocks.clear()
        self._emit([AllCleared()])

    def _restart(self) -> None:
        self._counts.add("num_restarts")
        self._begin_epoch()
        self._expected = 0
        self._held.clear()
        self._awaiting = None

    def _lose(self, next_seq: int) -> None:
        """Batches [expected, next_seq) are gone for good: start over from next_seq."""
        self._counts.add("num_batches_lost", next_seq - self._expected)
        self._begin_epoch()
        self._expected = next_seq
        self._awaiting = None
        for seq in [s for s in self._held if s < next_seq]:
            del self._held[seq]

    def _drain(self) -> None:
        while (nxt := self._held.pop(self._expected, None)) is not None:
            self._apply(nxt)
        if not self._held:
            self._awaiting = None

    def _emit(self, events: list[KvEvent]) -> None:
        if events:
            self._seq += 1
            self._outbox.append(
                EventBatch(
                    self.config.worker_id,
                    self._epoch,
                    self._seq,
                    self.config.block_size,
                    tuple(events),
                )
            )

    def _apply(self, batch: EngineBatch) -> None:
        self._expected = batch.seq + 1
        self._counts.add("num_batches_applied")
        out: list[KvEvent] = []
        for ev in batch.events:
            match ev:
                case EngineBlockStored():
                    self._store(ev, out)
                case EngineBlockRemoved():
                    self._remove(ev, out)
                case EngineAllCleared():
                    self._held_blocks.clear()
                    out.append(AllCleared())
                case EngineUnknown():
                    self._counts.add("num_unknown_events")
        self._emit(out)

    # ---- translation internals ----------------------------------------------------------

    def _medium_and_group_ok(self, medium: str | None, group_idx: int | None, n: int) -> bool:
        if medium is not None and medium not in self.config.media:
            self._counts.add("dropped_medium", n)
            return False
        if group_idx is not None and group_idx != self.config.group_idx:
            self._counts.add("dropped_group", n)
            return False
        return True

    def _salt_and_nameable(self, ev: EngineBlockStored) -> tuple[str | None, int]:
        """The salt vLLM put in the first block's extra keys, and how many leading blocks
        of the run we can name (the rest are counted as dropped here)."""
        n = len(ev.block_hashes)
        salt = ev.cache_salt
        keys = ev.extra_keys
        if not keys:
            return salt, n
        for i, entry in enumerate(keys[:n]):
            if not entry:
                continue
            reason = None
            for key in entry:
                match key:
                    case str() if i == 0 and ev.parent_block_hash is None and reason is None:
                        if salt is not None and salt != key:
                            reason = "dropped_extra_keys"
                        salt = key
                    case tuple() | bytes():
                        reason = "dropped_multimodal"
                    case _:
                        reason = "dropped_extra_keys"
                if reason is not None:
                    break
            if reason is not None:
                self._counts.add(reason, n - i)
                return salt, i
        return salt, n

    def _store(self, ev: EngineBlockStored, out: list[KvEvent]) -> None:
        n = len(ev.block_hashes)
        bs, ebs = self.config.block_size, ev.block_size
        if not n:
            return
        if not self._medium_and_group_ok(ev.medium, ev.group_idx, n):
            return
        if ev.lora_id is not None or ev.lora_name is not None:
            self._counts.add("dropped_lora", n)
            return
        if ebs % bs and bs % ebs:
            self._counts.add("dropped_block_size", n)
            return
        if len(ev.token_ids) != n * ebs or (ev.extra_keys is not None and len(ev.extra_keys) != n):
            self._counts.add("dropped_malformed", n)
            return
        if ev.parent_block_hash is None:
            salt, k = self._salt_and_nameable(ev)
            partition = Partition(cache_salt=salt or "")
            last: BlockHash | None = None
            tail = b""
            start = 0
        else:
            parent = self._held_blocks.chain(ev.parent_block_hash)
            if parent is None:
                self._counts.add("dropped_unknown_parent", n)
                return
            _, k = self._salt_and_nameable(ev)
            pid, last, tail, start = parent
            partition = self._held_blocks.partitions[pid]
        if not k:
            return
        tokens = _packed(ev.token_ids, k * ebs)
        if tokens is None:
            self._counts.add("dropped_malformed", k)
            return
        # the parent's tail, then the run's tokens: our block j's are B * 4 bytes from
        # raw[j * B * 4]
        raw = tail + tokens
        packed = np.frombuffer(raw, dtype=TOKEN_DTYPE)
        seed = partition.seed if last is None else unfmix64(last)
        hashes = block_hashes(packed, bs, seed, validate=False)
        ours: list[BlockHash] = hashes.tolist()
        tail_len = len(tail) // TOKEN_DTYPE.itemsize
        new, duplicates = self._held_blocks.store(
            ev.block_hashes[:k], ebs, tail_len, hashes, last, partition, raw, start
        )
        if duplicates:
            self._counts.add("num_engine_duplicate_stores", duplicates)
        self._announce(new, ours, last, partition, raw, out)

    def _announce(
        self,
        new: list[int],
        ours: list[BlockHash],
        last: BlockHash | None,
        partition: Partition,
        raw: bytes,
        out: list[KvEvent],
    ) -> None:
        """BlockStored runs of consecutive newly held blocks (``raw``: ``ours``' tokens,
        packed)."""
        width = self.config.block_size * TOKEN_DTYPE.itemsize
        self._counts.add("num_blocks_stored", len(new))
        if len(new) == len(ours):  # all of them (``new`` is increasing): one run
            if new:
                out.append(BlockStored(tuple(ours), last, raw[: len(ours) * width], partition))
            return
        i = 0
        while i < len(new):
            j = i
            while j + 1 < len(new) and new[j + 1] == new[j] + 1:
                j += 1
            first = new[i]
            hashes = tuple(ours[first : new[j] + 1])
            tokens = raw[first * width : (new[j] + 1) * width]
            out.append(BlockStored(hashes, ours[first - 1] if first else last, tokens, partition))
            i = j + 1

    def _remove(self, ev: EngineBlockRemoved, out: list[KvEvent]) -> None:
        n = len(ev.block_hashes)
        if not self._medium_and_group_ok(ev.medium, ev.group_idx, 0):
            self._counts.add("num_removed_unknown", n)
            return
        gone, unknown = self._held_blocks.remove(ev.block_hashes)
        if unknown:
            self._counts.add("num_removed_unknown", unknown)
        if gone:
            self._counts.add("num_blocks_removed", len(gone))
            out.append(BlockRemoved(tuple(gone)))


def _packed(token_ids: tuple[int, ...] | PackedTokenIds, n: int) -> bytes | None:
    """The first ``n`` token ids as TOKEN_DTYPE bytes; None when one is not a token id."""
    if isinstance(token_ids, PackedTokenIds):  # checked as they were decoded
        return token_ids.array[:n].astype(TOKEN_DTYPE, copy=False).tobytes()
    try:
        wide = np.array(token_ids[:n], dtype=np.int64)
    except OverflowError:  # an id past int64
        return None
    if len(wide) and (wide.min() < 0 or wide.max() > MAX_TOKEN_ID):
        return None
    return wide.astype(TOKEN_DTYPE).tobytes()
