"""Attention that reads K/V through each request's slot table (no per-request Python loop).

Two operations, each with a pure-torch reference (what the CPU path runs) and a Triton
kernel of the same signature (``worker.engine.paged_attention_triton``, imported only when
asked for, so this module needs neither triton nor a GPU):

* ``decode``: one query token per request. ``q`` [B, H, D]; request b attends to the
  ``ctx_lens[b]`` slots ``slot_table[b, :ctx_lens[b]]`` of one layer's pool tensors
  ``k_cache`` / ``v_cache`` [num_slots, KVH, D]. Query head h reads kv head
  ``h // (H // KVH)`` (grouped-query attention).
* ``prefill``: the new tokens of several requests packed one after another (varlen):
  request p owns rows ``cu_q[p] .. cu_q[p + 1]`` of ``q`` [T, H, D]; its new token i sits at
  absolute position ``start_pos[p] + i`` and sees the keys at positions 0 .. that position,
  read through ``slot_table[p]``. One computation for every prefill item of a step.

The executor writes the step's new K/V into the pool before attending, so a request's
context (cached prefix and new tokens alike) is always read from the pool.

Which implementation runs is the executor's ``attention`` option (see ``resolve``).
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

# The launch plan lives in attention_plan (the Triton kernels import it too); its names are
# re-exported here, where the executor and the graph runners look for them.
from worker.engine.attention_plan import PREFILL_BLOCK_M as PREFILL_BLOCK_M
from worker.engine.attention_plan import PrefillPlan as PrefillPlan
from worker.engine.attention_plan import decode_splits as decode_splits
from worker.engine.attention_plan import plan_prefill as plan_prefill
from worker.engine.attention_plan import prefill_splits as prefill_splits

# The executor's choices. "gather" is the original path in model.py (gather each request's
# K/V, SDPA per prefill item and once for the padded decode group); the others use this
# module: "paged" = Triton kernels on CUDA when triton is installed, else the torch
# reference; "paged-torch" / "paged-triton" force one implementation.
ATTENTION_CHOICES = ("gather", "paged", "paged-torch", "paged-triton")


def triton_available() -> bool:
    """Whether the ``triton`` package is importable (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """Whether Triton kernels would run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve(attention: str, device: torch.device) -> str:
    """The implementation an executor option selects on ``device``: "gather", "torch" or
    "triton". Raises ValueError for an unknown option or Triton where it cannot run."""
    if attention not in ATTENTION_CHOICES:
        raise ValueError(f"attention: {attention!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if attention == "gather":
        return "gather"
    if attention == "paged-torch":
        return "torch"
    if attention == "paged":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    # paged-triton
    if not triton_available():
        raise ValueError(
            "attention='paged-triton' needs the triton package (pip install -e '.[gpu-kernels]')"
        )
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"attention='paged-triton' needs a CUDA device, got {device.type!r} (on the CPU "
            "Triton only runs in its interpreter: set TRITON_INTERPRET=1 before starting)"
        )
    return "triton"


def _sdpa_gqa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA over [N, H, M, D] queries and [N, KVH, L, D] keys/values (KVH divides H)."""
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def decode_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Reference decode attention: one masked SDPA over the gathered [B, max_len] context.
    ``num_splits`` is accepted for the kernel's signature and ignored."""
    del num_splits
    k = k_cache[slot_table].transpose(1, 2)  # [B, KVH, L, D]
    v = v_cache[slot_table].transpose(1, 2)
    key = torch.arange(slot_table.shape[1], device=q.device)
    mask = (key[None, :] < ctx_lens.long()[:, None])[:, None, None, :]
    return _sdpa_gqa(q.unsqueeze(2), k, v, mask, scale).squeeze(2)


def prefill_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
) -> torch.Tensor:
    """Reference packed prefill: the items' new tokens padded to [P, max_new], their
    contexts gathered to [P, max_ctx], one SDPA with the plan's per-item causal mask."""
    num_items, max_new = plan.num_items, plan.max_new
    heads, dim = q.shape[1], q.shape[2]
    index = plan.pad_index()
    padded = q.new_zeros(num_items * max_new, heads, dim).index_copy_(0, index, q)
    qp = padded.view(num_items, max_new, heads, dim).transpose(1, 2)  # [P, H, M, D]
    k = k_cache[plan.slot_table].transpose(1, 2)  # [P, KVH, L, D]
    v = v_cache[plan.slot_table].transpose(1, 2)
    out = _sdpa_gqa(qp, k, v, plan.mask(), scale)  # [P, H, M, D]
    return out.transpose(1, 2).reshape(num_items * max_new, heads, dim)[index]


# ---- dispatch ---------------------------------------------------------------------------


def decode(
    impl: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention by ``impl`` ("torch" or "triton"); returns [B, H, D] in q's dtype."""
    if impl == "triton":
        from worker.engine import paged_attention_triton as kernels

        return kernels.decode_triton(
            q, k_cache, v_cache, slot_table, ctx_lens, scale, num_splits=num_splits
        )
    return decode_torch(q, k_cache, v_cache, slot_table, ctx_lens, scale)


def prefill(
    impl: str,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Packed prefill attention by ``impl`` ("torch" or "triton"); returns [T, H, D].
    ``num_splits``: the kernel's key splits (None: its own choice; the reference ignores it)."""
    if impl == "triton":
        from worker.engine import paged_attention_triton as kernels

        return kernels.prefill_triton(q, k_cache, v_cache, plan, scale, num_splits=num_splits)
    return prefill_torch(q, k_cache, v_cache, plan, scale)
