"""The set of worker connections: static addresses plus those the registry reports.

Connections are keyed by address (what the operator or the registry names); the worker id
is learned from the worker itself (GetLoad) and claimed in the core. Two addresses claiming
the same worker id is a misconfiguration: the second is refused (logged) until the first
goes away. Removing an address closes its connection and forgets the worker in the core
(its index entries go with it).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Iterable

from router.core.errors import RouterError
from router.core.pools import RouterPools
from router.service.worker_conn import ConnectionConfig, ConnectionHooks, WorkerConnection

log = logging.getLogger(__name__)


class WorkerPool:
    """Owns every WorkerConnection and the worker_id -> connection map."""

    def __init__(
        self,
        core: RouterPools,
        config: ConnectionConfig,
        *,
        rng: random.Random,
        clock: Callable[[], float],
        on_health_change: Callable[[int], None] | None = None,
    ) -> None:
        self._core = core
        self._config = config
        self._rng = rng
        self._clock = clock
        self._on_health_change = on_health_change
        self._changed = asyncio.Condition()
        self._hooks = ConnectionHooks(self._claim, self._release, self._on_health, self._changed)
        self.conns: dict[str, WorkerConnection] = {}
        self._static: set[str] = set()
        self._owners: dict[str, WorkerConnection] = {}
        self._refusals: dict[str, str] = {}  # address -> last refusal logged (log once)

    # ---- membership ----------------------------------------------------------------------

    def add(self, address: str, *, static: bool = False) -> WorkerConnection:
        """Connect to ``address`` (idempotent) and start following its events."""
        if static:
            self._static.add(address)
        conn = self.conns.get(address)
        if conn is None:
            conn = WorkerConnection(
                address,
                self._core,
                self._config,
                self._hooks,
                rng=random.Random(self._rng.getrandbits(64)),
                clock=self._clock,
            )
            self.conns[address] = conn
            conn.start()
            log.info("worker at %s added", address)
        return conn

    async def remove(self, address: str) -> None:
        """Disconnect from ``address`` and forget its worker."""
        self._static.discard(address)
        conn = self.conns.pop(address, None)
        if conn is not None:
            await conn.close()
            log.info("worker at %s removed", address)

    async def set_dynamic(self, addresses: Iterable[str]) -> None:
        """Make the non-static members exactly ``addresses`` (the registry's view)."""
        wanted = set(addresses)
        for address in list(self.conns):
            if address not in wanted and address not in self._static:
                await self.remove(address)
        for address in sorted(wanted):
            self.add(address)

    async def close(self) -> None:
        for address in list(self.conns):
            conn = self.conns.pop(address)
            await conn.close()
        self._static.clear()

    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> None:
        """Wait until ``predicate()`` holds, re-checking it after every connection state
        change and every applied event message; TimeoutError after ``timeout`` seconds."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    # ---- lookups -------------------------------------------------------------------------

    def by_worker_id(self, worker_id: str) -> WorkerConnection | None:
        return self._owners.get(worker_id)

    def address_of(self, worker_id: str) -> str:
        conn = self._owners.get(worker_id)
        return conn.address if conn is not None else ""

    @property
    def num_healthy(self) -> int:
        return sum(1 for c in self.conns.values() if c.healthy)

    # ---- connection hooks ----------------------------------------------------------------

    def _claim(self, conn: WorkerConnection, worker_id: str, block_size: int, model: str) -> bool:
        owner = self._owners.get(worker_id)
        if owner is not None and owner is not conn:
            return self._refuse(
                conn, f"worker id {worker_id!r} is already served by {owner.address}"
            )
        if not self._core.has_worker(worker_id):
            try:
                self._core.add_worker(worker_id, conn.address, block_size or None, model=model)
            except (RouterError, ValueError) as exc:
                return self._refuse(conn, f"worker {worker_id!r} refused: {exc}")
        self._owners[worker_id] = conn
        self._refusals.pop(conn.address, None)
        return True

    def _refuse(self, conn: WorkerConnection, reason: str) -> bool:
        """Log a refusal once per address and reason (the connection retries with backoff)."""
        if self._refusals.get(conn.address) != reason:
            self._refusals[conn.address] = reason
            log.error("not routing to %s: %s", conn.address, reason)
        return False

    def _release(self, conn: WorkerConnection, worker_id: str) -> None:
        if self._owners.get(worker_id) is conn:
            del self._owners[worker_id]
            if self._core.has_worker(worker_id):
                self._core.remove_worker(worker_id)

    def _on_health(self, conn: WorkerConnection, healthy: bool) -> None:
        if self._on_health_change is not None:
            self._on_health_change(self.num_healthy)
