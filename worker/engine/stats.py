"""Engine counters (the source for metrics) and the scheduler's model limits.

Pure: imports neither asyncio, grpc, torch nor a clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from edge.histogram import HistogramCounter, HistogramStats

__all__ = [
    "QUEUE_WAIT_BUCKETS_S",
    "Counters",
    "EngineStats",
    "HistogramCounter",
    "HistogramStats",
    "ModelLimits",
]


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the executor's model allows (the scheduler validates against it).

    ``eos_token_ids`` is every id that ends a sequence (a frozenset: the scheduler tests each
    generated token against it); ``eos_token_id``, the model's first one, is always in it.
    """

    vocab_size: int
    max_context_tokens: int
    eos_token_id: int | None
    eos_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        ids = frozenset(self.eos_token_ids)
        if self.eos_token_id is not None:
            ids |= {self.eos_token_id}
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
                raise ValueError(f"ModelLimits.eos_token_ids must be ints >= 0, got {t!r}")
        object.__setattr__(self, "eos_token_ids", ids)


@dataclass(slots=True)
class Counters:
    """Monotonic counters the scheduler bumps (mutable; EngineStats is the frozen view)."""

    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_prefill_tokens: int = 0
    generated_tokens: int = 0
    num_retractions: int = 0
    num_steps: int = 0
    num_dedup_holds: int = 0
    num_lpm_rematches: int = 0
    num_lpm_stale_estimates: int = 0
    num_evicted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A point-in-time view of the engine's counters and gauges.

    * ``prompt_tokens``: prompt tokens of every accepted request.
    * ``cached_prompt_tokens``: prompt tokens served from the cache at first admission.
    * ``computed_prefill_tokens``: tokens prefilled, recomputation after retraction included.
    * ``generated_tokens``: tokens sampled (streamed to clients).
    * ``num_dedup_holds``: (request, step) pairs held back by in-batch prefix dedup.
    * ``num_lpm_rematches`` / ``num_lpm_stale_estimates``: prefix re-matches LPM did to keep
      its ordering fresh, and waiting requests it ordered on a stale estimate because the
      per-step re-match budget ran out (LPM stays on; see EngineConfig.lpm_rematch_budget).
    """

    num_requests: int
    num_finished: int
    num_aborted: int
    prompt_tokens: int
    cached_prompt_tokens: int
    computed_prefill_tokens: int
    generated_tokens: int
    num_retractions: int
    num_steps: int
    num_dedup_holds: int
    num_lpm_rematches: int
    num_lpm_stale_estimates: int
    num_evicted_tokens: int
    num_running: int
    num_waiting: int
    num_free_kv_tokens: int
    num_evictable_kv_tokens: int
    num_protected_kv_tokens: int
    num_total_kv_tokens: int

    @property
    def num_used_kv_tokens(self) -> int:
        """KV tokens not immediately allocatable (request-owned or cached)."""
        return self.num_total_kv_tokens - self.num_free_kv_tokens

    @property
    def kv_usage(self) -> float:
        """Fraction of the pool held by running requests (cached-but-evictable excluded)."""
        if self.num_total_kv_tokens == 0:
            return 0.0
        busy = self.num_total_kv_tokens - self.num_free_kv_tokens - self.num_evictable_kv_tokens
        return busy / self.num_total_kv_tokens


# Queue wait: from add_request to the first step that prefills the request (seconds).
QUEUE_WAIT_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
