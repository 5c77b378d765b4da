"""TorchExecutor correctness, driven with ForwardItems and a tiny slot allocator.

The scheduler is not involved: each test plays the scheduler's part (allocate slots, reuse a
cached prefix's slots, split prefill into chunks, batch decodes) and checks that the tokens
are identical and the logits equal to float rounding, whatever path served them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from worker.engine.factory import build_tiny_default
from worker.engine.model import LlamaForCausalLM
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

NUM_SLOTS = 512
ATOL = 1e-5
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_default(seed=0)


class SlotAllocator:
    """Hands out slots in a shuffled order, so contexts are never contiguous in the pool."""

    def __init__(self, num_slots: int, seed: int) -> None:
        self._free = list(np.random.default_rng(seed).permutation(num_slots))

    def alloc(self, n: int) -> np.ndarray:
        assert n <= len(self._free), "test allocator ran out of slots"
        out, self._free = self._free[:n], self._free[n:]
        return np.array(out, dtype=np.int64)


@dataclass
class Run:
    """One request's record: its context slots, generated tokens, per-step logits."""

    slots: np.ndarray
    tokens: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)


def prefill(
    ex: TorchExecutor,
    alloc: SlotAllocator,
    prompt: np.ndarray,
    *,
    cached_slots: np.ndarray | None = None,
    chunk: int | None = None,
    sampling: SamplingParams = GREEDY,
) -> Run:
    """Prefill ``prompt`` after a cached prefix (its slots given), optionally in chunks;
    the last chunk samples the first token."""
    start = 0 if cached_slots is None else len(cached_slots)
    reused = np.empty(0, np.int64) if cached_slots is None else cached_slots
    slots = np.concatenate([reused, alloc.alloc(len(prompt) - start)])
    run = Run(slots=slots)
    step = chunk or len(prompt)
    pos = start
    while pos < len(prompt):
        end = min(pos + step, len(prompt))
        last = end == len(prompt)
        item = ForwardItem("r", prompt[pos:end], pos, slots[:end], sampling, sample=last)
        logits = ex.forward_logits([item], [])
        if last:
            run.logits.append(logits[0])
            run.tokens.append(ex._sampler.sample(logits, [sampling], [0])[0])
        pos = end
    return run


def decode_item(run: Run, alloc: SlotAllocator, rid: str, sampling=GREEDY) -> ForwardItem:
    """Grow ``run`` by one slot and describe its next decode step."""
    run.slots = np.concatenate([run.slots, alloc.alloc(1)])
    ctx = len(run.slots)
    return ForwardItem(
        rid,
        np.array([run.tokens[-1]]),
        ctx - 1,
        run.slots,
        sampling,
        num_generated=len(run.tokens),
    )


def decode_steps(ex: TorchExecutor, alloc: SlotAllocator, runs: list[Run], n: int) -> None:
    """n batched greedy decode steps over all ``runs`` together."""
    for _ in range(n):
        items = [decode_item(run, alloc, f"r{i}") for i, run in enumerate(runs)]
        logits = ex.forward_logits([], items)
        for run, row in zip(runs, logits, strict=True):
            run.logits.append(row)
            run.tokens.append(int(torch.argmax(row)))


def fresh(model: LlamaForCausalLM) -> tuple[TorchExecutor, SlotAllocator]:
    return TorchExecutor.create(model, NUM_SLOTS), SlotAllocator(NUM_SLOTS, seed=1)


def prompt_of(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n).astype(np.int64)


def serve_cold(model, prompt, *, chunk=None, new_tokens=6) -> Run:
    ex, alloc = fresh(model)
    run = prefill(ex, alloc, prompt, chunk=chunk)
    decode_steps(ex, alloc, [run], new_tokens - 1)
    return run


def assert_same(a: Run, b: Run) -> None:
    assert a.tokens == b.tokens
    assert len(a.logits) == len(b.logits)
    for x, y in zip(a.logits, b.logits, strict=True):
        torch.testing.assert_close(x, y, atol=ATOL, rtol=0)


def test_prefix_hit_equals_cold(model):
    shared, suffix = prompt_of(20, 1), prompt_of(9, 2)
    prompt = np.concatenate([shared, suffix])
    cold = serve_cold(model, prompt)

    ex, alloc = fresh(model)
    first = prefill(ex, alloc, np.concatenate([shared, prompt_of(5, 3)]))
    warm = prefill(ex, alloc, prompt, cached_slots=first.slots[: len(shared)])
    decode_steps(ex, alloc, [warm], 5)
    assert_same(warm, cold)


def test_hit_across_node_split_and_two_owners_equals_cold(model):
    """The cached prefix ends in the middle of one request's prompt (a node split) and is
    made of slots written by two different requests."""
    prompt = prompt_of(40, 4)
    cold = serve_cold(model, prompt)

    ex, alloc = fresh(model)
    a = prefill(ex, alloc, np.concatenate([prompt[:30], prompt_of(10, 5)]))
    # c reuses a's first 12 tokens (splitting a's node at 12) and computes 12..25 itself.
    c = prefill(
        ex, alloc, np.concatenate([prompt[:25], prompt_of(6, 6)]), cached_slots=a.slots[:12]
    )
    cached = np.concatenate([a.slots[:12], c.slots[12:25]])
    warm = prefill(ex, alloc, prompt, cached_slots=cached)
    decode_steps(ex, alloc, [warm], 5)
    assert_same(warm, cold)


@pytest.mark.parametrize("chunk", [1, 3, 7, 16])
def test_chunked_prefill_equals_one_shot(model, chunk):
    prompt = prompt_of(31, 7)
    cold = serve_cold(model, prompt)
    assert_same(serve_cold(model, prompt, chunk=chunk), cold)


def test_chunked_prefill_after_prefix_hit_equals_cold(model):
    prompt = prompt_of(33, 8)
    cold = serve_cold(model, prompt)
    ex, alloc = fresh(model)
    first = prefill(ex, alloc, prompt[:17])
    warm = prefill(ex, alloc, prompt, cached_slots=first.slots[:11], chunk=5)
    decode_steps(ex, alloc, [warm], 5)
    assert_same(warm, cold)


def test_full_prompt_logits_match_incremental_decode(model):
    """Teacher-forced logits of one prefill equal the logits decode steps produce."""
    prompt = prompt_of(12, 9)
    run = serve_cold(model, prompt, new_tokens=5)
    ex, _ = fresh(model)
    full = np.concatenate([prompt, np.array(run.tokens[:-1])])
    item = ForwardItem("r", full, 0, np.arange(len(full)), GREEDY)
    logits = ex.prompt_logits(item)[len(prompt) - 1 :]
    torch.testing.assert_close(logits, torch.stack(run.logits), atol=ATOL, rtol=0)


def test_batched_decode_equals_each_alone(model):
    prompts = [prompt_of(n, 10 + n) for n in (5, 17, 11, 2)]
    alone = [serve_cold(model, p, new_tokens=7) for p in prompts]

    ex, alloc = fresh(model)
    runs = [prefill(ex, alloc, p) for p in prompts]
    decode_steps(ex, alloc, runs, 6)
    for batched, single in zip(runs, alone, strict=True):
        assert_same(batched, single)


def test_mixed_step_prefill_and_decode_equals_separate(model):
    p1, p2 = prompt_of(9, 20), prompt_of(14, 21)
    alone1 = serve_cold(model, p1, new_tokens=2)
    alone2 = serve_cold(model, p2, new_tokens=1)

    ex, alloc = fresh(model)
    r1 = prefill(ex, alloc, p1)
    s2 = alloc.alloc(len(p2))
    tokens = ex.forward([ForwardItem("r2", p2, 0, s2, GREEDY)], [decode_item(r1, alloc, "r1")])
    assert tokens == [alone2.tokens[0], alone1.tokens[1]]


def test_forward_returns_minus_one_for_unsampled_chunks(model):
    ex, alloc = fresh(model)
    prompt = prompt_of(10, 30)
    slots = alloc.alloc(10)
    other = alloc.alloc(4)
    out = ex.forward(
        [
            ForwardItem("a", prompt[:6], 0, slots[:6], GREEDY, sample=False),
            ForwardItem("b", prompt[:4], 0, other, GREEDY),
        ],
        [],
    )
    assert out[0] == -1
    assert 0 <= out[1] < ex.vocab_size
    assert ex.step_cost_s([], []) > 0.0  # measured, so positive once something ran


def test_seeded_sampling_is_reproducible_regardless_of_batch(model):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    def run_batch(batch_with: list[np.ndarray]) -> list[int]:
        ex, alloc = fresh(model)
        main = prefill(ex, alloc, prompt_of(8, 40), sampling=sampled)
        others = [prefill(ex, alloc, p) for p in batch_with]
        for _ in range(5):
            items = [decode_item(main, alloc, "main", sampled)]
            items += [decode_item(r, alloc, f"o{i}") for i, r in enumerate(others)]
            out = ex.forward([], items)
            main.tokens.append(out[0])
            for r, t in zip(others, out[1:], strict=True):
                r.tokens.append(t)
        return main.tokens

    alone = run_batch([])
    assert run_batch([prompt_of(13, 41), prompt_of(3, 42)]) == alone
    assert run_batch([prompt_of(20, 43)]) == alone


@pytest.mark.parametrize(
    ("item", "match"),
    [
        (ForwardItem("x", np.array([], np.int64), 0, np.arange(1), GREEDY), "empty"),
        (ForwardItem("x", np.array([1, 2]), 0, np.arange(1), GREEDY), "slots: 1 slots"),
        (ForwardItem("x", np.array([1]), 0, np.array([NUM_SLOTS]), GREEDY), "out of range"),
        (ForwardItem("x", np.array([600]), 0, np.arange(1), GREEDY), r"token_ids: out of"),
        (ForwardItem("x", np.array([1]), -1, np.arange(1), GREEDY), "negative"),
        (ForwardItem("x", np.array([1]), 4096, np.arange(4097), GREEDY), "max_context"),
    ],
)
def test_bad_prefill_item_is_rejected(model, item, match):
    ex, _ = fresh(model)
    with pytest.raises(ValueError, match=match):
        ex.forward([item], [])


def test_bad_batches_are_rejected(model):
    ex, _ = fresh(model)
    with pytest.raises(ValueError, match="no prefill and no decode"):
        ex.forward([], [])
    two = ForwardItem("d", np.array([1, 2]), 0, np.arange(2), GREEDY)
    with pytest.raises(ValueError, match="a decode item has 1"):
        ex.forward([], [two])
    a = ForwardItem("a", np.array([1, 2]), 0, np.array([3, 4]), GREEDY)
    b = ForwardItem("b", np.array([1]), 0, np.array([4]), GREEDY)
    with pytest.raises(ValueError, match="same KV slot"):
        ex.forward([a, b], [])


def test_repeat_kv_fallback_equals_native_gqa(model, monkeypatch):
    """The pre-torch-2.5 path (K/V repeated per query head) computes the same logits."""
    import worker.engine.model as model_mod

    prompt = prompt_of(21, 50)
    native = serve_cold(model, prompt, chunk=8)
    monkeypatch.setattr(model_mod, "_SDPA_HAS_GQA", False)
    assert_same(serve_cold(model, prompt, chunk=8), native)
