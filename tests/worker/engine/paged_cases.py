"""Cases shared by the paged-attention tests: float64 oracles, random inputs, an executor
scenario, and the checks that run one implementation ("torch" or "triton") on a device.

Not a test module itself: tests/worker/engine/test_paged_attention.py runs the checks on the
torch reference in-process; test_paged_attention_triton.py runs them on the Triton kernels
in a subprocess with TRITON_INTERPRET=1 (``python paged_cases.py CASE``), and on CUDA
in-process (gpu-marked).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

from worker.engine import paged_attention as pa
from worker.engine.model import LlamaForCausalLM
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}  # (atol, rtol)


def oracle_decode(q, k_cache, v_cache, table, lens, scale) -> torch.Tensor:
    """Float64, one request and one head at a time."""
    bsz, heads, _ = q.shape
    rep = heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b in range(bsz):
        keys = table[b, : int(lens[b])].cpu()
        k, v = k_cache.cpu()[keys].double(), v_cache.cpu()[keys].double()
        for h in range(heads):
            s = k[:, h // rep] @ q[b, h].cpu().double() * scale
            out[b, h] = torch.softmax(s, 0) @ v[:, h // rep]
    return out


def oracle_prefill(q, k_cache, v_cache, num_new, start_pos, ctx_slots, scale) -> torch.Tensor:
    """Float64, one item and one head at a time, causal on absolute positions."""
    heads = q.shape[1]
    rep = heads // k_cache.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    row = 0
    for n, start, slots in zip(num_new, start_pos, ctx_slots, strict=True):
        keys = torch.as_tensor(slots[: start + n])
        k, v = k_cache.cpu()[keys].double(), v_cache.cpu()[keys].double()
        visible = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
        for h in range(heads):
            s = q[row : row + n, h].cpu().double() @ k[:, h // rep].T * scale
            s = s.masked_fill(~visible, float("-inf"))
            out[row : row + n, h] = torch.softmax(s, 1) @ v[:, h // rep]
        row += n
    return out


@dataclass(frozen=True)
class DecodeCase:
    lens: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_splits: int | None  # None: the kernel's own choice


DECODE_CASES = [
    DecodeCase((1,), 4, 4, 16, torch.float32, 1),  # length 1, no GQA
    DecodeCase((37, 1, 130, 64), 8, 2, 16, torch.float32, 1),  # ragged, GQA 4
    DecodeCase((37, 1, 130, 64), 8, 2, 16, torch.float32, 3),  # split (3rd split may be empty)
    DecodeCase((200, 5), 6, 1, 24, torch.float32, 4),  # MQA, head_dim not a power of two
    DecodeCase((300,), 4, 2, 32, torch.float32, None),
    DecodeCase((1, 77, 129), 8, 2, 16, torch.bfloat16, 1),
    DecodeCase((1, 77, 129), 8, 2, 16, torch.bfloat16, 2),
    DecodeCase((64,), 32, 8, 128, torch.bfloat16, 2),  # Llama-3-8B heads
]


@dataclass(frozen=True)
class PrefillCase:
    num_new: tuple[int, ...]
    start_pos: tuple[int, ...]
    heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_m: int
    num_splits: int | None = None  # None: the kernel's own choice


PREFILL_CASES = [
    PrefillCase((1,), (0,), 4, 4, 16, torch.float32, 16),  # one token, cold
    PrefillCase((5, 1, 40, 17), (0, 9, 3, 60), 8, 2, 16, torch.float32, 16),  # cached prefixes
    PrefillCase((33, 2), (100, 0), 6, 1, 24, torch.float32, 16),  # MQA, odd head_dim
    PrefillCase((70, 3), (0, 20), 4, 2, 32, torch.float32, 64),
    PrefillCase((18, 1, 40), (0, 7, 25), 8, 2, 16, torch.bfloat16, 16),
    # Keys split: a few new tokens after a long cached prefix (its own choice: 3 splits),
    # and forced splits where the last ones hold only keys past some rows' positions, some
    # splits are empty (short items), and rows of several items share the mid buffers.
    PrefillCase((8,), (600,), 4, 2, 16, torch.float32, 16),
    PrefillCase((5, 1, 40, 17), (0, 9, 3, 60), 8, 2, 16, torch.float32, 16, 3),
    PrefillCase((20, 2), (150, 0), 6, 1, 24, torch.float32, 16, 5),
    PrefillCase((18, 1, 40), (130, 7, 25), 8, 2, 16, torch.bfloat16, 16, 4),
]


def _pool(num_slots, kv_heads, head_dim, dtype, device, gen):
    k = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(num_slots, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return k, v


def check_decode(impl: str, device: str) -> None:
    """Each DecodeCase: the implementation against the float64 oracle and against the
    gather + SDPA reference (bf16 within bf16 rounding)."""
    for i, case in enumerate(DECODE_CASES):
        gen = torch.Generator().manual_seed(100 + i)
        num_slots = 2 * sum(case.lens) + 7
        k_cache, v_cache = _pool(num_slots, case.kv_heads, case.head_dim, case.dtype, device, gen)
        max_len = max(case.lens)
        table = torch.empty(len(case.lens), max_len, dtype=torch.int64)
        for b, n in enumerate(case.lens):  # distinct, shuffled slots; padded with row's first
            row = torch.randperm(num_slots, generator=gen)[:n]
            table[b, :n], table[b, n:] = row, row[0]
        table = table.to(device)
        lens = torch.tensor(case.lens, dtype=torch.int32, device=device)
        q = torch.randn(len(case.lens), case.heads, case.head_dim, generator=gen)
        q = q.to(case.dtype).to(device)
        scale = case.head_dim**-0.5
        got = pa.decode(impl, q, k_cache, v_cache, table, lens, scale, num_splits=case.num_splits)
        assert got.shape == q.shape and got.dtype == q.dtype, case
        want = oracle_decode(q, k_cache, v_cache, table, lens, scale)
        atol, rtol = TOL[case.dtype]
        torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol, msg=str(case))
        ref = pa.decode_torch(q, k_cache, v_cache, table, lens, scale)
        torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol, msg=str(case))


def check_prefill(impl: str, device: str) -> None:
    """Each PrefillCase: the packed implementation against the float64 per-item oracle and
    against the torch reference."""
    for i, case in enumerate(PREFILL_CASES):
        gen = torch.Generator().manual_seed(200 + i)
        lens = [s + n for s, n in zip(case.start_pos, case.num_new, strict=True)]
        num_slots = 2 * sum(lens) + 5
        k_cache, v_cache = _pool(num_slots, case.kv_heads, case.head_dim, case.dtype, device, gen)
        ctx = [torch.randperm(num_slots, generator=gen)[:n].numpy() for n in lens]
        plan = pa.plan_prefill(
            case.num_new, case.start_pos, ctx, torch.device(device), block_m=case.block_m
        )
        q = torch.randn(sum(case.num_new), case.heads, case.head_dim, generator=gen)
        q = q.to(case.dtype).to(device)
        scale = case.head_dim**-0.5
        got = pa.prefill(impl, q, k_cache, v_cache, plan, scale, num_splits=case.num_splits)
        assert got.shape == q.shape and got.dtype == q.dtype, case
        want = oracle_prefill(q, k_cache, v_cache, case.num_new, case.start_pos, ctx, scale)
        atol, rtol = TOL[case.dtype]
        torch.testing.assert_close(got.cpu().double(), want, atol=atol, rtol=rtol, msg=str(case))
        ref = pa.prefill_torch(q, k_cache, v_cache, plan, scale)
        torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=rtol, msg=str(case))


# ---- the executor scenario --------------------------------------------------------------

NO_SAMPLE = SamplingParams()


def executor_scenario(model: LlamaForCausalLM, attention: str, **options) -> list[torch.Tensor]:
    """Logits of six steps mixing several cold prefills, a cached prefix shared with another
    request, a chunked prefill, one-token prefills and ragged batched decodes. Tokens are
    drawn from a seeded generator (not sampled), so every backend runs the same steps.
    ``options``: more TorchExecutor.create arguments (static_decode=True: the decode-only
    steps and the lone prefill run the static paths)."""
    ex = TorchExecutor.create(model, 512, attention=attention, **options)
    rng = np.random.default_rng(7)
    free = list(rng.permutation(512))

    def alloc(n: int) -> np.ndarray:
        nonlocal free
        out, free = free[:n], free[n:]
        return np.array(out, dtype=np.int64)

    def toks(n: int) -> np.ndarray:
        return rng.integers(0, model.config.vocab_size, n).astype(np.int64)

    ctx: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # rid -> (tokens, slots)

    def pre(rid: str, tokens: np.ndarray, start: int, slots: np.ndarray, sample=True):
        ctx[rid] = (tokens, slots)
        return ForwardItem(rid, tokens[start:], start, slots, NO_SAMPLE, sample)

    def dec(rid: str) -> ForwardItem:
        tokens, slots = ctx[rid]
        tokens, slots = np.concatenate([tokens, toks(1)]), np.concatenate([slots, alloc(1)])
        ctx[rid] = (tokens, slots)
        return ForwardItem(rid, tokens[-1:], len(tokens) - 1, slots, NO_SAMPLE)

    out = []
    a, b = toks(20), toks(7)
    out.append(ex.forward_logits([pre("a", a, 0, alloc(20)), pre("b", b, 0, alloc(7))], []))
    c = np.concatenate([a[:12], toks(9)])  # 12 tokens cached from a
    c_slots = np.concatenate([ctx["a"][1][:12], alloc(9)])
    d = toks(35)
    d_slots = alloc(35)
    step = [pre("c", c, 12, c_slots), pre("d", d[:5], 0, d_slots[:5], sample=False)]
    out.append(ex.forward_logits(step, [dec("a"), dec("b")]))
    e = toks(1)
    step = [pre("d", d, 5, d_slots), pre("e", e, 0, alloc(1))]
    out.append(ex.forward_logits(step, [dec("a"), dec("b"), dec("c")]))
    for _ in range(3):
        out.append(ex.forward_logits([], [dec(r) for r in "abcde"]))
    # One request alone, then one long prefill alone (a single item of each kind).
    out.append(ex.forward_logits([], [dec("e")]))
    f = np.concatenate([d, toks(70)])
    out.append(ex.forward_logits([pre("f", f, 35, np.concatenate([d_slots, alloc(70)]))], []))
    return out


def check_executor(attention: str, model: LlamaForCausalLM, atol: float = 1e-5, **options) -> None:
    """The scenario's logits with ``attention`` (and executor ``options``) equal the gather
    path's."""
    want = executor_scenario(model, "gather")
    got = executor_scenario(model, attention, **options)
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=f"step {step}")


# ---- ahead-of-time compilation for a GPU (no GPU needed) --------------------------------


def _compile_sm90(fn, types: dict[str, str], consts: dict) -> str:
    """Compile a kernel for sm_90 (Hopper) with this triton, without a GPU; its PTX."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {n: "constexpr" if n in consts else types[n] for n in fn.arg_names}
    try:  # triton >= 3.2 keys constexprs by argument path; older by name
        by_path = {(fn.arg_names.index(n),): v for n, v in consts.items()}
        src = ASTSource(fn=fn, signature=sig, constexprs=by_path)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except (TypeError, KeyError, AttributeError):
        src = ASTSource(fn=fn, signature=sig, constexprs=consts)
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm.get("cubin"), "no cubin: ptxas did not run"
    return kernel.asm["ptx"]


def check_compiles_for_sm90() -> None:
    """The kernels build for an H100/H200 (Llama-3-8B head shapes): what the interpreter
    cannot show (compiled-mode typing, layouts, ptxas). bf16 dots must be tensor-core MMAs."""
    from worker.engine import paged_attention_triton as kernels

    strides = ["stride_ks", "stride_kh", "stride_vs", "stride_vh", "stride_tb"]
    for splits in (1, 4):
        mid = "*fp32" if splits > 1 else "*bf16"
        types = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], "*bf16")
        types |= {"table_ptr": "*i64", "lens_ptr": "*i32", "mid_o_ptr": mid, "mid_lse_ptr": mid}
        types |= {"scale": "fp32"} | dict.fromkeys(
            ["stride_qb", "stride_qh", "stride_ob", "stride_oh", *strides], "i32"
        )
        consts = dict(REP=4, HEAD_DIM=128, NUM_SPLITS=splits, BLOCK_H=16, BLOCK_N=64)
        ptx = _compile_sm90(kernels._decode_kernel, types, consts | dict(BLOCK_D=128, F32=False))
        assert "mma" in ptx, "the bf16 decode kernel does not use tensor cores"
    types = {"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "out_ptr": "*bf16"}
    types |= {"stride_ob": "i32", "stride_oh": "i32"}
    consts = dict(NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128)
    _compile_sm90(kernels._combine_kernel, types, consts)
    for dtype, f32 in (("bf16", False), ("fp32", True)):
        types = dict.fromkeys(["q_ptr", "k_ptr", "v_ptr", "out_ptr"], "*" + dtype)
        types |= dict.fromkeys(["cu_q_ptr", "start_ptr", "block_item_ptr", "block_row_ptr"], "*i32")
        types |= {"table_ptr": "*i64", "scale": "fp32"} | dict.fromkeys(
            ["stride_qt", "stride_qh", "stride_ot", "stride_oh", *strides], "i32"
        )
        for splits in (1, 4):
            mid = "*fp32" if splits > 1 else "*" + dtype
            consts = dict(REP=4, HEAD_DIM=128, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, F32=f32)
            consts |= dict(NUM_SPLITS=splits)
            typed = types | {"mid_o_ptr": mid, "mid_lse_ptr": mid}
            ptx = _compile_sm90(kernels._prefill_kernel, typed, consts)
            assert f32 or "mma" in ptx, "the bf16 prefill kernel does not use tensor cores"


def main(argv: list[str]) -> int:
    """``python paged_cases.py decode|prefill|executor|compile-sm90 [device]``: the Triton
    checks (the first three need TRITON_INTERPRET=1 on the CPU, the last must not have it)."""
    from worker.engine.model import build_tiny_model

    case, device = argv[0], argv[1] if len(argv) > 1 else "cpu"
    if case == "decode":
        check_decode("triton", device)
    elif case == "prefill":
        check_prefill("triton", device)
    elif case == "executor":
        model = build_tiny_model(0, device=device)
        check_executor("paged-triton", model)
        # the static paths over the Triton kernels: padded decode rows, and the lone
        # 70-token prefill padded to its 128-row bucket (the kernel reads the true count)
        check_executor("paged-triton", model, static_decode=True)
    elif case == "compile-sm90":
        check_compiles_for_sm90()
    else:
        raise SystemExit(f"unknown case {case!r}")
    print(f"ok {case}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
