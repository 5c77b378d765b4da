"""Cases shared by the fused-ops tests: float64 oracles, odd shapes, the executor scenario
with ``fused=...``, and the checks that run one implementation ("torch" or "triton").

Not a test module itself: tests/worker/engine/test_fused_ops.py runs the checks on the torch
references in-process, on the Triton kernels in a subprocess with TRITON_INTERPRET=1
(``python fused_cases.py CASE``), and on CUDA in-process (gpu-marked).

Tolerances (kernel against the torch reference, same dtype in and out):
* float32: atol = rtol = 1e-6 on the CPU (measured: at most 1 ulp, ~7e-7, from the order of
  the mean's additions and rsqrt's last bit); 1e-5 on CUDA (fused multiply-adds, the GPU's
  approximate rsqrt). The new residual (x + h) must be bit-identical.
* bfloat16: within one bfloat16 ulp (rtol = 2**-7), and at least MIN_IDENTICAL of the elements
  bit-identical (a cast that truncated instead of rounding to nearest even differs in about
  half of them; the interpreter measured 100 % identical).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from unittest import mock

import torch

from worker.engine import fused_ops
from worker.engine.model import LlamaForCausalLM
from worker.engine.torch_executor import TorchExecutor

FP32_TOL = {"cpu": 1e-6, "cuda": 1e-5}
BF16_RTOL = 2.0**-7
MIN_IDENTICAL = {"cpu": 0.99, "cuda": 0.97}


def oracle_add_rmsnorm(x, h, w, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (new residual, normed row x weight), without the intermediate roundings."""
    r = x.double() if h is None else x.double() + h.double()
    y = r / torch.sqrt(r.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return r, y


def oracle_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """float64 rotation written as a complex product: the pair (x[i], x[i + D/2]) times
    exp(i * angle[i]), the angle position * inv_freq[i] as float32 computes it (as the model
    does; at positions in the thousands that product's rounding is ~1e-4 rad)."""
    half = x.shape[-1] // 2
    angle = (positions.float()[:, None, None] * inv_freq.float()[None, None, :]).double()
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * torch.exp(1j * angle)
    return torch.cat((z.real, z.imag), dim=-1)


@dataclass(frozen=True)
class NormCase:
    rows: int
    hidden: int


# One row; non-power-of-two hidden sizes; several programs' worth of rows; Llama-3-8B's hidden.
NORM_CASES = [NormCase(1, 64), NormCase(37, 100), NormCase(130, 48), NormCase(5, 4096)]


@dataclass(frozen=True)
class RopeCase:
    tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    fused_qkv: bool  # q and k are views of one [T, (H + 2 KVH) * D] projection (strided rows)


ROPE_CASES = [
    RopeCase(1, 4, 2, 16, False),  # one token (a decode step of one)
    RopeCase(29, 6, 1, 24, False),  # MQA; half of head_dim (12) not a power of two
    RopeCase(7, 3, 3, 10, True),  # no GQA, half = 5, strided token rows
    RopeCase(3, 32, 8, 128, True),  # Llama-3-8B heads
]


def assert_close_as(got: torch.Tensor, want: torch.Tensor, device: str, what: str) -> None:
    """``got`` equals the reference ``want`` (same dtype) within the module's tolerances."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    got, want = got.cpu(), want.cpu()
    if want.dtype == torch.float32:
        tol = FP32_TOL[device]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=what)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=BF16_RTOL, msg=what)
    identical = (got == want).float().mean().item()
    assert identical >= MIN_IDENTICAL[device], f"{what}: only {identical:.1%} bit-identical"


def check_add_rmsnorm(impl: str, device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Each NormCase, with and without the residual add: the implementation against the
    float64 oracle (loosely: the reference rounds on purpose) and the torch reference."""
    eps = 1e-5
    for dtype in dtypes:
        for i, case in enumerate(NORM_CASES):
            gen = torch.Generator().manual_seed(300 + i)
            shape = (case.rows, case.hidden)
            x = (2 * torch.randn(shape, generator=gen)).to(dtype).to(device)
            h = torch.randn(shape, generator=gen).to(dtype).to(device)
            w = (1 + 0.1 * torch.randn(case.hidden, generator=gen)).to(dtype).to(device)
            x0, h0 = x.clone(), h.clone()
            for delta in (h, None):
                what = f"{case} {dtype} add={delta is not None}"
                res, y = fused_ops.add_rmsnorm(impl, x, delta, w, eps)
                ref_res, ref_y = fused_ops.add_rmsnorm_torch(x, delta, w, eps)
                assert torch.equal(res, ref_res), what  # x + h: one rounding, same in both
                assert_close_as(y, ref_y, device, what)
                want_res, want_y = oracle_add_rmsnorm(x, delta, w, eps)
                loose = 1e-5 if dtype == torch.float32 else 3e-2
                torch.testing.assert_close(
                    y.cpu().double(), want_y.cpu(), atol=loose, rtol=loose, msg=what
                )
                torch.testing.assert_close(
                    res.cpu().double(), want_res.cpu(), atol=loose, rtol=loose, msg=what
                )
            assert torch.equal(x, x0) and torch.equal(h, h0), "add_rmsnorm modified its inputs"


def check_rope(impl: str, device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Each RopeCase: q and k rotated in place (``rope_write_``) against the float64
    complex-product oracle and the torch reference; v, read for the cache, is not written."""
    for dtype in dtypes:
        for i, case in enumerate(ROPE_CASES):
            gen = torch.Generator().manual_seed(400 + i)
            t, hq, hk, d = case.tokens, case.heads, case.kv_heads, case.head_dim
            width = (hq + 2 * hk) * d
            qkv = torch.randn(t, width, generator=gen).to(dtype).to(device)
            if case.fused_qkv:
                q = qkv[:, : hq * d].view(t, hq, d)
                k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            else:
                q = qkv[:, : hq * d].clone().view(t, hq, d)
                k = qkv[:, hq * d : (hq + hk) * d].clone().view(t, hk, d)
            positions = torch.randint(0, 8192, (t,), generator=gen).to(device)
            inv_freq = 1.0 / (500_000.0 ** (torch.arange(0, d, 2).float() / d))
            cos, sin = fused_ops.rope_tables(positions, inv_freq)
            ref_q, ref_k = q.clone(), k.clone()
            fused_ops.rope_torch_(ref_q, ref_k, cos, sin)
            want_q = oracle_rope(q.cpu(), positions.cpu(), inv_freq)
            want_k = oracle_rope(k.cpu(), positions.cpu(), inv_freq)
            v_before = qkv[:, (hq + hk) * d :].clone()
            v = qkv[:, (hq + hk) * d :].view(t, hk, d)
            caches = torch.zeros(2, t, hk, d, dtype=dtype, device=device)
            slots = torch.arange(t, device=device)
            fused_ops.rope_write_(impl, q, k, v, cos, sin, caches[0], caches[1], slots)
            what = f"{case} {dtype}"
            assert_close_as(q, ref_q, device, what + " q")
            assert_close_as(k, ref_k, device, what + " k")
            loose = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(q.cpu().double(), want_q, atol=loose, rtol=loose, msg=what)
            torch.testing.assert_close(k.cpu().double(), want_k, atol=loose, rtol=loose, msg=what)
            assert torch.equal(qkv[:, (hq + hk) * d :], v_before), "rope_write_ wrote into v"


def check_rope_write(impl: str, device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Each RopeCase: q and k rotated in place as ``rope_`` rotates them, and the rotated k
    and the v rows stored at their token's slot of the caches (shuffled slots); every other
    cache row keeps its value."""
    for dtype in dtypes:
        for i, case in enumerate(ROPE_CASES):
            gen = torch.Generator().manual_seed(450 + i)
            t, hq, hk, d = case.tokens, case.heads, case.kv_heads, case.head_dim
            qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(dtype).to(device)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
            v = qkv[:, (hq + hk) * d :].view(t, hk, d)
            if not case.fused_qkv:
                q, k, v = q.clone(), k.clone(), v.clone()
            num_slots = 2 * t + 3
            k_cache = torch.randn(num_slots, hk, d, generator=gen).to(dtype).to(device)
            v_cache = torch.randn(num_slots, hk, d, generator=gen).to(dtype).to(device)
            slots = torch.randperm(num_slots, generator=gen)[:t].to(device)
            positions = torch.randint(0, 8192, (t,), generator=gen).to(device)
            inv_freq = 1.0 / (500_000.0 ** (torch.arange(0, d, 2).float() / d))
            cos, sin = fused_ops.rope_tables(positions, inv_freq)
            refs = [x.clone() for x in (q, k, v, k_cache, v_cache)]
            fused_ops.rope_write_torch_(*refs[:3], cos, sin, *refs[3:], slots)
            fused_ops.rope_write_(impl, q, k, v, cos, sin, k_cache, v_cache, slots)
            what = f"rope_write {case} {dtype}"
            for name, got, want in zip(
                ("q", "k", "v", "k_cache", "v_cache"),
                (q, k, v, k_cache, v_cache),
                refs,
                strict=True,
            ):
                assert_close_as(got, want, device, f"{what} {name}")
            assert torch.equal(k_cache[slots], k) and torch.equal(v_cache[slots], v), what
            others = torch.ones(num_slots, dtype=torch.bool)
            others[slots.cpu()] = False
            assert torch.equal(k_cache.cpu()[others], refs[3].cpu()[others]), what


# Rows x I: one row (a decode step of one); I not a power of two and not a multiple of the
# kernel's block; several blocks per row (Llama-3-8B's intermediate size).
SILU_MUL_CASES = [(1, 64), (19, 100), (3, 1500), (2, 14336)]


def check_silu_mul(impl: str, device: str, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """Each case: silu(gate) * up from one [T, 2 * I] tensor against the torch reference (the
    unfused MLP's two ops) and a float64 oracle; the input is not modified."""
    for dtype in dtypes:
        for i, (rows, inner) in enumerate(SILU_MUL_CASES):
            gen = torch.Generator().manual_seed(500 + i)
            gate_up = (3 * torch.randn(rows, 2 * inner, generator=gen)).to(dtype).to(device)
            before = gate_up.clone()
            got = fused_ops.silu_mul(impl, gate_up)
            what = f"silu_mul {rows}x{inner} {dtype}"
            assert_close_as(got, fused_ops.silu_mul_torch(gate_up), device, what)
            g, u = gate_up.cpu().double().chunk(2, dim=-1)
            loose = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(
                got.cpu().double(), g * torch.sigmoid(g) * u, atol=loose, rtol=loose, msg=what
            )
            assert torch.equal(gate_up, before), f"{what}: the input was modified"


# ---- the tiny model through the executor ------------------------------------------------


def scenario(model: LlamaForCausalLM, attention: str, **options) -> list[torch.Tensor]:
    """paged_cases.executor_scenario (six steps: cold and cached prefills, a chunked one,
    ragged decode batches) with executor ``options`` such as ``fused`` / ``static_decode``."""
    import paged_cases

    create = TorchExecutor.create

    def create_with(model, num_slots, **kwargs):
        return create(model, num_slots, **kwargs, **options)

    with mock.patch.object(TorchExecutor, "create", create_with):
        return paged_cases.executor_scenario(model, attention)


def check_model(impl: str, model: LlamaForCausalLM, atol: float) -> None:
    """The scenario's logits with ``fused=impl`` equal the unfused model's, with gather
    attention and with the static-shape decode path over paged attention."""
    want = scenario(model, "gather")
    runs = {
        "gather": scenario(model, "gather", fused=impl),
        "paged-torch static": scenario(model, "paged-torch", fused=impl, static_decode=True),
    }
    for name, got in runs.items():
        assert len(got) == len(want)
        for step, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=f"{name} step {step}")


# ---- ahead-of-time compilation for a GPU (no GPU needed) --------------------------------


def check_compiles_for_sm90() -> None:
    """The kernels build for an H100/H200 at Llama-3-8B shapes in bf16 (and the add-norm in
    float32): what the interpreter cannot show (compiled-mode typing, layouts, ptxas)."""
    import paged_cases

    from worker.engine import fused_triton as kernels

    ptrs = ["x_ptr", "h_ptr", "w_ptr", "res_ptr", "y_ptr"]
    strides = ["stride_x", "stride_h", "stride_res", "stride_y"]
    for dtype in ("bf16", "fp32"):
        for has_delta in (True, False):
            types = dict.fromkeys(ptrs, "*" + dtype) | {"n_rows": "i32", "eps": "fp32"}
            types |= dict.fromkeys(strides, "i32")
            consts = dict(N=4096, HAS_DELTA=has_delta, BLOCK_R=1, BLOCK_N=4096, RNE=False)
            paged_cases._compile_sm90(kernels._add_rmsnorm_kernel, types, consts)
    types = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "kc_ptr", "vc_ptr"], "*bf16")
    types |= {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64"}
    types |= dict.fromkeys(
        ["n_q_rows", "n_k_rows", "stride_qt", "stride_qh", "stride_kt", "stride_kh"], "i32"
    )
    types |= dict.fromkeys(
        ["stride_vt", "stride_vh", "stride_c", "stride_kcs", "stride_kch", "stride_vcs"], "i32"
    )
    types |= {"stride_vch": "i32"}
    consts = dict(Q_HEADS=32, K_HEADS=8, HALF=64, BLOCK_R=64, BLOCK_HALF=64, RNE=False)
    paged_cases._compile_sm90(kernels._rope_write_kernel, types, consts)
    types = {"x_ptr": "*bf16", "out_ptr": "*bf16", "n_cols": "i32", "stride_x": "i32"}
    types |= {"stride_o": "i32"}
    consts = dict(BLOCK=kernels.SILU_MUL_BLOCK, RNE=False)
    paged_cases._compile_sm90(kernels._silu_mul_kernel, types, consts)


def main(argv: list[str]) -> int:
    """``python fused_cases.py interpret|compile-sm90``: the Triton checks (the first needs
    TRITON_INTERPRET=1, the second must not have it)."""
    from worker.engine.model import build_tiny_model

    case = argv[0]
    if case == "interpret":
        check_add_rmsnorm("triton", "cpu")
        check_rope("triton", "cpu")
        check_silu_mul("triton", "cpu")
        check_rope_write("triton", "cpu")
        check_model("triton", build_tiny_model(0), atol=1e-5)
    elif case == "compile-sm90":
        check_compiles_for_sm90()
    else:
        raise SystemExit(f"unknown case {case!r}")
    print(f"ok {case}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
