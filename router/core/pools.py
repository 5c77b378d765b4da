"""Model pools: one :class:`~router.core.router_core.RouterCore` per served model name.

A router in front of workers of several models keeps one pool per served model -- its own
prefix index, block size, policy state and in-flight accounting -- and routes each request
by its ``model`` to that model's pool (decision 0036). Routing within a pool is the
RouterCore's, unchanged: a router serving one model holds one pool and behaves as before.

Which pool a worker joins (:meth:`RouterPools.pool_for_worker`), by the model name it
announces (``WorkerInfo.model_name``)::

    the name of a pool            -> that pool
    no name (an engine bridge may) -> the default pool (the first)
    another name, and the router   -> a new pool of that name (``open``: a router given no
      was given no model              --model forms its pools from what workers announce)
    another name, one pool fixed   -> that pool (the single-model router: workers are
                                      checked by their tokenizer, whatever they call it)
    another name, several fixed    -> refused (UnservedModelError), never routed to

Worker-keyed calls (streams, health, load) go to the worker's pool, so the shells use this
object where they used one RouterCore. Sans-I/O, like the cores it holds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvroute_proto.events import EventBatch, Snapshot
from router.core.core_types import (
    Action,
    Explanation,
    ReplicaEvent,
    ReplicaRouted,
    RouterStats,
    WorkerStats,
)
from router.core.errors import DuplicateWorkerError, RouterError, UnknownWorkerError
from router.core.router_core import RouterCore
from router.core.step_profile import StepProfile
from router.core.views import WorkerView

__all__ = [
    "PoolsConfig",
    "PoolsExplanation",
    "RouterPools",
    "UnknownModelError",
    "UnservedModelError",
]

ReplicaListener = Callable[[ReplicaEvent], None]


def served_list(names: Sequence[str]) -> str:
    return ", ".join(repr(n) for n in names)


class UnknownModelError(RouterError):
    """A request names a model no pool serves (``model`` None or empty: it names none, and
    the router serves several)."""

    def __init__(self, model: str | None, served: Sequence[str]):
        self.model = model
        self.served = tuple(served)
        if model:
            msg = f"The model {model!r} does not exist: this server serves {served_list(served)}"
        else:
            msg = f"model is required: this server serves {served_list(served)}"
        super().__init__(msg)


class UnservedModelError(RouterError):
    """A worker announces a model the router does not serve."""

    def __init__(self, model: str, served: Sequence[str]):
        self.model = model
        super().__init__(
            f"it serves model {model!r}, which this router does not serve "
            f"(it serves {served_list(served)}: --model / --served-model-name)"
        )


@dataclass(frozen=True, slots=True)
class PoolsExplanation:
    """Explain's answer: the explained pools' explanations, by model (one, the request's;
    every pool's for a request naming none on a router serving several), and the served
    models."""

    model: str  # the pool explained; "" when every pool's are
    explanations: tuple[tuple[str, Explanation], ...]
    served: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """``names``: the pools the router is configured with, the first the default one (a
    request without a model, a worker announcing none); ``open``: a worker announcing
    another name forms a pool of it (a router given no model)."""

    names: tuple[str, ...]
    open: bool = False

    def __post_init__(self) -> None:
        if not self.names or not all(self.names):
            raise ValueError(f"pool names must be non-empty strings, got {self.names!r}")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"served model names must differ, got {self.names!r}")


class RouterPools:
    """The pool map: model name -> RouterCore, and which pool each worker is in.

    ``make_core`` builds one pool's core; it is called for each configured name at once, in
    order, and for each pool formed later (``open``)."""

    def __init__(self, config: PoolsConfig, make_core: Callable[[], RouterCore]) -> None:
        self.config = config
        self._make_core = make_core
        self.pools: dict[str, RouterCore] = {name: make_core() for name in config.names}
        self._of_worker: dict[str, str] = {}  # worker id -> its pool's name
        self._listener: Callable[[ReplicaEvent], None] | None = None
        self._served: list[str] | None = None  # served_models(), until membership changes

    # ---- pools ---------------------------------------------------------------------------

    @property
    def default(self) -> str:
        return self.config.names[0]

    @property
    def core(self) -> RouterCore:
        """The default pool's core (the only one of a single-model router)."""
        return self.pools[self.default]

    def served_models(self) -> list[str]:
        """What ``GET /v1/models`` lists: the configured pools, in order; a router given no
        model lists the pools that have a worker, by name (its default name while none has
        one)."""
        if self._served is None:
            if not self.config.open:
                self._served = list(self.config.names)
            else:
                self._served = sorted(set(self._of_worker.values())) or [self.default]
        return list(self._served)

    def resolve(self, model: str | None) -> tuple[str, RouterCore]:
        """The pool a request for ``model`` goes to: (name, core). No model: the only
        served one. UnknownModelError otherwise."""
        if model:
            core = self.pools.get(model)
            if core is not None:
                return model, core
            raise UnknownModelError(model, self.served_models())
        if self._served is None:
            self.served_models()
        assert self._served is not None
        if len(self._served) == 1:
            return self._served[0], self.pools[self._served[0]]
        raise UnknownModelError(None, self._served)

    def pool_for_worker(self, announced: str) -> str:
        """The pool a worker announcing ``announced`` joins (the module's table); raises
        UnservedModelError. Forms no pool (add_worker does)."""
        if announced in self.pools:
            return announced
        if not announced:
            return self.default
        if self.config.open:
            return announced
        if len(self.config.names) == 1:
            return self.default
        raise UnservedModelError(announced, self.config.names)

    def model_of(self, worker_id: str) -> str:
        """The pool ``worker_id`` is in (UnknownWorkerError)."""
        try:
            return self._of_worker[worker_id]
        except KeyError:
            raise UnknownWorkerError(worker_id) from None

    def pool_of(self, worker_id: str) -> RouterCore:
        return self.pools[self.model_of(worker_id)]

    # ---- membership (RouterCore's, by the worker's pool) ---------------------------------

    def add_worker(
        self, worker_id: str, address: str = "", block_size: int | None = None, model: str = ""
    ) -> str:
        """Register a worker in the pool of ``model`` (pool_for_worker), forming it if
        need be; the pool's name. Raises what RouterCore.add_worker raises, and
        UnservedModelError."""
        if worker_id in self._of_worker:
            raise DuplicateWorkerError(worker_id)
        name = self.pool_for_worker(model)
        core = self.pools.get(name)
        if core is None:
            core = self.pools[name] = self._make_core()
            if self._listener is not None:
                core.set_replica_listener(self._tagged(name))
        core.add_worker(worker_id, address, block_size)
        self._of_worker[worker_id] = name
        self._served = None
        return name

    def remove_worker(self, worker_id: str) -> None:
        self.pool_of(worker_id).remove_worker(worker_id)
        del self._of_worker[worker_id]
        self._served = None

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._of_worker

    def workers(self) -> list[str]:
        """Every pool's workers, pool by pool."""
        return [w for core in self.pools.values() for w in core.workers()]

    def set_health(self, worker_id: str, healthy: bool) -> None:
        self.pool_of(worker_id).set_health(worker_id, healthy)

    def set_max_running(self, worker_id: str, max_running: int) -> None:
        self.pool_of(worker_id).set_max_running(worker_id, max_running)

    def set_step_profile(self, worker_id: str, profile: StepProfile) -> None:
        self.pool_of(worker_id).set_step_profile(worker_id, profile)

    def worker_view(self, worker_id: str) -> WorkerView:
        return self.pool_of(worker_id).worker_view(worker_id)

    def worker_blocks(self, worker_id: str) -> set[int]:
        return self.pool_of(worker_id).worker_blocks(worker_id)

    def expected_subscription(self, worker_id: str) -> tuple[int, int]:
        return self.pool_of(worker_id).expected_subscription(worker_id)

    def stream_position(self, worker_id: str) -> tuple[int, int]:
        return self.pool_of(worker_id).stream_position(worker_id)

    def on_stream_message(self, worker_id: str, msg: EventBatch | Snapshot) -> list[Action]:
        return self.pool_of(worker_id).on_stream_message(worker_id, msg)

    # ---- introspection -------------------------------------------------------------------

    @property
    def policy_name(self) -> str:
        return self.core.policy_name

    def stats(self) -> dict[str, RouterStats]:
        """Each pool's stats, by model."""
        return {name: core.stats() for name, core in self.pools.items()}

    def worker_stats(self) -> list[WorkerStats]:
        """Every pool's workers' routing state, pool by pool."""
        return [s for core in self.pools.values() for s in core.worker_stats()]

    # ---- replica sync (each pool's; a pick names its pool) -------------------------------

    def set_replica_listener(self, listener: ReplicaListener | None) -> None:
        """Tell ``listener`` every pool's picks, first tokens and finishes; a pick carries
        its pool's name (ReplicaRouted.model)."""
        self._listener = listener
        for name, core in self.pools.items():
            core.set_replica_listener(None if listener is None else self._tagged(name))

    def _tagged(self, name: str) -> ReplicaListener:
        listener = self._listener
        assert listener is not None

        def tag(event: ReplicaEvent) -> None:
            if isinstance(event, ReplicaRouted):
                event = dataclasses.replace(event, model=name)
            listener(event)

        return tag

    @property
    def replica_sync_window_s(self) -> float:
        return self.core.replica_sync_window_s

    def observe_replica_sync_delay(self, delay_s: float) -> None:
        for core in self.pools.values():
            core.observe_replica_sync_delay(delay_s)

    def apply_replica(self, router_id: str, event: ReplicaEvent) -> bool:
        """Another replica's pick goes to the pool it names (none: the default; a pool this
        router does not hold changes nothing); its first token and end to the pool that
        counts the request."""
        if isinstance(event, ReplicaRouted):
            core = self.pools.get(event.model or self.default)
            return core is not None and core.apply_replica(router_id, event)
        return any(core.apply_replica(router_id, event) for core in self.pools.values())

    @property
    def num_replica_inflight(self) -> int:
        return sum(core.num_replica_inflight for core in self.pools.values())

    def drop_replica(self, router_id: str) -> int:
        return sum(core.drop_replica(router_id) for core in self.pools.values())
