"""The agentic-sessions workload (``kvroute workload agentic-sessions``): coding or tool
agents, the class of traffic that dominates fleets now (issue 40).

Every session starts with the same long tool specification, then a context of its own
(the task, the files it was given), then tens of turns, each appending the agent's previous
action and the tool's result. Contexts grow to tens of thousands of tokens, so the fleet's
KV is under eviction pressure and a turn sent away from its session's worker recomputes
everything but the tool spec::

    turn 1:  [tool spec 6,000][session context 2k-8k]
    turn k:  [tool spec][session context][a1][tool result 1] ... [a(k-1)][tool result k-1]

Sessions start by a Poisson law; the next turn of a session comes a tool call's time after
the previous one (a uniform pause, standing in for the previous answer and the tool run).
A session ends after its turns or when the next prompt would pass ``max_prompt_tokens``.
Block ids follow :mod:`fleetsim.workload`'s rule: blocks entirely inside the tool spec are
shared by every session; every other block is its session's.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from fleetsim.replay.trace import TraceRecord

__all__ = ["AgenticSessionsConfig", "generate_agentic_sessions"]


@dataclass(frozen=True, slots=True)
class AgenticSessionsConfig:
    """Shape of the agentic-sessions workload (``rate_rps``: new sessions per second)."""

    rate_rps: float = 0.3
    duration_s: float = 180.0
    seed: int = 0
    block_size: int = 16
    tool_spec_tokens: int = 6000
    context_tokens: tuple[int, int] = (2000, 8000)  # the session's own context
    turns: tuple[int, int] = (10, 40)
    tool_result_tokens: tuple[int, int] = (200, 3000)
    action_tokens: tuple[int, int] = (30, 400)  # output_length: the agent's next action
    tool_pause_s: tuple[float, float] = (1.0, 6.0)  # previous answer + tool run
    max_prompt_tokens: int = 64_000

    def __post_init__(self) -> None:
        for name in ("rate_rps", "duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("seed", "tool_spec_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size!r}")
        for name in ("context_tokens", "turns", "tool_result_tokens", "action_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        lo_s, hi_s = self.tool_pause_s
        if not 0 <= lo_s <= hi_s:
            raise ValueError(f"tool_pause_s must be a range 0 <= lo <= hi, got {(lo_s, hi_s)}")
        first = self.tool_spec_tokens + self.context_tokens[1]
        if self.max_prompt_tokens < first:
            raise ValueError(
                f"max_prompt_tokens must be >= {first} (tool spec + longest session context), "
                f"got {self.max_prompt_tokens}"
            )


def generate_agentic_sessions(config: AgenticSessionsConfig) -> list[TraceRecord]:
    """The agentic-sessions trace, sorted by timestamp; deterministic for ``config.seed``."""
    rng = random.Random(config.seed)
    bs = config.block_size
    num_shared = config.tool_spec_tokens // bs
    ids: dict[tuple[int, int], int] = {}

    def block_ids(family: int, n_tokens: int) -> tuple[int, ...]:
        keys = ((-1 if j < num_shared else family, j) for j in range(-(-n_tokens // bs)))
        return tuple(ids.setdefault(k, len(ids)) for k in keys)

    # (time, session, prompt tokens, turns left); sessions' turns interleave by time
    due: list[tuple[float, int, int, int]] = []
    t = rng.expovariate(config.rate_rps)
    session = 0
    while t < config.duration_s:
        length = config.tool_spec_tokens + rng.randint(*config.context_tokens)
        heapq.heappush(due, (t, session, length, rng.randint(*config.turns)))
        session += 1
        t += rng.expovariate(config.rate_rps)
    records: list[TraceRecord] = []
    while due:
        t, family, length, left = heapq.heappop(due)
        action = rng.randint(*config.action_tokens)
        records.append(TraceRecord(float(int(t * 1000)), length, action, block_ids(family, length)))
        grown = length + action + rng.randint(*config.tool_result_tokens)
        t_next = t + rng.uniform(*config.tool_pause_s)
        if left > 1 and grown <= config.max_prompt_tokens and t_next < config.duration_s:
            heapq.heappush(due, (t_next, family, grown, left - 1))
    records.sort(key=lambda r: r.timestamp_ms)  # stable: same-ms turns keep their order
    return records
