"""A simulated replay's settings: the fleet, its engines, the routers (``SimConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from router.core.router_core import RouterConfig
from worker.engine.engine import EngineConfig
from worker.engine.sim_executor import SimCostModel

__all__ = ["DEFAULT_KV_CAPACITY_TOKENS", "SimConfig"]

DEFAULT_KV_CAPACITY_TOKENS = 450_000  # ~58 GiB of Llama-3-8B KV (128 KiB/token) on an H100


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Fleet and engine settings of one simulated replay."""

    num_workers: int = 8
    kv_capacity_tokens: int = DEFAULT_KV_CAPACITY_TOKENS  # per worker
    event_delay_s: float = 0.005
    load_interval_s: float = 1.0
    seed: int = 0
    page_size: int = 16
    block_size: int = 16  # engine event / router block size
    engine: EngineConfig = field(default_factory=EngineConfig)  # other engine knobs
    router: RouterConfig = field(default_factory=RouterConfig)  # policy is overridden
    cost_model: SimCostModel = field(default_factory=SimCostModel)
    vocab_size: int = 128_256
    max_context_tokens: int | None = None  # None: fit the longest request of the trace
    num_routers: int = 1  # independent router replicas (module docstring)
    route_decision_s: float = 0.0  # each routing decision takes this long (a router queue)
    measure_route_time: bool = False  # charge RouterCore.route's measured time instead
    network_delay_s: float = 0.0  # router -> worker: a routed request arrives this later
    event_loss: float = 0.0  # probability that an event batch never reaches a router
    flush_interval_s: float = 0.0  # > 0: every this often one worker (in turn) drops its cache
    # workers also send load reports around steps (worker/engine/load_reports.py):
    # kvroute worker --step-reports
    step_reports: bool = False
    # replica sync (num_routers > 1): each router's picks, first tokens and finishes reach
    # the other routers this much later (RouterCore.apply_replica); None: no sync
    replica_sync_delay_s: float | None = None
    # with sync and a decision time: applying a peer's pick is a job of the receiving
    # router's too, this long (a first token or finish a quarter of it), one job at a time
    # with its decisions: done before the next queued one, which waits for it
    replica_apply_s: float = 0.0
    # each policy gets the load-report freshness it has in production (its
    # Policy.load_interval_s, where it states one) instead of load_interval_s: set by
    # kvroute replay when --load-interval-s is not given (decision 0031)
    policy_load_intervals: bool = False

    def for_policy(self, policy: str) -> SimConfig:
        """This config as ``policy``'s replay runs it: with its own load-report interval
        when ``policy_load_intervals`` and the policy states one."""
        from router.core.registry import POLICIES

        factory = POLICIES.get(policy)
        interval = getattr(factory, "load_interval_s", None)
        if not self.policy_load_intervals or interval is None:
            return self
        return replace(self, load_interval_s=interval)

    def router_config(self, policy: str | None = None) -> RouterConfig:
        """Each router core's config: ``router`` with this fleet's block size, replica
        count (the routers) and whether the replicas sync (and ``policy``, when given).
        With sync and an auto window (``router.replica.sync_window_s`` None) the window is
        the sync delay:
        what a live router measures of its own sync (RouterCore.observe_replica_sync_delay)."""
        sync = self.num_routers > 1 and self.replica_sync_delay_s is not None
        window = self.router.replica.sync_window_s
        if sync and window is None:
            window = self.replica_sync_delay_s
        replica = replace(
            self.router.replica, count=self.num_routers, sync=sync, sync_window_s=window
        )
        return replace(
            self.router,
            policy=policy or self.router.policy,
            block_size=self.block_size,
            replica=replica,
        )

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.num_routers < 1:
            raise ValueError(f"num_routers must be >= 1, got {self.num_routers}")
        for name in ("route_decision_s", "network_delay_s", "flush_interval_s", "replica_apply_s"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.event_loss < 1:
            raise ValueError(f"event_loss must be in [0, 1), got {self.event_loss}")
        if self.kv_capacity_tokens < self.page_size:
            raise ValueError(
                f"kv_capacity_tokens must be >= page_size {self.page_size}, "
                f"got {self.kv_capacity_tokens}"
            )
        if self.event_delay_s < 0:
            raise ValueError(f"event_delay_s must be >= 0, got {self.event_delay_s}")
        if self.load_interval_s < 0:
            raise ValueError(f"load_interval_s must be >= 0, got {self.load_interval_s}")
        if self.replica_sync_delay_s is not None and not self.replica_sync_delay_s >= 0:
            raise ValueError(
                f"replica_sync_delay_s must be >= 0 or None, got {self.replica_sync_delay_s}"
            )
