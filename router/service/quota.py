"""Per-tenant limits: requests in flight and tokens per second, so one tenant cannot starve
the others.

Each tenant (the API key's, or the trusted header's; the anonymous tenant "" is one tenant
too) has its own

* **in-flight cap**: at most ``max_inflight`` of its Generate calls admitted at once;
* **token bucket**: ``tokens_per_s`` refill up to ``burst_tokens``; a Generate costs its prompt
  tokens plus its ``max_new_tokens`` (what it may make the fleet compute; one that leaves it
  0, to the worker, pays its output once it finished: ``charge_output``), an Explain its
  prompt tokens (what it makes the router tokenize and match), charged whole when admitted.
  A request costing more than the burst can never be admitted: it is refused with the reason
  and no retry hint (raise the tenant's ``burst_tokens`` to serve such prompts). So over any
  window of T seconds a tenant is charged at most ``burst + tokens_per_s * T``.

A request over either limit is refused at once with RESOURCE_EXHAUSTED (HTTP 429) and a
retry hint (``retry_after_s``: when the bucket will hold its cost; 1 s for the in-flight
cap), before it is routed, so it costs the fleet nothing; ``precheck`` refuses a tenant at
its in-flight cap, or whose bucket cannot pay what the request is sure to cost (a text
holds at least one token per ``max_token_chars`` characters), before its prompt is even
tokenized. The router's own work is charged too: a request refused for its cost after that
point (sure to pass the burst, or tokenized and then over the rate) is charged the tokens it
was sure to cost, the bucket going at most one burst into debt, so a tenant repeating
requests it can never afford is refused at once instead of parsed and tokenized again. A
request refused later, before any worker saw it (no worker free, a deadline admission
cannot meet), gets its tokens back (``Lease.refund``). Tenants never share a counter: tenant
A at its limit leaves tenant B's requests untouched.

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


class OverLimit(Overloaded):
    """A tenant over its own limits (RESOURCE_EXHAUSTED / 429): its refusal, unlike the
    router's own overload, may be held back a moment (``Frontend``: a tenant flooding the
    router with requests it cannot afford then sends them no faster than it is answered).
    ``timed``: the retry hint is when the bucket will hold the cost (else a guess)."""

    def __init__(
        self, message: str, *, retry_after_s: float | None = None, timed: bool = False
    ) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        self.timed = timed


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
    """An admitted request's hold on its tenant's in-flight count and the tokens it was
    charged; release it once (``refund`` first when no worker ever saw the request)."""

    tenant: str
    _owner: TenantQuotas | None
    charged: float = 0.0

    def refund(self) -> None:
        """Give the charged tokens back (the request was refused before any worker saw it)."""
        charged, self.charged = self.charged, 0.0
        if charged and self._owner is not None:
            self._owner._refund(self.tenant, charged)

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

    def precheck(self, tenant: str, sure: int = 0) -> None:
        """Refuse (Overloaded) a tenant at its in-flight cap, or whose bucket cannot pay the
        ``sure`` tokens its request costs at least (known before tokenizing: the text's
        characters over the most one token stands for), before any work is spent on it; admits
        nothing. A request sure to cost more than the burst is charged that much (the
        tenant's bucket goes into debt, at most one burst deep): sent again and again, such
        requests would make the router parse and refuse them for free."""
        if not self.config.enabled:
            return
        limit = self.config.limit_of(tenant)
        self._check_inflight(tenant, limit)
        if limit.tokens_per_s is not None:
            self._take(tenant, limit, sure, debit=False)

    def acquire(self, tenant: str, tokens: int, sure: int = 0) -> Lease:
        """Admit one Generate of ``tokens`` for ``tenant``, or raise Overloaded; refused
        for its cost, it is charged the ``sure`` tokens it passed :meth:`precheck` with
        (its prompt was tokenized: work done for the tenant)."""
        if not self.config.enabled:
            return Lease(tenant, None)
        limit = self.config.limit_of(tenant)
        self._check_inflight(tenant, limit)
        charged = 0.0
        if limit.tokens_per_s is not None:
            charged = self._take(tenant, limit, tokens, refused_debit=sure)
        self._inflight[tenant] = self.inflight(tenant) + 1
        return Lease(tenant, self, charged)

    def charge(self, tenant: str, tokens: int, sure: int = 0) -> None:
        """Charge a request that holds no in-flight slot (Explain) to the token bucket."""
        if self.config.enabled:
            limit = self.config.limit_of(tenant)
            if limit.tokens_per_s is not None:
                self._take(tenant, limit, tokens, refused_debit=sure)

    def charge_output(self, tenant: str, tokens: int) -> None:
        """Charge the output of a request that left ``max_new_tokens`` to the worker (what
        is left of the context: its cost unknown when admitted) once it finished, into a
        debt of one burst at most."""
        if self.config.enabled:
            limit = self.config.limit_of(tenant)
            if limit.tokens_per_s is not None:
                assert limit.burst is not None
                bucket = self._refill(tenant, limit.tokens_per_s, limit.burst)
                self._debt(bucket, limit.burst, tokens)

    def _check_inflight(self, tenant: str, limit: TenantLimit) -> None:
        if limit.max_inflight is not None and self.inflight(tenant) >= limit.max_inflight:
            self._refused(tenant)
            raise OverLimit(
                f"tenant {_name(tenant)} has {self.inflight(tenant)} requests in flight; its "
                f"limit is {limit.max_inflight} (--tenant-max-inflight)",
                retry_after_s=1.0,
            )

    def _take(
        self,
        tenant: str,
        limit: TenantLimit,
        tokens: int,
        *,
        debit: bool = True,
        refused_debit: int = 0,
    ) -> float:
        """Debit ``tokens`` from the tenant's bucket (``debit`` False: only check that it
        holds them, and one token at least). Refused, the bucket is still debited
        ``refused_debit`` tokens -- ``tokens`` themselves when they pass the burst and
        ``debit`` is False -- down to a debt of one burst."""
        rate, burst = limit.tokens_per_s, limit.burst
        assert rate is not None and burst is not None
        bucket = self._refill(tenant, rate, burst)
        if tokens > burst:
            self._refused(tenant)
            self._debt(bucket, burst, refused_debit or (0 if debit else tokens))
            raise OverLimit(
                f"this request costs {'at least ' if not debit else ''}{tokens} tokens "
                f"({_COST}), more than tenant {_name(tenant)} may spend at once: its burst is "
                f"{burst:g} tokens (--tenant-burst-tokens, or burst_tokens in --tenant-limits); "
                "shorten the prompt or max_new_tokens, or raise the burst"
            )
        need = float(max(tokens, 1))  # a precheck needs one token left
        if bucket.level < need:
            self._refused(tenant)
            self._debt(bucket, burst, refused_debit)
            needs = f"this request needs {tokens} tokens ({_COST}), " if tokens else ""
            raise OverLimit(
                f"tenant {_name(tenant)} is over its token rate: {needs}"
                f"{max(bucket.level, 0.0):.0f} are available; the limit is {rate:g} tokens/s "
                f"with a burst of {burst:g} (--tenant-tokens-per-s)",
                retry_after_s=(need - bucket.level) / rate,
                timed=True,
            )
        if not debit:
            return 0.0
        bucket.level -= tokens
        return float(tokens)

    @staticmethod
    def _debt(bucket: _Bucket, burst: float, tokens: int) -> None:
        if tokens > 0:
            bucket.level = max(bucket.level - tokens, -burst)

    def _refill(self, tenant: str, rate: float, burst: float) -> _Bucket:
        now = self._clock()
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(burst, now)
        bucket.level = min(burst, bucket.level + (now - bucket.updated) * rate)
        bucket.updated = now
        return bucket

    def _refund(self, tenant: str, tokens: float) -> None:
        limit = self.config.limit_of(tenant)
        bucket = self._buckets.get(tenant)
        if bucket is not None and limit.burst is not None:
            bucket.level = min(limit.burst, bucket.level + tokens)

    def _refused(self, tenant: str) -> None:
        self.num_refused[tenant] = self.num_refused.get(tenant, 0) + 1

    def _release(self, tenant: str) -> None:
        left = self._inflight[tenant] - 1
        if left:
            self._inflight[tenant] = left
        else:
            del self._inflight[tenant]


_COST = "its prompt, plus max_new_tokens for a Generate"


def _name(tenant: str) -> str:
    return repr(tenant) if tenant else "(anonymous)"
