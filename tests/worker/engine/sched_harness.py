"""Helpers for the scheduler / engine tests: a zero-cost sim engine, a forward recorder,
a run-to-completion driver and leak checks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.engine.engine import Engine, EngineConfig
from worker.engine.sim_executor import SimCostModel, SimExecutor, SimExecutorConfig
from worker.engine.types import (
    EngineRequest,
    FinishReason,
    ForwardItem,
    RequestOutput,
    SamplingParams,
    Usage,
)

VOCAB = 1000


class RecordingExecutor:
    """A zero-cost SimExecutor that records every step's forward slices.

    ``eos_token_ids``, when given, replaces the EOS ids it reports (a model that lists several,
    as Llama-3-Instruct does); the tokens are still the sim's, whose EOS is its config's."""

    def __init__(
        self, config: SimExecutorConfig, eos_token_ids: tuple[int, ...] | None = None
    ) -> None:
        self.inner = SimExecutor(SimCostModel.zero(), config)
        self.vocab_size = self.inner.vocab_size
        self.max_context_tokens = self.inner.max_context_tokens
        if eos_token_ids is None:
            eos_token_ids = self.inner.eos_token_ids
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        # One list per step: ("p"|"d", request_id, start_pos, num_tokens, sample)
        self.steps: list[list[tuple[str, str, int, int, bool]]] = []

    def forward(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> list[int]:
        self.steps.append(
            [("p", i.request_id, i.start_pos, len(i.token_ids), i.sample) for i in prefill]
            + [("d", i.request_id, i.start_pos, len(i.token_ids), i.sample) for i in decode]
        )
        for item in prefill + decode:
            assert len(item.slots) == item.start_pos + len(item.token_ids)
        return self.inner.forward(prefill, decode)

    def step_cost_s(self, prefill: list[ForwardItem], decode: list[ForwardItem]) -> float:
        return 0.0


def make_engine(
    *,
    sim: SimExecutorConfig | None = None,
    eos_token_ids: tuple[int, ...] | None = None,
    **config: Any,
) -> tuple[Engine, RecordingExecutor]:
    """A zero-cost engine over a recording executor (vocab 1000, context 8192)."""
    executor = RecordingExecutor(
        sim if sim is not None else SimExecutorConfig(vocab_size=VOCAB, max_context_tokens=8192),
        eos_token_ids,
    )
    config.setdefault("schedule_policy", "fcfs")
    clock = itertools.count(1).__next__
    engine = Engine(EngineConfig(**config), executor, clock)  # type: ignore[arg-type]
    return engine, executor


def request(
    request_id: str, tokens: Any, max_new_tokens: int = 4, **sampling: Any
) -> EngineRequest:
    return EngineRequest(
        request_id,
        np.asarray(tokens, dtype=np.int64),
        SamplingParams(max_new_tokens=max_new_tokens, **sampling),
    )


def expected_tokens(engine: Engine, request_id: str, n: int, seed: int | None = None) -> list[int]:
    """The first ``n`` tokens the sim executor generates for a request."""
    sim = engine.executor.inner  # type: ignore[attr-defined]
    sp = SamplingParams(seed=seed)
    empty = np.empty(0, dtype=np.int64)
    return [sim.token_for(ForwardItem(request_id, empty, 0, empty, sp, True, k)) for k in range(n)]


@dataclass
class Collected:
    tokens: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    first_step: int | None = None


def collect(outputs: list[RequestOutput], into: dict[str, Collected], step: int) -> None:
    for out in outputs:
        c = into.setdefault(out.request_id, Collected())
        assert c.finish_reason is None, f"output after finish for {out.request_id}"
        if c.first_step is None:
            c.first_step = step
        c.tokens.extend(out.new_token_ids)
        c.finish_reason = out.finish_reason
        c.usage = out.usage
        assert (out.finish_reason is None) == (out.usage is None)


def run(
    engine: Engine, into: dict[str, Collected] | None = None, max_steps: int = 10_000
) -> dict[str, Collected]:
    """Step until idle (bounded); checks the slot accounting after every step."""
    results = into if into is not None else {}
    for step in range(max_steps):
        if not engine.has_work():
            return results
        collect(engine.step(), results, step)
        check_accounting(engine)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def check_accounting(engine: Engine) -> None:
    """free + evictable + protected + request-owned == total (between steps)."""
    cache = engine.cache
    total = (
        engine.allocator.num_free
        + cache.evictable_size()
        + cache.protected_size()
        + engine.scheduler.num_request_owned_slots()
    )
    assert total == engine.config.num_kv_slots, (
        f"slot leak: free={engine.allocator.num_free} evictable={cache.evictable_size()} "
        f"protected={cache.protected_size()} owned={engine.scheduler.num_request_owned_slots()}"
    )


def assert_baseline(engine: Engine) -> None:
    """Idle engine: nothing locked; after reset every slot is free again."""
    assert not engine.has_work()
    assert engine.cache.protected_size() == 0
    assert engine.scheduler._ahead == {}  # every block a waiting context counted is gone
    check_accounting(engine)
    engine.cache.reset()
    assert engine.allocator.num_free == engine.config.num_kv_slots
