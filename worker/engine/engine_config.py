"""EngineConfig: every knob of the serving engine (cache, scheduler, limits) in one value.

Pure: imports neither asyncio, grpc, torch nor a clock. Re-exported by ``worker.engine.engine``.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.cache.base import SPLIT_RECENCY


@dataclass(frozen=True, slots=True)
class AdaptiveReserve:
    """SGLang's adaptive new-token reserve ratio (its defaults: SGLANG_INIT_NEW_TOKEN_RATIO,
    SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR, SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
    SGLANG_RETRACT_DECODE_STEPS).

    The ratio starts at ``init_ratio`` (and returns there whenever the engine goes idle),
    falls by ``(init - min) / decay_steps`` per decode step without a retraction down to
    ``min = init_ratio * min_ratio_factor``, and after a retraction jumps to what the
    surviving batch needs: ``(tokens generated + retract_decode_steps * requests) / max_new
    tokens``, summed over the requests still decoding (at most 1)."""

    init_ratio: float = 0.7
    min_ratio_factor: float = 0.14
    decay_steps: int = 600
    retract_decode_steps: int = 20

    def __post_init__(self) -> None:
        if not 0.0 < self.init_ratio <= 1.0:
            raise ValueError(f"AdaptiveReserve.init_ratio must be in (0, 1], got {self.init_ratio}")
        if not 0.0 <= self.min_ratio_factor <= 1.0:
            raise ValueError(
                f"AdaptiveReserve.min_ratio_factor must be in [0, 1], got {self.min_ratio_factor}"
            )
        for name in ("decay_steps", "retract_decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"AdaptiveReserve.{name} must be an int >= 1, got {value!r}")

    @property
    def min_ratio(self) -> float:
        return self.init_ratio * self.min_ratio_factor

    @property
    def decay(self) -> float:
        """Ratio lost per decode step without a retraction."""
        return (self.init_ratio - self.min_ratio) / self.decay_steps


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine. The first twelve fields are the stable interface callers build
    (docs/ARCHITECTURE.md, "Engine settings"); the rest are additions with defaults.

    * ``new_token_reserve_ratio``: admission keeps ``ratio * min(remaining new tokens, 4096)``
      free KV tokens per running request for its future decode tokens, so a fresh admission
      does not force a retraction on the next step (SGLang's new_token_ratio). None (the
      default): the ratio adapts as SGLang's does, by the rule and constants of
      ``adaptive_reserve`` -- high after a retraction, decaying while nothing is retracted.
      A number in [0, 1] holds the ratio fixed there (the behaviour before the adaptive
      rule; 0 admits greedily and leaves overflow to retraction).
    * ``adaptive_reserve``: the adaptive rule's constants (SGLang's by default).
    * ``in_batch_dedup_min_tokens``: hold a waiting request whose not-yet-cached prefix shares
      at least this many tokens with a request being prefilled (0 turns the dedup off).
    * ``lpm_rematch_budget``: most waiting requests whose prefix match LPM refreshes per step;
      the rest keep a stale estimate (counted in ``EngineStats.num_lpm_stale_estimates``).
    * ``split_recency``: "keep" or "stamp" -- whether the unused lower half of an edge that
      an access splits counts as accessed (CacheConfig.split_recency; "stamp" is SGLang's).
    * ``clamp_max_new_tokens``: accept prompt + max_new_tokens > max_context_tokens and stop
      such a request with ``FinishReason.MAX_CONTEXT`` instead of rejecting it.
    """

    worker_id: str = "worker-0"
    num_kv_slots: int = 65536
    page_size: int = 1
    block_size: int = 16
    eviction_policy: str = "lru"
    schedule_policy: str = "lpm"
    max_running_requests: int = 256
    max_waiting_requests: int = 4096
    max_prefill_tokens_per_step: int = 8192
    chunk_size: int = 2048
    enable_cache: bool = True
    seed: int = 0
    new_token_reserve_ratio: float | None = None
    in_batch_dedup_min_tokens: int = 32
    lpm_rematch_budget: int = 512
    clamp_max_new_tokens: bool = False
    adaptive_reserve: AdaptiveReserve = AdaptiveReserve()
    split_recency: str = "keep"

    def __post_init__(self) -> None:
        positive = (
            "num_kv_slots",
            "page_size",
            "block_size",
            "max_running_requests",
            "max_waiting_requests",
            "max_prefill_tokens_per_step",
            "chunk_size",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("in_batch_dedup_min_tokens", "lpm_rematch_budget"):
            if getattr(self, name) < 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.split_recency not in SPLIT_RECENCY:
            raise ValueError(
                f"EngineConfig.split_recency must be one of {SPLIT_RECENCY}, "
                f"got {self.split_recency!r}"
            )
        if not isinstance(self.adaptive_reserve, AdaptiveReserve):
            raise ValueError(
                "EngineConfig.adaptive_reserve must be an AdaptiveReserve, "
                f"got {self.adaptive_reserve!r}"
            )
        ratio = self.new_token_reserve_ratio
        if ratio is not None and not 0.0 <= ratio <= 1.0:
            raise ValueError(
                "EngineConfig.new_token_reserve_ratio must be None (adaptive) or in [0, 1], "
                f"got {ratio}"
            )
