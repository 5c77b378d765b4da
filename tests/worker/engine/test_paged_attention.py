"""Paged attention's torch reference (the CPU path of attention="paged"): the decode and the
packed prefill against float64 oracles, the executor's logits equal to the gather path's on
a mixed scenario, the option's resolution and the plan's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_cases import check_decode, check_executor, check_prefill, executor_scenario

from worker.engine import paged_attention as pa
from worker.engine.factory import build_tiny_default
from worker.engine.model import LlamaForCausalLM
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_default(seed=0)


def test_decode_reference_matches_oracle() -> None:
    check_decode("torch", "cpu")


def test_packed_prefill_reference_matches_oracle() -> None:
    check_prefill("torch", "cpu")


@pytest.mark.parametrize("attention", ["paged", "paged-torch"])
def test_executor_paged_logits_equal_gather(model: LlamaForCausalLM, attention: str) -> None:
    check_executor(attention, model)


def test_scenario_is_sensitive_to_the_attention(model: LlamaForCausalLM, monkeypatch) -> None:
    """The scenario check fails when the paged path attends one key too few (the causal
    mask off by one): equal logits mean something."""
    real = pa.PrefillPlan.mask

    def short(self: pa.PrefillPlan) -> torch.Tensor:
        mask = real(self).clone()
        key = torch.arange(mask.shape[-1])
        qpos = self.start_pos.long()[:, None] + torch.arange(self.max_new)
        mask &= ((key[None, None, :] < qpos[:, :, None]) | (key == 0))[:, None]
        return mask

    want = executor_scenario(model, "gather")
    monkeypatch.setattr(pa.PrefillPlan, "mask", short)
    got = executor_scenario(model, "paged-torch")
    assert not all(torch.allclose(g, w, atol=1e-3) for g, w in zip(got, want, strict=True))


def test_paged_executor_builds_no_per_item_gather_inputs(model: LlamaForCausalLM) -> None:
    ex = TorchExecutor.create(model, 64, attention="paged-torch")
    greedy = SamplingParams()
    items = [
        ForwardItem("a", np.array([1, 2, 3]), 0, np.arange(3), greedy),
        ForwardItem("b", np.array([4]), 2, np.array([10, 11, 12]), greedy),
    ]
    batch = ex._build_batch(
        items, [ForwardItem("c", np.array([5]), 1, [20, 21], greedy)], all_positions=False
    )
    assert batch.attention == "torch" and batch.prefill == ()
    plan = batch.prefill_plan
    assert plan is not None
    assert plan.cu_q.tolist() == [0, 3, 4] and plan.start_pos.tolist() == [0, 2]
    assert plan.ctx_lens.tolist() == [3, 3]
    assert plan.slot_table.tolist() == [[0, 1, 2], [10, 11, 12]]
    assert batch.decode is not None and batch.decode.ctx_mask is None
    assert batch.decode.ctx_lens is not None and batch.decode.ctx_lens.tolist() == [2]
    assert batch.decode.num_splits == 1


def test_plan_blocks_cover_every_row() -> None:
    plan = pa.plan_prefill(
        [5, 1, 33],
        [0, 4, 2],
        [np.arange(5), np.arange(5), np.arange(35)],
        torch.device("cpu"),
        block_m=16,
    )
    assert plan.block_item.tolist() == [0, 1, 2, 2, 2]
    assert plan.block_row.tolist() == [0, 0, 0, 16, 32]
    assert plan.pad_index().tolist()[:6] == [0, 1, 2, 3, 4, 33]
    with pytest.raises(ValueError, match="4 slots for a context of 5"):
        pa.plan_prefill([5], [0], [np.arange(4)], torch.device("cpu"))
    with pytest.raises(ValueError, match=">= 1 new token"):
        pa.plan_prefill([0], [0], [np.arange(4)], torch.device("cpu"))


def test_attention_option_resolution(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pa.resolve("gather", cpu) == "gather"
    assert pa.resolve("paged", cpu) == "torch"
    assert pa.resolve("paged-torch", cuda) == "torch"
    monkeypatch.setattr(pa, "triton_available", lambda: True)
    assert pa.resolve("paged", cuda) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pa.resolve("paged-triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pa.resolve("paged-triton", cpu) == "triton"
    monkeypatch.setattr(pa, "triton_available", lambda: False)
    assert pa.resolve("paged", cuda) == "torch"
    with pytest.raises(ValueError, match="needs the triton package"):
        pa.resolve("paged-triton", cuda)
    with pytest.raises(ValueError, match="not one of"):
        pa.resolve("flash", cpu)


def test_executor_rejects_unknown_attention(model: LlamaForCausalLM) -> None:
    with pytest.raises(ValueError, match="not one of"):
        TorchExecutor.create(model, 8, attention="fast")


def test_decode_splits_heuristic() -> None:
    assert pa.decode_splits(1, 8, 2048) == 8  # cut to 256-key pieces
    assert pa.decode_splits(1, 8, 100) == 1  # short contexts are not cut
    assert pa.decode_splits(128, 8, 2048) == 1  # enough programs already
    assert pa.decode_splits(8, 8, 8192, sm_count=132) == 5
    assert pa.decode_splits(1, 1, 100_000) == 16  # capped


def test_prefill_splits_heuristic() -> None:
    # 64 new tokens after 8,000 cached on Llama-3-8B's 32 heads: one query block, 9 splits
    assert pa.prefill_splits(1, 32, 8064) == 9
    assert pa.prefill_splits(126, 32, 8064) == 1  # a cold 8k prefill fills the GPU already
    assert pa.prefill_splits(1, 32, 200) == 1  # short contexts are not cut
    assert pa.prefill_splits(2, 32, 1000) == 4  # at most ceil(1000 / 256) pieces
    assert pa.prefill_splits(1, 1, 100_000) == 16  # capped
    assert pa.prefill_splits(4, 32, 8064, sm_count=64) == 1  # 128 programs = 2 per SM
