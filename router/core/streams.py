"""Stream ingest: each worker's KV event stream, sequenced and applied to the prefix index.

:class:`StreamIngest` feeds every message of a worker's stream to that worker's
:class:`~router.core.sync.StreamSequencer` (held by :class:`~router.core.fleet.Fleet`) and
applies what comes out in order: event batches to the index (a batch decoded lazily, a
:class:`~kvroute_proto.codec.WireBatch`, from its scanned layout when the index prefers
it), load reports to the worker's view, snapshots in place of the worker's confirmed
entries. A gap or a stale subscription comes back as a :class:`Resubscribe` for the shell.

Sans-I/O: no asyncio, grpc or clock (the core's injected clock stamps each message).
"""

from __future__ import annotations

from collections.abc import Callable

from kvroute_proto.codec import WireBatch
from kvroute_proto.events import EventBatch, Snapshot
from router.core.core_types import Action, Resubscribe
from router.core.fleet import Fleet
from router.core.index_api import PrefixIndexAPI

__all__ = ["StreamIngest"]


class StreamIngest:
    """The workers' KV event streams into the index.

    ``use_events``: whether the policy reads the events (else only load reports are
    applied); ``wire_apply``: whether a WireBatch is applied from its scanned layout.
    """

    def __init__(
        self,
        fleet: Fleet,
        index: PrefixIndexAPI,
        clock: Callable[[], float],
        *,
        use_events: bool,
        wire_apply: bool,
    ) -> None:
        self._fleet = fleet
        self._index = index
        self._clock = clock
        self._use_events = use_events
        self._wire_apply = wire_apply

    def expected_subscription(self, worker_id: str) -> tuple[int, int]:
        """(epoch, after_seq) to (re)subscribe with; (0, 0) when nothing was synced yet."""
        return self._fleet.get(worker_id).stream.expected_subscription()

    def position(self, worker_id: str) -> tuple[int, int]:
        """(epoch, seq) of the last applied batch or snapshot (read-only)."""
        stream = self._fleet.get(worker_id).stream
        return stream.epoch, stream.last_seq

    def receive(self, worker_id: str, msg: EventBatch | Snapshot) -> list[Action]:
        """Feed one message of a worker's event stream (RouterCore.on_stream_message)."""
        worker = self._fleet.get(worker_id)
        self._fleet.check_block_size(worker_id, msg.block_size)
        step = worker.stream.receive(msg)
        worker.last_message_at = self._clock()
        view = worker.view
        index = self._index
        slot = view.slot
        if step.new_epoch:  # a restart: nothing we knew or predicted about it holds
            index.remove_worker(slot)
        for item in step.apply:
            if isinstance(item, EventBatch):
                if self._use_events:
                    if type(item) is WireBatch and self._wire_apply:
                        index.apply_wire(slot, item.layout)
                    else:
                        for event in item.events:
                            index.apply(slot, event)
                if item.load is not None:
                    view.load = item.load
                    view.refresh()
            elif self._use_events:  # Snapshot: replaces the confirmed entries; a resync
                # keeps the predictions for requests in flight
                index.remove_worker(slot, predictions=False)
                for stored in item.blocks:
                    index.store(slot, stored)
        if step.resubscribe is None:
            return []
        epoch, after_seq = step.resubscribe
        return [Resubscribe(worker_id, epoch, after_seq, step.reason)]
