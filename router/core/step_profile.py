"""A worker's step-time profile: how long one engine step takes, as the router's cost
estimates a request's decode with it (decision 0031).

Sans-I/O: plain values; no asyncio, grpc or clock. The worker states its profile in
``WorkerInfo`` (its executor's cost model, or a measured one); a worker that states none is
costed with :data:`DEFAULT_STEP_PROFILE`, the simulator's ``h100`` profile::

    decode step (b running requests, K tokens of their KV) = decode_base_s
                                                            + b * decode_s_per_seq
                                                            + K * decode_s_per_context_token
    prefill of n tokens                                    ~ n * prefill_s_per_token
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["DEFAULT_STEP_PROFILE", "StepProfile"]


@dataclass(frozen=True, slots=True)
class StepProfile:
    """Step-time coefficients in seconds (module docstring)."""

    decode_base_s: float = 8e-3
    decode_s_per_seq: float = 1e-4
    decode_s_per_context_token: float = 6e-8
    prefill_s_per_token: float = 40e-6

    def __post_init__(self) -> None:
        for name in ("decode_base_s", "decode_s_per_seq", "decode_s_per_context_token"):
            if not 0 <= getattr(self, name) < math.inf:  # NaN too
                raise ValueError(
                    f"step profile {name} must be finite and >= 0, got {getattr(self, name)}"
                )
        if not 0 < self.prefill_s_per_token < math.inf:
            raise ValueError(
                f"step profile prefill_s_per_token must be finite and > 0, "
                f"got {self.prefill_s_per_token}"
            )

    @classmethod
    def stated(
        cls, decode_base_s: float, per_seq_s: float, per_context_token_s: float, prefill_s: float
    ) -> StepProfile:
        """The profile a worker states (``WorkerInfo``'s step fields); the default where
        it states none (a prefill time of 0: an older worker, or no profile)."""
        if prefill_s <= 0:
            return DEFAULT_STEP_PROFILE
        return cls(decode_base_s, per_seq_s, per_context_token_s, prefill_s)

    def seq_tokens(self) -> float:
        """One more running request's share of every decode step, in prefill tokens."""
        return self.decode_s_per_seq / self.prefill_s_per_token

    def context_tokens(self) -> float:
        """One more token of running KV's share of every decode step, in prefill tokens."""
        return self.decode_s_per_context_token / self.prefill_s_per_token


DEFAULT_STEP_PROFILE = StepProfile()
