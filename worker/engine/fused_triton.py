"""Triton kernels for ``worker.engine.fused_ops`` (imported only when they are used).

Kept apart from ``fused_ops`` so that module imports without triton, and so a process decides
whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``) before this one is
imported. Only long-stable ``triton.language`` is used (program_id, arange, masked
load/store, sum, rsqrt, exp, casts), so the kernels build with the Triton a CUDA torch ships.

``_add_rmsnorm_kernel``: one program per ``BLOCK_R`` rows of the [T, N] activations (one row
per program at Llama-3-8B's hidden size, several at small ones), each row whole in one tile:
read x (and h), write x + h rounded to the activation dtype, and the RMS-normed row times the
weight, rounded as ``fused_ops.rmsnorm_torch`` rounds.

``_rope_write_kernel``: RoPE over q and k and the step's KV pool write in one launch. The
rows ([T * H] of q, then [T * KVH] of k, then [T * KVH] of v, each one head of one token)
are cut into blocks of ``BLOCK_R``; a program rotates one block of q or k in place with its
tokens' cos/sin rows (k's rotated rows also stored at their token's slot of the K cache), or
copies one block of v to the V cache.

``_silu_mul_kernel``: one program per ``BLOCK`` columns of one row of the [T, 2 * I] gate/up
output: silu(gate) * up in float32, rounded as the unfused model's two ops round (silu(gate) to
the activation dtype, then the product).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Elements of one program's tile (rows x padded row length) the launch aims for.
TILE_ELEMENTS = 4096

# Triton's interpreter casts float32 to bfloat16 by truncation (a GPU rounds to nearest
# even); there the kernels round by hand first (``RNE``), so the CPU tests check bfloat16
# results bit for bit against torch's rounding.
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _to(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """float32 ``x`` cast to ``dtype``; RNE: round to nearest even by hand (x's low 16 bits
    rounded away, so the cast that follows is exact whatever its rounding)."""
    if RNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + (0x7FFF + ((bits >> 16) & 1))
        x = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    h_ptr,
    w_ptr,
    res_ptr,
    y_ptr,
    n_rows,
    eps,
    stride_x,
    stride_h,
    stride_res,
    stride_y,
    N: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RNE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask_r = rows < n_rows
    mask = mask_r[:, None] & (cols < N)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    if HAS_DELTA:
        h = tl.load(h_ptr + rows64[:, None] * stride_h + cols[None, :], mask=mask, other=0.0)
        x = _to(x.to(tl.float32) + h.to(tl.float32), dtype, RNE)  # rounded as torch's x + h
        tl.store(res_ptr + rows64[:, None] * stride_res + cols[None, :], x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 1) / N + eps)
    normed = _to(x32 * rstd[:, None], dtype, RNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = _to(normed * w[None, :], y_ptr.dtype.element_ty, RNE)
    tl.store(y_ptr + rows64[:, None] * stride_y + cols[None, :], y, mask=mask)


@triton.jit
def _row_block(
    block,
    n_rows,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Rows block * BLOCK_R ... of a [tokens * HEADS, 2 * HALF] view (row r: token
    r // HEADS, head r % HEADS): the rows, the half-row columns, the rows' token and head,
    and the mask of real rows and columns."""
    rows = block * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None] & (cols < HALF)[None, :]
    tok = (rows // HEADS).to(tl.int64)
    head = (rows % HEADS).to(tl.int64)
    return rows, cols, tok, head, mask


@triton.jit
def _store_halves(c_ptr, row_offsets, lo, hi, mask, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Rows' two halves stored at ``c_ptr + row_offsets`` (a KV cache's slots), cast to it."""
    dst = c_ptr + row_offsets[:, None] + tl.arange(0, BLOCK_HALF)[None, :]
    tl.store(dst, lo.to(c_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, hi.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_rows(
    x_ptr,
    cos_ptr,
    sin_ptr,
    block,
    n_rows,
    stride_t,
    stride_h,
    stride_c,
    HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RNE: tl.constexpr,
):
    """Rotate rows block * BLOCK_R ... of x in place (row r: token r // HEADS, head
    r % HEADS); returns the rotated halves, the rows, their token and head, and the mask."""
    rows, cols, tok, head, mask = _row_block(block, n_rows, HEADS, HALF, BLOCK_R, BLOCK_HALF)
    base = x_ptr + (tok * stride_t + head * stride_h)[:, None] + cols[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    trig = tok[:, None] * stride_c + cols[None, :]
    c = tl.load(cos_ptr + trig, mask=mask, other=0.0)
    s = tl.load(sin_ptr + trig, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = _to(a * c - b * s, x1.dtype, RNE)
    y2 = _to(b * c + a * s, x1.dtype, RNE)
    tl.store(base, y1, mask=mask)
    tl.store(base + HALF, y2, mask=mask)
    return y1, y2, rows, tok, head, mask


@triton.jit
def _rope_write_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    n_q_rows,
    n_k_rows,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c,
    stride_kcs,
    stride_kch,
    stride_vcs,
    stride_vch,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    RNE: tl.constexpr,
):
    """q rows rotated in place; k rows rotated in place and stored at their token's slot of
    the K cache; v rows copied to the V cache."""
    pid = tl.program_id(0)
    q_blocks = tl.cdiv(n_q_rows, BLOCK_R)
    k_blocks = tl.cdiv(n_k_rows, BLOCK_R)
    if pid < q_blocks:
        _rope_rows(
            q_ptr,
            cos_ptr,
            sin_ptr,
            pid,
            n_q_rows,
            stride_qt,
            stride_qh,
            stride_c,
            Q_HEADS,
            HALF,
            BLOCK_R,
            BLOCK_HALF,
            RNE,
        )
    elif pid < q_blocks + k_blocks:  # k rows: rotated in place and into the cache
        y1, y2, rows, tok, head, mask = _rope_rows(
            k_ptr,
            cos_ptr,
            sin_ptr,
            pid - q_blocks,
            n_k_rows,
            stride_kt,
            stride_kh,
            stride_c,
            K_HEADS,
            HALF,
            BLOCK_R,
            BLOCK_HALF,
            RNE,
        )
        slot = tl.load(slots_ptr + tok, mask=rows < n_k_rows, other=0).to(tl.int64)
        _store_halves(kc_ptr, slot * stride_kcs + head * stride_kch, y1, y2, mask, HALF, BLOCK_HALF)
    else:  # v rows: copied into the cache
        block = pid - q_blocks - k_blocks
        rows, cols, tok, head, mask = _row_block(
            block, n_k_rows, K_HEADS, HALF, BLOCK_R, BLOCK_HALF
        )
        src = v_ptr + (tok * stride_vt + head * stride_vh)[:, None] + cols[None, :]
        slot = tl.load(slots_ptr + tok, mask=rows < n_k_rows, other=0).to(tl.int64)
        lo = tl.load(src, mask=mask, other=0.0)
        hi = tl.load(src + HALF, mask=mask, other=0.0)
        _store_halves(vc_ptr, slot * stride_vcs + head * stride_vch, lo, hi, mask, HALF, BLOCK_HALF)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    n_cols,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,
    RNE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = _to(gate / (1.0 + tl.exp(-gate)), dtype, RNE).to(tl.float32)  # rounded as torch's
    tl.store(out_ptr + row * stride_o + cols, _to(silu * up, dtype, RNE), mask=mask)


def _rows_per_program(n_rows: int, block_cols: int) -> int:
    """Rows of one tile: TILE_ELEMENTS / padded row length, at most the rows there are."""
    return max(1, min(TILE_ELEMENTS // block_cols, triton.next_power_of_2(max(n_rows, 1))))


def _rne(dtype: torch.dtype) -> bool:
    return _INTERPRET and dtype == torch.bfloat16


def _warps(tile: int) -> int:
    return 4 if tile <= 2048 else 8


def add_rmsnorm_triton(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_ops.add_rmsnorm_torch``'s contract on rows of [..., N] (unit stride over N)."""
    n = residual.shape[-1]
    x = residual.reshape(-1, n)
    h = delta.reshape(-1, n) if delta is not None else x
    if x.stride(-1) != 1 or h.stride(-1) != 1 or weight.stride(-1) != 1:
        x, h, weight = x.contiguous(), h.contiguous(), weight.contiguous()
    rows = x.shape[0]
    out = torch.empty_like(x)
    new_res = torch.empty_like(x) if delta is not None else x
    if rows:
        block_n = triton.next_power_of_2(n)
        block_r = _rows_per_program(rows, block_n)
        _add_rmsnorm_kernel[(triton.cdiv(rows, block_r),)](
            x,
            h,
            weight,
            new_res,
            out,
            rows,
            float(eps),
            x.stride(0),
            h.stride(0),
            new_res.stride(0),
            out.stride(0),
            N=n,
            HAS_DELTA=delta is not None,
            BLOCK_R=block_r,
            BLOCK_N=block_n,
            RNE=_rne(x.dtype),
            num_warps=_warps(block_r * block_n),
        )
    shape = residual.shape
    return (new_res.view(shape) if delta is not None else residual), out.view(shape)


# Columns of one silu_mul program (Llama-3-8B's 14,336: 14 programs per row).
SILU_MUL_BLOCK = 1024


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """``fused_ops.silu_mul_torch``'s contract (gate_up [..., 2 * I] -> [..., I])."""
    width = gate_up.shape[-1]
    x = gate_up.reshape(-1, width)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape[0], width // 2
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if rows and cols:
        block = min(SILU_MUL_BLOCK, triton.next_power_of_2(cols))
        _silu_mul_kernel[(rows, triton.cdiv(cols, block))](
            x,
            out,
            cols,
            x.stride(0),
            out.stride(0),
            BLOCK=block,
            RNE=_rne(x.dtype),
            num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], cols)


def rope_write_triton_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``fused_ops.rope_write_torch_``'s contract in one launch (head_dim axes contiguous)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"rope_write_triton_: {name} needs a contiguous head_dim axis")
    if cos.stride(1) != 1 or sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if slots.stride(0) != 1:
        slots = slots.contiguous()
    tokens, q_heads, dim = q.shape
    k_heads = k.shape[1]
    if tokens == 0:
        return
    half = dim // 2
    block_half = triton.next_power_of_2(half)
    block_r = _rows_per_program(tokens * q_heads, block_half)
    kv_blocks = triton.cdiv(tokens * k_heads, block_r)
    grid = triton.cdiv(tokens * q_heads, block_r) + 2 * kv_blocks
    _rope_write_kernel[(grid,)](
        q,
        k,
        v,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        tokens * q_heads,
        tokens * k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        cos.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        Q_HEADS=q_heads,
        K_HEADS=k_heads,
        HALF=half,
        BLOCK_R=block_r,
        BLOCK_HALF=block_half,
        RNE=_rne(q.dtype),
        num_warps=_warps(block_r * block_half),
    )
