"""Event sequencing and the bounded replay buffer of a worker's KV event stream.

Sans-I/O: imports neither asyncio, grpc nor a clock. The engine runner calls it from the
engine thread only (it is not thread-safe), right after draining ``engine.take_events()``,
so a batch's seq and the engine state it describes always agree.

Numbering (docs/ARCHITECTURE.md, "The event contract")::

    epoch E (new per process)   seq: 1   2   3   4 ... last_seq
    replay buffer (last N)                   [3   4 ... last_seq]
    resume(E, after_seq=2..last_seq)  -> the buffered batches after after_seq
    resume(E, after_seq < 2), resume(other epoch), resume(0, _), resume(E, > last_seq)
                                      -> None: the caller sends a snapshot at last_seq

A batch is published only when it carries something: at least one event, or a load report.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute_proto.events import EventBatch, KvEvent, LoadReport


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    """Identity of the stream and the replay buffer size (in batches)."""

    worker_id: str
    epoch: int
    block_size: int
    replay_buffer_size: int = 1024

    def __post_init__(self) -> None:
        if not self.worker_id:
            raise ValueError("worker_id must not be empty")
        if not 1 <= self.epoch < 2**64:
            raise ValueError(f"epoch must be in [1, 2**64), got {self.epoch}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.replay_buffer_size < 0:
            raise ValueError(f"replay_buffer_size must be >= 0, got {self.replay_buffer_size}")


class EventPublisher:
    """Numbers event batches and remembers the last ``replay_buffer_size`` of them."""

    def __init__(self, config: PublisherConfig) -> None:
        self.config = config
        self._last_seq = 0
        self._buffer: deque[EventBatch] = deque(maxlen=config.replay_buffer_size)
        # counters (metrics): batches published; resumes answered from the buffer; resumes
        # of this epoch the buffer no longer covered (the subscriber gets a snapshot)
        self.num_published = 0
        self.num_replays = 0
        self.num_replay_misses = 0

    @property
    def epoch(self) -> int:
        return self.config.epoch

    @property
    def last_seq(self) -> int:
        """Seq of the newest batch (0 before the first)."""
        return self._last_seq

    @property
    def oldest_buffered_seq(self) -> int | None:
        """Seq of the oldest batch still in the replay buffer (None when it is empty)."""
        return self._buffer[0].seq if self._buffer else None

    def publish(
        self, events: Sequence[KvEvent], load: LoadReport | None = None
    ) -> EventBatch | None:
        """Wrap ``events`` (and ``load``) into the next batch; None when both are empty."""
        if not events and load is None:
            return None
        self._last_seq += 1
        batch = EventBatch(
            worker_id=self.config.worker_id,
            epoch=self.config.epoch,
            seq=self._last_seq,
            block_size=self.config.block_size,
            events=tuple(events),
            load=load,
        )
        self._buffer.append(batch)
        self.num_published += 1
        return batch

    def resume(self, epoch: int, after_seq: int) -> list[EventBatch] | None:
        """The batches a subscriber that has seen ``(epoch, after_seq)`` is missing.

        Returns the buffered batches with seq > after_seq (empty when it is up to date), or
        None when they cannot be replayed exactly: another epoch (or 0, "no state"), a seq
        older than the buffer, or a seq this stream never produced. The caller then sends a
        snapshot taken at :attr:`last_seq` instead.
        """
        if epoch != self.config.epoch or after_seq > self._last_seq:
            return None
        if after_seq == self._last_seq:
            return []
        oldest = self.oldest_buffered_seq
        if oldest is None or after_seq < oldest - 1:
            self.num_replay_misses += 1
            return None
        self.num_replays += 1
        # Buffered seqs are consecutive, so the missing ones are a suffix of the buffer.
        start = after_seq - oldest + 1
        return [self._buffer[i] for i in range(start, len(self._buffer))]
