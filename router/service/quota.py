"""Per-tenant limits: requests in flight and tokens per second, so one tenant cannot starve
the others.

Each tenant (the API key's, or the trusted header's; the anonymous tenant "" is one tenant
too) has its own

* **in-flight cap**: at most ``max_inflight`` of its Generate calls admitted at once;
* **token bucket**: ``tokens_per_s`` refill up to ``burst_tokens``; a request costs its prompt
  tokens plus its ``max_new_tokens`` (what it may make the fleet compute), charged when
  admitted. A request costing more than the burst is charged the burst, so it passes once the
  bucket is full instead of never.

A request over either limit is refused at once with RESOURCE_EXHAUSTED (HTTP 429) and a
retry hint (``retry_after_s``: when the bucket will hold its cost; 1 s for the in-flight
cap), before it is routed, so it costs the fleet nothing. Tenants never share a counter:
tenant A at its limit leaves tenant B's requests untouched.

Overrides per tenant come from a file (``--tenant-limits FILE``), one line per tenant::

    # tenant_id  max_inflight  tokens_per_s  [burst_tokens]     ('-' keeps the default)
    acme         64            20000         40000
    free-tier    4             500

Pure and synchronous: the clock is injected; no asyncio, no grpc.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from edge.frontdoor import Overloaded


@dataclass(frozen=True, slots=True)
class TenantLimit:
    """One tenant's limits; None = unlimited. ``burst_tokens`` defaults to one second's
    worth (``tokens_per_s``)."""

    max_inflight: int | None = None
    tokens_per_s: float | None = None
    burst_tokens: float | None = None

    def __post_init__(self) -> None:
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"tenant max_inflight must be >= 1, got {self.max_inflight}")
        for name in ("tokens_per_s", "burst_tokens"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"tenant {name} must be a finite number > 0, got {value}")
        if self.burst_tokens is not None and self.tokens_per_s is None:
            raise ValueError("tenant burst_tokens needs tokens_per_s")

    @property
    def burst(self) -> float | None:
        if self.tokens_per_s is None:
            return None
        return self.tokens_per_s if self.burst_tokens is None else self.burst_tokens


@dataclass(frozen=True, slots=True)
class QuotaConfig:
    """The default limit of every tenant and per-tenant overrides."""

    default: TenantLimit = field(default_factory=TenantLimit)
    overrides: Mapping[str, TenantLimit] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        limits = [self.default, *self.overrides.values()]
        return any(x.max_inflight is not None or x.tokens_per_s is not None for x in limits)

    def limit_of(self, tenant: str) -> TenantLimit:
        return self.overrides.get(tenant, self.default)


def parse_overrides(lines: Iterable[str], source: str) -> dict[str, TenantLimit]:
    """``tenant max_inflight tokens_per_s [burst]`` lines ('-' = unlimited); ValueError
    names the source and line."""
    out: dict[str, TenantLimit] = {}
    for num, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if not 3 <= len(parts) <= 4:
            raise ValueError(
                f"{source} line {num}: expected 'tenant max_inflight tokens_per_s [burst]'"
            )

        try:
            limit = TenantLimit(
                _int_or_none(parts[1]),
                _float_or_none(parts[2]),
                _float_or_none(parts[3]) if len(parts) == 4 else None,
            )
        except ValueError as exc:
            raise ValueError(f"{source} line {num}: {exc}") from None
        out[parts[0]] = limit
    return out


def _int_or_none(text: str) -> int | None:
    if text == "-":
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"max_inflight {text!r} is not an integer") from None


def _float_or_none(text: str) -> float | None:
    if text == "-":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a number") from None


@dataclass(slots=True)
class _Bucket:
    level: float
    updated: float


@dataclass(slots=True)
class Lease:
    """An admitted request's hold on its tenant's in-flight count; release it once."""

    tenant: str
    _owner: TenantQuotas | None

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._release(self.tenant)


class TenantQuotas:
    """The limits' state: each tenant's in-flight count and token bucket."""

    def __init__(self, config: QuotaConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self._clock = clock
        self._inflight: dict[str, int] = {}
        self._buckets: dict[str, _Bucket] = {}
        self.num_refused: dict[str, int] = {}

    def inflight(self, tenant: str) -> int:
        return self._inflight.get(tenant, 0)

    def acquire(self, tenant: str, tokens: int) -> Lease:
        """Admit one request of ``tokens`` for ``tenant``, or raise Overloaded."""
        if not self.config.enabled:
            return Lease(tenant, None)
        limit = self.config.limit_of(tenant)
        name = repr(tenant) if tenant else "(anonymous)"
        if limit.max_inflight is not None and self.inflight(tenant) >= limit.max_inflight:
            self._refused(tenant)
            raise Overloaded(
                f"tenant {name} has {self.inflight(tenant)} requests in flight; its limit is "
                f"{limit.max_inflight} (--tenant-max-inflight)",
                retry_after_s=1.0,
            )
        rate, burst = limit.tokens_per_s, limit.burst
        if rate is not None and burst is not None:
            now = self._clock()
            bucket = self._buckets.get(tenant)
            if bucket is None:
                bucket = self._buckets[tenant] = _Bucket(burst, now)
            bucket.level = min(burst, bucket.level + (now - bucket.updated) * rate)
            bucket.updated = now
            cost = min(float(tokens), burst)
            if bucket.level < cost:
                self._refused(tenant)
                wait = (cost - bucket.level) / rate
                raise Overloaded(
                    f"tenant {name} is over its token rate: this request needs {tokens} tokens "
                    f"(prompt + max_new_tokens), {bucket.level:.0f} are available; the limit is "
                    f"{rate:g} tokens/s with a burst of {burst:g} (--tenant-tokens-per-s)",
                    retry_after_s=wait,
                )
            bucket.level -= cost
        self._inflight[tenant] = self.inflight(tenant) + 1
        return Lease(tenant, self)

    def _refused(self, tenant: str) -> None:
        self.num_refused[tenant] = self.num_refused.get(tenant, 0) + 1

    def _release(self, tenant: str) -> None:
        left = self._inflight[tenant] - 1
        if left:
            self._inflight[tenant] = left
        else:
            del self._inflight[tenant]
