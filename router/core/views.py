"""What a policy reads: one view per worker, their cost fields in a table, the request.

The core owns and updates the views (in-flight counts, the last load report, recent work);
policies only read them. Sans-I/O: no asyncio, grpc, torch or clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

import numpy as np

from kvroute_proto.events import LoadReport
from router.core.policy_config import CostWeights
from router.core.step_profile import DEFAULT_STEP_PROFILE, StepProfile

__all__ = [
    "CandidateSet",
    "Matched",
    "Pick",
    "RouteQuery",
    "Views",
    "WorkerTable",
    "WorkerView",
    "worker_id_hash",
]


def worker_id_hash(worker_id: str) -> int:
    """A 64-bit hash of a worker id, the same in every process and on every machine (not
    Python's salted ``hash``): the affinity term's worker half."""
    return int.from_bytes(blake2b(worker_id.encode(), digest_size=8).digest(), "little")


class WorkerView:
    """What the router knows about one worker (mutable; the core owns and updates it).

    ``inflight_prefill_tokens``: uncached prompt tokens of requests routed here that have not
    produced their first token (router-tracked). ``num_active``: requests routed here and
    not finished. ``load``: the worker's last load report, if any. ``id_hash``: a 64-bit
    hash of ``worker_id``, the same in every process (the affinity term's). The two derived
    fields below are what policies read; :meth:`refresh` recomputes them after any change (kept as
    plain values because scoring 64 workers per request must not compute them):

    ``queued_prefill_tokens``: the router's count, or the worker's report if larger (it also
    sees other routers' requests; ours may not have reached it yet). ``num_running``:
    likewise for requests (running + waiting on the worker). ``slot_queue``: how many of
    those a new request would wait behind for a running slot, ``num_running + 1 -
    max_running`` when positive (``max_running``: the worker's stated cap, 0 if none; then
    0). ``recent_prefill``: prefill
    tokens routed here (and decode work of finished requests), decayed, times the core's
    current scale factor (policies multiply by
    ``RouteQuery.recent_scale`` to get tokens; see ``Flights.recent_scale``).
    ``kv_per_running``: KV tokens per running request in the last report (0: none yet).
    ``num_prefilling``: requests routed here not yet past their first token (router-tracked).
    ``step_profile``: the worker's stated step times (decision 0031).

    A view the core registered is attached to its :class:`WorkerTable`: every change of the
    four cost fields (by :meth:`refresh` or by assignment) is also written there, where the
    cache-aware cost reads them for all candidates at once.
    """

    __slots__ = (
        "_cap",
        "_kvper",
        "_profile",
        "_queued",
        "_recent",
        "_running",
        "_table",
        "address",
        "healthy",
        "id_hash",
        "inflight_prefill_tokens",
        "load",
        "num_active",
        "num_prefilling",
        "slot",
        "worker_id",
    )

    def __init__(
        self,
        worker_id: str,
        slot: int,
        address: str = "",
        healthy: bool = True,
        inflight_prefill_tokens: int = 0,
        num_active: int = 0,
        load: LoadReport | None = None,
        queued_prefill_tokens: int = 0,
        num_running: int = 0,
        recent_prefill: float = 0.0,
        max_running: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.id_hash = worker_id_hash(worker_id)
        self.slot = slot
        self.address = address
        self.healthy = healthy
        self.inflight_prefill_tokens = inflight_prefill_tokens
        self.num_active = num_active
        self.load = load
        self._queued = queued_prefill_tokens
        self._running = num_running
        self._recent = recent_prefill
        self._cap = max_running
        self._kvper = 0.0
        self.num_prefilling = 0
        self._profile = DEFAULT_STEP_PROFILE
        self._table: WorkerTable | None = None

    def __repr__(self) -> str:
        return (
            f"WorkerView(worker_id={self.worker_id!r}, slot={self.slot!r}, "
            f"address={self.address!r}, healthy={self.healthy!r}, "
            f"inflight_prefill_tokens={self.inflight_prefill_tokens!r}, "
            f"num_active={self.num_active!r}, load={self.load!r}, "
            f"queued_prefill_tokens={self._queued!r}, num_running={self._running!r}, "
            f"recent_prefill={self._recent!r}, max_running={self._cap!r})"
        )

    @property
    def queued_prefill_tokens(self) -> int:
        return self._queued

    @queued_prefill_tokens.setter
    def queued_prefill_tokens(self, value: int) -> None:
        self._queued = value
        if self._table is not None:
            self._table.set_view(self)

    @property
    def num_running(self) -> int:
        return self._running

    @num_running.setter
    def num_running(self, value: int) -> None:
        self._running = value
        if self._table is not None:
            self._table.set_view(self)

    @property
    def max_running(self) -> int:
        return self._cap

    @max_running.setter
    def max_running(self, value: int) -> None:
        if value < 0:
            raise ValueError(f"max_running must be >= 0, got {value}")
        self._cap = value
        if self._table is not None:
            self._table.set_view(self)

    @property
    def slot_queue(self) -> int:
        cap = self._cap
        return max(self._running + 1 - cap, 0) if cap else 0

    @property
    def recent_prefill(self) -> float:
        return self._recent

    @recent_prefill.setter
    def recent_prefill(self, value: float) -> None:
        self._recent = value
        if self._table is not None:
            self._table.fields[2, self.slot] = value

    @property
    def kv_per_running(self) -> float:
        return self._kvper

    @property
    def step_profile(self) -> StepProfile:
        return self._profile

    @step_profile.setter
    def step_profile(self, profile: StepProfile) -> None:
        self._profile = profile
        if self._table is not None:
            self._table.set_view(self)

    def refresh(self) -> None:
        """Recompute the derived fields from the router's counts and the last report."""
        load = self.load
        if load is None:
            queued = self.inflight_prefill_tokens
            running = self.num_active
        else:
            queued = max(self.inflight_prefill_tokens, load.num_queued_prefill_tokens)
            running = max(self.num_active, load.num_running + load.num_waiting)
            if load.num_running > 0:
                used = load.num_total_kv_tokens - load.num_free_kv_tokens
                used -= load.num_evictable_kv_tokens
                self._kvper = max(used, 0) / load.num_running
        self._queued = queued
        self._running = running
        if self._table is not None:
            self._table.set_view(self)

    def decode_parts(self) -> tuple[float, float]:
        """The decode-time term's two per-worker parts, (A, B), so that the term for a
        request of P prompt tokens expected to generate L is ``L * (A + (P + L / 2) * B)``
        (router.core.cost): with r the requests past their prefill and K their KV,
        A = r * 2 * seq + K * ctx and B = r * ctx; before a report says the KV per running
        request, each stands in with the request's own (K = r * (P + L / 2): B doubles)."""
        r = self._running - self.num_prefilling
        if r <= 0:
            return 0.0, 0.0
        profile = self._profile
        seq, ctx = profile.seq_tokens(), profile.context_tokens()
        if self._kvper > 0:
            return r * (2.0 * seq) + r * self._kvper * ctx, r * ctx
        return r * (2.0 * seq), 2.0 * (r * ctx)


ROWS = 7  # WorkerTable.fields' rows


class WorkerTable:
    """The cache-aware cost's inputs for every attached view, by worker slot: ``fields``
    rows 0, 1, 2 and 4 hold each slot's ``queued_prefill_tokens``, ``num_running``,
    ``recent_prefill`` and ``slot_queue`` as float64 (the values the cost's float arithmetic
    converts them to), row 3 the cost's load part under ``weights``, ``queued_prefill *
    queued + decode * running + slot_wait * slot_queue`` (the knee, which depends on the
    request, is added per route), computed in Python as :meth:`CacheAware.costs` computes
    it; rows 5 and 6 the decode-time term's parts (``WorkerView.decode_parts``); kept current
    by the views themselves.
    ``ids``: each slot's ``WorkerView.id_hash``."""

    __slots__ = ("_wc", "_wd", "_wq", "fields", "ids", "weights")

    def __init__(self, capacity: int = 64, weights: CostWeights | None = None) -> None:
        self.fields = np.zeros((ROWS, max(capacity, 1)))
        self.ids = np.zeros(self.fields.shape[1], dtype=np.uint64)
        self.weights = weights = weights or CostWeights()
        self._wq, self._wd, self._wc = weights.queued_prefill, weights.decode, weights.slot_wait

    def set_load(self, slot: int, queued: int, running: int, slot_queue: int = 0) -> None:
        fields = self.fields
        fields[0, slot] = queued
        fields[1, slot] = running
        fields[4, slot] = slot_queue
        fields[3, slot] = self._wq * queued + self._wd * running + self._wc * slot_queue

    def set_view(self, view: WorkerView) -> None:
        """Write ``view``'s load and decode-time fields (it changed)."""
        slot = view.slot
        self.set_load(slot, view._queued, view._running, view.slot_queue)
        self.fields[5, slot], self.fields[6, slot] = view.decode_parts()

    def attach(self, view: WorkerView) -> None:
        """Keep ``view``'s cost fields here from now on (its slot's column is overwritten)."""
        slot = view.slot
        capacity = self.fields.shape[1]
        if slot >= capacity:
            grown = np.zeros((ROWS, max(2 * capacity, slot + 1)))
            grown[:, :capacity] = self.fields
            self.fields = grown
            ids = np.zeros(grown.shape[1], dtype=np.uint64)
            ids[:capacity] = self.ids
            self.ids = ids
        self.ids[slot] = view.id_hash
        view._table = self
        self.fields[2, slot] = view._recent
        self.set_view(view)

    @staticmethod
    def detach(view: WorkerView) -> None:
        """Stop writing ``view``'s fields here (its worker left; the slot may be reused)."""
        view._table = None


@dataclass(slots=True)
class CandidateSet:
    """Candidates of a route as the core hands them to :meth:`Policy.select_set`:
    ``views`` (what :meth:`Policy.select` takes), ``table`` holding their cost fields,
    ``columns`` (their slots in ``table.fields``, in ``views`` order: a slice when the slots
    run 0, 1, ... in order) and ``position`` (slot -> index into ``views``)."""

    views: Sequence[WorkerView]
    table: WorkerTable
    columns: slice | np.ndarray
    position: dict[int, int]

    @classmethod
    def of(cls, views: Sequence[WorkerView], table: WorkerTable) -> CandidateSet:
        slots = [v.slot for v in views]
        columns: slice | np.ndarray
        if slots == list(range(len(slots))):
            columns = slice(0, len(slots))
        else:
            columns = np.array(slots, dtype=np.intp)
        return cls(views, table, columns, {s: i for i, s in enumerate(slots)})


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """The request as policies see it. ``block_hashes``: its full blocks' hashes.
    ``recent_scale``: turns a view's stored ``recent_prefill`` into decayed tokens now."""

    request_id: str
    prompt_tokens: int
    block_size: int
    block_hashes: Sequence[int]
    recent_scale: float = 1.0
    # tokens it is expected to generate (Flights.expected_output_tokens; 0: not known)
    expected_output_tokens: float = 0.0


Views = Sequence[WorkerView]  # a policy's candidates: healthy, not excluded, never empty
Matched = dict[int, int]  # matched prefix length in blocks per worker slot (absent: 0)
Pick = tuple[int, float]  # (index into the candidates, its cost; 0.0 without a cost model)
