"""Tiny traces and fleet settings shared by the replay simulator's tests."""

from __future__ import annotations

from fleetsim.replay.sim import SimConfig
from fleetsim.replay.trace import TraceRecord

BS = 64  # trace block size of the tiny traces


def two_prefix_trace(num_requests: int = 24, gap_ms: float = 500.0) -> list[TraceRecord]:
    """Prefixes A (ids 0-3) and B (ids 10-13) in the order A A B B A A B B ...; each request
    adds one unique block. Requests are far apart, so each finishes before the next."""
    records = []
    for i in range(num_requests):
        prefix = (0, 1, 2, 3) if (i // 2) % 2 == 0 else (10, 11, 12, 13)
        ids = (*prefix, 1000 + i)
        records.append(TraceRecord(i * gap_ms, len(ids) * BS, 4, ids))
    return records


def tiny_config(**kw) -> SimConfig:
    return SimConfig(num_workers=2, kv_capacity_tokens=20_000, **kw)
