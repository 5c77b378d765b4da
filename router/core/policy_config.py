"""The policies' settings: the cache-aware cost's weights and the factors beside them.

Plain frozen values, validated on construction; :mod:`router.core.cost` says what each term
does, and the decision records say how each number was chosen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = [
    "COST_WEIGHTS_FORM",
    "DEFAULT_BACKLOG_TOKENS",
    "DEFAULT_SATURATED_SCALE_TOKENS",
    "DEFAULT_SATURATED_TOKENS",
    "MIN_QUEUED_KNEE",
    "QUEUED_KNEE_PROMPTS",
    "SLOT_WAIT_TOKENS",
    "CostWeights",
    "PolicyConfig",
]

SLOT_WAIT_TOKENS = 1024.0  # CostWeights.slot_wait's default (decision 0012)
QUEUED_KNEE_PROMPTS = 14.0  # CostWeights.queued_knee's default (decision 0013)
DECODE_TIME_WEIGHT = 0.1  # CostWeights.decode_time's default (decision 0031)
DEFAULT_BACKLOG_TOKENS = 50_000.0  # PolicyConfig.backlog_tokens (decision 0010)
DEFAULT_SATURATED_TOKENS = 10_000.0  # PolicyConfig.saturated_tokens (decision 0011)
DEFAULT_SATURATED_SCALE_TOKENS = 2_000.0  # PolicyConfig.saturated_scale_tokens (0011)
# the --cost-weights option's form (CostWeights.parse), shown by every command that takes it
COST_WEIGHTS_FORM = "PREFILL,QUEUED,DECODE[,RECENT[,SLOT_WAIT[,KNEE[,DECODE_TIME]]]]"
MIN_QUEUED_KNEE = 1e-3  # a knee below a thousandth of a prompt means nothing (and overflows)


@dataclass(frozen=True, slots=True)
class CostWeights:
    """Weights of the cache-aware cost (all in prefill-token equivalents)::

        cost(worker) = prefill * (prompt_tokens - matched_tokens)
                     + queued_prefill * q * (1 + q / (queued_knee * prompt_tokens))
                     + decode * requests running on the worker
                     + recent_prefill * work routed there lately (decayed)
                     + slot_wait * requests ahead of it for a running slot
                     + decode_time * (the time its decode and its prefill add, in prefill
                                      tokens: router.core.cost, decision 0031)

    ``q``: queued prefill tokens on the worker; ``queued_knee`` 0 keeps the queued term
    linear. Defaults: decisions 0009 (prefill, queued, decode, recent), 0012 (slot wait),
    0013 (knee) and 0031 (decode time).
    """

    prefill: float = 1.0
    queued_prefill: float = 0.25
    decode: float = 16.0
    recent_prefill: float = 0.1
    slot_wait: float = SLOT_WAIT_TOKENS
    queued_knee: float = QUEUED_KNEE_PROMPTS
    decode_time: float = DECODE_TIME_WEIGHT

    def __post_init__(self) -> None:
        names = ("prefill", "queued_prefill", "decode", "recent_prefill", "slot_wait")
        for name in (*names, "decode_time"):
            if not getattr(self, name) >= 0:  # NaN too
                raise ValueError(f"CostWeights.{name} must be >= 0, got {getattr(self, name)}")
        knee = self.queued_knee
        if not knee >= 0:
            raise ValueError(f"CostWeights.queued_knee must be >= 0, got {knee}")
        if knee and not MIN_QUEUED_KNEE <= knee < math.inf:
            raise ValueError(
                f"CostWeights.queued_knee must be 0 (off) or a finite number of prompts >= "
                f"{MIN_QUEUED_KNEE:g}, got {knee}"
            )

    def per_knee(self, prompt_tokens: int) -> float:
        """``1 / (queued_knee * prompt_tokens)`` (a prompt of at least one token), the
        queued term's knee for one request; 0 when the term is linear (``queued_knee`` 0)."""
        knee = self.queued_knee
        return 1.0 / (knee * max(prompt_tokens, 1)) if knee else 0.0

    @classmethod
    def parse(cls, text: str) -> CostWeights:
        """``COST_WEIGHTS_FORM``, the form of the ``--cost-weights`` option of ``kvroute
        router`` and ``kvroute replay`` (missing ones keep their defaults); ValueError naming
        the option and the expected form otherwise."""
        parts = text.split(",")
        try:
            if not 3 <= len(parts) <= 7:
                raise ValueError
            values = [float(x) for x in parts]
        except ValueError:
            raise ValueError(
                "--cost-weights: cost weights must be three to seven numbers "
                f"{COST_WEIGHTS_FORM}, got {text!r}"
            ) from None
        return cls(*values)

    def form(self) -> str:
        """These weights as ``--cost-weights`` takes them (all seven)."""
        return (
            f"{self.prefill:g},{self.queued_prefill:g},{self.decode:g},"
            f"{self.recent_prefill:g},{self.slot_wait:g},{self.queued_knee:g},"
            f"{self.decode_time:g}"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PolicyConfig:
    """Settings shared by the policies (each reads what it needs).

    ``weights``: the cache-aware cost's. ``prefix_hash_blocks``: the leading blocks
    consistent_hash keys on. ``backlog_tokens``: the smallest queued prefill among the
    candidates at which the cost counts a miss double (0: off; decision 0010).
    ``saturated_tokens`` / ``saturated_scale_tokens``: past ``saturated_tokens`` of that
    smallest queue, every further ``saturated_scale_tokens`` counts a miss once more (scale 0:
    off; decision 0011). ``affinity_tokens``: the affinity term's largest value, for router
    replicas without sync (0: off; decision 0021; RouterConfig sets it from its replicas).
    """

    weights: CostWeights = field(default_factory=CostWeights)
    prefix_hash_blocks: int = 4
    backlog_tokens: float = DEFAULT_BACKLOG_TOKENS
    saturated_tokens: float = DEFAULT_SATURATED_TOKENS
    saturated_scale_tokens: float = DEFAULT_SATURATED_SCALE_TOKENS
    affinity_tokens: float = 0.0

    def __post_init__(self) -> None:
        if self.prefix_hash_blocks < 1:
            raise ValueError(f"prefix_hash_blocks must be >= 1, got {self.prefix_hash_blocks}")
        if not self.backlog_tokens >= 0:  # NaN too
            raise ValueError(f"backlog_tokens must be >= 0, got {self.backlog_tokens}")
        for name in ("saturated_tokens", "saturated_scale_tokens", "affinity_tokens"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too
                raise ValueError(f"{name} must be finite and >= 0, got {getattr(self, name)}")

    def with_affinity(self, tokens: float) -> PolicyConfig:
        """This config with the affinity term's weight ``tokens`` (the core sets it from its
        replica settings)."""
        return replace(self, affinity_tokens=tokens)
