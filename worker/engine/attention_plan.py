"""The launch plan the paged-attention paths share: where each prefill item's tokens sit in
the packed batch, which slots it reads, and how the Triton kernels cut the work.

Apart from ``paged_attention`` (the torch reference and the dispatch) and
``paged_attention_triton`` (the kernels) so that both import it and neither imports the
other's module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Rows of queries one prefill program handles (the plan's block map is cut to it).
PREFILL_BLOCK_M = 64


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
