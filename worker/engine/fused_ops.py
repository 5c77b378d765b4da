"""The decoder layer's two elementwise hot spots as single passes, with torch references.

* ``add_rmsnorm``: the residual add and the RMSNorm after it (``x = x + h; y = norm(x)``)
  in one read of ``x`` and ``h``; returns both the new residual and the normed output.
  Without ``h`` it is the plain RMSNorm (the first layer's input norm).
* ``rope_write_``: the rotary embedding applied to q and k together, in place, for the
  positions of a packed batch (one row of cos/sin per token), and the step's K/V stored into
  one layer of the KV pool in the same pass.
* ``silu_mul``: the SwiGLU gate, ``silu(gate) * up``, read from the one [T, 2 * I] output of
  the concatenated gate/up projection (the fused layers run gate and up as one matmul).

Each has a pure-torch reference (what ``fused="torch"`` runs, and what the kernels are tested
against) and a Triton kernel of the same contract (``worker.engine.fused_triton``, imported
only when asked for, so this module needs neither triton nor a GPU).

Numerics. ``add_rmsnorm`` rounds exactly as the model's unfused code does: the sum to the
input dtype, the normalised row to the input dtype, then the product with the weight to the
input dtype (float32 statistics); only the order of the mean's additions can differ.
``rope_write_`` rotates in float32 from float32 cos/sin and rounds once to the input dtype, where
the unfused model rounds the cos/sin tables and each product to the weights' dtype: in float32
the two agree (same operations), in bfloat16 the fused result is the more accurate one.
``silu_mul``'s reference is the unfused model's two ops on the two halves (bit for bit); the
kernel computes in float32 and rounds where they round (silu(gate), then the product).

Which implementation runs is the executor's ``fused`` option (see ``resolve``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.engine.paged_attention import triton_available, triton_interpreting

# The executor's choices: "off" runs the model's unfused ops (the default until measured on
# a GPU); "torch" the references below through the fused layer structure; "triton" the
# kernels (CUDA, or Triton's CPU interpreter with TRITON_INTERPRET=1).
FUSED_CHOICES = ("off", "torch", "triton")


def resolve(fused: str, device: torch.device) -> str:
    """The implementation an executor's ``fused`` option selects on ``device``. Raises
    ValueError for an unknown option or Triton where it cannot run."""
    if fused not in FUSED_CHOICES:
        raise ValueError(f"fused: {fused!r} is not one of {', '.join(FUSED_CHOICES)}")
    if fused != "triton":
        return fused
    if not triton_available():
        raise ValueError(
            "fused='triton' needs the triton package (pip install -e '.[gpu-kernels]')"
        )
    if device.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"fused='triton' needs a CUDA device, got {device.type!r} (on the CPU Triton only "
            "runs in its interpreter: set TRITON_INTERPRET=1 before starting; fused='torch' "
            "runs the same structure with torch ops)"
        )
    return "triton"


# ---- references -------------------------------------------------------------------------


def rmsnorm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis (float32 statistics; what ``model.RMSNorm`` runs)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rmsnorm_torch(
    residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(residual + delta, rmsnorm of it); without ``delta`` (residual, rmsnorm(residual))."""
    x = residual if delta is None else residual + delta
    return x, rmsnorm_torch(x, weight, eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 cos, sin [T, head_dim / 2] of the angles ``positions[t] * inv_freq[i]``."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos(), freqs.sin()


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [..., 2 * I] holding gate then up (what the unfused
    MLP computes from its two projections)."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def rope_write_torch_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``rope_torch_`` on q and k, then the step's K/V stored at ``slots`` (int64 [T]) of one
    layer's pool tensors ``k_cache`` / ``v_cache`` [num_slots, KVH, D] (``KVPool.write``)."""
    rope_torch_(q, k, cos, sin)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def rope_torch_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, H, D] and k [T, KVH, D] in place: for each head, the halves x1, x2 of
    a row become (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin float32 [T, D / 2]."""
    c, s = cos[:, None, :], sin[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        x32 = x.float()
        x1, x2 = x32[..., :half], x32[..., half:]
        x.copy_(torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1))


# ---- dispatch ---------------------------------------------------------------------------


def _check_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rope_write_: need q [T, H, D] and k [T, KVH, D], got {q.shape}, {k.shape}"
        )
    tokens, dim = q.shape[0], q.shape[2]
    if dim % 2 or cos.shape != (tokens, dim // 2) or sin.shape != cos.shape:
        raise ValueError(f"rope_write_: cos/sin must be [{tokens}, {dim // 2}], got {cos.shape}")


def add_rmsnorm(
    impl: str,
    residual: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_rmsnorm_torch``'s contract with ``impl`` "torch" or "triton" (new tensors; the
    inputs are not modified)."""
    if delta is not None and delta.shape != residual.shape:
        raise ValueError(f"add_rmsnorm: delta {delta.shape} != residual {residual.shape}")
    if weight.shape != residual.shape[-1:]:
        raise ValueError(f"add_rmsnorm: weight {weight.shape} for rows of {residual.shape}")
    if impl == "triton":
        dtypes = {residual.dtype, weight.dtype} | ({delta.dtype} if delta is not None else set())
        if len(dtypes) > 1:  # the kernel writes the activations' dtype
            raise ValueError(f"add_rmsnorm: the Triton kernel needs one dtype, got {dtypes}")
        from worker.engine import fused_triton

        return fused_triton.add_rmsnorm_triton(residual, delta, weight, eps)
    return add_rmsnorm_torch(residual, delta, weight, eps)


def silu_mul(impl: str, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu_mul_torch``'s contract with ``impl`` "torch" or "triton" (a new tensor of
    ``gate_up``'s dtype, [..., I])."""
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul: need [..., 2 * I] (gate then up), got {tuple(gate_up.shape)}")
    if impl == "triton":
        from worker.engine import fused_triton

        return fused_triton.silu_mul_triton(gate_up)
    return silu_mul_torch(gate_up)


def rope_write_(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``rope_write_torch_``'s contract with ``impl`` "torch" or "triton"."""
    _check_rope(q, k, cos, sin)
    if v.shape != k.shape:
        raise ValueError(f"rope_write_: v {tuple(v.shape)} must match k {tuple(k.shape)}")
    if k_cache.dim() != 3 or v_cache.shape != k_cache.shape or k_cache.shape[1:] != k.shape[1:]:
        raise ValueError(
            f"rope_write_: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not hold "
            f"rows of {tuple(k.shape[1:])}"
        )
    if slots.shape != (k.shape[0],):
        raise ValueError(f"rope_write_: need one slot per token, got {tuple(slots.shape)}")
    if impl == "triton":
        from worker.engine import fused_triton

        fused_triton.rope_write_triton_(q, k, v, cos, sin, k_cache, v_cache, slots)
    else:
        rope_write_torch_(q, k, v, cos, sin, k_cache, v_cache, slots)
