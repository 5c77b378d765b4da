"""Triton kernels for ``worker.engine.paged_attention`` (imported only when they are used).

Kept apart from ``paged_attention`` so that module imports without triton, and so a process
decides whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``, read when these
kernels are defined) before anything imports this one.

Only long-stable ``triton.language`` is used (program_id, arange, masked load/store, dot,
exp, log, max, sum, where, maximum), so the kernels build with the Triton a CUDA torch ships.

Decode (``decode_triton``): one program per (request, kv head, split of the context). It
holds the ``H // KVH`` query heads that share the kv head as the rows of one tile, walks its
part of the request's slot table ``BLOCK_N`` slots at a time, loads those K/V rows straight
from the pool by slot index and keeps an online softmax (running max, running sum, rescaled
accumulator). With one split it writes the output; with several each writes its normalised
partial output and log-sum-exp, and a second kernel combines the splits.

Prefill (``prefill_triton``): one program per (query block of one item, query head, split),
the blocks listed by the plan; each walks its split of the item's slots up to its last
query's position with the same online softmax and a causal mask on absolute positions. A
long cached prefix under a few new tokens leaves few query blocks, so their keys are split
(``prefill_splits``) and the decode path's combine kernel merges the splits per row.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from worker.engine.attention_plan import PrefillPlan, decode_splits, prefill_splits

# The interpreter multiplies bfloat16 tiles in tl.dot as raw uint16 (wrong); there the
# kernels upcast dot operands to float32 first. A GPU multiplies bfloat16 on tensor cores.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _mma(a, b, F32: tl.constexpr):
    """a @ b with a float32 result; F32: operands are (or are made) float32, multiplied
    exactly rather than in tf32."""
    if F32:  # noqa: SIM108 (a constexpr branch: one tl.dot is compiled)
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _load_rows(ptr, row_offsets, mask_r, offs_d, mask_d):
    """Rows [R, BLOCK_D] at ``ptr + row_offsets`` (head_dim contiguous; 0 where masked)."""
    return tl.load(
        ptr + row_offsets[:, None] + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    )


@triton.jit
def _split_range(length, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) of run ``split`` when keys [0, length) are cut into NUM_SPLITS runs of
    whole BLOCK_N blocks."""
    per_split = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    return lo, tl.minimum(lo + per_split, length)


@triton.jit
def _softmax_init(BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """An empty online softmax of BLOCK_R rows: max -inf, sum 0, output 0."""
    m_i = tl.zeros([BLOCK_R], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    return m_i, l_i, acc


@triton.jit
def _load_kv_block(k_g, v_g, table_row, start, hi, offs_n, offs_d, mask_d, stride_ks, stride_vs):
    """Keys ``start .. start + BLOCK_N`` below ``hi`` of one slot-table row (``table_row``):
    their positions and mask, K transposed [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] read
    through the table from one kv head's pool (``k_g``, ``v_g``; 0 where masked)."""
    keys = start + offs_n
    mask_n = keys < hi
    slots = tl.load(table_row + keys, mask=mask_n, other=0).to(tl.int64)
    kt = tl.load(
        k_g + slots[None, :] * stride_ks + offs_d[:, None],
        mask=mask_n[None, :] & mask_d[:, None],
        other=0.0,
    )
    v = tl.load(
        v_g + slots[:, None] * stride_vs + offs_d[None, :],
        mask=mask_n[:, None] & mask_d[None, :],
        other=0.0,
    )
    return keys, mask_n, kt, v


@triton.jit
def _softmax_step(
    q, kt, v, visible, m_i, l_i, acc, scale, F32: tl.constexpr, SAFE_MAX: tl.constexpr
):
    """One key block of the online softmax: each query row's running max ``m_i``, sum
    ``l_i`` and output ``acc``, updated with the keys ``visible`` to it. ``SAFE_MAX``: a row
    may see no key of the block while its max is still -inf; 0 then stands in for the max
    (exp(-inf - 0) = 0, never exp(-inf + inf))."""
    s = _mma(q, kt, F32) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if SAFE_MAX:  # noqa: SIM108 (a constexpr branch, as in _mma)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp(m_i - m_ref)
    p = tl.exp(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, F32)
    return m_new, l_i, acc


@triton.jit
def _store_out(
    acc,
    m_i,
    l_i,
    out_ptr,
    out_rows,
    mid_o,
    mid_lse,
    mask_r,
    offs_d,
    mask_d,
    NUM_SPLITS: tl.constexpr,
):
    """The rows' normalised output: with one split to ``out_ptr + out_rows``, else to the
    split buffers (rows ``mid_o``, of BLOCK_D floats, and their log-sum-exp at
    ``mid_lse``) that _combine_kernel merges."""
    nonempty = l_i > 0
    o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + out_rows[:, None] + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=mask_r[:, None] & mask_d[None, :],
        )
    else:
        tl.store(mid_o[:, None] + offs_d[None, :], o, mask=mask_r[:, None] & mask_d[None, :])
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse, lse, mask=mask_r)


@triton.jit
def _decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    lens_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    REP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32: tl.constexpr,
):
    b = tl.program_id(0)
    g = tl.program_id(1)  # kv head
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_h = offs_h < REP
    mask_d = offs_d < HEAD_DIM
    heads = g * REP + offs_h

    q = _load_rows(q_ptr, b * stride_qb + heads * stride_qh, mask_h, offs_d, mask_d)
    length = tl.load(lens_ptr + b)
    # This split's keys [lo, hi): the context cut into NUM_SPLITS whole blocks of BLOCK_N.
    lo, hi = _split_range(length, split, NUM_SPLITS, BLOCK_N)

    k_g, v_g, table_b = k_ptr + g * stride_kh, v_ptr + g * stride_vh, table_ptr + b * stride_tb
    m_i, l_i, acc = _softmax_init(BLOCK_H, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        _, mask_n, kt, v = _load_kv_block(
            k_g, v_g, table_b, start, hi, offs_n, offs_d, mask_d, stride_ks, stride_vs
        )
        m_i, l_i, acc = _softmax_step(q, kt, v, mask_n[None, :], m_i, l_i, acc, scale, F32, False)

    # mid_o: float32 [B, H, NUM_SPLITS, BLOCK_D]; mid_lse: float32 [B, H, NUM_SPLITS].
    out_rows = b * stride_ob + heads * stride_oh
    mid = (b * (REP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
    mid_o, mid_lse = mid_o_ptr + mid * BLOCK_D, mid_lse_ptr + mid
    _store_out(acc, m_i, l_i, out_ptr, out_rows, mid_o, mid_lse, mask_h, offs_d, mask_d, NUM_SPLITS)


@triton.jit
def _combine_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Out[b, h] = the splits' outputs weighted by exp(lse - max lse), normalised."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    row = (b * NUM_HEADS + h) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + row + offs_s, mask=mask_s, other=float("-inf"))
    o = tl.load(
        mid_o_ptr + (row + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )
    w = tl.exp(lse - tl.max(lse, 0))  # split 0 is never empty: the max is finite
    res = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        res.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    cu_q_ptr,
    start_ptr,
    table_ptr,
    block_item_ptr,
    block_row_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    REP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    F32: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    blk = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    g = h // REP
    item = tl.load(block_item_ptr + blk)
    row0 = tl.load(block_row_ptr + blk)
    q_first = tl.load(cu_q_ptr + item)
    num_new = tl.load(cu_q_ptr + item + 1) - q_first
    start_pos = tl.load(start_ptr + item)

    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < num_new
    mask_d = offs_d < HEAD_DIM
    rows = (q_first + offs_m).to(tl.int64)
    q = _load_rows(q_ptr, rows * stride_qt + h * stride_qh, mask_m, offs_d, mask_d)
    qpos = start_pos + offs_m  # absolute positions of the block's queries
    # Keys up to the block's last real query (the item's context ends there or later),
    # cut into NUM_SPLITS runs of whole BLOCK_N blocks; this program walks run ``split``.
    lo, hi = _split_range(
        start_pos + tl.minimum(row0 + BLOCK_M, num_new), split, NUM_SPLITS, BLOCK_N
    )

    k_g, v_g, table_i = k_ptr + g * stride_kh, v_ptr + g * stride_vh, table_ptr + item * stride_tb
    m_i, l_i, acc = _softmax_init(BLOCK_M, BLOCK_D)
    for start in range(lo, hi, BLOCK_N):
        keys, mask_n, kt, v = _load_kv_block(
            k_g, v_g, table_i, start, hi, offs_n, offs_d, mask_d, stride_ks, stride_vs
        )
        visible = mask_n[None, :] & (keys[None, :] <= qpos[:, None])
        # Key 0 is visible to every row, so with one split no row's max is ever -inf; a
        # later split can hold only keys past a row's position: there its max stays -inf
        # (SAFE_MAX).
        m_i, l_i, acc = _softmax_step(q, kt, v, visible, m_i, l_i, acc, scale, F32, True)

    # mid_o: float32 [T, H, NUM_SPLITS, BLOCK_D]; mid_lse: float32 [T, H, NUM_SPLITS] (the
    # decode kernel's layout with a packed row for a request: _combine_kernel merges both).
    out_rows = rows * stride_ot + h * stride_oh
    mid = (rows * tl.num_programs(1) + h) * NUM_SPLITS + split
    mid_o, mid_lse = mid_o_ptr + mid * BLOCK_D, mid_lse_ptr + mid
    _store_out(acc, m_i, l_i, out_ptr, out_rows, mid_o, mid_lse, mask_m, offs_d, mask_d, NUM_SPLITS)


@functools.cache
def _sm_count_of(device_type: str, index: int | None) -> int:
    if device_type != "cuda":
        return 132  # the interpreter: an H100/H200's count, so splits are chosen as there
    return torch.cuda.get_device_properties(index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    """The device's multiprocessor count, looked up once per device (an eager step sizes
    one launch per layer with it)."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _sm_count_of(device.type, index)


def _split_buffers(
    out: torch.Tensor, num_splits: int, block_d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The splits' partial outputs float32 [rows, H, S, BLOCK_D] and log-sum-exps
    [rows, H, S] for ``out`` [rows, H, D] (``out`` itself, unread, with one split)."""
    if num_splits == 1:
        return out, out
    rows, heads = out.shape[0], out.shape[1]
    mid_o = torch.empty(rows, heads, num_splits, block_d, dtype=torch.float32, device=out.device)
    mid_lse = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=out.device)
    return mid_o, mid_lse


def _combine(mid_o: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Merge the splits of ``_split_buffers`` into ``out``, row by row and head by head."""
    rows, heads, splits, block_d = mid_o.shape
    _combine_kernel[(rows, heads)](
        mid_o,
        mid_lse,
        out,
        out.stride(0),
        out.stride(1),
        NUM_HEADS=heads,
        HEAD_DIM=out.shape[2],
        NUM_SPLITS=splits,
        BLOCK_S=_pow2(splits, 2),
        BLOCK_D=block_d,
    )


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _use_f32(*tensors: torch.Tensor) -> bool:
    """Multiply in float32: float32 inputs, or bfloat16 under the interpreter (see above)."""
    dtypes = {t.dtype for t in tensors}
    return torch.float32 in dtypes or (_INTERPRET and torch.bfloat16 in dtypes)


def _check_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """The GQA ratio; the pool's K/V are [slots, KVH, D] with unit stride over D."""
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache / v_cache: need equal shapes [num_slots, kv_heads, head_dim]")
    if k_cache.stride(2) != 1 or v_cache.stride(2) != 1 or q.stride(-1) != 1:
        raise ValueError("q, k_cache, v_cache: head_dim must be the contiguous axis")
    heads, kv_heads = q.shape[-2], k_cache.shape[1]
    if heads % kv_heads or q.shape[-1] != k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit a pool of {tuple(k_cache.shape)}")
    return heads // kv_heads


def decode_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_n: int = 64,
) -> torch.Tensor:
    """Paged decode attention (same contract as ``paged_attention.decode_torch``)."""
    rep = _check_pool(q, k_cache, v_cache)
    bsz, _, dim = q.shape
    kv_heads = k_cache.shape[1]
    if slot_table.stride(1) != 1:
        slot_table = slot_table.contiguous()
    if num_splits is None:
        sms = _sm_count(q.device)
        num_splits = decode_splits(bsz, kv_heads, slot_table.shape[1], sm_count=sms)
    block_d = _pow2(dim)
    out = torch.empty_like(q)
    mid_o, mid_lse = _split_buffers(out, num_splits, block_d)
    _decode_kernel[(bsz, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        slot_table,
        ctx_lens,
        out,
        mid_o,
        mid_lse,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        slot_table.stride(0),
        out.stride(0),
        out.stride(1),
        REP=rep,
        HEAD_DIM=dim,
        NUM_SPLITS=num_splits,
        BLOCK_H=_pow2(rep),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        F32=_use_f32(q, k_cache),
    )
    if num_splits > 1:
        _combine(mid_o, mid_lse, out)
    return out


def prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    *,
    block_n: int = 64,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Packed (varlen) prefill attention (same contract as ``paged_attention.prefill_torch``).
    ``num_splits``: pieces each query block's keys are cut into (None: ``prefill_splits``,
    which cuts only when the query blocks alone leave SMs idle, as with a few new tokens
    after a long cached prefix)."""
    rep = _check_pool(q, k_cache, v_cache)
    tokens, heads, dim = q.shape
    if tokens != plan.num_tokens:
        raise ValueError(f"q has {tokens} rows; the plan packs {plan.num_tokens}")
    num_blocks = plan.block_item.shape[0]
    if num_splits is None:
        sms = _sm_count(q.device)
        max_ctx = max(s + n for s, n in zip(plan.starts, plan.num_new, strict=True))
        num_splits = prefill_splits(num_blocks, heads, max_ctx, sm_count=sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    block_d = _pow2(dim)
    out = torch.empty_like(q)
    mid_o, mid_lse = _split_buffers(out, num_splits, block_d)
    table = plan.slot_table
    _prefill_kernel[(num_blocks, heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        mid_o,
        mid_lse,
        plan.cu_q,
        plan.start_pos,
        table,
        plan.block_item,
        plan.block_row,
        float(scale),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        REP=rep,
        HEAD_DIM=dim,
        BLOCK_M=plan.block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        F32=_use_f32(q, k_cache),
        NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        _combine(mid_o, mid_lse, out)
    return out
