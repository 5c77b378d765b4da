"""Replay metrics: per-request results -> per-policy summary -> table and JSON.

Pure and synchronous; imports neither asyncio, grpc nor a clock.

Definitions (all times in trace seconds -- virtual in sim mode, wall time * speedup in live):

- ``hit_rate`` = prompt tokens served from cache / prompt tokens, over completed requests
  (from each request's final usage: ``cached_prompt_tokens / prompt_tokens``).
- ``prefill_tokens`` = prompt tokens actually computed (prompt - cached).
- ``ttft`` = first token time - arrival; ``e2e`` = finish time - arrival.
- ``itl`` = a request's mean inter-token latency, (finish - first token) / (completion
  tokens - 1), over requests with at least two tokens; ``itl_mean_s`` is its mean over
  requests, ``itl_p99_s`` its 99th percentile (a user's token speed, decode included).
- ``throughput_tok_s`` = generated tokens / (last finish - first arrival).
- ``load_imbalance`` = max / mean of prefill tokens computed per worker (1.0 = even): the
  *prefill* imbalance.
- ``busy_imbalance`` = max / mean of each worker's modelled busy time (prefill and decode
  steps together; sim mode only, None where the mode cannot measure it). Users feel busy
  time: a worker can compute few prefill tokens (its requests hit the cache) and still be
  the one everyone queues behind because it runs the most decodes.
- ``errors`` = requests that failed or never finished. They are left out of hit rate, TTFT
  and e2e (there is nothing to measure), so every table and figure prints their count next
  to those figures: a policy is never made to look better by dropping requests silently.

The JSON is a pure function of the results, so a deterministic simulation gives the same
JSON byte for byte; wall-clock time is kept out of it (the table prints it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestResult:
    """What happened to one request (mutable while the replay runs)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    worker_id: str | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    router: int = 0  # the router replica that placed it (the sim's --routers), from 0

    @property
    def done(self) -> bool:
        return self.error is None and self.finish_s is not None


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """One policy's row of the report."""

    policy: str
    requests: int
    errors: int
    hit_rate: float
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    completion_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p99_s: float
    throughput_tok_s: float
    load_imbalance: float
    itl_mean_s: float = math.nan  # mean over requests of each one's inter-token latency
    itl_p99_s: float = math.nan
    busy_imbalance: float | None = None  # max / mean busy time per worker (sim mode)
    busy_s_per_worker: dict[str, float] = field(default_factory=dict)
    prefill_tokens_per_worker: dict[str, int] = field(default_factory=dict)
    requests_per_worker: dict[str, int] = field(default_factory=dict)
    errors_by_kind: dict[str, int] = field(default_factory=dict)  # "INVALID_ARGUMENT": 3
    extra: dict[str, float | int] = field(default_factory=dict)  # mode-specific counters
    wall_s: float = 0.0  # not in the JSON (not deterministic)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("wall_s")
        return d


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _r(x: float, digits: int = 6) -> float:
    """Round for stable, readable JSON."""
    return x if math.isnan(x) else round(x, digits)


def summarize(
    policy: str,
    results: Iterable[RequestResult],
    worker_ids: Sequence[str],
    *,
    extra: dict[str, float | int] | None = None,
    wall_s: float = 0.0,
    busy_s_per_worker: dict[str, float] | None = None,
) -> PolicyReport:
    """Fold per-request results into a :class:`PolicyReport`.

    ``busy_s_per_worker``: modelled busy seconds per worker (prefill and decode steps), when
    the mode knows them; gives ``busy_imbalance``."""
    results = list(results)
    done = [r for r in results if r.done]
    errors = sum(1 for r in results if r.error is not None or r.finish_s is None)
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.cached_tokens for r in done)
    completion = sum(r.completion_tokens for r in done)
    per_worker = dict.fromkeys(worker_ids, 0)
    count_per_worker = dict.fromkeys(worker_ids, 0)
    for r in done:
        if r.worker_id is not None:
            per_worker[r.worker_id] = (
                per_worker.get(r.worker_id, 0) + r.prompt_tokens - (r.cached_tokens)
            )
            count_per_worker[r.worker_id] = count_per_worker.get(r.worker_id, 0) + 1
    errors_by_kind: dict[str, int] = {}
    for r in results:
        if r.error is not None or r.finish_s is None:
            kind = (r.error or "unfinished").split(":", 1)[0]
            errors_by_kind[kind] = errors_by_kind.get(kind, 0) + 1
    ttft = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
    e2e = [r.finish_s - r.arrival_s for r in done]  # type: ignore[operator]
    itl = [
        (r.finish_s - r.first_token_s) / (r.completion_tokens - 1)  # type: ignore[operator]
        for r in done
        if r.first_token_s is not None and r.completion_tokens > 1
    ]
    if done:
        start = min(r.arrival_s for r in results)
        end = max(r.finish_s for r in done if r.finish_s is not None)
        throughput = completion / (end - start) if end > start else math.nan
    else:
        throughput = math.nan
    loads = list(per_worker.values())
    mean_load = sum(loads) / len(loads) if loads else 0.0
    imbalance = max(loads) / mean_load if mean_load > 0 else 1.0
    busy_imbalance: float | None = None
    busy = {w: round(b, 6) for w, b in (busy_s_per_worker or {}).items()}
    if busy:
        mean_busy = sum(busy.values()) / len(busy)
        busy_imbalance = _r(max(busy.values()) / mean_busy, 4) if mean_busy > 0 else 1.0
    return PolicyReport(
        policy=policy,
        requests=len(results),
        errors=errors,
        hit_rate=_r(cached / prompt if prompt else 0.0),
        prompt_tokens=prompt,
        cached_tokens=cached,
        prefill_tokens=prompt - cached,
        completion_tokens=completion,
        ttft_p50_s=_r(_percentile(ttft, 50)),
        ttft_p99_s=_r(_percentile(ttft, 99)),
        e2e_p50_s=_r(_percentile(e2e, 50)),
        e2e_p99_s=_r(_percentile(e2e, 99)),
        throughput_tok_s=_r(throughput, 3),
        load_imbalance=_r(imbalance, 4),
        itl_mean_s=_r(float(np.mean(itl)) if itl else math.nan),
        itl_p99_s=_r(_percentile(itl, 99)),
        busy_imbalance=busy_imbalance,
        busy_s_per_worker=busy,
        prefill_tokens_per_worker=per_worker,
        requests_per_worker=count_per_worker,
        errors_by_kind=dict(sorted(errors_by_kind.items())),
        extra=dict(extra or {}),
        wall_s=wall_s,
    )


@dataclass(slots=True)
class ReplayReport:
    """The whole replay: setup, one row per policy, the pooled reference hit rate (one cache
    of N times the capacity; not a bound) and the infinite ceiling (no eviction)."""

    setup: dict[str, object]
    policies: list[PolicyReport] = field(default_factory=list)
    pooled_reference_hit_rate: float | None = None
    infinite_hit_rate: float | None = None
    # failed requests of the reference runs ("pooled", "infinite"), e.g. over max_context:
    # left out of their hit rates like a policy's, so printed next to them
    reference_errors: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "setup": self.setup,
            "pooled_reference_hit_rate": self.pooled_reference_hit_rate,
            "infinite_hit_rate": self.infinite_hit_rate,
            "reference_errors": self.reference_errors,
            "policies": [p.to_json() for p in self.policies],
        }

    def dumps(self) -> str:
        """Deterministic JSON text (sorted keys, NaN written as null)."""
        return json.dumps(_nan_to_none(self.to_json()), indent=2, sort_keys=True) + "\n"

    def policy(self, name: str) -> PolicyReport:
        for p in self.policies:
            if p.policy == name:
                return p
        raise KeyError(f"no policy {name!r} in the report")

    def format_table(self) -> str:
        """A fixed-width table, one row per policy, the references underneath."""
        head = (
            f"{'policy':<15} {'hit':>6} {'/ref':>6} {'prefill Mtok':>12} {'ttft p50':>9} "
            f"{'ttft p99':>9} {'e2e p50':>8} {'e2e p99':>8} {'itl':>6} {'itl p99':>7} "
            f"{'tok/s':>8} {'prefill imb':>11} {'busy imb':>8} {'reqs':>6} {'errors':>6} "
            f"{'wall s':>7}"
        )
        lines = [head, "-" * len(head)]
        for p in self.policies:
            ratio = (
                f"{p.hit_rate / ref:6.1%}"
                if (ref := self.pooled_reference_hit_rate)
                else f"{'-':>6}"
            )
            busy = f"{p.busy_imbalance:8.2f}" if p.busy_imbalance is not None else f"{'-':>8}"
            lines.append(
                f"{p.policy:<15} {p.hit_rate:6.1%} {ratio} {p.prefill_tokens / 1e6:12.2f} "
                f"{_fmt_s(p.ttft_p50_s):>9} {_fmt_s(p.ttft_p99_s):>9} "
                f"{_fmt_s(p.e2e_p50_s):>8} {_fmt_s(p.e2e_p99_s):>8} "
                f"{_fmt_ms(p.itl_mean_s):>6} {_fmt_ms(p.itl_p99_s):>7} "
                f"{p.throughput_tok_s:8.0f} {p.load_imbalance:11.2f} {busy} {p.requests:6d} "
                f"{p.errors:6d} {p.wall_s:7.1f}"
            )
        for p in self.policies:
            if p.errors_by_kind:
                kinds = ", ".join(f"{k} x{n}" for k, n in p.errors_by_kind.items())
                lines.append(f"{p.policy} errors: {kinds}")
        refs = []
        if self.pooled_reference_hit_rate is not None:
            refs.append(
                f"pooled reference (1 cache x N capacity): {self.pooled_reference_hit_rate:.1%}"
                + self.reference_errors_note("pooled")
            )
        if self.infinite_hit_rate is not None:
            refs.append(
                f"infinite ceiling (no eviction): {self.infinite_hit_rate:.1%}"
                + self.reference_errors_note("infinite")
            )
        if refs:
            lines.append("; ".join(refs))
        return "\n".join(lines)

    def reference_errors_note(self, kind: str) -> str:
        """The note ' (N errors)' when the ``kind`` reference run had failed requests."""
        n = self.reference_errors.get(kind, 0)
        return f" ({n} error{'s' if n != 1 else ''})" if n else ""


def _fmt_s(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.2f}s"


def _fmt_ms(x: float) -> str:
    """An inter-token latency, in milliseconds with one decimal."""
    return "-" if math.isnan(x) else f"{x * 1000:.1f}"


def _nan_to_none(obj: object) -> object:
    match obj:
        case float() if math.isnan(obj):
            return None
        case dict():
            return {k: _nan_to_none(v) for k, v in obj.items()}
        case list() | tuple():
            return [_nan_to_none(v) for v in obj]
    return obj
