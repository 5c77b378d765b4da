"""The static-shape decode path (``decode_graph``, ``TorchExecutor(static_decode=True)``):
padded batch and context buckets over preallocated buffers, which CUDA captures as graphs.

On the CPU the same path runs eagerly and is compared with the regular paged decode path:
greedy tokens identical, logits equal within ATOL (not bit-exact: the padded slot table is
wider than the step's longest context and the padded batch taller than the step, so SDPA's
masked reduction and the GEMMs run with other blockings; measured differences are ~1e-6),
and the K/V written to the pool equal within the same tolerance. Padding rows write only the
pool's scratch slot (checked byte for byte on the pool). The gpu-marked tests capture and
replay on CUDA (``python -m pytest -m gpu``; bench/gpu_session.sh runs them).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from stand_in_graphs import StandInCapturer

from worker.engine.decode_graph import DecodeGraphRunner, bucket_of, context_buckets
from worker.engine.engine import Engine, EngineConfig
from worker.engine.factory import build_executor, build_tiny_default
from worker.engine.kv_pool import KVPool, KVPoolConfig
from worker.engine.model import LlamaForCausalLM, build_tiny_model, tiny_config
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import EngineRequest, ForwardItem, SamplingParams

NUM_SLOTS = 2048
ATOL = 1e-5
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_default(seed=0)


def with_stand_in_graphs(ex: TorchExecutor) -> StandInCapturer:
    """Swap ``ex``'s eager static path for a captured one that replays stand-in graphs."""
    capturer = StandInCapturer()
    ex.decode_graphs = DecodeGraphRunner(
        ex.model, ex.kv_pool, ex.device, ex.attention_impl, capture=True, capturer=capturer
    )
    return capturer


def test_buckets() -> None:
    assert context_buckets(4096) == (256, 512, 1024, 2048, 4096)
    assert context_buckets(3000, 1024) == (1024, 2048, 3000)
    assert context_buckets(100, 256) == (100,)
    assert [bucket_of(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    with pytest.raises(ValueError, match="context_buckets"):
        context_buckets(0)


# ---- a scripted run: requests join, decode together, leave -------------------------------


@dataclass
class Req:
    rid: str
    slots: np.ndarray
    budget: int  # tokens to generate before leaving
    tokens: list[int] = field(default_factory=list)


# step -> prompt lengths of the requests that join before that step's decode. Batch sizes
# run 1, 2, 3 (bucket 4), up to 11 (bucket 16) and back down; the 250-token prompt's context
# crosses from the 256-wide table bucket into the 512 one.
JOINS = {0: [250], 1: [3], 3: [40, 1, 7], 5: [5, 6, 7, 8, 9, 10], 9: [13], 14: [20, 2]}
BUDGETS = [14, 4, 6, 12, 3, 5, 8, 2, 9, 4, 6, 7, 3, 5, 4]


def drive(executors: list[TorchExecutor], *, seed: int = 0, atol: float = ATOL) -> list[int]:
    """Run the script on every executor in lockstep (same slots, their own pools): every
    prefill token equal, every decode step's greedy tokens equal and logits within ``atol``.
    Freed slots go back to the free list, so later requests reuse them. Returns the batch
    size of each decode step."""
    rng = np.random.default_rng(seed)
    num_slots = executors[0].num_kv_slots
    free = [int(s) for s in rng.permutation(num_slots)]

    def alloc(n: int) -> np.ndarray:
        out = np.array(free[:n], dtype=np.int64)
        del free[:n]
        return out

    budgets = iter(BUDGETS)
    active: list[Req] = []
    batch_sizes: list[int] = []
    joined = 0
    for step in range(40):
        for length in JOINS.get(step, []):
            prompt = rng.integers(0, 256, length).astype(np.int64)
            req = Req(f"r{joined}", alloc(length), next(budgets))
            joined += 1
            item = ForwardItem(req.rid, prompt, 0, req.slots, GREEDY)
            firsts = {ex.forward([item], [])[0] for ex in executors}
            assert len(firsts) == 1, f"prefill of {req.rid} differs: {firsts}"
            req.tokens.append(firsts.pop())
            active.append(req)
        if not active:
            break
        items = []
        for req in active:
            req.slots = np.concatenate([req.slots, alloc(1)])
            ctx = len(req.slots)
            items.append(
                ForwardItem(req.rid, np.array([req.tokens[-1]]), ctx - 1, req.slots, GREEDY)
            )
        logits = [ex.forward_logits([], items) for ex in executors]
        for other in logits[1:]:
            torch.testing.assert_close(other, logits[0], atol=atol, rtol=0)
            assert torch.equal(other.argmax(-1), logits[0].argmax(-1))
        batch_sizes.append(len(items))
        for req, token in zip(active, logits[0].argmax(-1).tolist(), strict=True):
            req.tokens.append(int(token))
        for req in [r for r in active if len(r.tokens) >= r.budget]:
            active.remove(req)
            free.extend(int(s) for s in req.slots)
    assert not active, "the script should finish every request"
    return batch_sizes


def pools_close(a: KVPool, b: KVPool, atol: float = ATOL) -> None:
    """Equal K/V at every real slot (a scratch row is not compared)."""
    n = a.num_slots
    for layer in range(a.config.num_layers):
        torch.testing.assert_close(a.k[layer][:n], b.k[layer][:n], atol=atol, rtol=0)
        torch.testing.assert_close(a.v[layer][:n], b.v[layer][:n], atol=atol, rtol=0)


def test_static_decode_equals_regular_over_a_changing_batch(model):
    regular = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch")
    static = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    # Buckets of at most 4 rows: the larger decode steps fall back to the regular path.
    small = TorchExecutor(
        model,
        KVPool(static.kv_pool.config),
        "cpu",
        attention="paged-torch",
        static_decode=True,
        graph_batch_buckets=(1, 4),
    )
    gather = TorchExecutor.create(model, NUM_SLOTS)  # the original path, for good measure
    sizes = drive([regular, static, small, gather])

    assert regular.decode_graphs is None and gather.decode_graphs is None
    runner = static.decode_graphs
    assert runner is not None and not runner.capture and runner.num_graphs == 0
    assert max(sizes) > 8 and {1, 2, 3} <= set(sizes)  # buckets 1, 2, 4, 8 and 16
    # Every decode step ran the static path, in the bucket its size and context pick.
    assert sum(b.steps for b in runner.buckets.values()) == len(sizes)
    assert {b for b, _ in runner.buckets} == {bucket_of(n, runner.batch_buckets) for n in sizes}
    assert {w for _, w in runner.buckets} == {256, 512}
    small_runner = small.decode_graphs
    assert small_runner is not None
    assert sum(b.steps for b in small_runner.buckets.values()) == sum(n <= 4 for n in sizes)
    assert {b for b, _ in small_runner.buckets} == {1, 4}
    for ex in (static, small, gather):
        pools_close(ex.kv_pool, regular.kv_pool)


def test_captured_path_with_stand_in_graphs(model):
    """The capture / replay control flow (capture with padding rows on a bucket's first
    step, then load the step's inputs, then replay) over the same script."""
    regular = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch")
    graphs = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    capturer = with_stand_in_graphs(graphs)
    sizes = drive([regular, graphs])
    runner = graphs.decode_graphs
    assert runner is not None and runner.capture
    assert capturer.captures == runner.num_graphs == len(runner.buckets) == 7
    assert capturer.replays == len(sizes)
    pools_close(graphs.kv_pool, regular.kv_pool)


def snapshot(pool: KVPool) -> list[torch.Tensor]:
    return [t.clone() for t in (*pool.k, *pool.v)]


def changed_rows(before: list[torch.Tensor], pool: KVPool) -> set[int]:
    """Pool rows (slots) whose bytes differ in any layer's K or V."""
    rows: set[int] = set()
    for old, new in zip(before, (*pool.k, *pool.v), strict=True):
        diff = (old != new).flatten(1).any(1)
        rows.update(int(i) for i in torch.nonzero(diff).flatten())
    return rows


@pytest.mark.parametrize("captured", [False, True])
def test_padding_rows_write_only_the_scratch_slot(model, captured):
    """In the 4-row bucket: three requests (one padding row) write their three write slots
    and the scratch slot only. Then four fill the bucket, the fourth leaves and its slots go
    to someone else (a sentinel written into them): the next step, three rows again, must
    not write through the departed request's stale row -- its slots keep the sentinel."""
    ex = TorchExecutor.create(model, 256, attention="paged-torch", static_decode=True)
    if captured:
        with_stand_in_graphs(ex)
    scratch = ex.kv_pool.scratch_slot
    assert scratch == 256 and ex.kv_pool.k[0].shape[0] == 257
    rng = np.random.default_rng(3)
    slots = [rng.permutation(np.arange(i * 60, i * 60 + 60)) for i in range(4)]
    lens = [10, 31, 4, 17]
    tokens = []
    for i, n in enumerate(lens):
        prompt = rng.integers(0, 256, n)
        tokens.append(ex.forward([ForwardItem(f"r{i}", prompt, 0, slots[i][:n], GREEDY)], [])[0])

    def step(rows: list[int]) -> set[int]:
        """One decode step of ``rows``; the pool rows it changed."""
        before = snapshot(ex.kv_pool)
        items = [
            ForwardItem(f"r{i}", np.array([tokens[i]]), lens[i], slots[i][: lens[i] + 1], GREEDY)
            for i in rows
        ]
        out = ex.forward([], items)
        for i, token in zip(rows, out, strict=True):
            tokens[i] = token
            lens[i] += 1
        return changed_rows(before, ex.kv_pool)

    assert step([0, 1, 2]) == {int(slots[0][10]), int(slots[1][31]), int(slots[2][4]), scratch}
    assert step([0, 1, 2, 3]) == {int(slots[i][lens[i] - 1]) for i in range(4)}
    # r3 leaves; its slots (the one it wrote last included) now belong to another request.
    with torch.inference_mode():
        for t in (*ex.kv_pool.k, *ex.kv_pool.v):
            t[torch.from_numpy(slots[3])] = 7.0
    changed = step([0, 1, 2])
    # (padding rows write the same K/V into the scratch slot each time: it may not change)
    assert changed - {scratch} == {int(slots[i][lens[i] - 1]) for i in range(3)}
    for t in (*ex.kv_pool.k, *ex.kv_pool.v):
        assert bool((t[torch.from_numpy(slots[3])] == 7.0).all())
    runner = ex.decode_graphs
    assert runner is not None and {k: b.steps for k, b in runner.buckets.items()} == {(4, 256): 3}


def test_engine_tokens_equal_with_static_decode(model):
    """Through the Engine (continuous batching: requests admitted while others decode, and
    finishing at different lengths): the same tokens with the static path as without."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 256, n) for n in (30, 7, 64, 12, 3, 45)]
    budgets = [9, 3, 12, 5, 7, 2]

    def generate(**kwargs) -> tuple[dict[str, list[int]], TorchExecutor]:
        executor = TorchExecutor.create(model, 1024, **kwargs)
        engine = Engine(
            EngineConfig(num_kv_slots=1024), executor, clock=itertools.count(1).__next__
        )
        tokens: dict[str, list[int]] = {}
        for step in range(200):
            if step < len(prompts):  # one new request per step
                sampling = SamplingParams(max_new_tokens=budgets[step], ignore_eos=True)
                engine.add_request(EngineRequest(f"q{step}", prompts[step], sampling))
            elif not engine.has_work():
                break
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens, executor

    reference, _ = generate(attention="paged-torch")
    static, executor = generate(attention="paged-torch", static_decode=True)
    assert static == reference
    assert [len(static[f"q{i}"]) for i in range(len(prompts))] == budgets
    runner = executor.decode_graphs
    assert runner is not None and sum(b.steps for b in runner.buckets.values()) > 0
    # cuda_graphs from the factory defaults attention to paged, so it never meets gather.
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        build_executor("torch", num_kv_slots=64, device="cpu", cuda_graphs=True)


def test_seeded_sampling_equal_with_static_decode(model):
    sampled = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=99)
    results = []
    for static in (False, True):
        ex = TorchExecutor.create(model, 256, attention="paged-torch", static_decode=static)
        prompt = np.random.default_rng(8).integers(0, 256, 12)
        slots = np.arange(40)
        tokens = ex.forward([ForwardItem("s", prompt, 0, slots[:12], sampled)], [])
        for n in range(12, 20):
            item = ForwardItem("s", np.array(tokens[-1:]), n, slots[: n + 1], sampled, True, n - 11)
            tokens += ex.forward([], [item])
        results.append(tokens)
    assert results[0] == results[1]


def test_static_decode_rejects_what_the_regular_path_rejects(model):
    ex = TorchExecutor.create(model, 64, attention="paged-torch", static_decode=True)
    with pytest.raises(ValueError, match="a decode item has 1"):
        ex.forward([], [ForwardItem("d", np.array([1, 2]), 0, np.arange(2), GREEDY)])
    with pytest.raises(ValueError, match="out of range"):
        ex.forward([], [ForwardItem("d", np.array([1]), 0, np.array([64]), GREEDY)])
    a = ForwardItem("a", np.array([1]), 1, np.array([3, 4]), GREEDY)
    b = ForwardItem("b", np.array([1]), 0, np.array([4]), GREEDY)
    with pytest.raises(ValueError, match="same KV slot"):
        ex.forward([], [a, b])


def test_static_decode_setup_errors(model):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got 'cpu'"):
        TorchExecutor.create(model, 64, attention="paged-torch", cuda_graphs=True)
    with pytest.raises(ValueError, match="not 'gather'"):
        TorchExecutor.create(model, 64, static_decode=True)
    cfg = model.config
    plain = KVPool(
        KVPoolConfig(
            num_slots=64,
            num_layers=cfg.num_hidden_layers,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
        )
    )
    assert plain.scratch_slot is None and plain.k[0].shape[0] == 64
    with pytest.raises(ValueError, match="scratch slot"):
        TorchExecutor(model, plain, "cpu", attention="paged-torch", static_decode=True)
    scratch_pool = KVPool(dataclasses.replace(plain.config, scratch_slot=True))
    assert scratch_pool.scratch_slot == 64 and scratch_pool.k[0].shape[0] == 65
    with pytest.raises(ValueError, match="batch_buckets"):
        DecodeGraphRunner(
            model, scratch_pool, torch.device("cpu"), "torch", capture=False, batch_buckets=()
        )


def test_worker_cli_cuda_graphs_flag():
    from worker.cli import build_parser, build_server

    args = build_parser().parse_args(["--executor", "torch", "--device", "cpu", "--cuda-graphs"])
    assert args.cuda_graphs is True
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device, got 'cpu'"):
        build_server(args)
    assert build_parser().parse_args([]).cuda_graphs is None  # by device
    no = build_parser().parse_args(["--executor", "torch", "--no-cuda-graphs"])
    assert no.cuda_graphs is False
    bad = build_parser().parse_args(["--executor", "sim", "--no-cuda-graphs"])
    with pytest.raises(ValueError, match="--cuda-graphs applies to --executor torch only"):
        build_server(bad)


def test_factory_defaults_by_device(monkeypatch: pytest.MonkeyPatch):
    """The torch executor's speed options default by device: on the CPU gather, eager,
    unfused; on CUDA with triton paged + CUDA graphs + fused Triton kernels (checked on a
    GPU by test_factory_defaults_on_cuda); an explicit choice always wins."""
    cpu, _ = build_executor("torch", num_kv_slots=32, device="cpu")
    assert (cpu.attention, cpu.cuda_graphs, cpu.fused_impl) == ("gather", False, "off")
    paged, _ = build_executor("torch", num_kv_slots=32, device="cpu", attention="paged")
    assert (paged.attention, paged.cuda_graphs, paged.fused_impl) == ("paged", False, "off")
    # what a CUDA machine picks, up to the executor (which needs the device itself)
    from worker.engine import factory

    seen = {}

    def fake_build(model_dir, num_kv_slots, dev, seed, fraction, attention, graphs, fused):
        seen.update(dev=dev, attention=attention, graphs=graphs, fused=fused)
        return None, None

    monkeypatch.setattr(factory, "_build_torch", fake_build)
    monkeypatch.setattr(factory, "default_device", lambda: "cuda")
    monkeypatch.setattr("worker.engine.paged_attention.triton_available", lambda: True)
    build_executor("torch", num_kv_slots=32)
    assert seen == dict(dev="cuda", attention="paged", graphs=True, fused="triton")
    build_executor("torch", num_kv_slots=32, attention="gather")
    assert (seen["attention"], seen["graphs"], seen["fused"]) == ("gather", False, "triton")
    build_executor("torch", num_kv_slots=32, cuda_graphs=False, fused="off")
    assert (seen["attention"], seen["graphs"], seen["fused"]) == ("paged", False, "off")
    monkeypatch.setattr("worker.engine.paged_attention.triton_available", lambda: False)
    build_executor("torch", num_kv_slots=32)  # CUDA without triton: the plain path
    assert seen == dict(dev="cuda", attention="gather", graphs=False, fused="off")


# ---- on CUDA -----------------------------------------------------------------------------


def _cuda_model(dtype: torch.dtype) -> LlamaForCausalLM:
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    cfg = dataclasses.replace(tiny_config(vocab_size=512), dtype=dtype)
    return build_tiny_model(0, device="cuda", config=cfg)


@pytest.mark.gpu
def test_cuda_graph_replay_equals_eager_on_cuda():
    """Captured and replayed: the graph executor's logits equal the eager static path's
    (same kernels, same shapes) and the regular paged path's within ATOL, over the whole
    changing-batch script; graphs were captured per bucket and replayed every decode step."""
    model = _cuda_model(torch.float32)
    regular = TorchExecutor.create(model, NUM_SLOTS, attention="paged")
    eager = TorchExecutor.create(model, NUM_SLOTS, attention="paged", static_decode=True)
    graphs = TorchExecutor.create(model, NUM_SLOTS, attention="paged", cuda_graphs=True)
    sizes = drive([graphs, eager, regular], atol=1e-4)
    runner = graphs.decode_graphs
    assert runner is not None and runner.capture
    assert runner.num_graphs == len(runner.buckets) > 1
    assert sum(b.steps for b in runner.buckets.values()) == len(sizes)
    pools_close(graphs.kv_pool, regular.kv_pool, atol=1e-4)


@pytest.mark.gpu
def test_cuda_graph_padding_and_bf16_on_cuda():
    """bf16 (the serving dtype): graph replay equals the eager static path; padding rows
    of a replayed graph write only the scratch slot."""
    model = _cuda_model(torch.bfloat16)
    eager = TorchExecutor.create(model, NUM_SLOTS, attention="paged", static_decode=True)
    graphs = TorchExecutor.create(model, NUM_SLOTS, attention="paged", cuda_graphs=True)
    drive([graphs, eager], atol=2e-2)
    rng = np.random.default_rng(1)
    slots = rng.permutation(NUM_SLOTS)[:40]
    prompt = rng.integers(0, 256, 20)
    first = graphs.forward([ForwardItem("p", prompt, 0, slots[:20], GREEDY)], [])[0]
    before = snapshot(graphs.kv_pool)
    rows = [
        ForwardItem("p", np.array([first]), 20, slots[:21], GREEDY),
        ForwardItem("q", np.array([1]), 0, slots[30:31], GREEDY),
        ForwardItem("r", np.array([2]), 0, slots[31:32], GREEDY),
    ]
    graphs.forward([], rows)  # bucket 4 (one padding row): a replay of its graph
    runner = graphs.decode_graphs
    assert runner is not None and runner.buckets[(4, 256)].graph is not None
    changed = changed_rows(before, graphs.kv_pool)
    assert changed - {graphs.kv_pool.scratch_slot} == {int(slots[i]) for i in (20, 30, 31)}


@pytest.mark.gpu
def test_engine_with_cuda_graphs_on_cuda():
    """The factory's executor with cuda_graphs (attention defaults to paged) gives the
    Engine the same greedy tokens as without."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    rng = np.random.default_rng(6)
    prompts = [rng.integers(1, 256, n) for n in (30, 7, 300, 12)]

    def generate(**kwargs) -> dict[str, list[int]]:
        executor, _ = build_executor("torch", num_kv_slots=2048, device="cuda", **kwargs)
        engine = Engine(
            EngineConfig(num_kv_slots=2048), executor, clock=itertools.count(1).__next__
        )
        tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            sampling = SamplingParams(max_new_tokens=6 + 3 * i, ignore_eos=True)
            engine.add_request(EngineRequest(f"q{i}", p, sampling))
        for _ in range(300):
            if not engine.has_work():
                break
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    assert generate(cuda_graphs=True) == generate(attention="paged", cuda_graphs=False)


@pytest.mark.gpu
def test_factory_defaults_on_cuda():
    """On a CUDA machine the factory's torch executor is paged + CUDA graphs + fused Triton
    kernels unless told otherwise."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    ex, _ = build_executor("torch", num_kv_slots=256)
    assert ex.device.type == "cuda"
    assert (ex.attention, ex.attention_impl, ex.cuda_graphs, ex.fused_impl) == (
        "paged",
        "triton",
        True,
        "triton",
    )
