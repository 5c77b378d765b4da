"""The references beside a replay: one engine as big and fast as the whole fleet.

``pooled``: N times the KV capacity and N times the speed (a wrapper divides the step cost by
N) under the same scheduler; a reference, not a bound (its scheduler admits work sooner than
N queued workers do). ``infinite``: room for every token the trace ever holds (nothing is
evicted), a true ceiling on hit rate for the trace's content.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TextIO

from fleetsim.replay.progress import Progress
from fleetsim.replay.report import PolicyReport
from fleetsim.replay.sim import FleetSim, max_context_for
from fleetsim.replay.sim_config import SimConfig
from fleetsim.replay.trace import TokenExpander, TraceRecord
from worker.engine.engine import EngineConfig

__all__ = ["infinite_capacity_tokens", "simulate_reference"]


def infinite_capacity_tokens(records: Sequence[TraceRecord], block_size: int) -> int:
    """KV tokens that hold every distinct prompt block plus every output: no eviction."""
    ids: dict[tuple[int, int], int] = {}  # (parent node, hash id) -> one distinct prefix block
    for r in records:
        parent = -1
        for h in r.hash_ids:
            key = (parent, h)
            node = ids.get(key)
            if node is None:
                node = ids[key] = len(ids)
            parent = node
    outputs = sum(r.output_length for r in records)
    return len(ids) * block_size + outputs + 2 * max_context_for(records)


def simulate_reference(
    records: Sequence[TraceRecord],
    kind: str,
    config: SimConfig,
    expander: TokenExpander | None = None,
    *,
    trace_block_size: int = 512,
    progress_stream: TextIO | None = None,
) -> PolicyReport:
    """The ``pooled`` reference or the ``infinite`` ceiling: one engine as big and fast as
    the fleet (module docstring)."""
    n = config.num_workers
    match kind:
        case "pooled":
            capacity = n * config.kv_capacity_tokens
        case "infinite":
            capacity = max(
                n * config.kv_capacity_tokens, infinite_capacity_tokens(records, trace_block_size)
            )
        case _:
            raise ValueError(f"kind must be 'pooled' or 'infinite', got {kind!r}")
    e = config.engine
    # flushes: the fleet loses one worker's cache (1/n of what it holds) every interval; the
    # one big cache loses all of it every n intervals -- the same share per second
    one = replace(
        config,
        num_workers=1,
        kv_capacity_tokens=capacity,
        flush_interval_s=config.flush_interval_s * n,
    )

    def engine_config(worker_id: str) -> EngineConfig:
        return replace(
            e,
            worker_id=worker_id,
            num_kv_slots=capacity,
            page_size=config.page_size,
            block_size=config.block_size,
            seed=config.seed,
            max_running_requests=e.max_running_requests * n,
            max_waiting_requests=e.max_waiting_requests * n,
            max_prefill_tokens_per_step=e.max_prefill_tokens_per_step * n,
        )

    expander = expander or TokenExpander(vocab_size=config.vocab_size, seed=config.seed)
    start = time.monotonic()
    sim = FleetSim(
        records, "round_robin", one, expander, engine_config=engine_config, speed=float(n)
    )
    progress = Progress(kind, len(records), progress_stream) if progress_stream else None
    sim.run(progress)
    if progress is not None:
        progress.close()
    return sim.report(kind, wall_s=time.monotonic() - start)
