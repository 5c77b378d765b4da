"""A lone short prefill run static (``PrefillGraphRunner``): the step a cache hit on an idle
worker costs, as one CUDA graph replay per (new tokens, context) bucket.

On the CPU the static path runs eagerly (``static_decode=True``) or through a stand-in
capturer, over the torch reference and (in a Triton-interpreter subprocess) the Triton
kernel, and is compared with the regular path: same logits within 1e-5, same pool contents,
and padding rows that touch no real slot. The gpu-marked test captures real CUDA graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stand_in_graphs import StandInCapturer

from worker.engine.decode_graph import (
    DEFAULT_PREFILL_BUCKETS,
    DecodeGraphRunner,
    PrefillGraphRunner,
)
from worker.engine.model import LlamaForCausalLM, build_tiny_model
from worker.engine.torch_executor import TorchExecutor
from worker.engine.types import ForwardItem, SamplingParams

NUM_SLOTS = 2048
ATOL = 1e-5
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return build_tiny_model(0)


# (cached prefix, new tokens): cold prefills of 1, 15, 16, 17 and 64 tokens (one query
# block), 65 and 200 (several blocks; the torch reference pads them alike), suffixes after
# cached prefixes that cross the 256-wide context bucket, and one beyond the largest token
# bucket (the regular path).
STEPS = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 64), (0, 65), (0, 200), (240, 8), (250, 30)]
STEPS += [(700, 64), (1000, 3), (0, 600)]


def _run(executors: list[TorchExecutor], seed: int = 0, atol: float = ATOL) -> list[torch.Tensor]:
    """Every step of STEPS on every executor (same slots, their own pools): logits equal
    within ``atol``; returns the first executor's."""
    rng = np.random.default_rng(seed)
    out = []
    for i, (cached, new) in enumerate(STEPS):
        slots = rng.permutation(NUM_SLOTS)[: cached + new].astype(np.int64)
        tokens = rng.integers(0, 512, cached + new).astype(np.int64)
        prefix = ForwardItem(f"p{i}", tokens[:cached], 0, slots, GREEDY, True, 0)
        item = ForwardItem(f"r{i}", tokens[cached:], cached, slots, GREEDY, True, 0)
        got = []
        for ex in executors:
            if cached:
                ex.forward_logits([prefix], [])
            got.append(ex.forward_logits([item], []))
        for j, g in enumerate(got[1:], 1):
            torch.testing.assert_close(g, got[0], atol=atol, rtol=0, msg=f"step {i} ex {j}")
        out.append(got[0])
    return out


def _pools_close(a: TorchExecutor, b: TorchExecutor, atol: float = ATOL) -> None:
    """Every real slot of every layer within ``atol`` (the scratch slot is padding's)."""
    n = a.kv_pool.num_slots
    for layer in range(a.kv_pool.config.num_layers):
        for x, y in (
            (a.kv_pool.k[layer], b.kv_pool.k[layer]),
            (a.kv_pool.v[layer], b.kv_pool.v[layer]),
        ):
            torch.testing.assert_close(x[:n], y[:n], atol=atol, rtol=0)


@pytest.mark.parametrize("fused", ["off", "torch"])
def test_static_prefill_equals_regular(model, fused: str) -> None:
    """Lone prefills through the static path (eager) give the regular path's logits and
    pool contents; the steps that fit a bucket ran static, the one past the largest did not."""
    regular = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", fused=fused)
    static = TorchExecutor.create(
        model, NUM_SLOTS, attention="paged-torch", static_decode=True, fused=fused
    )
    _run([static, regular])
    runner = static.prefill_graphs
    assert runner is not None and not runner.capture
    fitting = [s for s in STEPS if s[1] <= DEFAULT_PREFILL_BUCKETS[-1]]
    cached_fitting = [s for s in fitting if s[0]]  # their prefixes are lone prefills too
    prefixes_fitting = [s for s in cached_fitting if s[0] <= DEFAULT_PREFILL_BUCKETS[-1]]
    assert sum(b.steps for b in runner.buckets.values()) == len(fitting) + len(prefixes_fitting)
    assert (64, 1024) in runner.buckets and (16, 256) in runner.buckets
    _pools_close(static, regular)


def test_padding_rows_touch_no_real_slot(model) -> None:
    """A 5-token prefill in the 16-token bucket: only its 5 write slots (and the scratch
    slot) change in the pool; the logits are the regular path's."""
    static = TorchExecutor.create(model, 64, attention="paged-torch", static_decode=True)
    regular = TorchExecutor.create(model, 64, attention="paged-torch")
    before = [t.clone() for t in static.kv_pool.k]
    slots = np.array([40, 7, 33, 12, 5], dtype=np.int64)
    item = ForwardItem("r", np.array([3, 1, 4, 1, 5]), 0, slots, GREEDY, True, 0)
    got = static.forward_logits([item], [])
    want = regular.forward_logits([item], [])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    changed = set()
    for layer, old in enumerate(before):
        diff = (static.kv_pool.k[layer] != old).flatten(1).any(1)
        changed |= {int(i) for i in torch.nonzero(diff).flatten()}
    assert changed - {static.kv_pool.scratch_slot} == set(slots.tolist())


def test_which_steps_run_static(model) -> None:
    """Only a prefill item alone that fits a bucket; not with decode rows, not two items,
    not when turned off (static_prefill=False), never with gather attention."""
    ex = TorchExecutor.create(model, 256, attention="paged-torch", static_decode=True)
    one = ForwardItem("a", np.array([1, 2, 3]), 0, np.arange(3), GREEDY, True, 0)
    two = ForwardItem("b", np.array([4, 5]), 0, np.arange(10, 12), GREEDY, True, 0)
    dec = ForwardItem("c", np.array([6]), 2, np.arange(20, 23), GREEDY, True, 0)
    assert ex._static_prefill([one], [])
    assert not ex._static_prefill([one, two], [])
    assert not ex._static_prefill([one], [dec])
    big = ForwardItem("d", np.zeros(513, np.int64), 0, np.arange(513), GREEDY, True, 0)
    assert not ex._static_prefill([big], [])
    off = TorchExecutor.create(
        model, 256, attention="paged-torch", static_decode=True, static_prefill=False
    )
    assert off.prefill_graphs is None and not off._static_prefill([one], [])
    assert TorchExecutor.create(model, 256).prefill_graphs is None  # gather, eager


def test_bad_input_is_refused_on_the_static_path(model) -> None:
    """The regular path's checks hold: out-of-range slots or tokens, a duplicated write
    slot, and nothing is written."""
    ex = TorchExecutor.create(model, 64, attention="paged-torch", static_decode=True)
    k0 = ex.kv_pool.k[0].clone()
    bad_slot = ForwardItem("a", np.array([1, 2]), 0, np.array([3, 64]), GREEDY, True, 0)
    with pytest.raises(ValueError, match=r"prefill\[a\]\.slots: out of range"):
        ex.forward([bad_slot], [])
    bad_tok = ForwardItem("b", np.array([1, 512]), 0, np.array([3, 4]), GREEDY, True, 0)
    with pytest.raises(ValueError, match=r"prefill\[b\]\.token_ids: out of range"):
        ex.forward([bad_tok], [])
    dup = ForwardItem("c", np.array([1, 2]), 0, np.array([9, 9]), GREEDY, True, 0)
    with pytest.raises(ValueError, match="write the same KV slot"):
        ex.forward([dup], [])
    assert torch.equal(ex.kv_pool.k[0], k0)


def test_replayed_graphs_equal_eager(model) -> None:
    """With a capturer (a stand-in for CUDA graphs on the CPU), each bucket is captured
    once and replayed after: logits equal the eager static path's."""
    ex = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    eager = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    capturer = StandInCapturer()
    ex.prefill_graphs = PrefillGraphRunner(
        model, ex.kv_pool, ex.device, "torch", capture=True, capturer=capturer
    )
    _run([ex, eager])
    runner = ex.prefill_graphs
    assert capturer.captures == len(runner.buckets) > 3
    assert capturer.replays == sum(b.steps for b in runner.buckets.values())


def test_runner_refuses_bad_setups(model) -> None:
    pool = TorchExecutor.pool_for(model, 16, scratch_slot=False)
    with pytest.raises(ValueError, match="scratch slot"):
        PrefillGraphRunner(model, pool, torch.device("cpu"), "torch", capture=False)
    pool = TorchExecutor.pool_for(model, 16, scratch_slot=True)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        PrefillGraphRunner(model, pool, torch.device("cpu"), "torch", capture=True)
    with pytest.raises(ValueError, match="token_buckets"):
        PrefillGraphRunner(
            model, pool, torch.device("cpu"), "torch", capture=False, token_buckets=(0, 16)
        )
    with pytest.raises(ValueError, match="static prefill runs paged attention"):
        PrefillGraphRunner(model, pool, torch.device("cpu"), "gather", capture=False)
    runner = PrefillGraphRunner(model, pool, torch.device("cpu"), "torch", capture=False)
    assert runner.bucket_key(17, 300) == (32, 512)
    assert runner.bucket_key(513, 600) is None
    assert runner.bucket_key(8, 5000) is None  # past the tiny model's 4,096 context


# ---- on CUDA -----------------------------------------------------------------------------


@pytest.mark.gpu
def test_prefill_graphs_on_cuda() -> None:
    """Captured and replayed on CUDA over the Triton kernels (float32): logits equal the
    regular paged path's within 1e-4 on every step, pools likewise; one graph per bucket."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    cuda_model = build_tiny_model(0, device="cuda")
    regular = TorchExecutor.create(cuda_model, NUM_SLOTS, attention="paged")
    graphs = TorchExecutor.create(cuda_model, NUM_SLOTS, attention="paged", cuda_graphs=True)
    _run([graphs, regular], atol=1e-4)
    _pools_close(graphs, regular, atol=1e-4)
    runner = graphs.prefill_graphs
    assert runner is not None and runner.capture
    assert all(b.graph is not None for b in runner.buckets.values())
    assert sum(b.steps for b in runner.buckets.values()) > len(runner.buckets)


# ---- every bucket captured ahead of the first step ----------------------------------------


def test_capture_all_covers_every_reachable_bucket(model) -> None:
    """capture_graphs captures each decode and lone-prefill bucket once (stand-in capturer);
    every (new tokens, context) a step can have lands in one of them, so the steps after
    capture nothing more and give the eager static path's logits."""
    ex = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    assert ex.capture_graphs() == 0  # nothing to capture without graphs
    eager = TorchExecutor.create(model, NUM_SLOTS, attention="paged-torch", static_decode=True)
    capturer = StandInCapturer()
    ex.prefill_graphs = PrefillGraphRunner(
        model, ex.kv_pool, ex.device, "torch", capture=True, capturer=capturer
    )
    ex.decode_graphs = DecodeGraphRunner(
        model, ex.kv_pool, ex.device, "torch", capture=True, capturer=capturer
    )
    prefill_keys = ex.prefill_graphs.keys(512)
    # tokens 16..256 with widths 256 and 512; 512 new tokens need a context of 512
    assert len(prefill_keys) == 11 and (512, 256) not in prefill_keys
    assert len(ex.decode_graphs.keys(512)) == 8 * 2
    assert ex.capture_graphs(512) == 11 + 16 == capturer.captures
    assert ex.capture_graphs(512) == 0  # once
    everything = ex.capture_graphs()
    assert everything == len(ex.prefill_graphs.keys()) + len(ex.decode_graphs.keys()) - 27
    rng = np.random.default_rng(3)
    for _ in range(300):
        n = int(rng.integers(1, 513))
        context = int(rng.integers(n, 4097))
        assert ex.prefill_graphs.bucket_key(n, context) in ex.prefill_graphs.buckets
    captured = capturer.captures
    _run([ex, eager])
    assert capturer.captures == captured and capturer.replays > 0


def test_worker_graph_warmup_flag() -> None:
    """--graph-warmup-context: torch only, >= 0, and only with CUDA graphs (so an error on
    the CPU); 0, the default, captures on first use."""
    from worker.cli import build_parser, build_server, config_from_args

    assert build_parser().parse_args([]).graph_warmup_context == 0
    args = build_parser().parse_args(
        ["--executor", "torch", "--device", "cpu", "--graph-warmup-context", "8192"]
    )
    with pytest.raises(ValueError, match="--graph-warmup-context needs CUDA graphs"):
        build_server(args)
    with pytest.raises(ValueError, match="must be >= 0"):
        config_from_args(build_parser().parse_args(["--graph-warmup-context", "-1"]))
    sim = build_parser().parse_args(["--executor", "sim", "--graph-warmup-context", "64"])
    with pytest.raises(ValueError, match="applies to --executor torch only"):
        config_from_args(sim)


@pytest.mark.gpu
def test_capture_graphs_ahead_on_cuda() -> None:
    """On CUDA, capture_graphs(512) captures every decode and lone-prefill bucket up to a
    512-token context; the steps after land in captured buckets only, with the regular
    path's logits."""
    assert torch.cuda.is_available(), "gpu tests need CUDA: run them on a GPU machine"
    cuda_model = build_tiny_model(0, device="cuda")
    regular = TorchExecutor.create(cuda_model, NUM_SLOTS, attention="paged")
    graphs = TorchExecutor.create(cuda_model, NUM_SLOTS, attention="paged", cuda_graphs=True)
    decode, prefill = graphs.decode_graphs, graphs.prefill_graphs
    assert decode is not None and prefill is not None
    want = len(decode.keys(512)) + len(prefill.keys(512))
    assert graphs.capture_graphs(512) == want and graphs.capture_graphs(512) == 0
    before = set(prefill.buckets)
    rng = np.random.default_rng(5)
    for i, n in enumerate((1, 17, 64, 200)):
        slots = rng.permutation(NUM_SLOTS)[:n].astype(np.int64)
        item = ForwardItem(f"r{i}", rng.integers(0, 512, n), 0, slots, GREEDY, True, 0)
        got = graphs.forward_logits([item], [])
        torch.testing.assert_close(got, regular.forward_logits([item], []), atol=1e-4, rtol=0)
    assert set(prefill.buckets) == before  # no bucket made (or captured) after the warm-up


def test_worker_says_which_torch_options_it_picked(caplog: pytest.LogCaptureFixture) -> None:
    """The worker logs the torch executor's attention, graphs and fused kernels once (they
    default by device): on the CPU gather, off, off."""
    import logging

    from worker.cli import build_parser, build_server

    args = build_parser().parse_args(["--executor", "torch", "--device", "cpu"])
    with caplog.at_level(logging.INFO, logger="kvroute.worker"):
        build_server(args)
    said = [r.getMessage() for r in caplog.records if "torch executor on" in r.getMessage()]
    assert said == [
        "torch executor on cpu: attention gather (gather), CUDA graphs off, fused kernels off"
    ]
