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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

# The executor's choices. "gather" is the original path in model.py (gather each request's
# K/V, SDPA per prefill item and once for the padded decode group); the others use this
# module: "paged" = Triton kernels on CUDA when triton is installed, else the torch
# reference; "paged-torch" / "paged-triton" force one implementation.
ATTENTION_CHOICES = ("gather", "paged", "paged-torch", "paged-triton")

# Rows of queries one prefill program handles (the plan's block map is cut to it).
PREFILL_BLOCK_M = 64


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


# ---- the packed prefill plan ------------------------------------------------------------


@dataclass(eq=False, slots=True)
class PrefillPlan:
    """Where each prefill item's new tokens sit in the packed batch and which slots it reads.

    Host-side lists are kept so nothing reads the device to size a launch."""

    cu_q: torch.Tensor  # int32 [P + 1]: first packed row of each item, then the total
    start_pos: torch.Tensor  # int32 [P]: absolute position of each item's first new token
    ctx_lens: torch.Tensor  # int32 [P]: start_pos + num_new
    slot_table: torch.Tensor  # int64 [P, max_ctx], each row padded with its own first slot
    block_item: torch.Tensor  # int32 [nblocks]: item of each BLOCK_M-row query block
    block_row: torch.Tensor  # int32 [nblocks]: its first row within the item's new tokens
    num_new: tuple[int, ...]
    starts: tuple[int, ...]
    block_m: int
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_items(self) -> int:
        return len(self.num_new)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def max_new(self) -> int:
        return max(self.num_new)

    def pad_index(self) -> torch.Tensor:
        """int64 [T]: row ``p * max_new + i`` of a padded [P, max_new] layout per packed row."""
        rows = [p * self.max_new + np.arange(n) for p, n in enumerate(self.num_new)]
        return torch.from_numpy(np.concatenate(rows)).to(self.slot_table.device)

    def mask(self) -> torch.Tensor:
        """bool [P, 1, max_new, max_ctx]: query i of item p sees key j when
        j <= start_pos[p] + i and j < ctx_lens[p] (built once, for the torch reference)."""
        if self._mask is None:
            dev = self.slot_table.device
            key = torch.arange(self.slot_table.shape[1], device=dev)
            qpos = self.start_pos.long()[:, None] + torch.arange(self.max_new, device=dev)
            visible = key[None, None, :] <= qpos[:, :, None]
            visible &= key[None, None, :] < self.ctx_lens.long()[:, None, None]
            self._mask = visible[:, None]
        return self._mask


def plan_prefill(
    num_new: Sequence[int],
    start_pos: Sequence[int],
    ctx_slots: Sequence[np.ndarray],
    device: torch.device,
    *,
    block_m: int = PREFILL_BLOCK_M,
) -> PrefillPlan:
    """The plan of a packed prefill: item p has ``num_new[p]`` new tokens starting at
    absolute position ``start_pos[p]`` and reads the slots ``ctx_slots[p]`` (at least
    ``start_pos[p] + num_new[p]`` of them; extra ones are ignored)."""
    if not (len(num_new) == len(start_pos) == len(ctx_slots)) or not num_new:
        raise ValueError("plan_prefill: need equally many num_new, start_pos, ctx_slots (>= 1)")
    lens = [s + n for s, n in zip(start_pos, num_new, strict=True)]
    if min(num_new) < 1 or min(start_pos) < 0:
        raise ValueError("plan_prefill: every item needs >= 1 new token and start_pos >= 0")
    for slots, length in zip(ctx_slots, lens, strict=True):
        if len(slots) < length:
            raise ValueError(f"plan_prefill: {len(slots)} slots for a context of {length}")
    max_ctx = max(lens)
    table = np.empty((len(lens), max_ctx), dtype=np.int64)
    for row, (slots, length) in enumerate(zip(ctx_slots, lens, strict=True)):
        table[row, :length] = slots[:length]
        table[row, length:] = slots[0]
    cu = np.zeros(len(lens) + 1, dtype=np.int32)
    np.cumsum(num_new, out=cu[1:])
    items = [np.full(-(-n // block_m), p, np.int32) for p, n in enumerate(num_new)]
    rows = [np.arange(0, n, block_m, dtype=np.int32) for n in num_new]

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device)

    return PrefillPlan(
        cu_q=dev(cu),
        start_pos=dev(np.asarray(start_pos, dtype=np.int32)),
        ctx_lens=dev(np.asarray(lens, dtype=np.int32)),
        slot_table=dev(table),
        block_item=dev(np.concatenate(items)),
        block_row=dev(np.concatenate(rows)),
        num_new=tuple(int(n) for n in num_new),
        starts=tuple(int(s) for s in start_pos),
        block_m=block_m,
    )


# ---- torch references -------------------------------------------------------------------


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


def decode_splits(batch: int, kv_heads: int, max_len: int, *, sm_count: int = 132) -> int:
    """How many pieces the Triton decode kernel cuts each request's context into, so the
    launch has about two programs per SM (short contexts are never cut below 256 keys)."""
    want = -(-2 * sm_count // max(1, batch * kv_heads))
    return max(1, min(want, -(-max_len // 256), 16))


def prefill_splits(num_blocks: int, heads: int, max_ctx: int, *, sm_count: int = 132) -> int:
    """How many pieces the Triton prefill kernel cuts each query block's keys into: none
    while the (block, head) programs fill about two per SM (a cold prefill of any length),
    else enough to -- a few new tokens after a long cached prefix (64 after 8,000: one block,
    32 heads, 9 splits) -- never pieces under 256 keys, at most 16."""
    programs = max(1, num_blocks * heads)
    if programs >= 2 * sm_count:
        return 1
    want = -(-2 * sm_count // programs)
    return max(1, min(want, -(-max_ctx // 256), 16))


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
