"""The engine over the real torch executor (tiny random Llama on CPU): prefix caching,
chunked prefill and retraction must not change a greedy request's tokens."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("torch")

from worker.engine.engine import Engine, EngineConfig
from worker.engine.factory import build_executor
from worker.engine.types import EngineRequest, SamplingParams

_RNG = np.random.default_rng(11)
PREFIX = _RNG.integers(1, 256, 96)
SUFFIXES = [_RNG.integers(1, 256, 8) for _ in range(4)]


def _engine(**config) -> Engine:
    num_slots = config.setdefault("num_kv_slots", 4096)
    executor, _ = build_executor("torch", num_kv_slots=num_slots, device="cpu", seed=0)
    return Engine(EngineConfig(**config), executor, clock=itertools.count(1).__next__)


def _generate(engine: Engine, prompts: dict[str, np.ndarray], n: int = 6) -> dict[str, list[int]]:
    sampling = SamplingParams(max_new_tokens=n, ignore_eos=True)
    for rid, prompt in prompts.items():
        engine.add_request(EngineRequest(rid, prompt, sampling))
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    for _ in range(1000):
        if not engine.has_work():
            break
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert not engine.has_work()
    return tokens


def _prompts() -> dict[str, np.ndarray]:
    return {f"r{i}": np.concatenate((PREFIX, s)) for i, s in enumerate(SUFFIXES)}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Each request alone on a cache-less engine."""
    out: dict[str, list[int]] = {}
    engine = _engine(enable_cache=False)
    for rid, prompt in _prompts().items():
        out.update(_generate(engine, {rid: prompt}))
    return out


def test_cached_prefix_gives_the_same_tokens(reference: dict[str, list[int]]) -> None:
    engine = _engine()
    prompts = _prompts()
    first = _generate(engine, {"r0": prompts.pop("r0")})
    rest = _generate(engine, prompts)
    assert {**first, **rest} == reference
    assert engine.stats().cached_prompt_tokens == 3 * len(PREFIX)


def test_chunked_prefill_gives_the_same_tokens(reference: dict[str, list[int]]) -> None:
    engine = _engine(chunk_size=16, max_prefill_tokens_per_step=40)
    assert _generate(engine, _prompts()) == reference


def test_retraction_gives_the_same_tokens(reference: dict[str, list[int]]) -> None:
    # 4 x 104 prompt tokens share a 96-token prefix: 96 + 4 * 8 = 128 slots, plus decode.
    engine = _engine(num_kv_slots=140, new_token_reserve_ratio=0.0, in_batch_dedup_min_tokens=0)
    assert _generate(engine, _prompts()) == reference
    assert engine.stats().num_retractions > 0
    engine.cache.reset()
    assert engine.num_free_slots == 140
