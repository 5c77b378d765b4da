"""The workers a router core knows: their views, event-stream sequencers and slots.

A worker gets the lowest free slot (its column in the cost's :class:`WorkerTable` and its
bit in the index); the healthy ones, in registration order, are the route's candidates.
Sans-I/O: no asyncio, grpc or clock.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from router.core.errors import (
    BlockSizeMismatchError,
    DuplicateWorkerError,
    InvalidRouteRequestError,
    UnknownWorkerError,
)
from router.core.policy_config import CostWeights
from router.core.sync import StreamSequencer, SyncConfig
from router.core.views import CandidateSet, WorkerTable, WorkerView

__all__ = ["Fleet", "FleetWorker"]


@dataclass(slots=True)
class FleetWorker:
    view: WorkerView
    stream: StreamSequencer
    last_message_at: float | None = None  # router clock at its stream's last message


class Fleet:
    """Registered workers by id, the healthy ones as candidates, the fleet's block size."""

    def __init__(self, weights: CostWeights, sync: SyncConfig, block_size: int | None) -> None:
        self.workers: dict[str, FleetWorker] = {}
        self.block_size = block_size
        self._sync = sync
        self._free_slots: list[int] = []  # heap of slots freed by remove
        self._next_slot = 0
        self.healthy: list[WorkerView] = []
        # the views' cost fields by slot, for policies that score all candidates at once
        self.table = WorkerTable(weights=weights)
        self.healthy_set = CandidateSet.of(self.healthy, self.table)

    def check_block_size(self, worker_id: str, block_size: int | None) -> None:
        if block_size is None:
            return
        if block_size <= 0:
            raise InvalidRouteRequestError("block_size", f"must be >= 1, got {block_size}")
        if self.block_size is None:
            self.block_size = block_size
        elif block_size != self.block_size:
            raise BlockSizeMismatchError(worker_id, block_size, self.block_size)

    def add(self, worker_id: str, address: str, block_size: int | None) -> None:
        if not worker_id:
            raise InvalidRouteRequestError("worker_id", "must not be empty")
        if worker_id in self.workers:
            raise DuplicateWorkerError(worker_id)
        self.check_block_size(worker_id, block_size)
        if self._free_slots:
            slot = heapq.heappop(self._free_slots)
        else:
            slot = self._next_slot
            self._next_slot += 1
        view = WorkerView(worker_id, slot, address)
        self.table.attach(view)
        self.workers[worker_id] = FleetWorker(view, StreamSequencer(worker_id, self._sync))
        self.refresh_healthy()

    def remove(self, worker_id: str) -> WorkerView:
        """Forget a worker; its view (for the caller's clean-up). Its slot is free again."""
        worker = self.get(worker_id)
        del self.workers[worker_id]
        self.table.detach(worker.view)
        heapq.heappush(self._free_slots, worker.view.slot)
        return worker.view

    def get(self, worker_id: str) -> FleetWorker:
        worker = self.workers.get(worker_id)
        if worker is None:
            raise UnknownWorkerError(worker_id)
        return worker

    def refresh_healthy(self) -> None:
        self.healthy = [w.view for w in self.workers.values() if w.view.healthy]
        self.healthy_set = CandidateSet.of(self.healthy, self.table)

    def candidates(self, exclude: frozenset[str]) -> list[WorkerView]:
        if exclude:
            return [v for v in self.healthy if v.worker_id not in exclude]
        return self.healthy

    def candidate_set(self, exclude: frozenset[str]) -> CandidateSet:
        if exclude:
            return CandidateSet.of(self.candidates(exclude), self.table)
        return self.healthy_set
